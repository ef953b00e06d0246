"""Liveness for real: `hpc run` with two gloo workers, a stall injected, the watchdog's answer.

A worker frozen with SIGSTOP must be noticed within the stall deadline, and a rank that sleeps
forever in its data loading (alive, outside any collective) within its busy budget; their
node's stacks written with the right rank named, the workers restarted, and the job must
finish at the right step from its last checkpoint. A healthy run with a slow first step,
saves, an evaluation pause on one rank and heavy jitter must never be declared stuck, nor one
whose rank 0 pauses 45 s in its own code, unmarked, under the default ``--stall-timeout
auto``; the same stall twice ends the job with advice instead of spending every restart.
`hpc run` never excludes a node.
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

from runtime.liveness.deadline import OUTPUT
from runtime.liveness.watchdog import output_beats
from tests.conftest import REPO
from tests.wandb_offline import read_run

pytestmark = [pytest.mark.distributed, pytest.mark.waits]   # CI runs these in a lane of their own
PROBE = REPO / "tests" / "distributed" / "scripts" / "stall_probe.py"


def hpc_run(job: Path, *probe_args: str, stall: str = "5", every: int = 5,
            extra: tuple[str, ...] = ()) -> subprocess.Popen:
    job.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hpc", "run", str(PROBE), "--nproc-per-node", "2", "--job-dir", str(job),
           "--stall-timeout", stall, "--checkpoint-every-steps", str(every), *extra,
           "--env", "HPC_PROGRESS_EVERY_S=0", "--", "--out", str(job), *probe_args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 180) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError("the job did not finish:\n" + out[-6000:]) from None
    assert p.returncode == 0, out[-6000:]
    return out


def progress(job: Path) -> dict:
    try:
        return json.loads((job / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(pred, timeout: float, what: str) -> float:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def hangs(job: Path) -> list[dict]:
    path = job / "hangs.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def rank_section(report: str, rank: int) -> str:
    """The part of a stall report with ``rank``'s stacks."""
    start = report.index(f"=== rank {rank} ")
    nxt = report.find("\n=== rank ", start + 1)
    return report[start:nxt if nxt > 0 else None]


def test_frozen_worker_is_named_dumped_and_the_job_resumes(tmp_path: Path) -> None:
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "80", "--step-s", "0.1")
    wait_for(lambda: progress(job).get("step", 0) >= 15, 120, "step 15")
    frozen = int((job / "pid-1-0").read_text())
    os.kill(frozen, signal.SIGSTOP)
    t = time.time()
    try:
        resumed = wait_for(lambda: progress(job).get("restart", 0) >= 1
                           and progress(job)["step"] > progress(job)["start_step"], 150,
                           "training to resume")   # new workers import torch: >60 s at load 40
    except AssertionError:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"no resume within 150 s; progress {progress(job)}; hangs {hangs(job)}:\n"
                             + p.communicate()[0][-6000:]) from None
    out = finish(p)
    [event] = hangs(job)
    assert event["suspect_rank"] == 1 and "stopped" in event["reason"], event
    assert event["time"] - t < 5 + 3, "detected within the 5-s deadline and a poll or two"
    report = (job / event["stacks"]).read_text()
    assert "suspect: rank 1" in report
    assert "<== SUSPECT" in rank_section(report, 1)
    assert "stall_probe.py" in rank_section(report, 1), "the frozen rank dumped where it froze"
    assert "stall_probe.py" in rank_section(report, 0)
    result = json.loads((job / "result.json").read_text())
    assert result["final_step"] == 80 and result["steps"] == 80, result
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "finished" and outcome["restarts"] == 1
    assert "suspect rank 1" in outcome["hangs"][0]
    print(f"worker freeze -> resumed in {resumed - t:.1f}s")
    assert not (job / "exclusions.jsonl").exists() and "excluding node" not in out, "hpc run: one machine"
    run = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip())
    logged = [fields for _, name, fields in run.events() if name == "hang"]
    assert len(logged) == 1 and logged[0].get("suspect_rank") == 1, run.events()
    assert "stall detected" in out


