"""Users' own scripts under `hpc run`, for real: the stop contract and one W&B run per job.

The script (tests/distributed/scripts/plain_snapshot.py) is a plain torchrun DDP script with
its own snapshot file in the shape of the PyTorch multinode example: no Session, no signal
handler. It records each start as `started-<requeue>-<restart>-<rank>` with the HPC_* and
WANDB_* variables it saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed.own_script_support import env_for, launcher_pid, outcomes, wait_for
from tests.wandb_offline import read_files, read_run, run_files

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "plain_snapshot.py"


def hpc_run(job: Path, env: dict[str, str], *script_args: str,
            extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
           "--job-dir", str(job), *extra, "--", "--snapshot", str(job / "snapshot.pt"),
           "--out", str(job), *script_args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(240)
def test_ignored_warning_then_sigterm_stops_without_restart_and_records_it(tmp_path: Path):
    """The bug of issue 15: warning swallowed, SIGTERM kills the workers, the agent restarts."""
    job, env = tmp_path / "job", env_for(tmp_path)
    p = hpc_run(job, env, "--steps", "100000", "--step-sleep", "0.05", "--wandb",
                extra=("--max-restarts", "3"))
    try:
        wait_for(lambda: (job / "snapshot.pt").exists(), 120, "the script's first snapshot")
        launcher = launcher_pid(job)
        os.kill(launcher, signal.SIGUSR2)        # the warning: the script has no handler
        time.sleep(1.5)
        assert p.poll() is None, "the warning killed the job"
        stop = json.loads((job / "logs/alloc-0/stop.json").read_text())
        # hpc run has no time limit: a warning is a preemption's (Ctrl-C sends it too).
        assert stop["signal"] == "SIGUSR2" and stop["kind"] == "preempted", stop
        assert stop["deadline"] > stop["received_at"]
        started = time.time()
        os.kill(launcher, signal.SIGTERM)        # Slurm's SIGTERM: the workers die of it
        out, _ = p.communicate(timeout=60)
        stopped_in = time.time() - started
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 75, out
    assert sorted(x.name for x in job.glob("started-*")) == ["started-0-0-0", "started-0-0-1"]
    assert sorted(x.name for x in (job / "logs/alloc-0").glob("restart-*")) == ["restart-0"], \
        "the workers were restarted inside the stopping allocation"
    last = outcomes(job)[-1]
    assert (last["allocation"], last["kind"], last["exit_code"]) == (0, "preempted", 75), last
    assert "SIGUSR2 (preempted): the workers did not stop by themselves" in last["reason"], last
    print(f"SIGTERM to the launcher -> hpc run exited 75 in {stopped_in:.2f} s")
    # ~2 s on an idle machine, 5.4 s once at load ~9 on 2 cores; Slurm's KillWait is 30 s by default
    assert stopped_in < 12, f"the stop took {stopped_in:.1f} s: Slurm's KillWait may be shorter"

    # The next allocation: told it is a resume, and the script resumes from its own snapshot.
    again = hpc_run(job, env, "--steps", "3", "--wandb")
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert "Resuming training from snapshot at step" in out, out
    seen = json.loads((job / "started-1-0-0").read_text())
    assert seen["HPC_RESUMED"] == "1" and seen["HPC_REQUEUE_COUNT"] == "1"
    assert seen["HPC_RESTART_COUNT"] == "0"
    assert seen["HPC_CHECKPOINT_DIR"] == str(job / "checkpoints")
    assert seen["HPC_STOP_FILE"] == str(job / "logs/alloc-1/stop.json")
    first = json.loads((job / "started-0-0-0").read_text())
    assert first["HPC_RESUMED"] == "0" and first["HPC_REQUEUE_COUNT"] == "0"
    assert [o["kind"] for o in outcomes(job)] == ["preempted", "finished"]
    # The SIGTERM'd allocation's offline W&B data was kept (the worker finished the run first).
    run_id = (job / "wandb_run_id").read_text().strip()
    files = run_files(job / "wandb", run_id)
    first_segment = read_files(files[:1])
    assert len(files) == 2 and first_segment.run_ids == {run_id}
    assert len(first_segment.steps) >= 2, first_segment.steps


@pytest.mark.timeout(300)
def test_own_wandb_init_is_one_run_across_restarts_and_runs(tmp_path: Path):
    """wandb.init() with no id, restarted twice by worker failures, then a second `hpc run`."""
    job, env = tmp_path / "job", env_for(tmp_path)
    p = hpc_run(job, env, "--steps", "8", "--fail-at", "5", "--wandb",
                extra=("--max-restarts", "2"))
    out, _ = p.communicate(timeout=200)
    assert p.returncode == 0, out
    p = hpc_run(job, env, "--steps", "12", "--wandb")
    out, _ = p.communicate(timeout=200)
    assert p.returncode == 0, out

    run_id = (job / "wandb_run_id").read_text().strip()
    ids = {f.name: f.read_text() for f in job.glob("wandb-id-*")}
    assert sorted(ids) == ["wandb-id-0-0", "wandb-id-0-1", "wandb-id-0-2", "wandb-id-1-0"], ids
    assert set(ids.values()) == {run_id}, ids
    run = read_run(job / "wandb", run_id)           # every offline segment, oldest first
    assert len(run.files) == 4 and run.run_ids == {run_id}
    assert set(run.steps) == set(range(1, 13)), run.steps
    # The redone steps (5 after each failure, resumed from the snapshot at 4; the second run
    # resumed at 8) are in the offline files again: see docs/own-script.md for what W&B keeps.
    assert run.steps == [1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 9, 10, 11, 12], run.steps
    launcher_log = next((job / "logs/alloc-0").glob("node-*.log")).read_text()
    assert "WANDB_RUN_ID" in launcher_log and run_id in launcher_log, launcher_log[-2000:]


@pytest.mark.waits   # ~25 s, most of it waiting for the time limit 35 s out: CI's clock lane
@pytest.mark.timeout(180)
def test_time_limit_warning_ignored_the_launcher_ends_the_workers_before_the_limit(tmp_path: Path):
    """Nobody sends SIGTERM here: the launcher does, 10 s before the (given) time limit."""
    job, env = tmp_path / "job", env_for(tmp_path)
    p = None
    try:
        # The job's time limit, as Slurm would tell the launcher. The warning must come well before it
        # (>= 20 s) for the test to tell "waited for the script, then ended it before the limit" from "ended it
        # at once": a start-up at load ~9 took 32 s to the first snapshot, so the limit is a minute away.
        end = time.time() + 60
        env["HPC_JOB_END_TIME"] = f"{end:.0f}"
        p = hpc_run(job, env, "--steps", "100000", "--step-sleep", "0.05")
        wait_for(lambda: (job / "snapshot.pt").exists(), 40, "the script's first snapshot")
        warned = time.time()
        os.kill(launcher_pid(job), signal.SIGUSR2)
        out, _ = p.communicate(timeout=end - time.time() + 30)
        ended = time.time()
    finally:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 75, out
    left = end - ended
    assert 0 < left < (end - warned) / 2 + 3 and ended - warned > 5, (warned, ended, end)
    last = outcomes(job)[-1]
    assert last["kind"] == "time_limit" and "did not stop by themselves" in last["reason"], last
    assert sorted(x.name for x in (job / "logs/alloc-0").glob("restart-*")) == ["restart-0"]
