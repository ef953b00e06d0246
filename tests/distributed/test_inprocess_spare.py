"""A hot spare joins in-process: ``hpc run --nodes 2 --spare-nodes 1 --recovery inprocess``.

Three launchers on this machine; node rank 2 is the spare: its launcher runs no torch agent,
its worker starts at once as a joiner and waits in the store. Node rank 1 is lost (its
launcher and its worker SIGKILLed, as a crash ends them): the survivor's re-form takes the
spare's worker in, the survivor broadcasts the state, and the world is 2 again. The outcome a
user cares about: the survivor is the same process, nothing was read from a checkpoint, the
weights and sample order are bit-equal to the uninterrupted 2-node run (run beside it), and
the spare's join is in the goodput ledger's events (``workers_started`` of node rank 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.inprocess_support import lines
from tests.distributed.support import launcher_pid, launchers

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 20   # 0.6-s steps: the job still runs when its spare is ready at CI's load (crash_node1 waits for it)


def hpc_run(out: Path, job: Path, *extra: str, steps: int = STEPS) -> subprocess.Popen[str]:
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="5")
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nodes", "2", *extra,
                             "--nproc-per-node", "1", "--recovery", "inprocess", "--job-dir", str(job),
                             "--", "--out", str(out), "--steps", str(steps), "--step-sleep", "0.6"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def spare_ready(job: Path) -> bool:
    """The spare's joiners wait in the store (its launcher's ``spare_ready`` event)."""
    f = job / "events.jsonl"
    return f.exists() and any(json.loads(x).get("ev") == "spare_ready" for x in f.read_text().splitlines()
                              if x.startswith("{") and x.endswith("}"))


def crash_node1(run: subprocess.Popen[str], out: Path, job: Path, deadline: float) -> tuple[int, int]:
    """Once rank 1 has trained 5 steps and the spare's joiners wait (at load their start took
    longer than 5 steps: the survivor then went on alone and grew later, another world's
    weights), node rank 1 crashes (its launcher and worker SIGKILLed); returns (rank 0's
    worker, rank 1's killed worker)."""
    while True:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        ran = lines(out)
        victim = next((p for p, r in ran.items() if r and r[0]["rank"] == 1 and len(r) >= 5), None)
        if victim is not None and spare_ready(job):
            break
        time.sleep(0.05)
    survivor = next(p for p, r in ran.items() if r and r[0]["rank"] == 0)
    os.killpg(launcher_pid(job, 1), signal.SIGKILL)
    os.kill(victim, signal.SIGKILL)
    return survivor, victim


def spare_training(run: subprocess.Popen[str], out: Path, others: tuple[int, ...], deadline: float) -> int:
    """The spare's worker (a pid not in ``others``), once it has trained 2 steps."""
    spare = None
    while spare is None or len(lines(out)[spare]) < 2:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        spare = next((p for p in lines(out) if p not in others), None)
        time.sleep(0.05)
    return spare


def test_a_spare_takes_a_lost_nodes_place_in_process_with_the_same_worlds_weights(tmp_path: Path):
    t0 = time.time()
    plain = hpc_run(tmp_path / "plain out", tmp_path / "plain job")   # the uninterrupted 2-node run
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, "--spare-nodes", "1")
    try:
        deadline = time.time() + 300
        survivor, victim = crash_node1(run, out, job, deadline)
        killed_at = time.time()
        text, _ = run.communicate(timeout=300)
        plain_text, _ = plain.communicate(timeout=300)
    finally:
        for p in (run, plain):
            if p.poll() is None:
                p.kill()
    # (hpc run's own exit reports the killed launcher; the job's outcome is node 0's)
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == STEPS, (outcome, text[-5000:])
    assert plain.returncode == 0, plain_text[-3000:]
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    [spare] = set(results) - {survivor}
    assert survivor in results, "the survivor was restarted"
    assert {r["step"] for r in results.values()} == {STEPS} and {r["world"] for r in results.values()} == {2}
    expected = json.loads(next((tmp_path / "plain out").glob("result-*.json")).read_text())
    assert {r["weights"] for r in results.values()} == {expected["weights"]}, "not the same world's weights"
    assert {json.dumps(r["sampler"], sort_keys=True) for r in results.values()} == \
        {json.dumps(expected["sampler"], sort_keys=True)}
    ckpt = str(job / "checkpoints")
    for r in results.values():
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
    assert 2 in launchers(job)[0], f"the spare's join is not in the ledger's events: {launchers(job)}"
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    [join] = [e for e in events if e["ev"] == "inproc_join"]
    assert join["pid"] == spare and join["world_size"] == 2
    first = lines(out)[spare][0]["t"]
    print(f"node lost -> spare's first step {first - killed_at:.2f} s (asked -> taken in "
          f"{join['wait_s']:.2f} s, taken in -> state {join['receive_s']:.2f} s); test {time.time() - t0:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}")


