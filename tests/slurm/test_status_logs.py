"""``hpc status``, ``hpc logs -f`` and ``hpc cancel`` on real jobs of the test cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import hpc, squeue_state

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "slurm" / "allreduce_check.py"


SLEEPER = """import os, time
print("sleeper rank", os.environ.get("RANK"), "started", flush=True)
time.sleep(600)
"""


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def test_logs_follow_until_done_then_status(env, tmp_path: Path) -> None:
    job_dir = tmp_path / "with space 'q'" / "job"
    r = hpc(env, "submit", str(CHECK), "--nodes", "2", "--nproc-per-node", "2", "--job-dir", str(job_dir))
    assert r.returncode == 0, r.stderr
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    t0 = time.monotonic()
    logs = hpc(env, "logs", "-f", job_id, timeout=300)  # by id, through the job index
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.count("rank 0/4 on node1: sum 10") == 1, logs.stdout  # not the tee too
    assert f"==> {job_dir}/logs/alloc-0/restart-0/rank-0.log <==" in logs.stdout
    assert f"slurm-{job_id}.out" in logs.stdout and f"job {job_id} is COMPLETED" in logs.stderr
    print(f"\nhpc logs -f returned {time.monotonic() - t0:.1f} s after submission")
    st = hpc(env, "status", "--json")  # no args: the recent jobs from the index
    views = json.loads(st.stdout)
    assert [v["job_id"] for v in views] == [job_id]
    assert views[0]["state"] == "COMPLETED" and views[0]["requeues"] == 0
    assert views[0]["allocations"][0]["outcome"] == "finished"
    table = hpc(env, "status", str(job_dir)).stdout
    assert "COMPLETED" in table and "#0 COMPLETED (finished)" in table


def test_cancel_running_job(env, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job_dir = tmp_path / "semi;colon $x" / "job"
    r = hpc(env, "submit", str(script), "--nodes", "2", "--job-dir", str(job_dir))
    assert r.returncode == 0, r.stderr
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    deadline = time.monotonic() + 60
    while squeue_state(env, job_id) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.3)
    st = json.loads(hpc(env, "status", "--json", job_id).stdout)
    assert st[0]["state"] == "RUNNING" and st[0]["nodes"].startswith("2 ")
    c = hpc(env, "cancel", str(job_dir))
    assert c.returncode == 0 and f"Cancelled job {job_id}" in c.stdout
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = json.loads(hpc(env, "status", "--json", job_id).stdout)[0]["state"]
        if state == "CANCELLED":
            break
        time.sleep(1)
    assert state == "CANCELLED"
