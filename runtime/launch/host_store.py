"""Does the rendezvous host's store answer? The evidence a node other than the host acts on.

A launcher that is not the rendezvous host learns of trouble in its rendezvous from torch's
agent as a ``RendezvousError``. Taking every such error for the host's loss (before this
module) started a succession, or recorded a node failure and a requeue, for errors that have
nothing to do with a lost host: a round that timed out because too few nodes came (the host
is alive and says so itself), a rendezvous the others closed because the job is ending, a
configuration the store refused. Whether the host is lost is a fact this node can check:
ask its store. :func:`answers` asks (a connect, then one request, bounded in time); the
reading of the error is :func:`runtime.launch.rdzv_failure.explain_non_host` (pure).

The same question, asked before joining, keeps a node that arrives after the host gave up
(its join timeout, ``--rdzv-timeout``) from knocking at a store that is gone: :func:`await_host`
waits for the store to answer, for at most the join timeout, and gives up at once when the
host has recorded the allocation's outcome (it ended the allocation without this node).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from runtime.launch.rdzv_failure import TIMEOUT_FLAG

log = logging.getLogger("hpc.launch")

STORE_LOST_S = 10.0   # a store silent this long (seen from a node that is not its host): its host is lost
PROBE_S = 5.0      # a store that does not answer one request in this long is silent (the fence: 10 s)
LOOK_EVERY_S = 1.0  # how often a node waiting for its host's store looks again
CONNECT_S = 2.0    # a live host's kernel accepts a connection in ms (one SYN resend fits): a
                   # crashed node's address, whose packets go nowhere, costs no more than this


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """A plain TCP connect (no torch: a refused port would make torch's client log its retries)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def answers(endpoint: str, timeout_s: float = PROBE_S) -> bool:
    """Whether the TCPStore at ``endpoint`` (``host:port``) answers a request within ``timeout_s``.

    A refused or unreachable port is no; a port that accepts but whose server does not answer
    (its process stopped, its node frozen behind a live kernel) is no after ``timeout_s``. The
    request runs on a daemon thread, so this returns in about ``timeout_s`` whatever torch's
    client does.
    """
    import torch.distributed as dist   # before the clock: the bound is the store's, not the import's

    host, port = _split(endpoint)
    start = time.monotonic()
    if not _listening(host, port, min(timeout_s, CONNECT_S)):
        return False
    got: list[bool] = []

    def ask() -> None:
        try:
            left = max(1.0, timeout_s - (time.monotonic() - start))
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left),
                                  wait_for_workers=False)
            store.check(["hpc.probe"])   # one request: the server's loop answers it
            got.append(True)
        except Exception as e:  # noqa: BLE001 - any failure is "did not answer"
            log.info("rendezvous store %s did not answer: %s", endpoint, e)

    thread = threading.Thread(target=ask, name="hpc-store-probe", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s - (time.monotonic() - start)) + 1.0)
    return bool(got)


def await_host(endpoint: str, *, timeout_s: float, ended: Callable[[], str | None],
               look_every_s: float = LOOK_EVERY_S, probe: Callable[[str], bool] = answers,
               clock: Callable[[], float] = time.monotonic) -> str | None:
    """Waits until the host's store at ``endpoint`` answers; None then (join), else why not.

    Args:
        endpoint: ``host:port`` of the rendezvous store.
        timeout_s: The join timeout (``--rdzv-timeout``): the host waits this long for the
            nodes, so a store silent for longer than that from here will not take this node.
        ended: Why the host has already ended the allocation (its recorded outcome), or None.
        look_every_s: How often to look again.
        probe: :func:`answers` (tests pass another).
        clock: Monotonic seconds.
    """
    start = clock()
    said = False
    while True:
        if probe(endpoint):
            return None
        why = ended()
        if why is not None:
            return (f"the rendezvous host {endpoint} ended this allocation before this node could "
                    f"join (it waits for the nodes at most {timeout_s:g} s, {TIMEOUT_FLAG} sets it): "
                    f"{why}")
        waited = clock() - start
        if waited >= timeout_s:
            return (f"the rendezvous host {endpoint} did not answer within {timeout_s:g} s "
                    f"({TIMEOUT_FLAG} sets it): it stopped waiting for this node, or it is lost")
        if not said and waited >= 2 * look_every_s:
            said = True
            log.warning("the rendezvous host %s does not answer yet; waiting up to %g s (%s)",
                        endpoint, timeout_s, TIMEOUT_FLAG)
        time.sleep(look_every_s)
