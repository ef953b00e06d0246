"""Breaking an abandoned gloo group's connections, so nothing of it is left pending.

Gloo cannot be aborted: in torch 2.13 ``ProcessGroupGloo.abort()`` and ``shutdown()`` return
without ending an operation in flight (pytorch#130345; measured: an unmatched all-reduce is
still pending 10 s after either). After a re-form the old generation's training group may
still have such an operation: the step's all-reduce that the guard released (the peer it
waited for left the step). Gloo's worker thread finishes it later, when its bound runs out or
when a peer closes its sockets, typically when that peer's process exits. It then runs the
guard's Python callback on that thread; during the interpreter's finalization this ends the
process: taking the GIL there exits the thread by a forced unwind through gloo's ``catch``
(``std::terminate``, "terminate called after throwing an instance of 'gloo::IoException'",
exit -6), or creates a thread state on a freed lock (SIGSEGV, exit -11). Seen in 8 of 18 runs
of the in-process fault test before this module.

So the abandoned groups' connections are broken at once, at the recovery, by this process:
each TCP connection of the group is ``shutdown()`` (the file descriptor stays gloo's). Gloo's
loop reads end-of-file, fails every operation of that connection, and the pending operation
completes now, with its callback, while the interpreter runs; the peers' ends of the same
connections fail too, so a peer still waiting on this rank in the old group leaves at once.

Which connections are the group's: each gloo device has its own ``epoll`` instance, created
with the group, in which every connection of the group is registered (with the device's
listening socket and a wake-up pipe). :func:`capture` notes the ``epoll`` instances that appear
while a group is created (in this thread, synchronously); :func:`break_connections` shuts down
the connected TCP sockets registered in them, read from ``/proc/self/fdinfo``. Only an
``epoll`` that holds a listening TCP socket (gloo's device) is taken.

Every group of the failed generation is broken, not only the training group (:func:`devices`):
a peer may sit in another group's collective when a fault comes (the checkpointer's gather of a
save, the preemption agreement), and a rank that left for the re-form never answers it. Seen on
the 3-node cluster: a node crashed at step 11, one survivor had entered the step-12 save's
gather while the others re-formed, and it waited there for the group's timeout (1860 s). Linux only; elsewhere
nothing is captured and nothing is broken (the old behaviour).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger("hpc.inprocess")
_FD_DIR = "/proc/self/fd"
_EPOLL = "anon_inode:[eventpoll]"


@dataclass
class Captured:
    """The ``epoll`` file descriptors of the gloo devices created inside :func:`capture`."""

    epolls: list[int] = field(default_factory=list)


def _link(fd: int) -> str:
    try:
        return os.readlink(f"{_FD_DIR}/{fd}")
    except OSError:
        return ""


def eventpolls() -> set[int]:
    """This process's ``epoll`` file descriptors (empty where ``/proc`` is absent)."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return set()
    return {int(n) for n in names if n.isdigit() and _link(int(n)) == _EPOLL}


def registered(epoll_fd: int) -> list[int]:
    """The file descriptors registered in ``epoll_fd`` (``tfd:`` lines of its fdinfo)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll_fd}") as f:
            return [int(line.split()[1]) for line in f if line.startswith("tfd:")]
    except (OSError, ValueError, IndexError):
        return []


def _sockets(epoll_fd: int) -> tuple[list[int], bool]:
    """The connected TCP sockets registered in ``epoll_fd``, and whether it holds a listener."""
    connected, listener = [], False
    for fd in registered(epoll_fd):
        if not _link(fd).startswith("socket:"):
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listener = True
            else:
                connected.append(fd)
        finally:
            s.close()   # closes the duplicate only
    return connected, listener


@contextmanager
def capture() -> Iterator[Captured]:
    """Notes the gloo devices (``epoll`` instances with a listener) created inside the block."""
    got = Captured()
    before = eventpolls()
    yield got
    for fd in sorted(eventpolls() - before):
        if _sockets(fd)[1]:
            got.epolls.append(fd)


def devices(since: set[int]) -> Captured:
    """Every gloo device (an ``epoll`` with a listening TCP socket) of this process whose
    ``epoll`` is not in ``since``: the groups made after that snapshot, whichever code made
    them (the Session's, the checkpointer's, DDP's)."""
    got = Captured()
    for fd in sorted(eventpolls() - since):
        if _sockets(fd)[1]:
            got.epolls.append(fd)
    return got


def tcp_sockets() -> set[int]:
    """This process's TCP socket descriptors (empty where ``/proc`` is absent)."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return set()
    return {int(n) for n in names if n.isdigit() and _link(int(n)).startswith("socket:")}


def shutdown(fds: list[int]) -> int:
    """Shuts down the connected TCP sockets among ``fds`` (the descriptors stay open: their
    owner closes them); a wait on one of them fails at once. Returns how many were shut down."""
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError as e:   # not connected any more: nothing to break
            log.debug("shutdown of fd %d: %s", fd, e)
        finally:
            s.close()   # closes the duplicate only
    return n


def break_connections(captured: Captured) -> int:
    """Shuts down every connected TCP socket of the captured gloo devices.

    The descriptors stay open (gloo closes them); a socket already closed by gloo has left the
    ``epoll`` and is not touched. Returns how many sockets were shut down.
    """
    n = 0
    for ep in captured.epolls:
        if _link(ep) != _EPOLL:   # the device is gone (the group was destroyed)
            continue
        for fd in _sockets(ep)[0]:
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError as e:   # not connected any more: nothing to break
                log.debug("shutdown of fd %d: %s", fd, e)
            finally:
                s.close()
    return n
