"""``--replacement shrink``: the survivors go on at once, the replacement joins at a step boundary.

The real launcher and torch's elastic agent on this machine (``hpc run``, 3 workers, gloo, DDP).
A worker is SIGKILLed; its launcher starts it again as a joiner, which here takes 3 s more to
start (``--joiner-delay``: the picture of a GPU worker's CUDA and NCCL start-up). Under the
default ``--replacement wait`` the survivors' re-form waits for that start-up; under ``shrink``
they re-form at world 2 at once, train on, and the joiner is taken in at a later step boundary
(the hot spares' grow path), back to world 3.

The outcome a user cares about: steps were trained at world 2 *before the joiner even asked to
join* (the recovery did not wait for its start-up), the world is 3 again at the end, every
step's global batch is the sampler's (same samples, same order, same size) at every world size,
the survivors are the same processes, the replicas end equal, and no checkpoint was read.
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

from runtime.sampler import ResumableSampler
from tests.distributed.inprocess_support import lines

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 160
# While the world is 2 a step sleeps 0.5 s (not 0.15): >75 s of steps after the kill for the cold joiner
# to ask. It asked 5.6 s after the kill at load 3; under CI load it did not ask within 11 s (80 steps,
# CI of 6768ed4) nor within 27 s (160 steps at 0.15 s, CI of cbb6fe2).
SHRUNK_STEP_SLEEP = 0.5
JOINER_DELAY_S = 3.0


def test_shrink_goes_on_without_waiting_for_the_replacement_and_grows_back_later(tmp_path: Path):
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60")
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                            "--recovery", "inprocess", "--replacement", "shrink", "--max-restarts", "1",
                            "--job-dir", str(job), "--", "--out", str(out), "--steps", str(STEPS),
                            "--step-sleep", "0.15", "--shrunk-step-sleep", str(SHRUNK_STEP_SLEEP), "--joiner-delay", str(JOINER_DELAY_S)],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while True:
            assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
            ran = lines(out)
            victim = next((p for p, r in ran.items() if r and r[0]["rank"] == 2 and len(r) >= 6), None)
            if victim is not None and len(ran) == 3:
                break
            time.sleep(0.05)
        originals = set(ran)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        text, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, text[-5000:]
    ran = lines(out)
    joiners = set(ran) - originals
    assert len(joiners) == 1, f"expected one joiner, got {sorted(joiners)}"
    [joiner] = joiners
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    assert joiner in results, f"the joiner {joiner} never finished (it ran {len(ran[joiner])} steps)"
    assert set(results) == (originals - {victim}) | {joiner}, "a survivor was restarted"
    assert {r["step"] for r in results.values()} == {STEPS} and {r["world"] for r in results.values()} == {3}
    assert len({r["weights"] for r in results.values()}) == 1, "the replicas differ"
    ckpt = str(job / "checkpoints")
    assert not [f for r in results.values() for f in r["opened_while_recovering"] if f.startswith(ckpt)]

    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    [join] = [e for e in events if e["ev"] == "inproc_join"]
    rec = [e for e in events if e["ev"] == "inproc_recovery"]
    assert [e["world_size"] for e in rec] == [2, 3], rec   # the shrink, then the grow
    assert "joiner" in rec[1]["reason"] and rec[1]["step"] > rec[0]["step"], rec
    at_two = [x for p in originals - {victim} for x in ran[p] if x["world"] == 2]
    assert at_two, "no step was trained at world 2: the re-form waited for the replacement"
    # Evidence, not a clock: the survivors trained at world 2 before the joiner had even asked.
    assert min(x["t"] for x in at_two) < join["t_asked"], (min(x["t"] for x in at_two), join)

    # Same samples in the same order at every world size: each step's global batch is the sampler's.
    sampler = ResumableSampler(600, global_batch=12, seed=3)
    expected = {s: sampler.next_global_batch()[0] for s in range(STEPS)}
    seen = {(x["step"], x["first"], x["n"]) for r in ran.values() for x in r}
    by_step: dict[int, set] = {}
    for step, first, n in seen:
        by_step.setdefault(step, set()).add((first, n))
    assert set(by_step) == set(range(STEPS))
    assert all(v == {(expected[s], 12)} for s, v in by_step.items()), \
        {s: v for s, v in by_step.items() if v != {(expected[s], 12)}}
    print(f"killed -> shrunk re-form {rec[0]['t'] - killed_at:.2f} s (world 2), joiner asked "
          f"{join['t_asked'] - killed_at:.2f} s, grown back {rec[1]['t'] - killed_at:.2f} s (the members' "
          f"pause for the grow {rec[1]['t'] - rec[1]['t_detect']:.2f} s); "
          f"{len(at_two)} rank-steps at world 2; test {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
