"""A node waiting for its rendezvous host's store before joining (runtime.launch.host_store).

The real processes (a late node against a host that gave up; stores alive, stopped and gone)
are in tests/distributed/test_rendezvous_host_evidence.py; here the rule on a fake clock: join
as soon as the store answers, give up at once when the host recorded the allocation's end, and
after the join timeout when it stays silent, each reason naming the host and the timeout.
"""

from __future__ import annotations

import pytest

from runtime.launch import host_store

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def wait(monkeypatch, answers_at: float | None, ended_at: float | None, timeout_s: float = 10.0):
    clock = Clock()
    monkeypatch.setattr(host_store.time, "sleep", lambda s: setattr(clock, "t", clock.t + s))
    probe = lambda _e: answers_at is not None and clock.t >= answers_at   # noqa: E731
    ended = lambda: "app_error: timed out" if ended_at is not None and clock.t >= ended_at else None   # noqa: E731
    why = host_store.await_host("h:29500", timeout_s=timeout_s, ended=ended, probe=probe, clock=clock)
    return why, clock.t


def test_a_store_that_answers_late_is_joined_once_it_answers(monkeypatch):
    assert wait(monkeypatch, answers_at=4.0, ended_at=None) == (None, 4.0)


def test_a_host_that_recorded_its_end_is_given_up_at_once_naming_it_and_the_timeout(monkeypatch):
    why, t = wait(monkeypatch, answers_at=None, ended_at=0.0)
    assert t == 0.0
    assert "rendezvous host h:29500 ended this allocation" in why and "10 s, --rdzv-timeout" in why, why
    assert "app_error: timed out" in why, why


def test_a_store_silent_for_the_join_timeout_is_given_up_naming_it_and_the_timeout(monkeypatch):
    why, t = wait(monkeypatch, answers_at=None, ended_at=None, timeout_s=10.0)
    assert 10.0 <= t <= 11.0
    assert "h:29500 did not answer within 10 s (--rdzv-timeout" in why, why
