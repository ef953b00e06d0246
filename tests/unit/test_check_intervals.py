"""The Session's step-boundary intervals (``runtime.session.check_intervals``): how often the
ranks agree on a preemption warning and how often rank 0's clock is asked whether a timed
save is due (a blocking broadcast, so a barrier at the boundary: 1-3 ms per step under
in-process recovery at 100-ms steps when it ran every step, benchmarks/RESULTS-runtime.md)."""

from __future__ import annotations

import pytest

from runtime.session import MAX_POLL_EVERY, POLL_TARGET_S, SAVE_CHECK_TARGET_S, check_intervals


def test_timed_save_check_runs_about_once_a_second_at_100ms_steps() -> None:
    poll, save = check_intervals(0.100)
    assert poll == 1                  # a warning is still agreed at every step
    assert save == 10                 # the clock is asked once a second, not every step


@pytest.mark.parametrize("step_s", [0.0003, 0.002, 0.013, 0.05, 0.1, 0.13, 0.3, 0.99, 1.0, 7.0, 600.0])
def test_save_check_is_an_agreement_step_and_at_most_a_second_late(step_s: float) -> None:
    poll, save = check_intervals(step_s)
    assert 1 <= poll <= MAX_POLL_EVERY
    assert save % poll == 0           # the check needs no boundary of its own
    # The agreement keeps its own target; a timed save starts at most ~a second late
    # (or one step, when a step is longer than that).
    assert poll * step_s <= max(POLL_TARGET_S, step_s) + 1e-12
    assert save * step_s <= max(SAVE_CHECK_TARGET_S, step_s * poll) + 1e-12
    # ... and is not checked more often than needed (at least half the target apart).
    assert save * step_s >= min(SAVE_CHECK_TARGET_S / 2, step_s * poll) - 1e-12


def test_long_steps_check_every_step() -> None:
    assert check_intervals(5.0) == (1, 1)
    assert check_intervals(1.5) == (1, 1)
