"""The preemption protocol's pure decisions, and the watcher's local (single-process) path."""

import os
import signal

import pytest

from runtime.preemption import PreemptionWatcher, classify_warning, deadline_for, decide

pytestmark = pytest.mark.unit


def test_sigterm_is_a_preemption():
    assert classify_warning("SIGTERM", 1000.0, job_end_time=5000.0, lead_s=120) == "preempted"


def test_warning_near_end_time_is_the_time_limit():
    # Slurm sends --signal=USR2@120 about 120 s before the end (checked every ~30 s).
    assert classify_warning("SIGUSR2", 4880.0, job_end_time=5000.0, lead_s=120) == "time_limit"
    assert classify_warning("SIGUSR2", 4850.0, job_end_time=5000.0, lead_s=120) == "time_limit"


def test_warning_long_before_end_is_a_preemption():
    # preempt_send_user_signal: the user's signal arrives at preemption, long before the end.
    assert classify_warning("SIGUSR2", 1000.0, job_end_time=5000.0, lead_s=120) == "preempted"


def test_warning_outside_slurm_is_a_preemption_not_a_time_limit():
    # hpc run (Ctrl-C, kill -USR2): there is no time limit; under Slurm with the end time
    # unknown the warning is still taken as the time limit's.
    assert classify_warning("SIGUSR2", 1000.0, job_end_time=None, lead_s=120, under_slurm=False) == "preempted"
    assert classify_warning("SIGUSR2", 1000.0, job_end_time=None, lead_s=120) == "time_limit"
    from runtime.stopping import enforce_in, notice_for

    notice = notice_for("SIGUSR2", 1000.0, allocation=0, job_end_time=None, lead_s=120,
                        grace_s=None, under_slurm=False)
    assert notice.kind == "preempted" and notice.deadline == 1030.0
    assert enforce_in(notice, 1000.0) == 27.0      # workers that ignore it: SIGTERM after 27 s


def test_deadlines():
    assert deadline_for("time_limit", 4880.0, job_end_time=5000.0, lead_s=120) == 5000.0
    assert deadline_for("time_limit", 100.0, job_end_time=None, lead_s=120) == 220.0
    assert deadline_for("preempted", 100.0, job_end_time=None, lead_s=120, grace_s=10) == 110.0


def test_decide_saves_only_when_the_save_fits():
    assert decide(now=0, deadline=60, estimated_save_s=5).save
    d = decide(now=0, deadline=6, estimated_save_s=5)
    assert not d.save and "last committed checkpoint" in d.reason


def test_watcher_records_real_signals_and_reports_once_polled():
    now = [100.0]
    w = PreemptionWatcher(("SIGUSR2", "SIGTERM"), None, job_end_time=None, lead_s=30,
                          clock=lambda: now[0])
    w.install()
    try:
        assert w.poll() is None
        os.kill(os.getpid(), signal.SIGUSR2)
        now[0] = 105.0
        os.kill(os.getpid(), signal.SIGTERM)     # a second signal: still one request
        req = w.poll()
        assert req is not None and req.kind == "preempted" and req.signal_name == "SIGTERM"
        assert req.received_at == 100.0 and req.deadline == 130.0
    finally:
        w.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