def test_rank_stuck_in_its_data_loading_is_named_from_its_stack(tmp_path: Path) -> None:
    """Alive and outside any collective: busy, logged as running long past its 5-s deadline,
    restarted only past its --busy-timeout (14 s: the watch's look between the two must not
    miss on a loaded machine; with 8 s, CI of bc7b3ea first looked past it)."""
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "40", "--step-s", "0.1", "--hang-in-data", "12",
                extra=("--busy-timeout", "14"))
    out = finish(p)
    [event] = hangs(job)
    report = (job / event["stacks"]).read_text()
    mine = rank_section(report, 1)
    assert "in load_batch" in mine, mine
    assert event["suspect_rank"] == 1 and "outside any collective" in event["reason"], event
    assert event["kind"] == "busy" and "--busy-timeout" in event["reason"], event
    assert "rank 1 is running long" in out, "logged as running long before its budget ran out"
    assert "in load_batch" not in rank_section(report, 0)
    assert json.loads((job / "result.json").read_text())["final_step"] == 40


def test_a_stall_that_outlives_the_restarts_ends_as_hang(tmp_path: Path) -> None:
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "400", "--step-s", "0.1", extra=("--max-restarts", "0"))
    wait_for(lambda: progress(job).get("step", 0) >= 8, 120, "step 8")
    os.kill(int((job / "pid-0-0").read_text()), signal.SIGSTOP)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out[-4000:]
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "hang", outcome
    assert "suspect rank 0" in outcome["reason"] and "exited with -9" in outcome["reason"]


def test_healthy_run_with_long_phases_and_jitter_is_never_stuck(tmp_path: Path) -> None:
    """Deadline 5 s; a 9-s first step, saves, 8-s evaluations on rank 0 only, 0-0.6 s jitter."""
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "40", "--step-s", "0.05", "--slow-first-step", "9",
                "--eval-every", "15", "--eval-s", "8", "--jitter", "0.6", every=4)
    finish(p, timeout=240)
    assert hangs(job) == []
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "finished" and outcome["restarts"] == 0 and not outcome.get("hangs")
    assert json.loads((job / "result.json").read_text())["final_step"] == 40


def test_an_unmarked_45s_pause_is_left_alone_and_changes_nothing(tmp_path: Path) -> None:
    """Issue 23: rank 0 works 45 s in its own code at step 30 (no session.phase), default
    --stall-timeout auto (a 20-s step deadline). Run beside the same job without the pause:
    same weights, no stall, no restart, no exclusion; the log says rank 0 runs long."""
    paused, plain = tmp_path / "paused", tmp_path / "plain"
    args = ("--steps", "40", "--step-s", "0.05")
    p = hpc_run(paused, *args, "--pause-at", "30", "--pause-s", "45", stall="auto")
    q = hpc_run(plain, *args, stall="auto")
    out = finish(p, timeout=300)
    finish(q, timeout=120)
    assert hangs(paused) == [], hangs(paused)
    [outcome] = [json.loads(x) for x in (paused / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "finished" and outcome["restarts"] == 0 and not outcome["hangs"], outcome
    assert not (paused / "exclusions.jsonl").exists() and "excluding node" not in out
    assert "rank 0 is running long" in out and "in unmarked_evaluation" in out, out[-4000:]
    a, b = (json.loads((j / "result.json").read_text()) for j in (paused, plain))
    assert a["final_step"] == b["final_step"] == 40
    assert a["weights"] == b["weights"], "the pause changed the training"


def test_a_long_call_holding_the_interpreter_lock_is_not_a_frozen_process(tmp_path: Path) -> None:
    """Rank 0 spends ~35 s in one C call that holds the interpreter's lock (its alive beat
    thread cannot run): the kernel sees it use CPU, so it is alive and running long, not
    frozen. Before the CPU evidence it was killed as frozen once the beat was 10 s silent."""
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "20", "--step-s", "0.05", "--pause-at", "12", "--pause-s", "35",
                "--pause-holds-gil", stall="auto")
    out = finish(p, timeout=300)
    assert float((job / "pause_s").read_text()) > 25, "the lock was not held long enough to matter"
    assert hangs(job) == [], hangs(job)
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "finished" and outcome["restarts"] == 0, outcome
    assert json.loads((job / "result.json").read_text())["final_step"] == 20
    assert "rank 0 is running long" in out, out[-4000:]


def test_the_same_stall_twice_ends_the_job_with_advice(tmp_path: Path) -> None:
    """A 60-s unmarked pause at step 13 in every run, --busy-timeout 6: restarted once (from
    step 10), then the job ends as hang with what to do, with restarts left unused."""
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "40", "--step-s", "0.05", "--pause-at", "13", "--pause-s", "60",
                extra=("--busy-timeout", "6", "--max-restarts", "3"))
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 1, out[-4000:]
    events_ = hangs(job)
    assert len(events_) == 2 and len({e["step"] for e in events_}) == 1, events_
    assert {e["kind"] for e in events_} == {"busy"} and {e["suspect_rank"] for e in events_} == {0}
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "hang" and outcome["restarts"] == 1, outcome
    assert f"the same stall twice at step {events_[0]['step']}" in outcome["reason"], outcome
    assert "session.phase" in outcome["reason"] and "--busy-timeout" in outcome["reason"]
    assert "no restart (2 left unused)" in out, out[-4000:]
    assert not (job / "exclusions.jsonl").exists()


