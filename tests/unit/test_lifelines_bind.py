"""The lifelines listener of a job on one machine (its store on loopback, ``hpc run``) is
reachable from that machine only; a job across nodes listens where other nodes reach it."""

from __future__ import annotations

import pytest

from runtime.inprocess.launcher.lifelines import Lifelines, listen_host

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("store, host", [("127.0.0.1:29500", "127.0.0.1"), ("localhost:1", "127.0.0.1"),
                                         ("[::1]:29500", "127.0.0.1"), ("127.0.0.5:1", "127.0.0.1"),
                                         ("10.0.0.2:29500", ""), ("node1:29500", "")])
def test_the_listen_address_follows_the_store(store: str, host: str) -> None:
    assert listen_host(store) == host


def test_a_local_jobs_listener_is_bound_to_loopback() -> None:
    lines = Lifelines("127.0.0.1:29500", key=bytes(32))
    try:
        assert lines.server.getsockname()[0] == "127.0.0.1"
    finally:
        lines.server.close()
