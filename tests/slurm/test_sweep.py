"""A sweep on the real cluster: a 3x2 grid is ONE job array of 6 tasks, each a full hpc job."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import hpc, wait_until
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


def _outcomes(task: Path) -> list[dict]:
    path = task / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _latest(task: Path) -> int:
    try:
        return int((task / "checkpoints" / "latest").read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return 0


def test_a_preempted_task_requeues_and_resumes_alone(slurm_cluster, tmp_path: Path) -> None:
    """A real higher-priority job preempts the node of task 1: task 1 saves, is requeued and
    resumes at its checkpoint; tasks 0 and 2 run on untouched in their first allocation."""
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    root = tmp_path / "sweep"
    steps = 30
    r = hpc(env, "sweep", str(REPO / "examples" / "train_gpt.py"), "--job-dir", str(root),
            "--nodes", "1", "--nproc-per-node", "1", "--cpus-per-task", "4",  # one task per node
            "--time", "10", "--checkpoint-every-steps", "2", "--grid", "seed=1,2,3",
            "--", "--preset", "tiny", "--max-steps", str(steps), "--step-sleep", "0.3")
    assert r.returncode == 0, r.stderr
    array_id = (root / "slurm_job_id").read_text().strip()
    tasks = [root / f"task-{i}" for i in range(3)]
    wait_until(lambda: all(_latest(t) >= 2 for t in tasks), 180, "every task's first checkpoint")
    node = subprocess.run(["squeue", "-h", "-j", f"{array_id}_1", "-o", "%N"], env=env,
                          capture_output=True, text=True).stdout.strip()
    assert node.startswith("node"), node
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", "1", "-w", node,
                           "-t", "2", "-o", str(tmp_path / "high.out"), "--wrap", "sleep 4"],
                          env=env, capture_output=True, text=True)
    assert high.returncode == 0, high.stderr

    out = subprocess.run([sys.executable, "-c", COLLECT, array_id], env=env, capture_output=True,
                         text=True, timeout=700, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["states"] == ["COMPLETED"] * 3
    assert all(row["final_step"] == steps for row in got["rows"])
    kinds = [[o["kind"] for o in _outcomes(t)] for t in tasks]
    assert kinds[1] == ["preempted", "finished"], kinds
    assert kinds[0] == kinds[2] == ["finished"], kinds          # untouched, one allocation each
    resumed = _outcomes(tasks[1])[1]
    assert resumed["start_step"] == _outcomes(tasks[1])[0]["step"]   # resumed at its checkpoint


def test_cancel_one_task_leaves_the_others_running(slurm_cluster, tmp_path: Path) -> None:
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home")}
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(300)\n")
    root = tmp_path / "sweep"
    r = hpc(env, "sweep", str(script), "--job-dir", str(root), "--nodes", "1", "--time", "5",
            "--grid", "x=1,2")
    assert r.returncode == 0, r.stderr
    array_id = (root / "slurm_job_id").read_text().strip()

    seen: dict[str, str] = {}

    def read() -> bool:
        """Reads each task's state into ``seen``; False when squeue failed (a busy controller):
        an empty answer then is no sign that a task left the queue."""
        r = subprocess.run(["squeue", "-h", "--array", "-j", array_id, "-o", "%i %T"], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            return False
        out = r.stdout.split()
        seen.clear()
        seen.update(zip(out[::2], out[1::2]))
        return True

    wait_until(lambda: read() and seen.get(f"{array_id}_0") == seen.get(f"{array_id}_1") == "RUNNING",
               60, "both tasks running")
    c = hpc(env, "cancel", f"{array_id}_1")
    assert c.returncode == 0 and f"Cancelled job {array_id}_1" in c.stdout, c.stderr
    wait_until(lambda: read() and f"{array_id}_1" not in seen, 60, "task 1 gone")
    assert seen.get(f"{array_id}_0") == "RUNNING", seen
    assert hpc(env, "cancel", array_id).returncode == 0
    wait_until(lambda: read() and not seen, 60, "the whole array gone")
