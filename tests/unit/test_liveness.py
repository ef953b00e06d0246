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
from runtime.liveness import hang_log
from runtime.liveness.deadline import OUTPUT, StallPolicy, deadline_s, p99, policy_for, step_deadline_s
from runtime.liveness.heartbeat import Heartbeat, HeartbeatWriter, read_all
from runtime.liveness.stacks import main_thread_first
from runtime.liveness.verdict import (BUSY, COLLECTIVE, DESYNC, FROZEN, HARDWARE_KINDS, LOST, POSTED, QUIET, USER,
                                      assess, blame, desync, judge, main_thread_in_collective,
                                      waiting_call, weigh)

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


def policy_from_spec(stall_timeout: str, busy_timeout_s: int = 1800) -> StallPolicy | None:
    """The flags' one way to a policy: the JobSpec's LivenessConfig, then policy_for."""
    from hpc.contract.jobspec import JobSpec

    spec = JobSpec(script="t.py", stall_timeout=stall_timeout, busy_timeout_s=busy_timeout_s)
    return policy_for(spec.liveness)


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
        w = HeartbeatWriter(Path(d), rank=0, local_rank=0, restart=0, clock=lambda: now[0],
                            alive_every_s=None)
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
    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, restart=0, clock=lambda: now[0],
                        alive_every_s=None)
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
    w = HeartbeatWriter(tmp_path, rank=3, local_rank=1, restart=2, every_s=1.0, clock=lambda: now[0],
                        alive_every_s=None)
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
  File "/work/main/runtime/worker/start.py", line 75 in main
"""
IN_DATA = """Current thread 0x00007fbf08650b80 (most recent call first):
  File "/work/train.py", line 52 in load_batch
  File "/work/train.py", line 228 in main
  File "/work/main/runtime/worker/start.py", line 75 in main
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
    e = hang_log.HangEvent(allocation=1, node="node2", node_rank=1, reason="rank 3 is stopped",
                         suspect_rank=3, stacks="logs/alloc-1/hang-node2-1.txt", step=40,
                         ranks=("rank 2 ...", "rank 3 ..."))
    hang_log.append(tmp_path, e)
    (tmp_path / hang_log.HANGS).open("a").write("{garbage\n")
    [back] = hang_log.read(tmp_path, allocation=1)
    assert back.ranks == e.ranks and back.suspect_rank == 3 and back.time > 0
    assert hang_log.read(tmp_path, allocation=0) == []
    line = Outcome(allocation=1, kind="finished", exit_code=0, hangs=(back.summary(),)).describe()
    assert "1 stall(s) recovered" in line and "suspect rank 3" in line and "hang-node2-1.txt" in line


# --- peers through the rendezvous store -----------------------------------------------------
def test_peer_tracker_names_a_silent_peer_only_while_the_store_answers_us():
    from runtime.liveness.beacon import PeerTracker

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


def test_a_peer_lost_before_the_group_formed_again_is_not_the_new_groups():
    """A member crashes, the group re-forms (a hot spare in its place, or fewer nodes) and the
    new workers start up quietly for seconds: the crashed node's silence is no stall of the
    new group. A peer that goes on beating is watched again, and its later silence counts."""
    from runtime.liveness.beacon import PeerTracker

    t = PeerTracker(node_rank=0)
    for now in range(0, 5):                  # both peers beat; node rank 2 crashes at 5
        t.observe(1, now + 1, float(now))
        t.observe(2, now + 1, float(now))
        t.store_ok_at = float(now)
    for now in range(5, 7):
        t.observe(1, now + 1, float(now))
        t.observe(2, 5, float(now))
        t.store_ok_at = float(now)
    t.new_group()                            # at 7 this node's workers start again
    for now in range(7, 30):
        t.observe(1, now + 1 if now < 12 else 12, float(now))   # node rank 1 is cut at 12
        t.observe(2, 5, float(now))
        t.store_ok_at = float(now)
        if now < 22:
            assert 2 not in t.lost(float(now), after_s=10), now
    assert t.lost(29.0, after_s=10) == {1: 18.0}, "silent since 11, after the group formed"


