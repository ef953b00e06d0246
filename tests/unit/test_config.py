from pathlib import Path

import pytest

from hpc.config import find_config, parse_config
from hpc.contract.errors import SpecError

pytestmark = pytest.mark.unit


def test_profile_overlays_defaults():
    cfg = parse_config({"defaults": {"partition": "cpu", "qos": "low"},
                        "profiles": {"big": {"partition": "gpu", "signal-lead": 300}}})
    raw, where = cfg.options_for("big")
    assert raw["partition"] == "gpu" and raw["qos"] == "low" and raw["signal_lead_s"] == 300
    assert "[profiles.big]" in where["partition"] and "[defaults]" in where["qos"]


def test_unknown_key_lists_valid_keys():
    with pytest.raises(SpecError) as e:
        parse_config({"profiles": {"x": {"partiton": "gpu"}}})
    assert "'partiton'" in str(e.value) and "partition" in str(e.value) and "account" in str(e.value)


def test_unknown_top_level_key():
    with pytest.raises(SpecError, match="default_profile, defaults, profiles"):
        parse_config({"partition": "gpu"})


def test_unknown_profile_names_the_defined_ones():
    cfg = parse_config({"profiles": {"a": {}, "b": {}}})
    with pytest.raises(SpecError, match=r"--profile 'c'.*defined: a, b"):
        cfg.options_for("c")


def test_pyproject_tool_hpc_is_found(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text('[tool.hpc.profiles.c]\naccount = "p1"\n')
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    assert cfg.options_for("c")[0]["account"] == "p1"


def test_hpc_toml_wins_over_pyproject(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text('[tool.hpc.profiles.c]\naccount = "p1"\n')
    (tmp_path / "hpc.toml").write_text('default_profile = "c"\n[profiles.c]\naccount = "p2"\n')
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    assert cfg.options_for("")[0]["account"] == "p2"


def test_docs_list_every_option():
    from hpc.contract.jobspec import flag_name, option_fields
    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    for f in option_fields():
        assert f"`{flag_name(f.name)}`" in doc, f"docs/config.md misses {flag_name(f.name)}"


# --------------------------------------------------------------------------- errors in TOML terms


def _error(tmp_path: Path, text: str, profile: str = "") -> str:
    (tmp_path / "hpc.toml").write_text(text)
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    with pytest.raises(SpecError) as e:
        cfg.parsed_options(profile)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    return msg


def test_a_wrong_type_is_explained_in_toml_with_file_table_and_key(tmp_path: Path):
    msg = _error(tmp_path, "[defaults]\nnodes = true\n")
    assert msg.startswith(f"{tmp_path / 'hpc.toml'} [defaults] nodes = true is invalid: ")
    assert msg.endswith('Example: [defaults] nodes = "2:4"')
    assert "/hpc.toml [defaults] nodes 2" not in msg and "--nodes" not in msg


@pytest.mark.parametrize(("text", "example"), [
    ('nproc_per_node = "8"', "nproc_per_node = 8"),
    ('exclusive = "false"', "exclusive = false"),
    ('exclusive = "yes"', "exclusive = true"),
    ('rdzv_port = "80"', "rdzv_port = 80"),
    ('checkpoint_every_min = "30"', "checkpoint_every_min = 30"),
    ('max_restarts = "three"', "max_restarts = 3"),
])
def test_strings_for_integers_numbers_and_booleans_are_refused(tmp_path: Path, text: str,
                                                               example: str):
    msg = _error(tmp_path, f'default_profile = "c"\n[profiles.c]\n{text}\n')
    assert f"[profiles.c] {text} is invalid: a TOML " in msg and "without quotes" in msg
    assert msg.endswith(f"Example: [profiles.c] {example}")


def test_text_stays_text_where_the_flag_takes_text(tmp_path: Path):
    (tmp_path / "hpc.toml").write_text('[defaults]\ntime = "4:00:00"\nnodes = "2:4"\nmem = "64G"\n'
                                       '[profiles.m]\ntime = 30\nnodes = 3\nexclusive = true\n')
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    assert {k: v for k, v in cfg.parsed_options().items()} == \
        {"time_limit_s": 14400, "nodes": (2, 4), "mem": "64G"}
    opts = cfg.parsed_options("m")
    assert (opts["time_limit_s"], opts["nodes"], opts["exclusive"]) == (1800, (3, 3), True)


def test_pyproject_errors_name_the_tool_hpc_table(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text("[tool.hpc.defaults]\nkeep_last = 3.0\n")
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    with pytest.raises(SpecError) as e:
        cfg.parsed_options()
    assert "pyproject.toml [tool.hpc.defaults] keep_last = 3.0 is invalid: an integer >= 1" in str(e.value)
    assert "ASCII" not in str(e.value) and str(e.value).endswith("[tool.hpc.defaults] keep_last = 3")


def test_every_keys_toml_example_is_valid_toml_the_key_accepts(tmp_path: Path):
    from hpc.config import toml_example
    from hpc.contract.jobspec import CONFIG_KEYS, JobSpec

    for key, name in CONFIG_KEYS.items():
        extra = 'gpus_per_node = 8\n' if name == "gpu_type" else \
            'nproc_per_node = 4\n' if name in ("tp", "pp", "dp_replicate", "dp_shard") else \
            'recovery = "inprocess"\n' if name == "replacement" else ""
        (tmp_path / "hpc.toml").write_text(f"[defaults]\n{extra}{key} = {toml_example(name)}\n")
        opts = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)}).parsed_options()
        JobSpec(script="s", **opts)
