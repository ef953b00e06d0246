"""Liveness, the pure parts: the stall deadline, heartbeats, the verdict, the stack files.

The no-false-alarm tests replay step-time series through the real heartbeat writer (fake
clock) and the real deadline, and check the watchdog's worst moment (just before each step or
phase ends) against the deadline of the record it would read then.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hpc.contract.errors import SpecError
from hpc.contract.jobdir import Outcome
from hpc.contract.stall import check_stall_timeout, parse_stall_timeout
from runtime.liveness import events
from runtime.liveness.deadline import OUTPUT, StallPolicy, deadline_s, p99, policy_from_spec, step_deadline_s
from runtime.liveness.heartbeat import Heartbeat, HeartbeatWriter, read_all
from runtime.liveness.stacks import main_thread_first
from runtime.liveness.verdict import assess, blame, judge, main_thread_in_collective

pytestmark = pytest.mark.unit


# --- --stall-timeout ---------------------------------------------------------------------
@pytest.mark.parametrize("given,want", [("auto", "auto"), (" AUTO ", "auto"), ("off", "off"),
                                        ("45", "45"), (90, "90"), ("7.5", "7.5")])
def test_stall_timeout_values(given, want):
    assert parse_stall_timeout(given) == want
    check_stall_timeout(want)


@pytest.mark.parametrize("bad", ["", "never", "-5", "0", "4", "nan", "inf", True, "١٠"])
def test_stall_timeout_refuses_with_the_valid_forms(bad):
    with pytest.raises(SpecError, match="auto, off, or seconds >= 5"):
        parse_stall_timeout(bad, "--stall-timeout")


def test_jobspec_carries_the_stall_timeout(tmp_path: Path):
    from hpc.contract.jobspec import JobSpec

    assert JobSpec(script="t.py").stall_timeout == "auto"
    spec = JobSpec(script="t.py", stall_timeout="60")
    assert JobSpec.from_json(spec.to_json()).stall_timeout == "60"
    with pytest.raises(SpecError):
        JobSpec(script="t.py", stall_timeout="soon")


def test_policy_from_spec():
    assert policy_from_spec("off") is None
    assert policy_from_spec("auto") == StallPolicy()
    assert policy_from_spec("30").fixed_s == 30.0


# --- the deadline ----------------------------------------------------------------------------
def test_p99_nearest_rank():
    assert p99([]) is None
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_step_deadline_adapts_with_a_floor():
    policy = StallPolicy(floor_s=20, k=10)
    assert step_deadline_s(policy, None, 0) == 20
    assert step_deadline_s(policy, 0.05, 100) == 20          # fast steps: the floor
    assert step_deadline_s(policy, 6.0, 100) == 60            # slow steps: k x p99
    assert step_deadline_s(policy, 6.0, 3) == 20              # too few samples yet
    assert step_deadline_s(StallPolicy(fixed_s=45), 6.0, 100) == 45


def test_a_phase_measured_once_gets_k_times_its_longest_run():
    policy = StallPolicy()
    kw = {"steps_done": 50, "p99_s": 0.1, "samples": 100}
    assert deadline_s(policy, phase="save", measured_s=0.7, **kw) == 20      # the step floor
    assert deadline_s(policy, phase="save", measured_s=30.0, **kw) == 300
    assert deadline_s(policy, phase="eval", measured_s=30.0, budget_s=4000, **kw) == 4000
    assert deadline_s(StallPolicy(fixed_s=5), phase="save", measured_s=0.5, **kw) == 5


def test_a_stopped_rank_inside_a_long_phase_gets_an_ordinary_deadline():
    ranks = assess([beat(0, 0.0, phase="save"), beat(1, 0.0, phase="save")], {101: True}, 25.0, POLICY)
    assert [r.deadline_s for r in ranks] == [1800.0, 20.0]
    v = judge(ranks)
    assert v.stalled and blame(v, {}).suspect_rank == 1


def test_writer_measures_phases():
    import tempfile
    now = [0.0]
    with tempfile.TemporaryDirectory() as d:
        w = HeartbeatWriter(Path(d), rank=0, local_rank=0, restart=0, clock=lambda: now[0])
        w.set_base("step")
        w.enter("save")
        assert w.written.measured_s is None
        now[0] += 3.0
        w.leave()
        w.enter("save")
        assert w.written.measured_s == 3.0 and w.written.phase == "save"


def test_long_phases_get_their_budgets():
    policy = StallPolicy()
    kw = {"p99_s": 0.1, "samples": 100}
    assert deadline_s(policy, phase="step", steps_done=0, **kw) == policy.first_steps_s
    assert deadline_s(policy, phase="step", steps_done=policy.first_steps, **kw) == 20
    assert deadline_s(policy, phase="save", steps_done=50, **kw) == 1800
    assert deadline_s(policy, phase="eval", steps_done=50, **kw) == 1800
    assert deadline_s(policy, phase="my-reload", steps_done=50, **kw) == 1800
    assert deadline_s(policy, phase="my-reload", steps_done=50, budget_s=3, **kw) == 20
    assert deadline_s(policy, phase="eval", steps_done=50, budget_s=4000, **kw) == 4000
    assert policy.longest_s >= 1800


# Step-time series shaped like the ones we measured (tiny GPT on CPU: ~0.3 s steps; a GPU
# job: ~2 s), with what makes them hard. Each item: (phase, seconds); "step" items are steps.
def _series(seed: int, step_s: float, n: int, *, first: float, jitter: float, save_every: int,
            save_s: float, eval_every: int, eval_s: float, spikes: float = 0.0) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    out = [("step", first)]
    for i in range(1, n):
        t = step_s * rng.lognormvariate(0, jitter)
        if spikes and rng.random() < 0.01:
            t *= spikes                     # a GC pause, a slow collective, a noisy neighbour
        out.append(("step", t))
        if save_every and i % save_every == 0:
            out.append(("save", save_s * rng.lognormvariate(0, 0.5)))
        if eval_every and i % eval_every == 0:
            out.append(("eval", eval_s * rng.lognormvariate(0, 0.3)))
    return out


SERIES = {
    "cpu-tiny-gpt": _series(1, 0.3, 2000, first=45.0, jitter=0.4, save_every=100, save_s=0.3,
                            eval_every=500, eval_s=120.0),
    "gpu-large": _series(2, 2.0, 600, first=600.0, jitter=0.2, save_every=150, save_s=400.0,
                         eval_every=250, eval_s=900.0),
    "heavy-jitter": _series(3, 0.5, 1500, first=30.0, jitter=1.0, save_every=0, save_s=0,
                            eval_every=0, eval_s=0, spikes=8.0),
    "fast-steps": _series(4, 0.02, 5000, first=90.0, jitter=0.5, save_every=1000, save_s=5.0,
                          eval_every=2500, eval_s=60.0, spikes=50.0),
}


def _replay(tmp_path: Path, series: list[tuple[str, float]], policy: StallPolicy) -> float:
    """The worst age/deadline ratio the watchdog would see over the series (< 1: no alarm)."""
    now = [1000.0]
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, restart=0, clock=lambda: now[0])
    w.enter("restore")
    now[0] += 12.0                      # restoring a checkpoint
    w.leave()
    w.set_base("step")
    worst, first = 0.0, True
    assert read_all(tmp_path) == [w.written]
    for phase, seconds in series:
        if phase != "step":
            w.enter(phase)
        rec = w.written
        now[0] += seconds
        limit = deadline_s(policy, phase=rec.phase, steps_done=rec.steps_done, p99_s=rec.p99_s,
                           samples=rec.samples, budget_s=rec.budget_s)
        worst = max(worst, (now[0] - rec.time) / limit)
        if phase == "step":
            w.step_done(rec.step + 1, None if first else seconds)
            first = False
        else:
            w.leave()
    return worst


@pytest.mark.parametrize("name", sorted(SERIES))
def test_healthy_series_never_look_stuck(tmp_path: Path, name: str):
    ratio = _replay(tmp_path, SERIES[name], StallPolicy())
    assert ratio < 1.0, f"{name}: a healthy run reached {ratio:.2f} of its deadline"


def test_a_real_stall_does_cross_the_deadline(tmp_path: Path):
    series = SERIES["cpu-tiny-gpt"][:300] + [("step", 25.0)]  # one step that never ends in time
    assert _replay(tmp_path, series, StallPolicy()) > 1.0


# --- heartbeats ------------------------------------------------------------------------------
def test_writer_throttles_steps_but_writes_phases_at_once(tmp_path: Path):
    now = [0.0]
    w = HeartbeatWriter(tmp_path, rank=3, local_rank=1, restart=2, every_s=1.0, clock=lambda: now[0])
    w.set_base("step")
    for i in range(1, 6):
        now[0] += 0.1
        w.step_done(i, 0.1)
    [rec] = read_all(tmp_path)
    assert rec.step == 0 and rec.phase == "step"      # throttled: at most once a second
    now[0] += 1.0
    w.step_done(6, 0.1)
    [rec] = read_all(tmp_path)
    assert (rec.step, rec.steps_done, rec.rank, rec.local_rank, rec.restart) == (6, 6, 3, 1, 2)
    assert rec.samples == 6 and rec.p99_s == pytest.approx(0.1)
    w.enter("eval", 120.0)
    [rec] = read_all(tmp_path)
    assert (rec.phase, rec.budget_s, rec.time) == ("eval", 120.0, now[0])
    w.leave()
    assert read_all(tmp_path)[0].phase == "step"
    w.close()
    assert read_all(tmp_path) == []


def test_read_all_skips_garbage(tmp_path: Path):
    (tmp_path / "hb-1.json").write_text("{torn")
    (tmp_path / "other.json").write_text("{}")
    assert read_all(tmp_path) == []
    assert read_all(tmp_path / "missing") == []


# --- the verdict -----------------------------------------------------------------------------
def beat(rank: int, t: float, step: int = 50, phase: str = "step", **kw) -> Heartbeat:
    return Heartbeat(pid=100 + rank, rank=rank, local_rank=rank, restart=0, phase=phase, step=step,
                     steps_done=step, time=t, p99_s=0.1, samples=100, **kw)


POLICY = StallPolicy(floor_s=20)


def test_no_stall_while_any_rank_progresses():
    ranks = assess([beat(0, 0.0), beat(1, 95.0)], {}, 100.0, POLICY)
    v = judge(ranks)
    assert not v.stalled and "may be waiting for rank 1" in v.reason


def test_ranks_waiting_for_a_rank_in_eval_are_not_stuck():
    ranks = assess([beat(0, 0.0, phase="eval"), beat(1, 0.0)], {}, 300.0, POLICY)
    assert not judge(ranks).stalled


def test_all_ranks_overdue_is_a_stall_unless_another_node_progresses():
    ranks = assess([beat(0, 0.0), beat(1, 1.0)], {}, 30.0, POLICY)
    assert judge(ranks).stalled
    assert not judge(ranks, peer_progress_age_s=3.0).stalled
    assert judge(ranks, peer_progress_age_s=25.0).stalled


def test_a_stopped_rank_is_a_stall_even_if_a_peer_looks_fresh():
    ranks = assess([beat(0, 29.0), beat(1, 0.0)], {101: True}, 30.0, POLICY)
    v = blame(judge(ranks), {})
    assert v.stalled and v.suspect_rank == 1 and "stopped" in v.reason


WAITING = """Thread 0x00007f4e869fd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f4ed7420b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395 in backward
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 623 in backward
  File "/work/train.py", line 228 in main
  File "/work/main/runtime/worker.py", line 75 in main
