"""No single point of failure inside an allocation (runtime/succession.py), on the real cluster.

The rendezvous host is the allocation's first node (node1 here). When it crashes or is cut
off, a majority of survivors elects a new host and goes on in the same allocation (no requeue:
the same SLURM_RESTART_COUNT), with the same sample order as an uninterrupted run; the old host
stops on its own and never commits a checkpoint after it was replaced. Without a majority
(2 nodes) nobody goes on alone: the outcome is recorded and the job is requeued.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.slurm.support import (ELASTIC, assert_same_as_baseline, hpc, latest_step, outcomes,
                                 progress, restarts, submit, wait_done)

pytestmark = pytest.mark.slurm

# The fixtures `env` and `elastic_baseline` are conftest's.


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


@pytest.mark.parametrize("fault", ["crash", "cut"])
def test_inprocess_rendezvous_host_loss_is_survived_in_process(env, slurm_cluster, tmp_path, fault):
    """``--recovery inprocess`` keeps its membership in node1's store. When node1 crashes (its
    store's connections reset) or its link is cut (its store silent, node1 alive), the
    survivors' launchers elect node2 as before (same board, same majority) but keep their
    workers: the new epoch's agents adopt them and name node2's new store to them, and they
    re-form there in process: the same PIDs, no checkpoint read, at most one step computed
    twice, world 4 after, in the same allocation, and the job finishes. A cut node1 stops its
    own workers and commits nothing after the survivors' epoch."""
    from tests.slurm.support import workers

    job = tmp_path / f"inprochead{fault}"
    job_id = submit({**env, "HPC_PROGRESS_EVERY_S": "0.5"}, job, "--nodes", "2:3", "--max-restarts", "3",
                    "--recovery", "inprocess", train=("--step-sleep", "0.3", *ELASTIC))
    wait_until(lambda: latest_step(job) >= 6, 240, "training to checkpoint step 6")
    assert progress(job)["world_size"] == 6
    kept = {n: workers(n) for n in ("node2", "node3")}
    assert all(len(p) == 2 for p in kept.values()), kept
    at, cut_step = progress(job)["step"], latest_step(job)
    wall0 = time.time()
    slurm_cluster.crash("node1") if fault == "crash" else slurm_cluster.cut("node1")
    logs = [f"logs/alloc-0/node-{n}.log" for n in ("node1", "node2", "node3")]
    try:
        resumed_s = _resumed_after(job, 4, wall0, 180)
        print(f"\ninprocess: rendezvous node {fault} -> survivors training again: {resumed_s:.1f} s")
        for n, pids in kept.items():   # the same processes, before the job ends
            assert pids == workers(n), f"the workers on {n} were started again: {pids} -> {workers(n)}"
        if fault == "crash":   # an adopted worker lost after the re-form: a joiner takes its place
            killed = _kill_adopted_worker(job, kept["node3"])
        wait_done(env, job_id, job, timeout=500)
        assert restarts(env, job_id) in (0, -1), "not requeued: the survivors went on in the allocation"
    except AssertionError:   # what the survivors did, for the report
        if os.environ.get("HPC_TEST_KEEP_DIR"):   # the whole job directory, to read after the cleanup
            shutil.copytree(job, Path(os.environ["HPC_TEST_KEEP_DIR"]) / f"{job.name}-{int(wall0)}")
        for f in ["events.jsonl", *logs]:
            print(f"--- {f}\n" + ((job / f).read_text()[-4000:] if (job / f).exists() else "(none)"))
        raise
    try:
        if fault == "crash":
            _check_joined(job, killed, wall0)
        _check_kept_in_process(env, job, fault, kept=kept, wall0=wall0, at=at, cut_step=cut_step,
                               extra_recoveries=1 if fault == "crash" else 0)
    except AssertionError:
        if os.environ.get("HPC_TEST_KEEP_DIR"):
            shutil.copytree(job, Path(os.environ["HPC_TEST_KEEP_DIR"]) / f"{job.name}-{int(wall0)}")
        raise


