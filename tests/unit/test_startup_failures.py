"""Which failed starts are not retried: a usage error, or the same exception twice before any
step; faults that go away keep their restarts (pure rules, runtime.ending.outcome)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from runtime.ending.outcome import startup_failure

pytestmark = pytest.mark.unit


def f(message: object, exitcode: int = 1, t: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(message=message, exitcode=exitcode, timestamp=t)


def err(line: str) -> dict:
    return {"message": f"Traceback (most recent call last):\n  ...\n{line}"}


def test_a_usage_error_before_the_first_step_is_not_retried_even_without_the_session() -> None:
    for stepped in (False, None):
        why, _ = startup_failure({1: f("To enable traceback see: ...", exitcode=2)}, stepped=stepped,
                                 previous=None)
        assert why == "rank 1 exited with status 2 (a usage error) before its first step"


def test_the_same_exception_twice_before_a_step_is_not_retried_a_different_one_is() -> None:
    first = {0: f(err("ImportError: cannot import name 'x' from 'y'"))}
    why, sig = startup_failure(first, stepped=False, previous=None)
    assert why is None and sig                        # once: it may have been a passing fault
    why, _ = startup_failure(first, stepped=False, previous=sig)
    assert why == ("rank 0 failed the same way twice before its first step "
                   "(ImportError: cannot import name 'x' from 'y')")
    other = {0: f(err("RuntimeError: something else"))}
    assert startup_failure(other, stepped=False, previous=sig)[0] is None


@pytest.mark.parametrize("failures", [
    {0: f("To enable traceback see: ...", exitcode=-signal.SIGKILL)},              # killed: a node
    {0: f(err("RuntimeError: Connection reset by peer"))},                        # a peer's loss
    {0: f("To enable traceback see: ...", exitcode=-signal.SIGSEGV)},             # no exception
], ids=["sigkill", "collateral", "signal"])
def test_infrastructure_faults_keep_their_restarts_even_twice(failures: dict) -> None:
    _, sig = startup_failure(failures, stepped=False, previous=None)
    assert startup_failure(failures, stepped=False, previous=sig)[0] is None


def test_after_a_step_or_without_the_session_only_the_usage_error_is_judged() -> None:
    same = {0: f(err("ValueError: nan loss"))}
    _, sig = startup_failure(same, stepped=False, previous=None)
    assert startup_failure(same, stepped=True, previous=sig) == (None, None)
    assert startup_failure(same, stepped=None, previous=sig) == (None, None)
    assert startup_failure({0: f("x", exitcode=2)}, stepped=True, previous=None) == (None, None)
