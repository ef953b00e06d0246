"""What a finished or stopped allocation says, whoever wrote the script (pure): when a warning
signal arrived, and how to resume when hpc knows no step."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.backends.local import resume_hint
from hpc.contract import jobdir
from runtime.ending.outcome import signals_note

pytestmark = pytest.mark.unit


def test_a_warning_long_before_the_end_is_not_after_the_work() -> None:
    note = signals_note([(100.0, "SIGUSR2")], ended=160.0)
    assert note == "SIGUSR2 arrived 60s before the workers ended; they did not stop for it and " \
                   "finished the work"


def test_a_warning_at_the_end_says_so() -> None:
    note = signals_note([(159.0, "SIGUSR2"), (159.5, "SIGTERM"), (159.6, "SIGUSR2")], ended=160.0)
    assert note == "SIGUSR2,SIGTERM arrived as the workers were ending (1.0s before)"


def outcome(**kw) -> jobdir.Outcome:
    return jobdir.Outcome(allocation=0, kind="preempted", exit_code=75, **kw)


def test_resume_hint_says_only_what_is_known() -> None:
    job = Path("/jobs/a")
    assert resume_hint(outcome(step=40), job) == \
        "to resume from step 40, run the same command with --job-dir /jobs/a"
    assert resume_hint(outcome(last_step=17), job) == \
        "no checkpoint was saved (the run reached step 17); to start it again, run the same " \
        "command with --job-dir /jobs/a"
    plain = resume_hint(outcome(), job)
    assert "None" not in plain and plain.startswith("to resume, run the same command with "
                                                    "--job-dir /jobs/a (hpc saw no checkpoint")
