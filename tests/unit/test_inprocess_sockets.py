"""Breaking an abandoned gloo group's connections (runtime.inprocess.worker.sockets), on real gloo.

Two real gloo process groups (ranks 0 and 1 of one world, in two threads of this process). Rank
1 posts an all-reduce rank 0 never joins, with a 60-s bound, as the guard's released all-reduce
is left after a re-form. Gloo's own abort does not end it; breaking the group's connections
must end it at once, with its callback run now (an operation left to finish during the
interpreter's exit ended the process: exit -6/-11, issue 26), and the peer's next operation on
that group must fail at once instead of waiting.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from runtime.inprocess.worker import sockets  # noqa: E402


def two_groups() -> tuple[list, sockets.Captured]:
    store = dist.HashStore()
    pgs: list = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, timedelta(seconds=60))

    with sockets.capture() as cap:
        threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(pgs), "the gloo groups did not form"
    return pgs, cap


def allreduce(pg, timeout_s: float):
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=timeout_s)
    return pg.allreduce([torch.ones(4)], opts).get_future()


def test_breaking_the_connections_ends_an_operation_gloo_abort_leaves_pending():
    pgs, cap = two_groups()
    assert len(cap.epolls) == 2, cap   # one gloo device per group
    ran = threading.Event()
    pending = allreduce(pgs[1], 60)
    pending.add_done_callback(lambda f: ran.set())
    pgs[1].abort()   # torch 2.13: returns, the operation goes on
    time.sleep(0.5)
    assert not pending.done(), "gloo's abort ended the operation: this module may be unneeded"
    t0 = time.monotonic()
    assert sockets.break_connections(cap) >= 1
    assert ran.wait(10), "the pending all-reduce did not end when its connections were broken"
    assert time.monotonic() - t0 < 10
    with pytest.raises(Exception):
        pending.value()
    t1 = time.monotonic()
    peer = allreduce(pgs[0], 60)
    with pytest.raises(Exception):
        peer.wait()
    assert time.monotonic() - t1 < 10, "the peer's operation waited for its bound"


def test_only_gloo_devices_created_inside_the_block_are_taken():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    outside = select.epoll()
    outside.register(listener.fileno(), select.EPOLLIN)
    with sockets.capture() as cap:
        no_listener = select.epoll()   # an epoll of someone else's, without a listening socket
    assert outside.fileno() not in cap.epolls and no_listener.fileno() not in cap.epolls
    assert cap.epolls == []
    outside.close(), no_listener.close(), listener.close()
