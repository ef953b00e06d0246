"""A crashed node's workers announced at once under ``--recovery inprocess``: lifelines.

A worker that dies is announced by its own launcher (:mod:`.inprocess_agent`); a node that
crashes takes its launcher with it, so nobody announced its workers and the survivors' re-form
waited out its join window (``HPC_INPROC_WINDOW_S``, 3 s; measured on the 3-node cluster: the
re-form took 3.00 s of a 3.5-s recovery) or the peer beacon (5 s,
:mod:`.inprocess_silent`). Waiting less on the clock alone would leave out a member that is
merely slow to arrive. The evidence used instead: a process's TCP connection.

The store host's launcher (the one whose rendezvous store the workers use) listens on a port
it publishes in the store (``lifelines`` at ``ROOT``, :mod:`runtime.inprocess.protocol`). Every
worker, once it is a member of a generation, and every launcher opens one connection to it
and says who it is (:class:`~runtime.inprocess.protocol.Hello`); nothing else goes over it until
the process ends on purpose and says ``bye``. When a process ends any other way -- SIGKILL,
a crash, the OOM killer, every process of its node killed -- its kernel closes the socket and
the listener reads end-of-file at once. A worker whose line closed so is dead, and is
announced (``dead/UID`` and ``fault/G``, as its launcher would) by the rule
:func:`~runtime.inprocess.rules.lifeline_dead`: at once under ``--replacement shrink``; under
``wait`` only once its launcher's line closed too (its node crashed: no replacement will be
promised), since a live launcher announces the death itself after promising a joiner.

What is never taken for a death: a line that stays open. A slow worker, one in a long
evaluation, a stopped one (SIGSTOP) or one behind a cut link keeps its connection; those
keep today's paths (the join window, the frozen-worker kill, the peer beacon). A power-off
(no FIN from a dead kernel) is also silent here and left to the beacon. When the store host
itself is lost, so is this listener, and the job takes the restart path as before.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from runtime.inprocess.launcher import announce, silent as inprocess_silent

log = logging.getLogger("hpc.launch")
PUBLISH_EVERY_S = 0.2   # how often the listener tries to reach the store to publish its port
MAX_HELLO = 4096        # a hello longer than this is not one: the connection is dropped
HELLO_WITHIN_S = 10.0   # a connection that has not said a signed hello in this long is dropped
MAX_PENDING = 128       # connections without a hello yet; a new one beyond it drops the oldest


def _store(address: str, timeout_s: float = 5.0) -> Any:
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class _Line:
    """One connection's state on the listener's side."""

    def __init__(self, sock: socket.socket, peer: str = "") -> None:
        self.sock, self.buf, self.peer = sock, b"", peer
        self.hello: proto.Hello | None = None
        self.bye = False
        self.since = time.monotonic()


def listen_host(store_address: str) -> str:
    """The address the listener binds (pure): loopback when the job's store is on loopback (a
    job of one machine, ``hpc run``: nothing outside it may reach the listener), else every
    interface (the workers of other nodes connect to the store host's name, which may resolve
    there to an address this node's own resolver does not give)."""
    import ipaddress

    host = store_address.rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return "127.0.0.1" if loopback else ""


class Lifelines(threading.Thread):
    """The store host launcher's listener (see the module docstring).

    Args:
        store_address: ``host:port`` of the rendezvous store.
        key: The job's key (:mod:`hpc.contract.jobsecret`): a hello not signed with it is
            refused, and its connection dropped unread. Connections that say nothing are
            dropped after ``HELLO_WITHIN_S``, the oldest first beyond ``MAX_PENDING``: a flood
            of idle connections neither fills the listener nor delays a member's line.
        replacement: The job's ``--replacement``.
        events: The launcher's ``EventLog`` (``inproc_detect`` with ``by: lifeline``), or None.
        host: This launcher's host (for the record).
    """

    def __init__(self, store_address: str, *, key: bytes, replacement: str = recovery_settings.WAIT,
                 events: Any = None, host: str = "") -> None:
        super().__init__(name="hpc-lifelines", daemon=True)
        self.store_address, self.replacement, self.events = store_address, replacement, events
        self.key = key
        self.pending: dict[socket.socket, _Line] = {}   # accepted, no hello yet (oldest first)
        self.members: dict[socket.socket, _Line] = {}   # open lines with a signed hello
        self.refused = 0   # connections dropped without a signed hello
        self.host = host or socket.gethostname()
        self.server = socket.create_server((listen_host(store_address), 0), backlog=256)
        self.server.setblocking(False)
        self.port = self.server.getsockname()[1]
        self.closed: dict[str, proto.Hello] = {}    # workers whose line closed, not yet named
        self.launchers_closed: set[str] = set()
        self.announced: set[str] = set()
        self.stopped = threading.Event()
        self._raw: Any = None

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ, None)
        published, next_try = False, 0.0
        while not self.stopped.is_set():
            if not published and time.monotonic() >= next_try:
                published = self._publish()
                next_try = time.monotonic() + PUBLISH_EVERY_S
            for key, _ in sel.select(timeout=PUBLISH_EVERY_S):
                if key.data is None:
                    self._accept(sel)
                else:
                    self._read(sel, key.data)
            late = time.monotonic() - HELLO_WITHIN_S
            for line in [x for x in self.pending.values() if x.since < late]:
                self._refuse(sel, line, "said no hello")
        sel.close()

    def stop(self) -> None:
        self.stopped.set()

    def _publish(self) -> bool:
        try:
            if self._raw is None:
                self._raw = _store(self.store_address, timeout_s=2.0)
            self._raw.set(proto.ROOT + proto.LIFELINES, str(self.port))
        except Exception:   # noqa: BLE001 - the store is not up yet: the next try
            self._raw = None
            return False
        log.info("in-process recovery: lifelines on port %d", self.port)
        return True

    def _accept(self, sel: selectors.BaseSelector) -> None:
        if len(self.pending) >= MAX_PENDING:
            self._refuse(sel, next(iter(self.pending.values())), "said no hello (too many waiting)")
        try:
            sock, peer = self.server.accept()
        except OSError:   # out of descriptors: make room for the next one
            if self.pending:
                self._refuse(sel, next(iter(self.pending.values())), "said no hello (no descriptors)")
            return
        sock.setblocking(False)
        line = _Line(sock, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
        self.pending[sock] = line
        sel.register(sock, selectors.EVENT_READ, line)

    def _refuse(self, sel: selectors.BaseSelector, line: _Line, why: str) -> None:
        """Drops a connection that is not one of the job's lines (counted first: whoever sees
        it closed sees it counted)."""
        self.refused += 1
        self.pending.pop(line.sock, None)
        try:
            sel.unregister(line.sock)
        except (KeyError, ValueError):
            pass
        line.sock.close()
        if self.refused in (1, 10) or self.refused % 1000 == 0:
            log.warning("in-process recovery: refused %d connection(s) to the lifelines, the last "
                        "from %s: %s", self.refused, line.peer or "?", why)

    def _read(self, sel: selectors.BaseSelector, line: _Line) -> None:
        try:
            data = line.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:   # reset by the peer: as good as end-of-file
            data = b""
        if data:
            line.buf += data
            if line.hello is None and b"\n" in line.buf:
                first, line.buf = line.buf.split(b"\n", 1)
                try:
                    line.hello = proto.Hello.parse(first, self.key)
                except (ValueError, KeyError, TypeError) as e:   # not one of ours
                    self._refuse(sel, line, str(e))
                    return
                self.pending.pop(line.sock, None)
                self.members[line.sock] = line
            if line.hello is not None and proto.LIFELINE_BYE.strip() in line.buf:
                line.bye = True
            if len(line.buf) > MAX_HELLO:
                if line.hello is None:
                    self._refuse(sel, line, f"a hello of over {MAX_HELLO} bytes")
                    return
                data = b""
            if data:
                return
        self.pending.pop(line.sock, None)
        self.members.pop(line.sock, None)
        sel.unregister(line.sock)
        line.sock.close()
        if line.hello is not None and not line.bye:
            self._closed(line.hello)

    def _closed(self, hello: proto.Hello) -> None:
        """A line closed without its last words: its process ended."""
        if hello.kind == "launcher":
            self.launchers_closed.add(hello.uid)
        elif hello.kind == "worker":
            self.closed[hello.uid] = hello
        named = rules.lifeline_dead({u: h.parent for u, h in self.closed.items()},
                                    self.launchers_closed, replacement=self.replacement)
        for u in named:
            hello = self.closed.pop(u)
            try:
                self._announce(hello)
            except Exception as e:   # noqa: BLE001 - the store is busy or gone: the beacon still holds
                log.warning("in-process recovery: cannot announce %s (its lifeline closed): %s", u, e)
                self._raw = None

    def _announce(self, hello: proto.Hello) -> None:
        import torch.distributed as dist

        if self._raw is None:
            self._raw = _store(self.store_address)
        store = dist.PrefixStore(hello.space, self._raw)
        if store.check([proto.DONE]):
            return   # the job finished: nobody re-forms
        gen, uids = inprocess_silent.generation(store)
        if hello.uid not in uids or store.check([proto.dead(hello.uid)]):
            return   # not a member now (left out, replaced), or announced already
        t = time.time()
        parent_gone = hello.parent in self.launchers_closed
        why = (f"worker {hello.uid} ended: its connection to {self.host}'s lifelines closed"
               + (f", and its launcher's ({hello.parent}) too: its node is lost" if parent_gone else ""))
        announce.dead(store, [hello.uid], why, gen=gen)
        self.announced.add(hello.uid)
        log.warning("in-process recovery: %s; announced (generation %d), the others go on", why, gen)
        if self.events is not None:
            self.events.emit("inproc_detect", t=t, by="lifeline", workers=[hello.uid],
                             lost_node=hello.uid.rsplit("/", 1)[0] if parent_gone else "",
                             launcher=hello.parent, launcher_gone=parent_gone, gen=gen)


class LauncherLine(threading.Thread):
    """This launcher's own lifeline (its workers' deaths count once it is gone).

    Connects when the store host has published its listener's port; :meth:`close` says
    ``bye`` (this launcher ends on purpose: its workers' lines decide alone).

    Args:
        store_address: ``host:port`` of the rendezvous store.
        key: The job's key: the hello is signed with it.
    """

    def __init__(self, store_address: str, *, key: bytes) -> None:
        super().__init__(name="hpc-lifeline", daemon=True)
        self.store_address, self.key = store_address, key
        self.me = proto.uid(socket.gethostname(), os.getpid())
        self.sock: socket.socket | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        host = self.store_address.rpartition(":")[0]
        raw = None
        while not self.stopped.wait(PUBLISH_EVERY_S):
            try:
                raw = raw or _store(self.store_address, timeout_s=2.0)
                if not raw.check([proto.ROOT + proto.LIFELINES]):
                    continue
                port = int(raw.get(proto.ROOT + proto.LIFELINES))
                sock = socket.create_connection((host, port), timeout=5.0)
                sock.sendall(proto.Hello("launcher", self.me).line(self.key))
            except Exception:   # noqa: BLE001 - the store or the listener is not up yet
                raw = None
                continue
            self.sock = sock
            if self.stopped.is_set():   # closed while connecting: the last words now
                self.close()
            return

    def close(self) -> None:
        self.stopped.set()
        if self.sock is not None:
            try:
                self.sock.sendall(proto.LIFELINE_BYE)
                self.sock.close()
            except OSError:
                pass
            self.sock = None
