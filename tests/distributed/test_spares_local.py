"""A hot spare for real, on one machine: ``hpc run --nodes 2 --spare-nodes 1`` starts three
launchers; torch's rendezvous takes two, the third waits without a rank. A member's launcher
and workers are SIGKILLed mid-training (as a node crash ends them); the spare takes its place,
the group re-forms at world 2 from the last checkpoint and finishes with the weights and sample
order of the uninterrupted 2-node run. (The cluster test, tests/slurm/test_spares_on_cluster.py,
does the same with a crashed node and a cut link, and checks the ledger and ``hpc status``.)
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

from tests.conftest import REPO, wait_until
from tests.distributed.support import launcher_pid, launchers

pytestmark = pytest.mark.distributed
TRAIN = REPO / "examples" / "train_gpt.py"
ARGS = ("--preset", "tiny", "--max-steps", "8")


def hpc_run(job: Path, *hpc_args: str, train: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hpc", "run", str(TRAIN), "--nproc-per-node", "1", "--job-dir", str(job),
         "--checkpoint-every-steps", "2", *hpc_args, "--", *ARGS, *train],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def latest_step(job: Path) -> int:
    try:
        return int((job / "checkpoints" / "latest").read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return 0


def test_a_spare_replaces_a_killed_node_and_the_weights_are_those_of_the_same_world(tmp_path: Path):
    job, plain = tmp_path / "spare", tmp_path / "plain"
    base = hpc_run(plain, "--nodes", "2")    # the uninterrupted run, meanwhile
    run = hpc_run(job, "--nodes", "2", "--spare-nodes", "1", train=("--step-sleep", "0.3"))
    try:
        wait_until(lambda: latest_step(job) >= 2 and len(launchers(job)[0]) == 2
                   and len(launchers(job)[1]) == 3, 240, f"training with a spare waiting: {launchers(job)}")
        started, ready = launchers(job)
        [spare] = ready - started
        victim = max(started - {0})      # node 0 hosts the rendezvous store
        killed_at = time.time()
        os.killpg(launcher_pid(job, victim), signal.SIGKILL)   # the launcher and its workers
        out, _ = run.communicate(timeout=300)
        took_s = time.time() - killed_at
        base_out, _ = base.communicate(timeout=300)
    finally:
        for p in (run, base):
            if p.poll() is None:
                p.kill()
    assert spare in launchers(job)[0], f"the spare's workers never started: {launchers(job)}\n{out[-3000:]}"
    result = json.loads((job / "result.json").read_text())
    assert result["final_step"] == 8 and result["world_size"] == 2, result
    print(f"node rank {victim} killed; finished {took_s:.1f} s later")
    assert base.returncode == 0, base_out[-3000:]
    expected = json.loads((plain / "result.json").read_text())
    assert result["sample_order_sha256"] == expected["sample_order_sha256"], "samples lost or repeated"
    assert result["weights_sha256"] == expected["weights_sha256"], "not the numerics of the same world"
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["hangs"] == [], outcome
    # The job finished: hpc run says so (0), not the killed launcher's 137.
    assert run.returncode == 0, out[-3000:]
    status = subprocess.run([sys.executable, "-m", "hpc", "status", str(job)], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "HPC_HOME": str(tmp_path)})
    assert f"(node rank {spare}) joined" in status.stdout, status.stdout + status.stderr


def test_a_spare_failing_its_health_check_is_not_used_and_no_one_waits_for_it(tmp_path: Path):
    """Node rank 2, one of three launchers of ``--nodes 2 --spare-nodes 1``, fails its pre-join
    check (its job-directory probe points at a path that cannot be written): it leaves without
    joining, and the two others train at world 2 and finish; nothing waited for it."""
    job = tmp_path / "job"
    r = subprocess.run(
        [sys.executable, "-m", "hpc", "run", str(TRAIN), "--nodes", "2", "--spare-nodes", "1",
         "--nproc-per-node", "1", "--job-dir", str(job), "--env", "HPC_TEST_HEALTH_FAIL=2",
         "--", "--preset", "tiny", "--max-steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert json.loads((job / "result.json").read_text())["world_size"] == 2
    started, ready = launchers(job)
    assert started == ready == {0, 1}, (started, ready)
    logs = "".join(p.read_text() for p in (job / "logs" / "alloc-0").glob("node-*.log"))
    assert "[hpc launch node 2] ERROR health check failed" in logs and "this node leaves the job" in logs
