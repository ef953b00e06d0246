"""The stop deadline from Slurm itself (runtime.stop_deadline and the launcher's StopTracker).

Job records are the ones recorded on the test cluster (tests/fixtures/slurm): a 10-minute job
with ``--signal=USR2@120`` in a partition with GraceTime=10, before and 0.1 s into its
preemption, and after Slurm requeued it.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from hpc.contract.slurm import SlurmError
from hpc.contract.slurm_parse import parse_show_job
from runtime import stop_deadline, stopping

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
IN_GRACE = parse_show_job((FIXTURES / "scontrol_show_job_preempt_grace.txt").read_text())
BEFORE = parse_show_job((FIXTURES / "scontrol_show_job_before_preempt.txt").read_text())
REQUEUED = parse_show_job((FIXTURES / "scontrol_show_job_requeued_completing.txt").read_text())
PREEMPT_T = IN_GRACE.preempt_time.timestamp()
SLURM_END = IN_GRACE.end_time.timestamp()     # PreemptTime + GraceTime (10 s)
JOB_END = BEFORE.end_time.timestamp()         # the 10-minute time limit


def test_a_job_in_its_preemption_grace_ends_at_preempt_time_plus_grace() -> None:
    found, why = stop_deadline.slurm_stop(IN_GRACE, PREEMPT_T + 1, lead_s=120, restarts=0)
    assert why == "" and found is not None
    assert (found.kind, found.deadline, found.preempt_time) == ("preempted", PREEMPT_T + 10, PREEMPT_T)


def test_a_warning_within_the_lead_of_the_end_is_the_time_limit_else_slurm_does_not_say() -> None:
    end = BEFORE.end_time.timestamp()
    near, _ = stop_deadline.slurm_stop(BEFORE, end - 110, lead_s=120, restarts=0)
    assert (near.kind, near.deadline) == ("time_limit", end)
    # A warning minutes before the end with no PreemptTime: a user's `scancel --signal`.
    far, _ = stop_deadline.slurm_stop(BEFORE, end - 590, lead_s=120, restarts=0)
    assert far.kind is None and far.deadline == end


def test_a_job_slurm_is_still_signaling_is_read_as_running() -> None:
    """CI of 32c4e0b: asked on the warning, Slurm answered JobState=SIGNALING (the warning
    itself still being delivered); the launcher took it for an ended job and planned on its
    assumption instead of Slurm's deadline."""
    text = (FIXTURES / "scontrol_show_job_preempt_grace.txt").read_text()
    signaling = parse_show_job(text.replace("JobState=RUNNING", "JobState=SIGNALING"))
    assert signaling.raw_state == "SIGNALING"
    found, why = stop_deadline.slurm_stop(signaling, PREEMPT_T + 1, lead_s=120, restarts=0)
    assert why == "" and found is not None
    assert (found.kind, found.deadline) == ("preempted", PREEMPT_T + 10)


def test_a_record_of_another_run_or_an_ended_job_says_nothing() -> None:
    gone, why = stop_deadline.slurm_stop(REQUEUED, PREEMPT_T + 11, lead_s=120, restarts=0)
    assert gone is None and "COMPLETING" in why
    later, why = stop_deadline.slurm_stop(IN_GRACE, PREEMPT_T + 1, lead_s=120, restarts=3)
    assert later is None and "run 0, this is run 3" in why


def assumed_notice(received: float, **kw) -> stopping.StopNotice:
    return stopping.notice_for("SIGUSR2", received, allocation=0, job_end_time=JOB_END,
                               lead_s=120, grace_s=10, **kw)


def test_a_late_warning_plans_for_slurms_earlier_deadline_and_keeps_both() -> None:
    # The case: the warning reached the launcher 6.1 s after PreemptTime (3.9 s before
    # Slurm's SIGTERM with GraceTime 10); the assumption puts the end 10 s after the warning.
    late = assumed_notice(PREEMPT_T + 6.1)
    found, _ = stop_deadline.slurm_stop(IN_GRACE, PREEMPT_T + 6.2, lead_s=120, restarts=0)
    refined = stop_deadline.refine(late, found)
    assert refined.deadline == SLURM_END and refined.assumed_deadline == PREEMPT_T + 16.1
    assert refined.slurm_deadline == SLURM_END and refined.query == stop_deadline.ANSWERED
    line = stop_deadline.describe(refined, PREEMPT_T + 6.2)
    assert "assumed deadline" in line and "+9.9 s" in line and "Slurm's" in line and "+3.8 s" in line
    # The launcher's enforcement follows the real deadline: 3/4 of the 3.8 s left, not of 9.9 s.
    assert stopping.enforce_in(refined, PREEMPT_T + 6.2) == pytest.approx(3.8 * 3 / 4)


