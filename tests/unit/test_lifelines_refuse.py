"""The lifelines listener acts only on lines signed with the job's key: a forged hello is
dropped unread, idle connections are dropped (the oldest first, and after ``HELLO_WITHIN_S``),
and a member's line stays through a flood. The real listener thread and real sockets; only
the store is left out (the port is not published: nothing here is announced to anyone)."""

from __future__ import annotations

import socket
import time

import pytest

from runtime.inprocess import protocol as proto
from runtime.inprocess.launcher import lifelines as inprocess_lifelines
from runtime.inprocess.launcher.lifelines import MAX_PENDING, Lifelines

pytestmark = pytest.mark.unit
KEY = bytes(range(32))


def _until(pred, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := pred()):
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def listener():
    lines = Lifelines("127.0.0.1:1", key=KEY)
    lines._publish = lambda: True   # no store: nothing is published or announced
    lines.start()
    yield lines
    lines.stop()
    lines.join(5)
    lines.server.close()


def _member(lines: Lifelines) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", lines.port), timeout=10)
    s.sendall(proto.Hello("worker", "n1/7", parent="n1/6", space="hpc/inproc/n0:1").line(KEY))
    return s


def test_a_hello_without_the_jobs_key_is_dropped_unread_and_a_signed_one_is_kept(listener) -> None:
    member = _member(listener)
    for forged in (proto.Hello("launcher", "n1/6").line(bytes(32)),            # another key
                   b'{"kind": "launcher", "uid": "n1/6"}\n',                   # no signature
                   b"[1, 2]\n", b"\xff\xfe\n", b"{" * 5000):                  # not a hello at all
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
            s.sendall(forged)
            assert s.recv(1) == b"", forged[:40]   # the listener closed it
    assert listener.refused == 5
    assert not listener.closed and not listener.launchers_closed   # no line counted as a death
    member.settimeout(0.2)
    with pytest.raises(socket.timeout):
        member.recv(1)   # the member's line stays open
    member.close()
    _until(lambda: "n1/7" in listener.closed, "the member's line closing to count")


def test_a_flood_of_idle_connections_is_bounded_and_the_member_stays(listener) -> None:
    member = _member(listener)
    flood = [socket.create_connection(("127.0.0.1", listener.port), timeout=10) for _ in range(3 * MAX_PENDING)]
    _until(lambda: listener.refused >= 2 * MAX_PENDING, "the oldest idle connections dropped")
    assert len(listener.pending) <= MAX_PENDING
    late = _member(listener)   # a member that comes during the flood still gets in
    _until(lambda: len(listener.members) == 2, "both members' lines")
    assert len(listener.pending) <= MAX_PENDING and not listener.closed
    for s in flood:
        s.close()
    member.close()
    late.close()


def test_a_connection_that_says_nothing_is_dropped_after_a_while(listener, monkeypatch) -> None:
    monkeypatch.setattr(inprocess_lifelines, "HELLO_WITHIN_S", 0.3)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
        assert s.recv(1) == b""
    assert listener.refused == 1

