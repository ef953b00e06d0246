import json

import pytest

from hpc.contract.errors import SpecError
from hpc.contract.jobspec import CONFIG_KEYS, JobSpec, flag_name, option_fields

pytestmark = pytest.mark.unit


def test_json_round_trip_is_exact():
    spec = JobSpec(script="/x/train.py", script_args=("--lr", "3e-4"), nodes=(2, 4), gpus_per_node=8,
                   time_limit_s=3600, env=(("A", "1"),), job_dir="/j")
    again = JobSpec.from_json(spec.to_json())
    assert again == spec
    assert json.loads(spec.to_json())["schema_version"] == 1


def test_nproc_defaults_to_gpus_then_one():
    assert JobSpec(script="s", gpus_per_node=4).nproc_per_node == 4
    assert JobSpec(script="s").nproc_per_node == 1


def test_nproc_must_match_gpus():
    with pytest.raises(SpecError, match="nproc_per_node .*gpus_per_node=8, nproc_per_node=8"):
        JobSpec(script="s", gpus_per_node=8, nproc_per_node=4)


def test_lead_must_be_shorter_than_time():
    with pytest.raises(SpecError, match="signal_lead_s 120 .*time_limit_s: 60 s"):
        JobSpec(script="s", time_limit_s=60, signal_lead_s=120)


def test_every_option_has_help_parser_and_example():
    for f in option_fields():
        assert f.metadata["help"], f.name
        assert f.metadata["parse"] is not None, f.name
        assert f.metadata["example"].startswith(flag_name(f.name)), f.name
    assert CONFIG_KEYS["time"] == "time_limit_s"
    assert CONFIG_KEYS["signal_lead"] == "signal_lead_s"


def test_schema_version_mismatch_is_explained():
    data = json.loads(JobSpec(script="s").to_json())
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version 99"):
        JobSpec.from_json(json.dumps(data))


# --- a reused job directory whose jobspec.json this version cannot use -------------------------

@pytest.mark.parametrize(("text", "fragment"), [
    ("{not json", "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "a JSON list"),
    ('{"schema_version": 2}', "schema_version 2"),
    ('{"schema_version": "1"}', "schema_version '1'"),
    ("{}", "schema_version None"),
])
def test_unusable_jobspec_json_is_a_spec_error_saying_what_to_do(text: str, fragment: str) -> None:
    with pytest.raises(SpecError) as e:
        JobSpec.from_json(text, source="/j/jobspec.json")
    msg = str(e.value)
    assert e.value.flag == "/j/jobspec.json" and fragment in msg and "new --job-dir" in msg
    assert len(msg.splitlines()) == 1


def _spec_data(**changes: object) -> str:
    data = json.loads(JobSpec(script="/x/train.py", job_dir="/j").to_json())
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"future_option": 1}, "unknown keys future_option"),
    ({"nodes": 5}, "malformed value"),
    ({"env": [["A"]]}, "env"),
    ({"env": 5}, "malformed value"),
    ({"partition": "gpu\necho x"}, "partition"),
    ({"rdzv_port": 70000}, "rdzv_port"),
    ({"gpus_per_node": "8"}, "gpus_per_node"),
    ({"checkpoint_every_min": None}, "checkpoint_every_min"),
])
def test_jobspec_json_values_are_checked_like_flags_and_named_by_key(changes: dict, fragment: str) -> None:
    with pytest.raises(SpecError, match="jobspec.json") as e:
        JobSpec.from_json(_spec_data(**changes))
    assert fragment in str(e.value)


def test_a_missing_key_takes_its_default() -> None:
    data = json.loads(_spec_data())
    del data["keep_every"]
    assert JobSpec.from_json(json.dumps(data)).keep_every == 0


def test_load_names_the_file(tmp_path) -> None:
    (tmp_path / "jobspec.json").write_text('{"schema_version": 7}')
    with pytest.raises(SpecError) as e:
        JobSpec.load(tmp_path)
    assert e.value.flag == str(tmp_path / "jobspec.json") and "schema_version 7" in str(e.value)
    (tmp_path / "jobspec.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(SpecError, match="not UTF-8"):
        JobSpec.load(tmp_path)


def test_load_of_a_missing_file_is_an_hpc_error(tmp_path) -> None:
    from hpc.contract.errors import HpcError

    with pytest.raises(HpcError, match="cannot read .*jobspec.json"):
        JobSpec.load(tmp_path)


def test_hpc_run_on_a_garbled_job_dir_exits_2(tmp_path, monkeypatch, capsys) -> None:
    from hpc.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HPC_CONFIG", raising=False)
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    (job / "jobspec.json").write_text('{"schema_version": 1, "nodes": ')
    assert main(["run", "train.py", "--job-dir", str(job)]) == 2
    err = capsys.readouterr().err
    assert str(job / "jobspec.json") in err and "new --job-dir" in err
    assert len(err.strip().splitlines()) == 1
