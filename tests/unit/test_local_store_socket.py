"""``hpc run``'s rendezvous store socket (hpc/backends/local.py, runtime/launch/rendezvous.py).

``hpc run`` binds the store's port itself, on loopback, and hands the listening socket to node
0's launcher: no other process can take the port between its choice and the store's start. The
real path (launchers, TCPStore on the inherited socket, /proc/net/tcp) runs in
tests/distributed/test_listed_rendezvous_local.py; here the pure choice and the error a user reads.
"""

from __future__ import annotations

import socket

import pytest

from hpc.backends.local import rdzv_listener
from hpc.contract.errors import SpecError
from runtime.launch import rendezvous
from runtime.launch.rendezvous import BACKEND, HELD_C10D, LISTEN_FD, Choice, on_socket
from tests.listeners import taken_port


def test_the_host_store_on_an_inherited_socket_keeps_the_round_and_names_the_socket():
    c10d = on_socket(Choice("c10d", {"is_host": True}, "c10d"), 7)
    assert (c10d.backend, c10d.configs) == (HELD_C10D, {"is_host": True, LISTEN_FD: 7})
    listed = on_socket(Choice(BACKEND, {"is_host": True}, "first round from the node list"), 7)
    assert listed.backend == BACKEND and listed.configs[LISTEN_FD] == 7
    assert listed.reason.startswith("first round from the node list") and "fd 7" in listed.reason


def test_both_handlers_are_registered_under_their_names():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous.register()
    assert rendezvous_handler_registry._registry[HELD_C10D] is rendezvous.create_held
    assert rendezvous_handler_registry._registry[BACKEND] is rendezvous.create


def test_the_listener_is_on_loopback_and_listening():
    s = rdzv_listener(0)
    try:
        host, port = s.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=5):   # in the backlog before any store
            pass
    finally:
        s.close()


def test_a_taken_rdzv_port_is_refused_naming_the_flag_and_the_way_out():
    with taken_port() as port, pytest.raises(SpecError) as e:
        rdzv_listener(port)
    assert e.value.flag == "--rdzv-port" and e.value.value == port
    assert "--rdzv-port 0" in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