def test_a_lost_peer_with_a_quiet_node_is_a_stall_in_any_phase():
    ranks = assess([beat(0, 0.0, phase="save"), beat(1, 0.0, phase="save")], {}, 6.0, POLICY)
    assert not judge(ranks).stalled, "within the save's budget"
    v = judge(ranks, lost_peers={"node3 (node rank 2)": 11.0})
    assert v.stalled and v.lost_node == "node3 (node rank 2)" and "stopped answering" in v.reason
    assert blame(v, {0: WAITING, 1: WAITING}).reason == v.reason
    busy = assess([beat(0, 5.0), beat(1, 0.0)], {}, 6.0, POLICY)
    assert not judge(busy, lost_peers={"node3": 11.0}).stalled, "a rank here still progresses"


def test_a_rank_recovering_in_process_from_a_lost_peer_is_not_killed_for_it():
    # --recovery inprocess: the survivor re-forms with a spare's joiner (phase "recover") and
    # waits in a collective for it while the lost node stays silent; its budget applies.
    recovering = assess([beat(0, 0.0, phase="recover", budget_s=300.0)], {}, 8.0, POLICY)
    assert not judge(recovering, lost_peers={"node3": 11.0}).stalled
    stopped = assess([beat(0, 0.0, phase="recover", budget_s=300.0)], {beat(0, 0.0).pid: True}, 8.0, POLICY)
    assert judge(stopped, lost_peers={"node3": 11.0}).stalled, "a stopped process recovers nothing"