def _kill_adopted_worker(job: Path, pids: set[int]) -> int:
    """SIGKILLs one of ``pids`` (a node's adopted workers) once the job trained two steps past
    its re-form; returns it."""
    from tests.slurm.support import events

    def reformed_at() -> int | None:
        recs = [e for e in events(job) if e["ev"] == "inproc_recovery"]
        return recs[0]["step"] if recs else None
    wait_until(lambda: reformed_at() is not None and progress(job)["step"] >= reformed_at() + 2, 120,
               "two steps after the in-process re-form")
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    return victim


def _check_joined(job: Path, killed: int, wall0: float) -> None:
    """The killed adopted worker's joiner joined (no fallback to the restart path). Its
    environment is the dead worker's, from /proc: with the epoch it had started in, the joiner
    broke its own connections to the new store and died three times in a row (the campaign)."""
    from tests.slurm.support import events

    evs = [e for e in events(job) if e["t"] > wall0]
    detect = [e for e in evs if e["ev"] == "inproc_detect" and e.get("pid") == killed]
    assert detect and detect[0]["replace"], [(e["ev"], e.get("pid"), e.get("node")) for e in evs]
    joins = [e for e in evs if e["ev"] == "inproc_join" and e["t"] > detect[0]["t"]]
    assert joins and joins[0]["world_size"] == 4, (joins, [(e["ev"], str(e.get("reason", ""))[:200]) for e in evs])
    replaced = [e for e in evs if e["ev"] == "inproc_replace" and e["t"] > detect[0]["t"]]
    assert len(replaced) == 1, replaced   # one joiner, not a row of them dying
    print(f"adopted worker {killed} killed -> joiner {joins[0]['pid']} joined "
          f"{joins[0]['t'] - detect[0]['t']:.1f} s later")


def _check_kept_in_process(env: dict, job: Path, fault: str, *, kept: dict, wall0: float, at: int,
                           cut_step: int, extra_recoveries: int = 0) -> None:
    from tests.slurm.support import events, twice

    logs = [f"logs/alloc-0/node-{n}.log" for n in ("node1", "node2", "node3")]
    for f in logs[1:]:   # which way each survivor kept its workers (the agent's error, or the fence)
        print(f, [x[:200] for x in (job / f).read_text().splitlines() if "kept" in x or "keeping" in x])
    outs = outcomes(job)
    assert [o["kind"] for o in outs] == ["finished"], outs
    assert outs[0]["succession"] and "new host node2" in outs[0]["succession"][-1], outs
    evs = events(job)
    after = [e for e in evs if e["t"] > wall0 and e.get("node") != "node1"]
    print("after the fault:", [(e["ev"], e.get("node"), round(e["t"] - wall0, 1), str(e.get("reason", ""))[:300])
                               for e in after if e["ev"].startswith(("inproc", "restore"))])
    assert not [e for e in after if e["ev"] == "inproc_fallback"], after
    assert not [e for e in after if e["ev"].startswith("restore")], "a checkpoint was read after the fault"
    adopted = [e for e in after if e["ev"] == "inproc_adopt"]
    assert sorted(p for e in adopted for p in e["pids"]) == sorted(p for ps in kept.values() for p in ps), adopted
    assert all(e["epoch"] == 1 and e["store"].startswith("node2:") for e in adopted), adopted
    recs = [e for e in after if e["ev"] == "inproc_recovery"]
    assert recs and recs[0]["world_size"] == 4 and recs[0]["old_world_size"] == 6, recs
    dups = [d for d in twice(job) if d >= at - 3]
    assert len(dups) <= 1 + extra_recoveries, (dups, at)   # a failed step is computed again, once
    assert progress(job)["world_size"] == 4
    later = [m for m in _manifests(job) if m["step"] > cut_step + 2]
    assert later and all(m["world_size"] == 4 for m in later), later   # one group committed
    if fault == "cut":   # node1 stopped itself: fenced by the new epoch, or on losing its majority
        node1_log = (job / logs[0]).read_text()
        assert "stops and records nothing" in node1_log, node1_log[-3000:]
    report = hpc(env, "report", str(job))
    assert report.returncode == 0, report.stderr
    assert "kept its workers" in report.stdout and "world 6 -> 4" in report.stdout, report.stdout
    print(f"steps twice {dups}; recoveries {recs}; hpc report:\n{report.stdout[-2500:]}")
