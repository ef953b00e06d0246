"""Joining a running in-process job: ``hpc run --recovery inprocess`` replaces dead workers.

The real launcher and torch's elastic agent on this machine (3 workers, gloo, DDP). Two workers
are SIGKILLed at different steps (the second one after the first replacement joined). Each
time the launcher promises a replacement in the store, announces the death and starts the
dead worker's command again as a *joiner*; the survivors' re-form waits for it, the member
holding the newest step broadcasts the state, and the world never shrinks. The outcome a user
cares about: the job ends at world 3 with weights bit-equal to an uninterrupted run (run
beside it), the workers never killed are the same processes, no checkpoint was read to
recover or to join, and the joins are recorded in ``events.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.inprocess_support import kill_when, lines

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 24


def hpc_run(out: Path, job: Path) -> subprocess.Popen[str]:
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60")
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                             "--recovery", "inprocess", "--max-restarts", "2", "--job-dir", str(job),
                             "--", "--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.15"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_killed_workers_are_replaced_by_joiners_and_the_weights_are_the_uninterrupted_ones(tmp_path: Path):
    t0 = time.time()
    plain = hpc_run(tmp_path / "plain out", tmp_path / "plain job")   # the uninterrupted run, beside
    out, job = tmp_path / "out", tmp_path / "job dir"
    run = hpc_run(out, job)
    try:
        deadline = time.time() + 300
        first = kill_when(run, out, lambda pid, ran: ran[0]["rank"] == 2 and len(ran) >= 6, deadline)
        originals = set(lines(out))
        # The second fault: an original worker of rank 1, once the replacement has trained a step.
        second = kill_when(run, out, lambda pid, ran: pid in originals and ran[0]["rank"] == 1 and any(
            r for p, r in lines(out).items() if p not in originals and len(r) >= 2), deadline)
        text, _ = run.communicate(timeout=300)
        plain_text, _ = plain.communicate(timeout=300)
    finally:
        for p in (run, plain):
            if p.poll() is None:
                p.kill()
    assert run.returncode == 0, text[-5000:]
    assert plain.returncode == 0, plain_text[-3000:]
    ran = lines(out)
    joiners = set(ran) - originals
    assert len(joiners) == 2, f"expected two joiners, got pids {sorted(joiners)}"
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    kept = originals - {first, second}
    assert set(results) == kept | joiners, (sorted(results), kept, joiners)   # survivors are the same processes
    assert {r["step"] for r in results.values()} == {STEPS} and {r["world"] for r in results.values()} == {3}
    expected = json.loads(next((tmp_path / "plain out").glob("result-*.json")).read_text())
    assert {r["weights"] for r in results.values()} == {expected["weights"]}, "not the uninterrupted run's weights"
    assert {json.dumps(r["sampler"], sort_keys=True) for r in results.values()} == \
        {json.dumps(expected["sampler"], sort_keys=True)}
    ckpt = str(job / "checkpoints")
    for r in results.values():
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
    for steps in ran.values():   # the world never shrank
        assert {x["world"] for x in steps} == {3}
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    joins = [e for e in events if e["ev"] == "inproc_join"]
    assert sorted(e["pid"] for e in joins) == sorted(joiners), joins
    detect = [e for e in events if e["ev"] == "inproc_detect"]
    assert [e["pid"] for e in detect] == [first, second] and all(e["replace"] for e in detect), detect
    rec = [e for e in events if e["ev"] == "inproc_recovery"]
    assert len(rec) == 2 and {e["world_size"] for e in rec} == {3}, rec
    # Measured: fault -> the joiner's first step (its start-up dominates), and the join itself.
    for d, j in zip(detect, sorted(joins, key=lambda e: e["t"])):
        first_step = ran[j["pid"]][0]["t"]
        print(f"fault -> joiner's first step {first_step - d['t']:.2f} s (start-up until it asked "
              f"{j['t_asked'] - d['t']:.2f} s, asked -> taken in {j['wait_s']:.2f} s, taken in -> state received "
              f"{j['receive_s']:.2f} s, {j['bytes']} bytes)")
    print(f"test took {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
