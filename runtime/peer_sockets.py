"""Shutting down this process's TCP connections to one ``host:port``: a lost store's.

When the rendezvous host is lost (a cut link: its packets go nowhere), a request to its store
blocks until the client's timeout (a minute, or the rendezvous timeout for torch's agent).
Both sides of in-process recovery leave such requests at once when they learn of the loss by
other means: a worker, when its launcher names the new epoch's store
(:mod:`runtime.inprocess.worker.rebind`); a launcher, when its fence keeps its workers through
the loss (:mod:`runtime.launch.main`): torch's agent, blocked on the old store, fails now and
lets the launcher go on. Each socket is ``shutdown()``; its descriptor stays its owner's
(torch's client reads end-of-file and raises). Linux only (``/proc``); elsewhere nothing is
found and nothing is broken.
"""

from __future__ import annotations

import os
import socket


def _resolve(address: str) -> tuple[set[str], int]:
    host, _, port = address.rpartition(":")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        ips = {host}
    return ips, int(port)


def break_connections_to(address: str) -> int:
    """Shuts down every TCP connection of this process to ``address`` (``host:port``): a
    store request blocked on it (another thread's) fails now. The descriptors stay open
    (their owners close them). Returns how many were shut down."""
    ips, port = _resolve(address)
    n = 0
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd") if x.isdigit()]
    except OSError:
        return 0
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                peer = s.getpeername()
                ip = peer[0].removeprefix("::ffff:")   # an IPv4 peer on an IPv6 socket (torch's)
                if peer[1] == port and ip in ips:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
        except OSError:
            pass   # not connected (a listener), or closed meanwhile
        finally:
            s.close()   # the duplicate only
    return n
