"""A rendezvous that can never reach MIN nodes ends as a requeue; a slow joiner is waited for.

Found by the fault campaign (benchmarks/RESULTS-campaign.md, restart seed 3): the rendezvous
host, left alone below MIN after its peer was lost, waited in torch's rendezvous (600-s join
timeout) for a node Slurm had already dropped from the job, instead of ending the allocation
as a node failure and requeueing. Both sides on the real cluster (runtime/launch/quorum.py), in
one job to keep the slurm tier short:

- the healthy job first: node 1 starts 30 s late (``HPC_TEST_SLOW_JOIN``, first allocation
  only). It is still in Slurm's job, so the host waits for it (its watch asks Slurm several
  times meanwhile) and training starts at world 2;
- then the fault: node 1 crashes. The host's workers fail and its agent waits for a second
  node that cannot come. The allocation must end as a node failure within ~2 minutes (Slurm
  drops the crashed node in ~20-30 s; before the fix: 600 s), requeue, and finish on the
  cluster's other nodes at the right step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from hpc.contract.slurm_parse import expand_hostlist
from tests.conftest import squeue_state, wait_until

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_gpt.py"
STEPS = 20


def submit(env: dict[str, str], job: Path, *extra: str, sleep: str = "0.3") -> str:
    r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(TRAIN), "--nodes", "2",
                        "--nproc-per-node", "1", "--job-dir", str(job), "--partition", "debug",
                        "--checkpoint-every-steps", "2", "--max-restarts", "3", *extra, "--",
                        "--preset", "tiny", "--max-steps", str(STEPS), "--step-sleep", sleep],
                       env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return (job / "slurm_job_id").read_text().strip()


def outcomes(job: Path) -> list[dict]:
    path = job / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def progress(job: Path) -> dict:
    try:
        return json.loads((job / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def ended(env: dict[str, str], job_id: str) -> bool:
    return squeue_state(env, job_id) in ("GONE", "COMPLETED", "FAILED", "CANCELLED")


def test_slow_joiner_waited_for_then_lone_survivor_below_min_requeues(slurm_cluster, tmp_path):
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    job = tmp_path / "lone"
    t_submit = time.time()
    job_id = submit(env, job, "--env", "HPC_TEST_SLOW_JOIN=1:30")
    wait_until(lambda: progress(job).get("step", 0) >= 4, 300, "training to step 4")
    # The healthy side: the late node was waited for, nothing ended the allocation.
    assert progress(job)["world_size"] == 2 and progress(job)["allocation"] == 0, progress(job)
    assert outcomes(job) == [], outcomes(job)
    logs = {p.name: p.read_text() for p in (job / "logs" / "alloc-0").glob("node-*.log")}
    assert any("joining the rendezvous 30s late" in text for text in logs.values()), list(logs)
    print(f"slow joiner: training at world 2 {time.time() - t_submit:.0f}s after the submit")
    nodes = expand_hostlist(subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=env,
                                           capture_output=True, text=True).stdout.strip())
    assert len(nodes) == 2, nodes
    lost = nodes[1]                      # node 1, not the rendezvous host (the allocation's first node)
    t_crash = time.time()
    slurm_cluster.crash(lost)
    wait_until(lambda: any(o["allocation"] == 0 for o in outcomes(job)), 240,
               f"allocation 0 to end (the host alone below MIN 2); outcomes {outcomes(job)}")
    first = next(o for o in outcomes(job) if o["allocation"] == 0)
    assert first["kind"] == "node_failure", first
    assert "below MIN 2" in first["reason"], first
    assert first["time"] - t_crash < 180, f"ended {first['time'] - t_crash:.0f}s after the crash"
    # The requeue: the job comes back on the other nodes, resumes from its checkpoint, finishes.
    wait_until(lambda: ended(env, job_id), 300, f"job {job_id} to finish; outcomes {outcomes(job)}")
    kinds = [(o["allocation"], o["kind"]) for o in outcomes(job)]
    assert kinds == [(0, "node_failure"), (1, "finished")], kinds
    result = json.loads((job / "result.json").read_text())
    assert result["final_step"] == STEPS and result["world_size"] == 2, result
    assert outcomes(job)[1]["start_step"] >= 2, outcomes(job)   # resumed, not from scratch
    print(f"lone survivor: allocation 0 ended {first['time'] - t_crash:.0f}s after the crash "
          f"({first['reason']})")
