"""A worker's lifeline: one idle TCP connection whose closing tells the store host it died.

The listener is the store host launcher's (:mod:`runtime.inprocess.launcher.lifelines`, which
says why and what it concludes). A worker opens its line once it is a member of a generation
(its uid is in the store), says who it is, and keeps the socket untouched for its life; the
Session's end says ``bye``. Any other end of the process (SIGKILL, a crash, its node lost)
closes the socket in the kernel, and the listener announces the death at once, instead of the
survivors' re-form waiting out its join window. Opening the line costs one store read and one
connection at start; no thread, nothing on the step's path.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from runtime.inprocess import protocol as proto

log = logging.getLogger("hpc.inprocess")


def open_line(raw: Any, store_address: str, *, me: str, space: str, key: bytes) -> socket.socket | None:
    """Connects this worker's lifeline, its hello signed with the job's ``key``; None when the store host has no listener (an older
    launcher, or not yet published: the join window then holds as before)."""
    try:
        if not raw.check([proto.ROOT + proto.LIFELINES]):
            log.info("in-process recovery: no lifelines listener published; a lost node is "
                     "waited for by the join window")
            return None
        port = int(raw.get(proto.ROOT + proto.LIFELINES))
        host = store_address.rpartition(":")[0]
        sock = socket.create_connection((host, port), timeout=10.0)
        parent = proto.uid(socket.gethostname(), os.getppid())
        sock.sendall(proto.Hello("worker", me, parent=parent, space=space).line(key))
        return sock
    except Exception as e:   # noqa: BLE001 - recovery still works, only slower for a lost node
        log.warning("in-process recovery: cannot open this worker's lifeline: %s", e)
        return None


def close_line(sock: socket.socket | None) -> None:
    """Says ``bye`` (this worker ends on purpose) and closes the line."""
    if sock is None:
        return
    try:
        sock.sendall(proto.LIFELINE_BYE)
        sock.close()
    except OSError:
        pass