def test_a_frozen_worker_on_the_taken_in_spare_is_killed_and_the_survivor_goes_on(tmp_path: Path):
    """Campaign, session 14 (one hot spare, seed 1): the spare took a crashed node's place, then
    its worker was frozen (SIGSTOP). Its launcher watched only for deaths, so the survivor waited
    in the step boundary's broadcast until the allocation was cancelled 576 s later. The spare's
    launcher must treat a stopped worker as a member node's does: kill it and announce it dead;
    the survivor goes on in process (no spare left: the world shrinks) and finishes."""
    steps = 40
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, "--spare-nodes", "1", steps=steps)
    spare = None
    try:
        deadline = time.time() + 300
        survivor, victim = crash_node1(run, out, job, deadline)
        spare = spare_training(run, out, (survivor, victim), deadline)
        os.kill(spare, signal.SIGSTOP)
        stopped_at = time.time()
        text, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
        if spare is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(spare, signal.SIGKILL)
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == steps, (outcome, text[-5000:])
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    assert set(results) == {survivor}, "the survivor was restarted, or the frozen spare trained on"
    assert results[survivor]["world"] == 1 and results[survivor]["step"] == steps
    assert not [f for f in results[survivor]["opened_while_recovering"] if f.startswith(str(job / "checkpoints"))]
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    recoveries = [e for e in events if e["ev"] == "inproc_recovery" and e["t"] > stopped_at]
    assert recoveries, "no re-form after the spare's worker froze"
    assert "stopped (SIGSTOP)" in text and "SIGKILLed by its launcher" in text, text[-5000:]
    print(f"spare's worker stopped -> re-formed without it {recoveries[0]['t'] - stopped_at:.1f} s; "
          f"load {os.getloadavg()[0]:.1f}")


def test_a_taken_in_spare_whose_host_is_lost_takes_the_lost_host_path(tmp_path: Path):
    """Campaign, session 14 (one hot spare, seed 3): node rank 1 crashed, the spare took its place,
    then the rendezvous host crashed. The spare's worker died with the host's group, its launcher
    ended as a failed node before its store watch's bound, and the job held one idle node until
    the run's cap: nobody was left to elect a host or requeue. The spare's launcher must take the
    lost-host path (under hpc run: the job ends as a node failure, at once)."""
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, "--spare-nodes", "1", steps=60)
    try:
        deadline = time.time() + 300
        host, victim = crash_node1(run, out, job, deadline)
        spare_training(run, out, (host, victim), deadline)   # the spare took node rank 1's place
        os.killpg(launcher_pid(job, 0), signal.SIGKILL)   # the rendezvous host crashes
        with contextlib.suppress(ProcessLookupError):
            os.kill(host, signal.SIGKILL)
        lost_at = time.time()
        text, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    ended = time.time() - lost_at
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["ev"] == "inproc_fallback" and e.get("spare") and e["t"] > lost_at]
    assert fallback and "is lost" in fallback[0]["reason"], (fallback, text[-5000:])
    assert "a hot spare's worker failed" not in text, text[-5000:]
    print(f"host lost -> the spare's lost-host path {fallback[0]['t'] - lost_at:.1f} s, job ended {ended:.1f} s; "
          f"load {os.getloadavg()[0]:.1f}")
