"""The step boundary's wait for its posted collectives under in-process recovery
(``StepGuard.settle``): short collectives cost little, a lost peer ends the wait."""

from __future__ import annotations

import pytest

from runtime.inprocess.worker import guard as guard_mod
from runtime.inprocess.worker.guard import PeerLost, StepGuard


class _Work:
    """A posted collective that completes after ``polls`` looks."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_the_wait_for_a_short_collective_starts_at_20_us_and_grows_to_the_poll(monkeypatch):
    """A checkpoint broadcast or metric reduction takes ~0.1-0.3 ms on gloo: the first sleeps
    are tens of microseconds (a first sleep of 0.5 ms cost each boundary collective 0.5 ms,
    ~1 % of a 100-ms step with the agreement and the checkpoint decision at every step)."""
    slept: list[float] = []
    monkeypatch.setattr(guard_mod.time, "sleep", slept.append)
    g = StepGuard({}, timeout_s=lambda: 60.0, rank=0)
    g.settle([_Work(3)])
    assert slept == pytest.approx([20e-6, 40e-6, 80e-6])
    slept.clear()
    g.settle([_Work(12)], poll_s=0.0005)
    assert slept[0] == pytest.approx(20e-6) and max(slept) == pytest.approx(0.0005)
    assert sum(slept) < 0.0005 * len(slept)


def test_a_peer_lost_while_waiting_ends_the_wait_with_its_reason(monkeypatch):
    g = StepGuard({}, timeout_s=lambda: 60.0, rank=0)
    monkeypatch.setattr(guard_mod.time, "sleep", lambda s: g.fail("all-reduce: connection reset"))
    with pytest.raises(PeerLost, match="connection reset"):
        g.settle([_Work(100)])