def test_watchdog_dumps_records_and_kills_a_stalled_worker(tmp_path: Path) -> None:
    """One watchdog look, on a real child process that registered its stack dump."""
    from runtime.liveness import hang_log
    from runtime.liveness.deadline import StallPolicy
    from runtime.liveness.heartbeat import Heartbeat, path_for
    from runtime.liveness.watchdog import Watchdog

    w = Watchdog(tmp_path, allocation=0, node_rank=0, policy=StallPolicy(floor_s=5))
    w.directory = tmp_path / "hb"
    w.directory.mkdir()
    code = ("import sys, time; from runtime.liveness.stacks import install; install(sys.argv[1]); "
            "open(sys.argv[2], 'w').close()\ndef stuck_here():\n    time.sleep(60)\nstuck_here()")
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", code, str(w.directory), str(ready), "runtime.worker"],
                             cwd=REPO)
    try:
        wait_for(ready.exists, 30, "the child to register its dump")
        beat = Heartbeat(pid=child.pid, rank=3, local_rank=0, restart=0, phase="step", step=12,
                         steps_done=12, time=time.time() - 60, p99_s=0.1, samples=50)
        path_for(w.directory, child.pid).write_text(json.dumps(beat.__dict__))
        verdict = w.check()
        assert verdict is not None and verdict.stalled and verdict.suspect_rank == 3
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    [event] = hang_log.read(tmp_path)
    report = (tmp_path / event.stacks).read_text()
    assert "suspect: rank 3" in report and "in stuck_here" in report, report


def test_script_without_the_session_is_watched_by_its_output(tmp_path: Path):
    """No heartbeats: with --stall-timeout SECONDS, a rank whose output stopped (frozen in its
    own code, nothing died) is found by its stack, its node's workers restarted, and the script
    runs to its end."""
    job = tmp_path / "plain"
    job.mkdir()
    script = REPO / "tests" / "distributed" / "scripts" / "plain_freeze.py"
    p = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2",
                          "--job-dir", str(job), "--stall-timeout", "8", "--", "--out", str(job)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    out = finish(p)
    done = json.loads((job / "done.json").read_text())
    assert done == {"steps": 8, "total": 16.0, "restart": 1}, out[-3000:]
    hangs = [json.loads(x) for x in (job / "hangs.jsonl").read_text().splitlines()]
    assert len(hangs) == 1 and hangs[0]["suspect_rank"] == 1, hangs
    assert "phase output" in hangs[0]["reason"], hangs
    stacks = (job / hangs[0]["stacks"]).read_text()
    assert "stuck_in_own_code" in stacks, stacks[-3000:]
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["hangs"], outcome


