"""In-process recovery on the real cluster (issue 26): one job, 2 nodes x 2 processes + 1 node.

The tiny example under ``--recovery inprocess`` on node1-3 (2 processes each). Four faults one
after the other in the same job, as hardware fails:

1. a worker SIGKILLed on node2 (its launcher announces the death and starts a joiner that
   receives the state from the peers' memory);
2. the other worker of node2 SIGSTOPped (frozen: its launcher sees it stopped 2 s, kills it and
   replaces it like a dead one);
3. node3 crashes (every process there SIGKILLed, slurmd included; its launcher dies with it);
4. node2's link is cut (its processes live on, silent): node1's launcher sees node2's beacon
   stand still 5 s and announces its workers dead; the link then heals and node2's workers,
   left out, end cleanly.

After each: the surviving workers are the same processes (PIDs), the recovery read no
checkpoint (an ``inproc_recovery`` event, no ``restore_*`` after the fault), at most one step
was computed twice; at the end the job is finished. The fault -> next step times are printed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import tests.slurm.support as ft
from tests.conftest import wait_until
from tests.slurm.support import events, twice, workers

pytestmark = pytest.mark.slurm
STEPS = 120


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def step_now(job: Path) -> int:
    try:
        return int(ft.progress(job).get("step", 0))
    except (FileNotFoundError, ValueError):
        return 0


def recovered(job: Path, since: float) -> list[dict]:
    return [e for e in events(job) if e["ev"] == "inproc_recovery" and e["t"] >= since]


def check(job: Path, since: float, survivors: dict[str, set[int]], what: str) -> None:
    """The outcome after one fault: same processes, no checkpoint read, no fallback (the
    steps computed twice are counted per fault at the end: the step windows come late)."""
    for n, pids in survivors.items():
        assert pids <= workers(n), f"{what}: survivors on {n} restarted: {pids} -> {workers(n)}"
    assert recovered(job, since), f"{what}: no in-process recovery: {[e['ev'] for e in events(job)][-20:]}"
    assert not [e for e in events(job) if e["ev"].startswith("restore") and e["t"] >= since], what
    assert not [e for e in events(job) if e["ev"] == "inproc_fallback" and e["t"] >= since], what


def fault(job: Path, what: str, act, timings: dict[str, float]) -> float:
    """Injects a fault; returns its time once 3 more steps are done (the first one is timed)."""
    at, t = step_now(job), time.time()
    timings[what + " at step"] = at
    act()
    wait_until(lambda: step_now(job) >= at + 1, 150, f"a step after the {what}; {events(job)[-6:]}")
    timings[what] = time.time() - t
    wait_until(lambda: step_now(job) >= at + 3, 60, f"training on after the {what}")
    return t


def test_four_faults_are_survived_in_process(env, slurm_cluster, tmp_path):
    job = tmp_path / "inproc"
    t0 = time.time()
    job_id = ft.submit(env, job, "--nodes", "2:3", "--max-restarts", "4", "--recovery", "inprocess",
                       train=("--step-sleep", "0.3", "--max-steps", str(STEPS), *ft.ELASTIC))
    wait_until(lambda: step_now(job) >= 6 and ft.progress(job).get("world_size") == 6, 240,
               "training on 3 nodes")
    before = {n: workers(n) for n in ("node1", "node2", "node3")}
    assert all(len(p) == 2 for p in before.values()), before
    timings: dict[str, float] = {}

    # 1. A worker SIGKILLed on node2: replaced by a joiner.
    killed, frozen = sorted(before["node2"])
    t = fault(job, "worker kill", lambda: os.kill(killed, signal.SIGKILL), timings)
    check(job, t, {"node1": before["node1"], "node2": {frozen}, "node3": before["node3"]}, "worker kill")
    joiner1 = workers("node2") - {frozen}

    # 2. The other worker of node2 SIGSTOPped: frozen, killed by its launcher, replaced.
    t = fault(job, "worker SIGSTOP", lambda: os.kill(frozen, signal.SIGSTOP), timings)
    check(job, t, {"node1": before["node1"], "node2": joiner1, "node3": before["node3"]}, "worker SIGSTOP")
    assert frozen not in workers("node2")
    node2 = workers("node2")
    assert len(node2) == 2, node2

    # 3. node3 crashes (slurmd and every process there).
    t = fault(job, "node crash", lambda: slurm_cluster.crash("node3"), timings)
    check(job, t, {"node1": before["node1"], "node2": node2}, "node crash")

    # 4. node2's link is cut: node1 goes on alone; healed, node2's left-out workers end.
    t = fault(job, "link cut", lambda: slurm_cluster.cut("node2"), timings)
    check(job, t, {"node1": before["node1"]}, "link cut")
    [cut] = [e for e in events(job) if e["ev"] == "inproc_detect" and e.get("lost_node") == "node2"]
    assert sorted(cut["workers"]) == sorted(f"node2/{p}" for p in node2), (cut, node2)
    slurm_cluster.heal("node2")

    ft.wait_done(env, job_id, job)
    assert ft.outcomes(job)[-1]["kind"] == "finished", ft.outcomes(job)
    # At most one step computed twice per fault: each duplicate belongs to the fault before it
    # (progress.json, which gave the fault's step, may lag the real step by a few).
    ats = [v for k, v in timings.items() if k.endswith(" at step")] + [10 ** 9]
    dups = twice(job)
    for k in range(4):
        mine = [d for d in dups if ats[k] - 3 <= d < ats[k + 1] - 3]
        assert len(mine) <= 1, (k, dups, ats)
    assert len(dups) <= 4, dups
    worlds = [e["world_size"] for e in events(job) if e["ev"] == "inproc_recovery"]
    print(f"fault -> next step: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items() if 'at step' not in k)}; "
          f"steps twice {dups}; "
          f"worlds after each recovery {worlds}; test took {time.time() - t0:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}")