"""
IN_DATA = """Current thread 0x00007fbf08650b80 (most recent call first):
  File "/work/train.py", line 52 in load_batch
  File "/work/train.py", line 228 in main
  File "/work/main/runtime/worker.py", line 75 in main
"""


def test_main_thread_in_collective():
    assert main_thread_in_collective(WAITING) is True
    assert main_thread_in_collective(IN_DATA) is False
    assert main_thread_in_collective("") is None


def test_the_rank_outside_the_collective_is_the_suspect():
    ranks = assess([beat(0, 0.0), beat(1, 0.5)], {}, 30.0, POLICY)
    v = blame(judge(ranks), {0: WAITING, 1: IN_DATA})
    assert v.suspect_rank == 1 and "outside any collective" in v.reason


def test_every_local_rank_waiting_points_off_the_node():
    ranks = assess([beat(0, 0.0), beat(1, 0.5)], {}, 30.0, POLICY)
    v = blame(judge(ranks), {0: WAITING, 1: WAITING})
    assert v.suspect_rank is None and "another node" in v.reason


def test_without_stacks_the_lowest_step_is_the_suspect():
    ranks = assess([beat(0, 0.0, step=51), beat(1, 0.5, step=50)], {}, 30.0, POLICY)
    assert blame(judge(ranks), {}).suspect_rank == 1


def test_main_thread_comes_first_in_a_dump():
    out = main_thread_first(WAITING)
    assert out.startswith("Current thread") and "threading.py" in out.split("\n\n")[-1]
    assert main_thread_first("") == ""


# --- records ---------------------------------------------------------------------------------
def test_hang_events_round_trip_and_reach_the_outcome_line(tmp_path: Path):
    e = events.HangEvent(allocation=1, node="node2", node_rank=1, reason="rank 3 is stopped",
                         suspect_rank=3, stacks="logs/alloc-1/hang-node2-1.txt", step=40,
                         ranks=("rank 2 ...", "rank 3 ..."))
    events.append(tmp_path, e)
    (tmp_path / events.HANGS).open("a").write("{garbage\n")
    [back] = events.read(tmp_path, allocation=1)
    assert back.ranks == e.ranks and back.suspect_rank == 3 and back.time > 0
    assert events.read(tmp_path, allocation=0) == []
    line = Outcome(allocation=1, kind="finished", exit_code=0, hangs=(back.summary(),)).describe()
    assert "1 stall(s) recovered" in line and "suspect rank 3" in line and "hang-node2-1.txt" in line


# --- peers through the rendezvous store -----------------------------------------------------
def test_peer_tracker_names_a_silent_peer_only_while_the_store_answers_us():
    from runtime.liveness.peers import PeerTracker

    t = PeerTracker(node_rank=0, hosts={1: "node2", 2: "node3"})
    for now in range(0, 5):
        t.observe(1, now + 1, float(now))
        t.observe(2, now + 1, float(now))
        t.store_ok_at = float(now)
    for now in range(5, 20):                 # node3's counter stops at 5
        t.observe(1, now + 1, float(now))
        t.observe(2, 5, float(now))
        t.store_ok_at = float(now)
    assert t.lost(19.0, after_s=10) == {2: 15.0}
    assert t.name(2) == "node3 (node rank 2)"
    assert t.lost(40.0, after_s=10) == {}, "we cannot reach the store ourselves: say nothing"
    t.done.add(2)
    assert t.lost(19.0, after_s=10) == {}
    t.observe(0, 99, 19.0)
    assert 0 not in t.seen, "our own counter is not a peer's"


def test_a_lost_peer_with_a_quiet_node_is_a_stall_in_any_phase():
    ranks = assess([beat(0, 0.0, phase="save"), beat(1, 0.0, phase="save")], {}, 6.0, POLICY)
    assert not judge(ranks).stalled, "within the save's budget"
    v = judge(ranks, lost_peers={"node3 (node rank 2)": 11.0})
    assert v.stalled and v.lost_node == "node3 (node rank 2)" and "stopped answering" in v.reason
    assert blame(v, {0: WAITING, 1: WAITING}).reason == v.reason
    busy = assess([beat(0, 5.0), beat(1, 0.0)], {}, 6.0, POLICY)
    assert not judge(busy, lost_peers={"node3": 11.0}).stalled, "a rank here still progresses"


def test_the_outcome_is_hang_only_when_the_watchdogs_kill_ended_the_allocation(tmp_path: Path):
    from runtime.liveness.watchdog import Watchdog

    w = Watchdog(tmp_path, allocation=0, node_rank=0, policy=None)
    assert w.amend("app_error", "rank 1 exited with 1: ValueError: x") == \
        ("app_error", "rank 1 exited with 1: ValueError: x", ())
    events.append(tmp_path, events.HangEvent(allocation=0, node="n1", node_rank=0, reason="r",
                                             suspect_rank=1, stacks="logs/alloc-0/hang-n1-1.txt"))
    kind, reason, lines = w.amend("app_error", "rank 0 exited with -9: (no error message)")
    assert kind == "hang" and reason.startswith("stall on n1") and len(lines) == 1
    assert w.amend("app_error", "rank 1 exited with 1: ValueError: x")[0] == "app_error"
    assert w.amend("finished", "")[:2] == ("finished", "")


def test_a_rank_without_heartbeats_is_judged_by_its_output_only_with_a_fixed_deadline():
    silent = [Heartbeat(pid=300 + r, rank=r, local_rank=r, restart=0, phase=OUTPUT, step=0,
                        steps_done=0, time=0.0, p99_s=None, samples=0) for r in (0, 1)]
    auto = assess(silent, {}, 10_000.0, POLICY)
    assert not judge(auto).stalled                    # auto: how often it prints is unknown
    fixed = assess(silent, {}, 31.0, StallPolicy(fixed_s=30.0))
    assert judge(fixed).stalled and "no output for 31.0s (deadline 30.0s)" in fixed[0].describe()
    stopped = assess(silent, {301: True}, 25.0, POLICY)   # a stopped process: in any mode
    assert judge(stopped).stalled and blame(judge(stopped), {}).suspect_rank == 1
