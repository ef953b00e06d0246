"""A user's own DDP script with its own snapshot under `hpc submit`, preempted for real (issue 15).

The script (tests/distributed/scripts/plain_snapshot.py) has the shape of the PyTorch multinode
example (Trainer, snapshot.pt saved by rank 0 every few steps and loaded at start, no signal
handler) and calls `wandb.init()` itself with no id. We cannot download that example here (no
network but PyPI), so this is an equivalent written for the test. A higher-priority job preempts
it: Slurm sends the warning (ignored by the script), then SIGTERM at the end of GraceTime. The
allocation must not restart its workers, must record `preempted`, be requeued, and resume from
the script's own snapshot; W&B must see one run id across both allocations.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import squeue_state, wait_until
from tests.wandb_offline import read_run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "plain_snapshot.py"
STEPS = 40


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def outcomes(job: Path) -> list[dict]:
    path = job / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def snapshot_step(job: Path) -> int:
    saved = [int(line.split()[1]) for f in job.glob("logs/alloc-*/restart-*/rank-0.log")
             for line in f.read_text(errors="replace").splitlines()
             if line.startswith("Step ") and "snapshot saved" in line]
    return max(saved, default=0)


def squeue(env: dict[str, str], job_id: str) -> str:
    """The job's state, "" once it left the queue ("UNKNOWN" when squeue failed: not gone)."""
    state = squeue_state(env, job_id)
    return "" if state == "GONE" else state


def test_preempted_own_script_requeues_and_resumes_from_its_snapshot(env, slurm_cluster, tmp_path):
    job = tmp_path / "own"
    r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(SCRIPT), "--nodes", "2",
                        "--nproc-per-node", "2", "--partition", "debug", "--max-restarts", "3",
                        "--job-dir", str(job), "--", "--steps", str(STEPS), "--step-sleep", "0.3",
                        "--snapshot", str(job / "snapshot.pt"), "--out", str(job), "--wandb"],
                       env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    wait_until(lambda: snapshot_step(job) >= 6, 240, "the script's snapshot at step 6")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", "3", "-t", "2",
                           "-o", str(tmp_path / "high.out"), "--wrap", "sleep 4"], env=env,
                          capture_output=True, text=True)
    assert high.returncode == 0, high.stderr
    preempted_at = time.monotonic()
    wait_until(lambda: outcomes(job), 90, "allocation 0's outcome")
    recorded_s = time.monotonic() - preempted_at
    wait_until(lambda: squeue(env, job_id) in ("", "COMPLETED", "FAILED", "CANCELLED"), 400,
               f"job {job_id} to end; outcomes {outcomes(job)}")

    kinds = [(o["allocation"], o["kind"]) for o in outcomes(job)]
    assert kinds == [(0, "preempted"), (1, "finished")], outcomes(job)
    print(f"allocation 0 recorded {recorded_s:.1f} s after the preempting job was submitted: "
          f"{outcomes(job)[0]['reason']}")
    assert sorted(p.name for p in (job / "logs/alloc-0").glob("restart-*")) == ["restart-0"], \
        "workers were restarted inside the preempted allocation"
    assert not list(job.glob("started-0-1-*")), "the script ran again inside the stopping allocation"
    rank0 = (job / "logs/alloc-1/restart-0/rank-0.log").read_text(errors="replace")
    resumed = [int(x.rsplit(" ", 1)[1]) for x in rank0.splitlines()
               if x.startswith("Resuming training from snapshot at step")]
    assert resumed and resumed[0] >= 6, rank0[-2000:]
    assert "plain_snapshot: done 40 steps" in rank0
    seen = json.loads((job / "started-1-0-0").read_text())
    assert seen["HPC_RESUMED"] == "1" and seen["HPC_REQUEUE_COUNT"] == "1", seen
    stop = json.loads((job / "logs/alloc-0/stop.json").read_text())
    assert stop["kind"] == "preempted", stop

    run_id = (job / "wandb_run_id").read_text().strip()
    ids = {f.name: f.read_text() for f in job.glob("wandb-id-*")}
    assert sorted(ids) == ["wandb-id-0-0", "wandb-id-1-0"] and set(ids.values()) == {run_id}, ids
    run = read_run(job / "wandb", run_id)
    assert run.run_ids == {run_id} and len(run.files) == 2
    assert set(run.steps) == set(range(1, STEPS + 1)), run.steps
