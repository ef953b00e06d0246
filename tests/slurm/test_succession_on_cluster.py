"""No single point of failure inside an allocation (runtime/succession.py), on the real cluster.

The rendezvous host is the allocation's first node (node1 here). When it crashes or is cut
off, a majority of survivors elects a new host and goes on in the same allocation (no requeue:
the same SLURM_RESTART_COUNT), with the same sample order as an uninterrupted run; the old host
stops on its own and never commits a checkpoint after it was replaced. Without a majority
(2 nodes) nobody goes on alone: the outcome is recorded and the job is requeued.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.slurm.test_fault_tolerance import (ELASTIC, assert_same_as_baseline, latest_step,
                                              outcomes, progress, restarts, submit, wait_done,
                                              wait_until)

pytestmark = pytest.mark.slurm

# The fixture `env` is test_fault_tolerance's (pytest finds it here); `elastic_baseline` is conftest's.
from tests.slurm.test_fault_tolerance import env  # noqa: E402,F401,F811


def _manifests(job: Path) -> list[dict]:
    out = []
    for m in sorted((job / "checkpoints").glob("step-*/manifest.json")):
        data = json.loads(m.read_text())
        out.append({"step": data["step"], "world_size": data["world_size"],
                    "allocation": data.get("metadata", {}).get("allocation")})
    return out


def _resumed_after(job: Path, world: int, t0: float, timeout: float) -> float:
    """Seconds from wall time ``t0`` until rank 0 reports progress at world size ``world``."""
    def moving() -> bool:
        try:
            p = progress(job)
        except (FileNotFoundError, ValueError):
            return False
        return p["world_size"] == world and p["step"] > p.get("start_step", 0) and p["time"] > t0
    wait_until(moving, timeout, f"progress at world size {world}")
    return progress(job)["time"] - t0


def test_rendezvous_node_crash_survivors_go_on_in_the_same_allocation(env, slurm_cluster, tmp_path,
                                                                      elastic_baseline):
    job = tmp_path / "headcrash"
    job_id = submit({**env, "HPC_PROGRESS_EVERY_S": "0.5"}, job, "--nodes", "2:3",
                    "--max-restarts", "3", train=("--step-sleep", "0.3", *ELASTIC))
    wait_until(lambda: latest_step(job) >= 6, 240, "training to checkpoint step 6")
    assert progress(job)["world_size"] == 6
    wall0 = time.time()
    slurm_cluster.crash("node1")
    resumed_s = _resumed_after(job, 4, wall0, 120)
    print(f"\nrendezvous node crash -> survivors training again: {resumed_s:.1f} s")
    wait_done(env, job_id, job)
    result = assert_same_as_baseline(job, elastic_baseline, weights=False)
    assert result["world_size"] == 4
    assert restarts(env, job_id) in (0, -1), "not requeued: the survivors went on in the allocation"
    outs = outcomes(job)
    assert [o["kind"] for o in outs] == ["finished"], outs
    assert outs[0]["succession"] and "new host node2" in outs[0]["succession"][-1], outs
    assert (job / ".rdzv" / "alloc-0" / "current.json").exists()


def test_rendezvous_node_cut_the_majority_goes_on_alone_and_two_nodes_requeue_without_split_brain(
        env, slurm_cluster, tmp_path, elastic_baseline):
    """Two jobs whose rendezvous host is node1 (the first node of both) and one cut of node1's
    link for both (one start-up and one cut for the two, where each had its own):

    * ``--nodes 1:3`` on node1-3: MIN 1, so node1 alone could train on: only the fence keeps it
      from a second group; node2 and node3 elect a new host and go on in the same allocation,
      and only they commit checkpoints after the cut;
    * ``--nodes 1:2`` on node1-2: no majority without node1, so nobody goes on alone: node2
      records the node failure and the job is requeued and resumes; node1 never trained alone.
    """
    job, two = tmp_path / "headcut", tmp_path / "twocut"
    job_id = submit({**env, "HPC_PROGRESS_EVERY_S": "0.5"}, job, "--nodes", "1:3",
                    "--max-restarts", "3", train=("--step-sleep", "0.3", *ELASTIC))
    two_id = submit(env, two, "--nodes", "1:2", "--max-restarts", "3",
                    train=("--step-sleep", "0.3", *ELASTIC))
    wait_until(lambda: latest_step(job) >= 6 and latest_step(two) >= 6, 300,
               "both jobs training to checkpoint step 6")
    assert progress(job)["world_size"] == 6 and progress(two)["world_size"] == 4
    cut_step = latest_step(job)
    wall0 = time.time()
    slurm_cluster.cut("node1")
    resumed_s = _resumed_after(job, 4, wall0, 240)
    print(f"\nrendezvous node cut -> survivors training again: {resumed_s:.1f} s")
    wait_until(lambda: any(o["kind"] == "node_failure" for o in outcomes(two)), 240,
               "the two-node job's survivor's node_failure record")
    wait_done(env, job_id, job, timeout=500)
    wait_done(env, two_id, two, timeout=600)

    # --nodes 1:3: the majority went on; node1 stopped itself
    assert_same_as_baseline(job, elastic_baseline, weights=False)
    assert restarts(env, job_id) in (0, -1)
    later = [m for m in _manifests(job) if m["step"] > cut_step + 2]
    assert later and all(m["world_size"] == 4 for m in later), later   # one group committed
    node1_log = (job / "logs" / "alloc-0" / "node-node1.log").read_text()
    # node1 stopped itself: fenced by the survivors' new epoch, or on losing its majority
    assert "stops and records nothing" in node1_log, node1_log[-3000:]
    assert "replaced by epoch 1" in node1_log or "cut off" in node1_log, node1_log[-3000:]

    # --nodes 1:2: no split brain, requeued
    assert_same_as_baseline(two, elastic_baseline, weights=False)
    assert outcomes(two)[-1]["kind"] == "finished"
    assert restarts(env, two_id) >= 1 or len(outcomes(two)) >= 2   # requeued once, resumed
    alloc0 = [m for m in _manifests(two) if m["allocation"] == 0]
    assert all(m["world_size"] == 4 for m in alloc0), alloc0    # node1 never trained alone


def test_inprocess_rendezvous_node_crash_hands_over_to_succession(env, slurm_cluster, tmp_path):
    """``--recovery inprocess`` keeps its membership in node1's store: when node1 crashes the
    survivors cannot recover in place; they record why (``inproc_fallback``) and the restart
    path's succession goes on in the same allocation (before: the campaign's run hung 9 min)."""
    job = tmp_path / "inprocheadcrash"
    job_id = submit({**env, "HPC_PROGRESS_EVERY_S": "0.5"}, job, "--nodes", "2:3", "--max-restarts", "3",
                    "--recovery", "inprocess", train=("--step-sleep", "0.3", *ELASTIC))
    wait_until(lambda: latest_step(job) >= 6, 240, "training to checkpoint step 6")
    assert progress(job)["world_size"] == 6
    wall0 = time.time()
    slurm_cluster.crash("node1")
    try:
        resumed_s = _resumed_after(job, 4, wall0, 180)
    except AssertionError:   # what the survivors did, for the report
        for f in ["events.jsonl", *(f"logs/alloc-0/node-{n}.log" for n in ("node2", "node3"))]:
            print(f"--- {f}\n" + ((job / f).read_text()[-4000:] if (job / f).exists() else "(none)"))
        raise
    print(f"\ninprocess: rendezvous node crash -> survivors training again: {resumed_s:.1f} s")
    wait_done(env, job_id, job)
    assert restarts(env, job_id) in (0, -1), "not requeued: the survivors went on in the allocation"
    outs = outcomes(job)
    assert [o["kind"] for o in outs] == ["finished"], outs
    assert outs[0]["succession"] and "new host node2" in outs[0]["succession"][-1], outs
    evs = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    fallbacks = [e for e in evs if e["ev"] == "inproc_fallback" and e["t"] > wall0]
    print(f"inproc_fallback: {[(e['node'], round(e['t'] - wall0, 1), e['reason'][:160]) for e in fallbacks]}")
    assert fallbacks and all(e["reason"].startswith("the rendezvous host node1 is lost") for e in fallbacks), fallbacks
