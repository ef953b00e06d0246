"""A worker's move to a new rendezvous epoch's store, when the old host (and its store) is lost.

The store of in-process recovery lives on the rendezvous host. When that node is lost, the
launchers elect a new host (:mod:`runtime.succession`) and keep their workers alive
(:mod:`runtime.inprocess.launcher.adopt`); the new epoch's store has no history. Each launcher
names that store in a node-local file (``HPC_INPROC_CHANNEL``, a
:class:`~runtime.inprocess.protocol.Rebind`), never through the shared job directory (another
node's attribute cache could show it late).

:class:`EpochWatch` looks at that file 4 times a second (one ``stat``). When a newer epoch
appears it first breaks this process's connections to the old store (a store request to a
crashed host, whose packets go nowhere, would otherwise wait out its whole timeout) and the
current generation's gloo connections (a step waiting on a lost peer ends now), then offers
the new store to the recovery (:meth:`EpochWatch.take`), which re-forms there
(:mod:`runtime.inprocess.worker.stages`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runtime.inprocess import protocol as proto
from runtime import peer_sockets

log = logging.getLogger("hpc.inprocess")
LOOK_EVERY_S = 0.25
WAIT_S = 180.0   # how long a worker whose store is gone waits for its launcher's new epoch


def read(path: Path) -> proto.Rebind | None:
    """The channel's record, or None (not written yet, or half written: the next look)."""
    try:
        return proto.Rebind.decode(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


class EpochWatch(threading.Thread):
    """Watches the launcher's channel for a new rendezvous epoch (see the module docstring).

    Args:
        path: The channel file (``HPC_INPROC_CHANNEL``).
        epoch: The epoch this worker's store belongs to (a record not newer is ignored).
        address: ``() -> host:port`` of the store in use now (broken when a newer one comes).
        on_new: Breaks the current generation's connections (called before :meth:`take`
            offers the new store, so it never breaks the new generation's).
    """

    def __init__(self, path: Path, epoch: int, *, address: Callable[[], str],
                 on_new: Callable[[], None]) -> None:
        super().__init__(name="hpc-inproc-epoch", daemon=True)
        self.path, self.epoch, self.address, self.on_new = path, epoch, address, on_new
        self._new: proto.Rebind | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._mtime = 0.0

    def run(self) -> None:
        while not self._stop.wait(LOOK_EVERY_S):
            try:
                mtime = self.path.stat().st_mtime
            except OSError:
                continue
            if mtime == self._mtime:
                continue
            rec = read(self.path)
            if rec is None or rec.epoch <= self.epoch:
                self._mtime = mtime if rec is not None else self._mtime
                continue
            self._mtime = mtime
            old = self.address()
            broken = peer_sockets.break_connections_to(old)
            try:
                self.on_new()
            except Exception as e:   # noqa: BLE001 - the step still ends at its bound
                log.warning("in-process recovery: breaking the old generation: %s", e)
            log.warning("in-process recovery: rendezvous epoch %d: store %s (the old one, %s, is "
                        "lost; %d connection(s) to it shut down)", rec.epoch, rec.store, old, broken)
            self.epoch = rec.epoch
            self._new = rec
            self._ready.set()

    def take(self, timeout_s: float = 0.0) -> proto.Rebind | None:
        """The new epoch's store once (None: none came within ``timeout_s``)."""
        if not self._ready.wait(timeout_s):
            return None
        self._ready.clear()
        rec, self._new = self._new, None
        return rec

    def pending(self) -> bool:
        return self._ready.is_set()

    def stop(self) -> None:
        self._stop.set()


def wait_for(watch: EpochWatch | None, error: BaseException, timeout_s: float = WAIT_S) -> proto.Rebind:
    """After a store request failed: the new epoch's store, waited for ``timeout_s``.

    Raises:
        BaseException: ``error`` when no watch runs or no new epoch came.
    """
    if watch is None:
        raise error
    log.warning("in-process recovery: the store failed (%s); waiting up to %.0f s for the "
                "launcher to name a new rendezvous epoch's store", error, timeout_s)
    t0 = time.monotonic()
    rec = watch.take(timeout_s)
    if rec is None:
        raise error
    log.info("in-process recovery: the new epoch's store came after %.1f s", time.monotonic() - t0)
    return rec
