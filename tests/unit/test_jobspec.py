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
    with pytest.raises(SpecError, match="--nproc-per-node .*--gpus-per-node 8"):
        JobSpec(script="s", gpus_per_node=8, nproc_per_node=4)


def test_lead_must_be_shorter_than_time():
    with pytest.raises(SpecError, match="--signal-lead"):
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