def test_an_earlier_assumption_stands_and_slurm_names_the_kind() -> None:
    # A time-limit warning mistaken for a preemption (its end 100 s away, GraceTime 10 s).
    notice = assumed_notice(1000.0)
    refined = stop_deadline.refine(notice, stop_deadline.SlurmStop(1100.0, "time_limit"))
    assert (refined.kind, refined.deadline, refined.slurm_deadline) == ("time_limit", 1010.0, 1100.0)


def test_no_answer_keeps_the_assumption_and_says_why() -> None:
    refined = stop_deadline.refine(assumed_notice(1000.0), None, "no answer in 1.5 s")
    assert refined.deadline == 1010.0 and refined.slurm_deadline is None
    assert refined.query == "unanswered: no answer in 1.5 s"


def test_the_save_plan_takes_the_notice_of_this_allocation_only() -> None:
    refined = stop_deadline.refine(assumed_notice(1000.0),
                                   stop_deadline.SlurmStop(1004.0, "preempted"))
    kind, deadline, note = stop_deadline.plan("time_limit", 1200.0, refined, allocation=0)
    assert (kind, deadline) == ("preempted", 1004.0) and "Slurm's" in note
    assert stop_deadline.plan("time_limit", 1200.0, refined, allocation=1)[:2] == ("time_limit", 1200.0)
    assert stop_deadline.plan("preempted", 1010.0, None, allocation=0)[:2] == ("preempted", 1010.0)


