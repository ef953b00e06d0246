"""Sweeps: argument sets from a grid or a file, one job array per sweep (pure parts)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpc import sweeps
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from tests.conftest import hpc

pytestmark = pytest.mark.unit

SPEC = JobSpec(script="/home/me/train.py", script_args=("--preset", "tiny"), job_name="gpt",
               job_dir="/scratch/me/sweep", python="/opt/venv/bin/python", nodes=(1, 2))


def test_grid_is_the_product_first_key_slowest() -> None:
    grid = sweeps.parse_grid(["lr=1e-3,3e-4", "seed=1,2,3"])
    sets = sweeps.expand_grid(grid)
    assert len(sets) == 6
    assert sets[0] == ("--lr", "1e-3", "--seed", "1")
    assert sets[3] == ("--lr", "3e-4", "--seed", "1")
    assert sweeps.expand_grid([("-x", ["a"])]) == [("-x", "a")]     # a given dash is kept


@pytest.mark.parametrize("bad", ["lr", "=1,2", "lr=", "lr=1,,2", "l r=1"])
def test_bad_grid_items_name_the_flag_and_the_form(bad: str) -> None:
    with pytest.raises(SpecError) as e:
        sweeps.parse_grid([bad])
    assert "--grid" in str(e.value) and "KEY=V1,V2" in str(e.value)


def test_repeated_grid_key_is_refused() -> None:
    with pytest.raises(SpecError, match="repeated"):
        sweeps.parse_grid(["lr=1", "lr=2"])


def test_grid_file_grid_and_runs(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[grid]\nlr = ["1e-3", "3e-4"]\nwarmup = [10]\n')
    assert sweeps.load_file(f) == [("--lr", "1e-3", "--warmup", "10"), ("--lr", "3e-4", "--warmup", "10")]
    f.write_text('[[runs]]\nargs = ["--lr", "1"]\n[[runs]]\nargs = ["--fsdp"]\n')
    assert sweeps.load_file(f) == [("--lr", "1"), ("--fsdp",)]
    f.write_text('[grid]\nlr = ["1"]\n[[runs]]\nargs = []\n')
    with pytest.raises(SpecError, match="one of the two"):
        sweeps.load_file(f)


def test_plan_gives_each_task_its_own_job_dir_args_and_one_wandb_group() -> None:
    p = sweeps.plan(SPEC, [("--lr", "1"), ("--lr", "2")], throttle=1)
    assert p.array == "0-1%1"
    assert [t.job_dir for t in p.tasks] == ["/scratch/me/sweep/task-0", "/scratch/me/sweep/task-1"]
    assert p.tasks[1].script_args == ("--preset", "tiny", "--lr", "2")
    assert {t.env_dict["WANDB_RUN_GROUP"] for t in p.tasks} == {"gpt"}
    assert "#SBATCH --array=0-1%1" in p.script
    assert "#SBATCH --output=/scratch/me/sweep/task-%a/logs/slurm-%A_%a.out" in p.script
    assert 'JOB_DIR=/scratch/me/sweep"/task-${SLURM_ARRAY_TASK_ID}"' in p.script


def test_array_script_runs_each_task_in_its_directory_in_bash(tmp_path: Path) -> None:
    """The JOB_DIR line, run by bash with a hostile sweep directory, names the task's directory."""
    root = tmp_path / "semi;colon $HOME `x` quote's"
    p = sweeps.plan(SPEC.replace(job_dir=str(root)), [("--lr", "1")])
    line = next(x for x in p.script.splitlines() if x.startswith("JOB_DIR="))
    out = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$JOB_DIR"'],
                         env={"SLURM_ARRAY_TASK_ID": "7"}, capture_output=True, text=True).stdout
    assert out == f"{root}/task-7"


def test_plan_refuses_no_tasks_and_negative_throttle() -> None:
    with pytest.raises(SpecError):
        sweeps.plan(SPEC, [])
    with pytest.raises(SpecError, match="--throttle"):
        sweeps.plan(SPEC, [("--a",)], throttle=-1)


def test_cli_dry_run_prints_tasks_and_array_and_creates_nothing(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    job_dir = tmp_path / "sw"
    r = hpc({"PATH": "/usr/bin:/bin", "HPC_HOME": str(tmp_path / "home")}, "sweep", str(script),
            "--job-dir", str(job_dir), "--grid", "lr=1,2", "--grid", "seed=7", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "#   task-1: --lr 2 --seed 7" in r.stdout and "#SBATCH --array=0-1" in r.stdout
    assert not job_dir.exists()
    r = hpc({"PATH": "/usr/bin:/bin"}, "sweep", str(script), "--dry-run")
    assert r.returncode == 2 and "--grid" in r.stderr


def test_task_records_and_resolving_a_task_id(tmp_path: Path) -> None:
    from hpc.contract.index import JobRecord, record_job, resolve

    root = tmp_path / "sw"
    for i in range(2):
        (root / f"task-{i}").mkdir(parents=True)
    (root / sweeps.SWEEP_FILE).write_text(json.dumps(
        {"tasks": [{"index": i, "job_dir": str(root / f"task-{i}"), "args": []} for i in range(2)]}))
    rec = JobRecord("900", str(root), "gpt", "sbatch-array", 0.0)
    assert [r.job_id for r in sweeps.task_records(rec)] == ["900_0", "900_1"]
    record_job(rec, home=tmp_path / "home")
    assert resolve("900_1", home=tmp_path / "home").job_dir == str(root / "task-1")