def test_output_beats_of_a_real_process_follow_its_output(tmp_path: Path):
    """A child whose stdout is a file (as the agent's rank logs are): its stand-in heartbeat
    carries its rank and the time it last wrote; before it wrote anything it is starting up
    (a loaded machine may keep a worker importing torch longer than a short deadline)."""
    log = tmp_path / "rank-3.log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); print('x', flush=True); time.sleep(30)"],
                                 stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RANK": "3", "LOCAL_RANK": "1"})
    try:
        deadline = time.time() + 20
        while not output_beats({child.pid}) and time.time() < deadline:   # until it runs as itself
            time.sleep(0.02)
        [quiet] = output_beats({child.pid})
        assert quiet.phase == "startup" and log.stat().st_size == 0, "nothing written yet"
        deadline = time.time() + 20
        while log.stat().st_size == 0 and time.time() < deadline:
            time.sleep(0.05)
        [b] = output_beats({child.pid})
        assert (b.rank, b.local_rank, b.phase) == (3, 1, OUTPUT)
        assert b.time == pytest.approx(log.stat().st_mtime, abs=0.01)
        assert output_beats({os.getpid() + 10_000_000}) == []    # gone: nothing
    finally:
        child.kill()
        child.wait()


def test_a_worker_whose_heartbeat_is_gone_is_not_judged_by_its_output(tmp_path: Path):
    """A Session worker removes its heartbeat when it closes; while it exits it must not get a
    stand-in (with a peer lost, an exiting run was killed and waited out torch's timeouts)."""
    from dataclasses import asdict

    from runtime.liveness import proc
    from runtime.liveness.deadline import StallPolicy
    from runtime.liveness.heartbeat import Heartbeat, path_for
    from runtime.liveness.watchdog import Watchdog

    def worker(rank: int) -> subprocess.Popen:   # "runtime.worker" in argv: a worker to proc.workers
        out = open(tmp_path / f"rank-{rank}.log", "w")   # noqa: SIM115 (closed with the process)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "runtime.worker"],
                                stdout=out, stderr=out, env={**os.environ, "RANK": str(rank)})

    session_worker, plain_worker = worker(0), worker(1)
    dog = Watchdog(tmp_path / "job", allocation=0, node_rank=0, policy=StallPolicy(floor_s=20))
    dog.directory.mkdir(parents=True, exist_ok=True)
    try:
        # Until both run as themselves: Popen returns once exec began, and for a while after
        # (long on a loaded machine) /proc still shows an empty command line and environment.
        both = {session_worker.pid, plain_worker.pid}
        wait_for(lambda: both <= set(proc.workers(os.getpid())) and len(output_beats(both)) == 2,
                 30, "both workers to run as themselves")
        beat = Heartbeat(pid=session_worker.pid, rank=0, local_rank=0, restart=0, phase="step", step=5,
                         steps_done=5, time=time.time(), p99_s=None, samples=0)
        path_for(dog.directory, session_worker.pid).write_text(json.dumps(asdict(beat)))
        seen = dog.check()
        # The plain worker wrote nothing yet: starting up (imports), not silent.
        assert {(r.beat.rank, r.beat.phase) for r in seen.ranks} == {(0, "step"), (1, "startup")}
        path_for(dog.directory, session_worker.pid).unlink()      # the Session closed
        seen = dog.check()
        assert {(r.beat.rank, r.beat.phase) for r in seen.ranks} == {(1, "startup")}
    finally:
        for p in (session_worker, plain_worker):
            p.kill()
            p.wait()
        dog.stop()


