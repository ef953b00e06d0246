"""A sweep on the real cluster: a 3x2 grid is ONE job array of 6 tasks, each a full hpc job."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import hpc
from tests.wandb_offline import read_run

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]

COLLECT = textwrap.dedent("""
    import json, sys
    import hpc
    sweep = hpc.Sweep.attach(sys.argv[1])
    views = sweep.wait(timeout=600, max_interval_s=3)
    print(json.dumps({"states": [v.state for v in views], "rows": sweep.results()}))
""")


def test_a_3x2_grid_is_one_array_of_six_jobs(slurm_cluster, tmp_path: Path) -> None:
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    root = tmp_path / "sweep dir"
    r = hpc(env, "sweep", str(REPO / "examples" / "train_gpt.py"), "--job-dir", str(root),
            "--nodes", "1", "--nproc-per-node", "1", "--time", "10", "--throttle", "3",
            "--grid", "seed=1,2,3", "--grid", "lr=1e-3,3e-4", "--", "--preset", "tiny",
            "--max-steps", "6")
    assert r.returncode == 0, r.stderr
    array_id = (root / "slurm_job_id").read_text().strip()
    assert f"Submitted sweep {array_id}: 6 tasks" in r.stdout

    # One Slurm job: every task id is ARRAY_i, and the array asks for at most 3 at once.
    q = subprocess.run(["scontrol", "show", "job", "-o", array_id], env=env, capture_output=True,
                       text=True).stdout
    assert f"ArrayJobId={array_id}" in q and "%3" in q

    out = subprocess.run([sys.executable, "-c", COLLECT, array_id], env=env, capture_output=True,
                         text=True, timeout=700, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["states"] == ["COMPLETED"] * 6
    rows = got["rows"]
    assert [r["job_id"] for r in rows] == [f"{array_id}_{i}" for i in range(6)]
    assert all(r["outcome"] == "finished" and r["final_step"] == 6 for r in rows)
    assert rows[0]["args"][-4:] == ["--seed", "1", "--lr", "1e-3"]
    assert rows[5]["args"][-4:] == ["--seed", "3", "--lr", "3e-4"]
    # Different seeds and learning rates really trained different models.
    assert len({r["weights_sha256"] for r in rows}) == 6

    # Each task has its own W&B run, all in the sweep's group.
    groups, run_ids = set(), set()
    for i in range(6):
        task = root / f"task-{i}"
        run_id = (task / "wandb_run_id").read_text().strip()
        run = read_run(task / "wandb", run_id)
        run_ids.add(run_id)
        groups |= run.groups
    assert len(run_ids) == 6 and groups == {"train_gpt"}

    status = hpc(env, "status", array_id)
    assert status.returncode == 0, status.stderr
    assert f"sweep {array_id} (train_gpt): 6 tasks: 6 COMPLETED" in status.stdout
    assert f"{array_id}_5" in status.stdout
    logs = hpc(env, "logs", f"{array_id}_2")
    assert logs.returncode == 0 and "train_gpt: done at step 6" in logs.stdout, logs.stderr