def test_the_outcome_is_hang_only_when_the_watchdogs_kill_ended_the_allocation(tmp_path: Path):
    from runtime.liveness.watchdog import Watchdog

    w = Watchdog(tmp_path, allocation=0, node_rank=0, policy=None)
    assert w.amend("app_error", "rank 1 exited with 1: ValueError: x") == \
        ("app_error", "rank 1 exited with 1: ValueError: x", ())
    hang_log.append(tmp_path, hang_log.HangEvent(allocation=0, node="n1", node_rank=0, reason="r",
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


# --- evidence, not the clock alone (issue 23) -----------------------------------------------
def alive_beat(rank: int, t: float, alive_at: float | None, **kw) -> Heartbeat:
    """A heartbeat whose writer has an alive beat, last touched at ``alive_at``."""
    return beat(rank, t, alive_every_s=1.0, alive=alive_at, **kw)


WAITING_AT_STEP_BOUNDARY = """Current thread 0x00007fbf08650b80 (most recent call first):
  File "/work/main/runtime/liveness/posted.py", line 17 in wait
  File "/work/main/runtime/preemption.py", line 176 in poll
  File "/work/main/runtime/session.py", line 420 in steps
  File "/work/train.py", line 60 in <module>
  File "/work/main/runtime/worker/start.py", line 95 in main
"""
IN_EVAL = """Current thread 0x00007fbf08650b80 (most recent call first):
  File "/work/train.py", line 67 in evaluate
  File "/work/train.py", line 89 in <module>
  File "/work/main/runtime/worker/start.py", line 95 in main
"""


def test_a_wait_on_a_posted_collective_at_the_step_boundary_counts_as_inside_one():
    assert main_thread_in_collective(WAITING_AT_STEP_BOUNDARY) is True
    assert main_thread_in_collective(IN_EVAL) is False


def test_an_alive_rank_working_outside_any_collective_runs_long_and_is_not_a_stall():
    policy = StallPolicy(floor_s=20, busy_s=600)
    ranks = assess([alive_beat(0, 0.0, 44.5), alive_beat(1, 0.1, 44.8)], {}, 45.0, policy)
    v = judge(ranks)
    assert v.stalled and not v.hard, "a candidate only: no stack was looked at yet"
    w = weigh(v, {0: IN_EVAL, 1: WAITING_AT_STEP_BOUNDARY}, policy, now=45.0)
    assert not w.stalled and w.busy == (0,) and "running long" in w.reason, w
    late = assess([alive_beat(0, 0.0, 600.5), alive_beat(1, 0.1, 600.8)], {}, 601.0, policy)
    w = weigh(judge(late), {0: IN_EVAL, 1: WAITING_AT_STEP_BOUNDARY}, policy, now=601.0)
    assert w.stalled and w.kind == BUSY and w.suspect_rank == 0 and "--busy-timeout" in w.reason


def test_without_an_alive_beat_a_rank_outside_any_collective_is_a_stall_at_the_short_deadline():
    ranks = assess([beat(0, 0.0), beat(1, 0.1)], {}, 45.0, POLICY)   # no alive beat: no evidence
    w = weigh(judge(ranks), {0: IN_EVAL, 1: WAITING}, POLICY, now=45.0)
    assert w.stalled and w.suspect_rank == 0 and w.kind == USER and not w.busy


def test_a_silent_alive_beat_with_the_cpu_still_working_is_a_long_call_not_a_frozen_process():
    # Rank 0's alive beat is 15 s silent (one C call holds the interpreter's lock), but the
    # kernel saw it work 0.5 s ago: alive, running long outside any collective.
    beats = [alive_beat(0, 0.0, 10.0), alive_beat(1, 0.1, 24.9)]
    ranks = assess(beats, {}, 25.0, POLICY, ran={100: 24.5, 101: 24.9})
    assert not ranks[0].silent and ranks[0].alive
    v = judge(ranks)
    assert not v.hard
    w = weigh(v, {0: IN_EVAL, 1: WAITING}, POLICY, now=25.0)
    assert not w.stalled and w.busy == (0,)
    # No CPU since the beat fell silent (a wedged process): frozen, as before.
    wedged = assess(beats, {}, 25.0, POLICY, ran={100: 10.0, 101: 24.9})
    assert judge(wedged).hard and judge(wedged).kind == FROZEN


def test_a_frozen_process_gets_the_short_deadline_whatever_its_stack():
    stopped = assess([alive_beat(0, 0.0, 0.0), alive_beat(1, 0.1, 24.9)], {100: True}, 25.0, POLICY)
    v = judge(stopped)
    assert v.stalled and v.hard and v.kind == FROZEN
    assert blame(v, {0: IN_EVAL}).suspect_rank == 0
    # Its alive beat silent for 15 s (not stopped: wedged with the interpreter's lock held).
    silent = assess([alive_beat(0, 0.0, 10.0), alive_beat(1, 0.1, 24.9)], {}, 25.0, POLICY)
    v = judge(silent)
    assert v.stalled and v.kind == FROZEN
    b = blame(v, {0: IN_EVAL, 1: WAITING})
    assert b.suspect_rank == 0 and "alive beat is silent" in b.reason and b.kind == FROZEN
    fresh = assess([alive_beat(0, 0.0, 24.0), alive_beat(1, 0.1, 24.9)], {}, 25.0, POLICY)
    assert not judge(fresh).hard


def test_a_collective_after_a_busy_rank_gets_its_bound_from_when_the_rank_was_last_busy():
    policy = StallPolicy(floor_s=20, busy_s=600)
    ranks = assess([alive_beat(0, 0.0, 59.5), alive_beat(1, 0.1, 59.8)], {}, 60.0, policy)
    both_wait = {0: WAITING, 1: WAITING_AT_STEP_BOUNDARY}
    w = weigh(judge(ranks), both_wait, policy, busy_seen_at=50.0, now=60.0)
    assert not w.stalled, "rank 0 may just have joined the collective"
    w = weigh(judge(ranks), both_wait, policy, busy_seen_at=30.0, now=60.0)
    assert w.stalled and w.kind == COLLECTIVE and w.suspect_rank is None
    assert "another node" in w.reason


def test_ranks_waiting_in_a_collective_give_other_nodes_time_to_report_a_busy_rank():
    ranks = assess([alive_beat(0, 0.0, 24.5), alive_beat(1, 0.1, 24.8)], {}, 25.0, POLICY)
    both_wait = {0: WAITING, 1: WAITING}
    assert not weigh(judge(ranks), both_wait, POLICY, now=25.0, peers_watch=True).stalled
    assert weigh(judge(ranks), both_wait, POLICY, now=25.0).stalled, "one node: no one to hear from"
    acted = "stall on node2 at step 11, suspect rank 2: rank 2 is stopped (SIGSTOP or a tracer)"
    w = weigh(judge(ranks), both_wait, POLICY, now=25.0, peers_watch=True, peer_stall=acted)
    assert w.stalled and w.kind == COLLECTIVE and acted in w.reason, "its workers are being killed"
    later = assess([alive_beat(0, 0.0, 31.5), alive_beat(1, 0.1, 31.8)], {}, 32.0, POLICY)
    assert weigh(judge(later), both_wait, POLICY, now=32.0, peers_watch=True).stalled
    busy_elsewhere = "rank 2 on node2 (step 30, working outside any collective for 40s)"
    v = judge(later, peer_busy=busy_elsewhere)
    assert not v.stalled and busy_elsewhere in v.reason


def test_only_hardware_like_stalls_mark_a_node_bad():
    assert set(HARDWARE_KINDS) == {FROZEN, LOST, QUIET}
    assert BUSY not in HARDWARE_KINDS and USER not in HARDWARE_KINDS


def _hang(step: int, kind: str = BUSY, rank: int | None = 0, node: str = "n1") -> hang_log.HangEvent:
    return hang_log.HangEvent(allocation=0, node=node, node_rank=0, reason="rank 0 ran outside any "
                            "collective", suspect_rank=rank, stacks="logs/alloc-0/hang-n1-1.txt",
                            step=step, kind=kind)


def test_the_same_stall_twice_is_a_pattern_with_advice():
    assert hang_log.repeated([]) is None
    assert hang_log.repeated([_hang(30)]) is None
    assert hang_log.repeated([_hang(30), _hang(31)]) is None
    assert hang_log.repeated([_hang(30), _hang(30, kind=FROZEN)]) is None
    assert hang_log.repeated([_hang(30), _hang(30, rank=1)]) is None
    assert hang_log.repeated([_hang(30), _hang(30, node="n2")]) is None
    twice = hang_log.repeated([_hang(30), _hang(12), _hang(30)])
    assert twice is not None and twice.step == 30
    assert hang_log.repeated([_hang(30), _hang(30), _hang(31)]) is None, "only the latest counts"
    advice = twice.advice()
    assert "twice at step 30" in advice and "session.phase" in advice and "--busy-timeout" in advice
    assert "--stall-timeout" in _hang(30, kind=COLLECTIVE, rank=None).advice()


def test_the_watchdog_ends_the_allocation_with_the_pattern(tmp_path: Path):
    from runtime.liveness.watchdog import Watchdog

    w = Watchdog(tmp_path, allocation=0, node_rank=0, policy=None)
    hang_log.append(tmp_path, _hang(30))
    assert w.repeated() is None
    hang_log.append(tmp_path, _hang(30))
    assert "twice at step 30" in (w.repeated() or "")
    kind, reason, lines = w.amend("app_error", "rank 0 exited with -9: (no error message)")
    assert kind == "hang" and "twice at step 30" in reason and len(lines) == 2
    other = Watchdog(tmp_path, allocation=1, node_rank=0, policy=None)
    assert other.repeated() is None, "an earlier allocation's stalls are its own"


def test_heartbeat_records_carry_the_alive_beat(tmp_path: Path):
    import os
    import time

    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, restart=0, alive_every_s=0.05)
    try:
        w.set_base("step")
        [first] = read_all(tmp_path)
        assert first.alive_every_s == 0.05 and first.alive is not None
        old = time.time() - 100
        os.utime(w.path, (old, old))
        deadline = time.time() + 10
        while read_all(tmp_path)[0].alive < old + 50 and time.time() < deadline:
            time.sleep(0.02)
        [rec] = read_all(tmp_path)
        assert rec.alive_age_s(time.time()) < 5, "the alive beat touched the record again"
        assert rec.time == first.time, "an alive beat is not progress"
    finally:
        w.close()
    plain = HeartbeatWriter(tmp_path, rank=1, local_rank=1, restart=0, alive_every_s=None)
    plain.set_base("step")
    [rec] = read_all(tmp_path)
    assert rec.alive is None and rec.alive_age_s(time.time()) is None
    plain.close()


def test_busy_timeout_is_validated_and_reaches_the_policy():
    from hpc.contract.jobspec import JobSpec, parse_options

    assert JobSpec(script="t.py").busy_timeout_s == 1800
    assert policy_from_spec("auto", 300).busy_s == 300 and policy_from_spec("45", 300).busy_s == 300
    assert StallPolicy(busy_s=7200).longest_s == 7200, "the collective timeout must outlast it"
    for bad in ("soon", "0", "4", "-1", "604801"):
        with pytest.raises(SpecError, match=r"--busy-timeout.*5.*604800"):
            parse_options({"busy_timeout_s": bad}, lambda name: "--busy-timeout")


def test_the_alive_beat_writes_a_record_the_throttle_held_back(tmp_path: Path):
    """A rank that stops right after a throttled step: within a second the record on disk
    names that step (the same stall twice is recognized by its step)."""
    import time

    w = HeartbeatWriter(tmp_path, rank=0, local_rank=0, restart=0, every_s=60.0, alive_every_s=0.05)
    try:
        w.set_base("step")
        w.step_done(1, 0.1)
        w.step_done(2, 0.1)          # held back by the 60-s throttle
        deadline = time.time() + 10
        while read_all(tmp_path)[0].step != 2 and time.time() < deadline:
            time.sleep(0.02)
        assert read_all(tmp_path)[0].step == 2
    finally:
        w.close()
    time.sleep(0.2)
    assert read_all(tmp_path) == [], "closed: nothing written again"


def test_a_stopped_process_gets_the_floor_even_after_a_long_unmarked_step():
    """A 45-s pause entered the p99 (10 x 45 s = 450 s for an ordinary step); a stopped
    process does no work whatever its step times: the 20-s floor."""
    slow = Heartbeat(pid=100, rank=0, local_rank=0, restart=0, phase="step", step=50, steps_done=50,
                     time=0.0, p99_s=45.0, samples=50)
    [running] = assess([slow], {}, 25.0, POLICY)
    assert running.deadline_s == 450.0 and not running.overdue
    [stopped] = assess([slow], {100: True}, 25.0, POLICY)
    assert stopped.deadline_s == 20.0 and stopped.overdue and judge([stopped]).kind == FROZEN


# --- LivenessConfig: the stall watch's settings, parsed once -------------------------------
def test_liveness_config_parses_the_flags_once_and_refuses_bad_values():
    from hpc.contract.components import LIVENESS, LivenessConfig
    from hpc.contract.jobspec import JobSpec

    assert JobSpec(script="t.py").liveness == LIVENESS == LivenessConfig.from_flags("auto")
    assert LivenessConfig.from_flags(" OFF ").watch is False
    assert LivenessConfig.from_flags("45", 300) == LivenessConfig(fixed_step_s=45.0, busy_s=300.0)
    with pytest.raises(SpecError, match="--stall-timeout"):
        LivenessConfig.from_flags("soon")
    with pytest.raises(ValueError, match="fixed_step_s=2"):
        LivenessConfig(fixed_step_s=2)
    with pytest.raises(ValueError, match="busy_s=1"):
        LivenessConfig(busy_s=1)


def test_no_runtime_process_reads_the_stall_flags_text():
    """The launcher, its watchdog, the NCCL plan and the Session take ``JobSpec.liveness``
    whole: none reads ``stall_timeout``/``busy_timeout_s`` or parses the flag again."""
    import ast

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if name in ("stall_timeout", "busy_timeout_s", "parse_stall_timeout", "stall_seconds"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert found == [], "take JobSpec.liveness (hpc.contract.components.LivenessConfig) instead"


# --- ranks deadlocked in different collectives (issue 40, point 2) ---------------------------
IN_SAVE_GATHER = """Thread 0x00007f4e869fd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007fbf08650b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3180 in all_gather
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3085 in all_gather_object
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/main/runtime/checkpoint/checkpointer.py", line 315 in _gather
  File "/work/main/runtime/checkpoint/checkpointer.py", line 280 in save
  File "/work/main/runtime/session.py", line 834 in _boundary
  File "/work/train.py", line 60 in <module>
  File "/work/main/runtime/worker/start.py", line 95 in main
"""
IN_RECV = """Current thread 0x00007fbf08650b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2410 in recv
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/pp.py", line 40 in stage
  File "/work/main/runtime/worker/start.py", line 95 in main
"""


def first_steps(*beats: Heartbeat, now: float = 12.0) -> tuple:
    """Ranks in their first steps: the long budget (1800 s) is their deadline."""
    ranks = assess(list(beats), {}, now, POLICY)
    assert all(r.deadline_s >= 1800 for r in ranks) and not judge(ranks).stalled
    return ranks


def test_waiting_call_names_the_collective_and_where_it_was_called():
    assert waiting_call(IN_SAVE_GATHER) == ("all_gather_object",
                                            "checkpoint/checkpointer.py:315 <- checkpoint/checkpointer.py:280")
    assert waiting_call(WAITING) == ("backward", "work/train.py:228")
    assert waiting_call(WAITING_AT_STEP_BOUNDARY) == (POSTED, "runtime/preemption.py:176 <- runtime/session.py:420")
    assert waiting_call(IN_EVAL) is None and waiting_call("") is None


def test_ranks_idle_in_different_collectives_are_a_deadlock_whatever_the_first_steps_budget():
    ranks = first_steps(beat(0, 0.0, step=2), beat(1, 0.5, step=2))
    v = desync(ranks, {0: WAITING, 1: IN_SAVE_GATHER}, {0: 11.0, 1: 11.5})
    assert v is not None and v.stalled and v.kind == DESYNC and v.suspect_rank == 0
    assert "rank 0 in backward (work/train.py:228)" in v.reason, v.reason
    assert "rank 1 in all_gather_object (checkpoint/checkpointer.py:315" in v.reason, v.reason
    assert "idle for 11s at step 2" in v.reason, v.reason
    assert DESYNC not in HARDWARE_KINDS   # the node is not to blame
    # the odd one out is the suspect
    three = first_steps(beat(0, 0.0, step=2), beat(1, 0.5, step=2), beat(2, 0.5, step=2))
    v = desync(three, {0: IN_SAVE_GATHER, 1: WAITING, 2: IN_SAVE_GATHER}, {0: 11, 1: 11, 2: 11})
    assert v is not None and v.suspect_rank == 1 and "ranks 0, 2 in all_gather_object" in v.reason
    # two of our own waits, posted in different places, are different collectives too
    at_save = WAITING_AT_STEP_BOUNDARY.replace("runtime/preemption.py\", line 176 in poll",
                                               "runtime/checkpoint/checkpointer.py\", line 347 in should_save")
    v = desync(ranks, {0: WAITING_AT_STEP_BOUNDARY, 1: at_save}, {0: 11.0, 1: 11.5})
    assert v is not None and "rank 1 in a posted collective (checkpoint/checkpointer.py:347" in v.reason
    assert desync(ranks, {0: at_save, 1: at_save}, {0: 11.0, 1: 11.5}) is None


@pytest.mark.parametrize("case", ["same collective", "one computes", "one progressed", "one outside",
                                  "pipeline", "recovering", "one rank", "no dump"])
def test_what_is_not_a_desync(case):
    """The other side: ranks waiting in one collective (a slow restore, a peer elsewhere), a
    rank still computing or just progressed (a long first step), a rank in its own code (an
    evaluation), a pipeline's sends and receives, an in-process recovery."""
    b0, b1 = beat(0, 0.0, step=2), beat(1, 0.5, step=2)
    dumps, idle = {0: WAITING, 1: IN_SAVE_GATHER}, {0: 11.0, 1: 11.0}
    if case == "same collective":
        dumps = {0: IN_SAVE_GATHER, 1: IN_SAVE_GATHER}
    elif case == "one computes":
        idle = {0: 0.5, 1: 11.0}
    elif case == "one progressed":
        b1 = beat(1, 8.0, step=2)
    elif case == "one outside":
        dumps = {0: WAITING, 1: IN_EVAL}
    elif case == "pipeline":
        dumps = {0: WAITING, 1: IN_RECV}
    elif case == "recovering":
        b1 = beat(1, 0.5, step=2, phase="recover")
    elif case == "no dump":
        dumps = {0: WAITING}
    ranks = assess([b0] if case == "one rank" else [b0, b1], {}, 12.0, POLICY)
    assert desync(ranks, dumps, idle) is None


def test_a_desync_seen_twice_advises_making_the_decision_agree():
    from hpc.contract.records import HangEvent

    e = HangEvent(allocation=0, node="n", node_rank=0, reason="ranks wait in different collectives",
                  suspect_rank=0, stacks="logs/x.txt", step=2, time=0.0, ranks=(), kind=DESYNC)
    assert "the same on every rank" in e.advice() and "--stall-timeout" not in e.advice()


def test_first_steps_waiting_in_one_collective_with_nothing_working_get_an_ordinary_steps_bound():
    """The first steps' 1800 s are for work (compilation, warm-up): ranks all idle in one
    collective past an ordinary step's deadline are stalled; a slow restore, a rank that
    works, or a wait still within that deadline are left alone."""
    ordinary = {0: 20.0, 1: 20.0}
    ranks = first_steps(beat(0, 0.0, step=1), beat(1, 0.5, step=1), now=25.0)
    same = {0: IN_SAVE_GATHER, 1: IN_SAVE_GATHER}
    v = desync(ranks, same, {0: 24.0, 1: 24.0}, ordinary_s=ordinary)
    assert v is not None and v.kind == COLLECTIVE and v.suspect_rank is None, v
    assert "every rank here waits in one collective, idle for 24s at step 1" in v.reason, v.reason
    assert "ranks 0, 1 in all_gather_object" in v.reason, v.reason
    assert desync(ranks, same, {0: 24.0, 1: 24.0}) is None, "without the ordinary bound: desync only"
    assert desync(ranks, same, {0: 15.0, 1: 24.0}, ordinary_s=ordinary) is None, "within a step's deadline"
    assert desync(ranks, same, {0: 1.0, 1: 24.0}, ordinary_s=ordinary) is None, "one rank works"
    restoring = assess([beat(0, 0.0, step=0, phase="restore"), beat(1, 0.5, step=0, phase="restore")],
                       {}, 25.0, POLICY)
    assert desync(restoring, same, {0: 24.0, 1: 24.0}, ordinary_s=ordinary) is None, "a slow restore"


def test_the_peers_are_all_heard_only_while_the_store_answers_and_every_counter_moves():
    """The desync rule needs the peers' word current: a store that stopped answering (its
    host cut off) or one peer's counter standing still (its node lost) is no deadlock here."""
    from runtime.liveness.beacon import PeerTracker

    t = PeerTracker(node_rank=1)
    assert not t.all_heard(100.0, 2.5)                  # the store never answered
    t.store_ok_at = 99.5
    t.observe(0, 5, 99.0)
    t.observe(2, 7, 99.8)
    assert t.all_heard(100.0, 2.5)
    assert not t.all_heard(103.0, 2.5)                  # the store silent for 3.5 s
    t.store_ok_at = 102.9
    t.observe(2, 8, 102.9)
    assert not t.all_heard(103.0, 2.5)                  # node 0's counter still since 99.0
    t.observe(0, 6, 102.95)
    assert t.all_heard(103.0, 2.5)
    t.done.add(0)
    assert t.all_heard(110.0 - 5.0, 2.5)                # a node that finished is not waited for