def test_ranks_in_different_collectives_or_idle_in_one_are_found_inside_the_first_steps_budget(
        tmp_path: Path) -> None:
    """Issue 40, two faults in one job, both in the first steps (1800 s each under the default
    --stall-timeout auto), which only the ranks' stacks and CPU can tell from work:

    1. rank 1 saves at step 1 and rank 0 does not (a decision that differed): rank 1 waits in
       the save's gather, rank 0 in its next collective (the boundary's save decision). The
       watch must act within seconds (8 s of idleness) and name both collectives;
    2. restarted, at step 1 rank 0 all-reduces over a second group and rank 1 over the
       default one: both wait, idle, in one all_reduce. With nothing working the first steps'
       budget does not apply: the watch acts after an ordinary step's deadline (20 s).

    Then the job finishes (the faults are in those two starts only)."""
    job = tmp_path / "job"
    p = hpc_run(job, "--steps", "12", "--step-s", "0.1", "--diverge-at", "1", "--split-at", "1",
                stall="auto")
    out = finish(p, timeout=400)   # a miss waits out the 1800-s budget: this backstop fails it
    odd, split = hangs(job)
    for event in (odd, split):
        assert all("(deadline 1800.0s)" in r for r in event["ranks"]), ("inside the long budget", event)
    assert odd["kind"] == "desync", odd
    assert "rank 0 in " in odd["reason"], odd
    assert "rank 1 in all_gather_object (checkpoint/checkpointer.py:" in odd["reason"], odd
    found_s = odd["time"] - float((job / "diverged").read_text())
    print(f"divergence -> desync found in {found_s:.1f}s")
    assert found_s < 60, f"found {found_s:.0f}s after the divergence (the bound is 8 s of idleness)"
    report = (job / odd["stacks"]).read_text()
    assert "in all_gather_object" not in rank_section(report, 0), report
    assert "in all_gather_object" in rank_section(report, 1), report
    assert split["kind"] == "collective", split
    assert "every rank here waits in one collective" in split["reason"], split
    assert "ranks 0, 1 in all_reduce (scripts/stall_probe.py:" in split["reason"], split
    found_s = split["time"] - float((job / "split").read_text())
    print(f"split collective -> stall found in {found_s:.1f}s")
    assert 20 <= found_s < 90, f"found {found_s:.0f}s after the split (an ordinary step's deadline is 20 s)"
    [outcome] = [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert outcome["kind"] == "finished" and outcome["restarts"] == 2, outcome
    assert json.loads((job / "result.json").read_text())["final_step"] == 12
    assert not (job / "exclusions.jsonl").exists() and "ranks wait in different collectives" in out


def test_a_desync_under_inprocess_recovery_is_found_through_its_polled_waits(tmp_path: Path) -> None:
    """The in-process recovery's step-boundary waits poll (a lost peer must end them): they
    still count as waits in a collective, idle. Rank 1 saves at step 3 and rank 0 does not;
    the watch finds the deadlock, the workers are killed (every member: torch's restart path)
    and the job finishes."""
    job = tmp_path / "job"
    script = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
    cmd = [sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2", "--job-dir", str(job),
           "--recovery", "inprocess", "--checkpoint-every-steps", "100", "--max-restarts", "2",
           "--", "--out", str(job), "--steps", "12", "--step-sleep", "0.1", "--diverge-at", "3"]
    job.mkdir(parents=True)
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    out = finish(p, timeout=300)
    [event] = hangs(job)
    assert event["kind"] == "desync", event
    assert "rank 1 in all_gather_object (checkpoint/checkpointer.py:" in event["reason"], event
    assert "rank 0 in a posted collective" in event["reason"], event
    found_s = event["time"] - float((job / "diverged").read_text())
    print(f"in-process: divergence -> desync found in {found_s:.1f}s")
    assert found_s < 60, found_s
    results = [json.loads(f.read_text()) for f in job.glob("result-*.json")]
    assert len(results) == 2 and {r["step"] for r in results} == {12}, results
    assert "ranks wait in different collectives" in out
