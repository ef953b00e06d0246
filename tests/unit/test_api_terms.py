"""The Python API speaks Python: a JobSpec built in Python is refused in field names, units and
Python examples; the CLI keeps its flag-named errors; ``dir(hpc)`` lists the public API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hpc
from hpc.cli import main
from hpc.contract import jobspec, spec_terms
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

pytestmark = pytest.mark.unit


def test_a_slurm_time_string_for_seconds_is_refused_in_seconds_not_with_a_flag_example() -> None:
    with pytest.raises(SpecError) as e:
        JobSpec(script="s", time_limit_s="1:00:00")
    msg = str(e.value)
    assert e.value.flag == "time_limit_s" and "in seconds" in msg
    assert "Example: time_limit_s=14400" in msg
    assert "--time 1." not in msg and "Example: --time" not in msg
    assert "is time_limit_s=3600 in Python" in msg      # what the CLI's text would have meant


def test_nodes_as_an_int_is_a_fixed_node_count() -> None:
    assert JobSpec(script="s", nodes=3).nodes == (3, 3)
    assert JobSpec(script="s", nodes=[2, 4]).nodes == (2, 4)
    assert JobSpec(script="s", script_args=["--lr", "1"]).script_args == ("--lr", "1")


def test_bad_nodes_from_python_are_explained_in_python() -> None:
    with pytest.raises(SpecError) as e:
        JobSpec(script="s", nodes=(4, 2))
    msg = str(e.value)
    assert msg.startswith("nodes (4, 2) is invalid: an int N or a tuple (MIN, MAX)")
    assert "MIN 4 is larger than MAX 2" in msg and "Example: nodes=(2, 4)" in msg


def test_cross_field_errors_from_python_name_fields() -> None:
    with pytest.raises(SpecError, match=r"gpu_type 'a100' .*used with gpus_per_node=N.*"
                                        r"Example: gpus_per_node=8, gpu_type='a100'"):
        JobSpec(script="s", gpu_type="a100")


@pytest.mark.parametrize("argv,flag", [(["--gpus-per-node", "8", "--nproc-per-node", "4"], "--nproc-per-node"),
                                       (["--gpu-type", "a100"], "--gpu-type"),
                                       (["--time", "1", "--signal-lead", "120"], "--signal-lead")])
def test_the_cli_keeps_flag_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HPC_CONFIG", raising=False)
    (tmp_path / "train.py").write_text("")
    assert main(["render", "train.py", *argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} " in err and "Example: --" in err and "_per_node" not in err
    assert not spec_terms.in_cli_terms()            # the CLI's terms end with the CLI's spec


@pytest.mark.parametrize("f", jobspec.option_fields(), ids=lambda f: f.name)
def test_every_fields_python_example_is_valid_python_for_that_field(f) -> None:
    example = spec_terms.python_example(f, jobspec.flag_name(f.name))
    code = example.split(" (", 1)[0]          # time_limit_s=14400 (04:00:00)
    name, _, value = code.partition("=")
    assert name == f.name
    # A field checked against another needs that one too (typed GPUs; a mesh needs its ranks).
    needs = {"gpu_type": {"gpus_per_node": 8}, "tp": {"nproc_per_node": 4},
             "pp": {"nproc_per_node": 4}, "dp_replicate": {"nproc_per_node": 4},
             "dp_shard": {"nproc_per_node": 4}, "replacement": {"recovery": "inprocess"}}
    spec = JobSpec(script="s", **needs.get(name, {}), **{name: eval(value)})  # noqa: S307 - our own examples
    assert getattr(spec, name) == eval(value)


def test_dir_lists_the_public_api_without_importing_torch() -> None:
    names = dir(hpc)
    for public in ("submit", "JobSpec", "Job", "run", "sweep", "SpecError", "load_results"):
        assert public in names
    assert "Any" not in names and "annotations" not in names
    code = ("import sys\nimport hpc\nnames = dir(hpc)\nassert 'JobSpec' in names\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'wandb', 'torchx')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
