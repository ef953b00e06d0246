"""Hot spares on the real cluster: a 2-node job with ``--spare-nodes 1`` on the 3-node cluster.

The third node's launcher starts, passes its health check and waits in torch's rendezvous
without a rank. A member is then lost, as hardware fails: its node crashes (every process
killed, sockets closed by the kernel), or its link goes down (its processes run on, nothing
closes: the stall watch must notice). The spare takes the lost node's place, the group
re-forms at the same world size (2 nodes x 2 processes) from the last checkpoint, and the job
ends with weights and sample order bit-equal to the uninterrupted 2-node run (the session's
``baseline``), without a requeue; the ledger has the spare's idle time and its join, and
``hpc status`` says which node joined.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.conftest import wait_until
from tests.slurm.support import (assert_same_as_baseline, hpc, latest_step, outcomes, restarts,
                                 submit, wait_done)

import pytest

pytestmark = pytest.mark.slurm


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def members(job: Path) -> tuple[set[str], set[str]]:
    """(nodes whose workers started, nodes that passed their health check) in allocation 0."""
    try:
        evs = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return set(), set()
    started = {e["node"] for e in evs if e.get("ev") == "workers_started" and e.get("alloc") == 0}
    ready = {e["node"] for e in evs if e.get("ev") == "node_ready" and e.get("alloc") == 0}
    return started, ready


def run_with_spare(env: dict[str, str], job: Path, baseline: dict, fault: str, slurm_cluster) -> None:
    job_id = submit(env, job, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "3",
                    train=("--step-sleep", "0.2"))
    submitted = time.time()
    wait_until(lambda: latest_step(job) >= 4 and len(members(job)[0]) == 2 and len(members(job)[1]) == 3,
               240, f"training on 2 nodes with a third waiting; events: {members(job)}")
    started, ready = members(job)
    [spare] = ready - started
    # The rendezvous host (node1, the first node) hosts the store: lose the other member.
    victim = sorted(started - {"node1"})[-1]
    print(f"members {sorted(started)}, spare {spare}; {fault} {victim} at step {latest_step(job)}, "
          f"{time.time() - submitted:.1f} s after the submission")
    lost_at = time.time()
    getattr(slurm_cluster, fault)(victim)
    wait_until(lambda: spare in members(job)[0], 120, f"{spare} to join; outcomes {outcomes(job)}")
    print(f"{fault} -> spare {spare}'s workers started {time.time() - lost_at:.1f} s later")
    wait_done(env, job_id, job)
    print(f"job done {time.time() - lost_at:.1f} s after the {fault}")
    result = assert_same_as_baseline(job, baseline)
    assert result["world_size"] == 4, "the spare kept the world size (2 nodes x 2)"
    assert [o["kind"] for o in outcomes(job)] == ["finished"], outcomes(job)
    assert restarts(env, job_id) in (0, -1), "not requeued: the spare took the lost node's place"
    report = hpc(env, "report", "--json", str(job))
    assert report.returncode == 0, report.stderr
    ledger = json.loads(report.stdout)
    [alloc] = ledger["allocations"]
    assert ledger["categories"]["spare"] > 0, ledger["categories"]
    assert [m[2] for m in alloc["markers"] if m[1] == "spare"] == [f"spare {spare} joins"], alloc["markers"]
    assert alloc["spares"][spare][2] is True
    status = hpc(env, "status", str(job))
    assert f"{spare} joined" in status.stdout, status.stdout + status.stderr
    print(f"ledger: spare {ledger['categories']['spare']:.1f} node-s of "
          f"{ledger['allocated_node_s']:.1f}, goodput {ledger['goodput']:.3f}")


def test_a_crashed_node_is_replaced_by_the_spare_bit_equal(env, slurm_cluster, tmp_path, baseline):
    run_with_spare(env, tmp_path / "crash", baseline, "crash", slurm_cluster)


def test_a_cut_link_is_replaced_by_the_spare_bit_equal(env, slurm_cluster, tmp_path, baseline):
    """Nothing closes on a cut link: the survivors' stall watch names the silent node and kills
    its workers; the re-formed group takes the spare. The cut node, cut off from the store and
    from Slurm's controller, fences itself and records nothing (runtime/launch/main.py)."""
    run_with_spare(env, tmp_path / "cut", baseline, "cut", slurm_cluster)