def test_a_reader_waits_for_the_answer_but_not_past_its_bound() -> None:
    asking = stopping.StopNotice(0, "preempted", "SIGUSR2", 100.0, 110.0, query=stop_deadline.ASKING)
    answered = stop_deadline.refine(asking, stop_deadline.SlurmStop(105.0, "preempted"))
    now = [100.0]
    reads = iter([None, asking, answered])
    got = stop_deadline.await_answer(lambda: next(reads), 100.0, clock=lambda: now[0],
                                     sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == answered
    now[0] = 100.0
    got = stop_deadline.await_answer(lambda: asking, 100.0, clock=lambda: now[0],
                                     sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == asking and now[0] == pytest.approx(100.0 + stop_deadline.ANSWER_WAIT_S, abs=0.06)


def test_the_question_to_slurm_is_bounded(tmp_path: Path) -> None:
    """A controller that does not answer: the real client gives up after the budget."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nsleep 30\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="no answer within"):
        stop_deadline.ask_slurm("42", env, budget_s=1.0)
    assert time.monotonic() - t0 < 3.0


def tracker(path: Path, **kw) -> stopping.StopTracker:
    return stopping.StopTracker(path, allocation=0, job_end_time=JOB_END, lead_s=120,
                                grace_s=10, restarts=0, **kw)


def test_the_asking_launcher_rewrites_the_notice_with_slurms_deadline(tmp_path: Path) -> None:
    path = tmp_path / "stop.json"
    asked = []
    t = tracker(path, ask_slurm=lambda: asked.append(1) or IN_GRACE)
    t.on_signal("SIGUSR2", PREEMPT_T + 6.1)
    assert t.refined.wait(5)
    got = stopping.StopNotice.read(path)
    assert asked == [1] and got == t.notice
    assert (got.kind, got.deadline, got.assumed_deadline) == ("preempted", SLURM_END, PREEMPT_T + 16.1)
    t.on_signal("SIGUSR2", PREEMPT_T + 7)        # a repeated warning asks nothing more
    assert asked == [1]


def test_a_controller_that_does_not_answer_leaves_the_assumption(tmp_path: Path) -> None:
    def ask():
        raise SlurmError("scontrol show job failed: no answer within 2 s", ["scontrol"], None, "")
    t = tracker(tmp_path / "stop.json", ask_slurm=ask)
    t.on_signal("SIGUSR2", 1000.0)
    assert t.refined.wait(5)
    got = stopping.StopNotice.read(tmp_path / "stop.json")
    assert got.deadline == 1010.0 and got.query.startswith("unanswered: no answer in")


def test_no_slurm_here_no_question_and_the_notice_is_final(tmp_path: Path) -> None:
    t = tracker(tmp_path / "stop.json")
    t.on_signal("SIGUSR2", 1000.0)
    assert t.refined.is_set()
    got = stopping.StopNotice.read(tmp_path / "stop.json")
    assert (got.deadline, got.query) == (1010.0, "") and not stop_deadline.is_pending(got)


def test_other_nodes_follow_node_0s_answer_and_never_overwrite_it(tmp_path: Path) -> None:
    path = tmp_path / "stop.json"
    node0 = tracker(path, ask_slurm=lambda: IN_GRACE)
    node0.on_signal("SIGUSR2", PREEMPT_T + 6.1)
    assert node0.refined.wait(5)
    node1 = tracker(path, follow=True)
    node1.on_signal("SIGUSR2", PREEMPT_T + 6.3)
    assert node1.refined.wait(5)
    assert node1.notice.deadline == SLURM_END and node1.notice.kind == "preempted"
    assert json.loads(path.read_text())["received_at"] == round(PREEMPT_T + 6.1, 3)   # node 0's


def test_an_old_notice_without_the_new_fields_still_reads(tmp_path: Path) -> None:
    (tmp_path / "stop.json").write_text(json.dumps({
        "allocation": 0, "kind": "preempted", "signal": "SIGUSR2", "received_at": 1.0, "deadline": 11.0}))
    got = stopping.StopNotice.read(tmp_path / "stop.json")
    assert got.deadline == 11.0 and got.query == "" and got.slurm_deadline is None


FORWARD = """
import functools, json, os, signal, sys, time
from pathlib import Path
from runtime import stop_deadline, stopping
from runtime.launch.forwarding import SignalForwarder

notice, env = Path(sys.argv[1]), {**os.environ, "PATH": sys.argv[2] + ":" + os.environ["PATH"]}
f = SignalForwarder((signal.SIGUSR2,))
f.stop = stopping.StopTracker(notice, allocation=0, job_end_time=None, lead_s=120, grace_s=10,
                              restarts=0, ask_slurm=functools.partial(stop_deadline.ask_slurm, "1", env))
f.install()
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.4)                        # the query runs (1 s): a second signal comes
os.kill(os.getpid(), signal.SIGUSR2)
assert f.stop.refined.wait(10)
print(json.dumps({"query": f.stop.notice.query}))
"""


def test_the_launcher_does_not_forward_the_warning_to_its_own_slurm_query(tmp_path: Path) -> None:
    """The launcher passes each signal on to its children; its `scontrol show job`, started on
    the warning, is one of them. Seen on the test cluster: it died of a SIGUSR2 (exit status
    -12) and the deadline stayed assumed. Here a second signal comes while it runs."""
    import subprocess
    import sys

    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\nsleep 1\ncat '{FIXTURES / 'scontrol_show_job_preempt_grace.txt'}'\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    r = subprocess.run([sys.executable, "-c", FORWARD, str(tmp_path / "stop.json"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["query"] == "answered", r.stdout + r.stderr


def test_a_preemption_read_while_slurm_still_signals_is_not_a_users_cancel() -> None:
    """A SIGTERM-only preemption asked about while Slurm still delivers it (JobState=SIGNALING)
    was read as COMPLETING, which without a requeue claim means a user's ``scancel``: the
    preempted job would have been recorded cancelled and not requeued."""
    from runtime.ending.outcome import cancelled_from

    grace = (FIXTURES / "scontrol_show_job_preempt_grace.txt").read_text()
    signaling = parse_show_job(grace.replace("JobState=RUNNING", "JobState=SIGNALING"))
    assert not cancelled_from(signaling, requeue_claimed=False, restarts_at_start=0)
    assert not cancelled_from(IN_GRACE, requeue_claimed=False, restarts_at_start=0)
    # The other side: a user's scancel (COMPLETING while ending, then CANCELLED) still is one.
    text = (FIXTURES / "scontrol_show_job_before_preempt.txt").read_text()
    completing = parse_show_job(text.replace("JobState=RUNNING", "JobState=COMPLETING"))
    assert cancelled_from(completing, requeue_claimed=False, restarts_at_start=0)
    assert not cancelled_from(completing, requeue_claimed=True, restarts_at_start=0)    # our own requeue
    cancelled = parse_show_job(text.replace("JobState=RUNNING", "JobState=CANCELLED"))
    assert cancelled_from(cancelled, requeue_claimed=False, restarts_at_start=0)


def test_a_preemption_whose_exit_outlasts_the_grace_is_not_a_users_cancel() -> None:
    """CI of stop 36, load ~9: a SIGTERM-only preemption's workers took 10 s to exit, past the
    10-s grace; the launcher then read the job COMPLETING and recorded a user's ``scancel``
    ("cancelled (scancel) while running"). Slurm says otherwise: PreemptTime is set while the
    preemption runs, and once Slurm has requeued the job its Restarts exceed the count the
    allocation started with."""
    from runtime.ending.outcome import cancelled_from

    grace = (FIXTURES / "scontrol_show_job_preempt_grace.txt").read_text()
    assert not cancelled_from(parse_show_job(grace.replace("JobState=RUNNING", "JobState=COMPLETING")),
                              requeue_claimed=False, restarts_at_start=0)
    assert REQUEUED.state.name == "COMPLETING" and REQUEUED.restarts == 1
    assert not cancelled_from(REQUEUED, requeue_claimed=False, restarts_at_start=0)
    # The same record read in the allocation Slurm's requeue started is a user's scancel again.
    assert cancelled_from(REQUEUED, requeue_claimed=False, restarts_at_start=1)
