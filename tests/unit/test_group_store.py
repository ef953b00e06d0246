"""The workers' own store on loopback (runtime/worker/group_store.py): a real TCPStore, the
listening address read from /proc/net/tcp, and the cases where torch's start stays."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from runtime.worker.group_store import loopback_store, on_loopback
from tests.listeners import LOOPBACK, listeners, taken_port

pytestmark = pytest.mark.unit
T = timedelta(seconds=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("addr, expected", [("localhost", True), ("127.0.0.1", True), ("::1", True),
                                            ("127.0.1.1", True), ("10.0.0.5", False), ("node1", False),
                                            ("", False)])
def test_only_loopback_addresses_are_loopback(addr: str, expected: bool):
    assert on_loopback(addr) is expected


def test_rank_0_serves_on_loopback_only_and_rank_1_reaches_it():
    port = free_port()
    env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    got: dict[int, object] = {}
    server = threading.Thread(target=lambda: got.setdefault(0, loopback_store({**env, "RANK": "0"}, T)))
    server.start()      # it waits for rank 1
    deadline = time.monotonic() + 30
    while not listeners(port) and time.monotonic() < deadline:
        time.sleep(0.01)
    mine = loopback_store({**env, "RANK": "1"}, T)
    client, rank, world = mine["store"], mine["rank"], mine["world_size"]
    server.join(30)
    store, rank0 = got[0]["store"], got[0]["rank"]
    assert (rank0, rank, world) == (0, 1, 2)
    assert listeners(port) == {LOOPBACK}      # 127.0.0.1, not every interface
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_taken_master_port_names_the_address():
    with taken_port() as port, pytest.raises(OSError, match=f"127.0.0.1:{port} \\(MASTER_PORT\\)"):
        loopback_store({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                        "WORLD_SIZE": "1"}, T)


@pytest.mark.parametrize("env", [{"MASTER_ADDR": "node1"},
                                 {"MASTER_ADDR": "localhost", "TORCHELASTIC_USE_AGENT_STORE": "True"}])
def test_torchs_start_stays_across_machines_and_for_the_agents_store(env: dict[str, str]):
    assert loopback_store({**env, "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}, T) == {}
