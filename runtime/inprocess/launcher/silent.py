"""Silent losses under ``--recovery inprocess``: a frozen worker, a node that stopped answering.

A worker that dies is announced by its own launcher at once (:mod:`.inprocess_agent`). Two
losses make no such noise, and without this module they end either in a wait for the training
all-reduce's bound (the stall deadline, 20 s or more) or in the stall watch killing every
worker of the waiting nodes (the restart path):

- **a frozen worker** (SIGSTOP; a process the kernel stopped): its launcher sees the state
  ``T`` in ``/proc`` (:class:`StoppedWorkers`). One that stays stopped :data:`STOPPED_S` is
  SIGKILLed, so its death is announced and a joiner replaces it like any dead worker. A slow
  worker is never stopped, and a tracer's stop (``t``: a debugger, py-spy) is left alone;
- **a lost node** (a cut link, a frozen or crashed node whose launcher cannot speak): the
  launchers' peer beacon (:mod:`runtime.liveness.beacon`) names a node whose counter stood
  still :data:`LOST_S` while the store answers. :class:`LostNodes` then marks that node's
  workers of the running generation (its launcher publishes them: ``node/N``) dead (``dead/UID``) and announces the generation's fault
  (``fault/G``): every survivor leaves its step within 0.1 s (its fault watch breaks its
  groups' connections) and the re-form does not wait for the lost ones. The beacon is the
  launcher's own thread, one store request a second, whatever the workers do: a node whose
  training is slow, or that evaluates for minutes, keeps beating and is never named. A
  launcher names no one until it has watched :data:`LOST_S` without a gap of its own (it was
  frozen, or cut off from the store): back from a gap, everyone would look silent to it.

A crashed node whose processes ended (their kernel closed their sockets) is announced sooner,
at once, by its workers' lifelines (:mod:`.inprocess_lifelines`); the beacon remains the path
for a node that goes silent without closing anything.

When the store itself is out of reach (the lost node hosts it) nothing is announced: the
beacon names nobody lost while it cannot reach the store, and the job takes the restart path.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from runtime.inprocess import protocol as proto
from runtime.inprocess.launcher import announce

log = logging.getLogger("hpc.launch")
STOPPED_S = 2.0   # a worker stopped this long is frozen (SIGKILLed, replaced)
LOST_S = 5.0      # a peer node's beacon still this long (the store answering us): lost


class StoppedWorkers:
    """Which local workers have been stopped (``T``) for :data:`STOPPED_S` (pure over the
    states it is given; the caller reads ``/proc`` and kills).

    Args:
        stopped_s: How long a stop must last.
    """

    def __init__(self, stopped_s: float = STOPPED_S) -> None:
        self.stopped_s = stopped_s
        self.since: dict[int, float] = {}
        self.killed: dict[int, str] = {}   # pid -> why (for the announcement of its death)

    def frozen(self, states: Mapping[int, str | None], now: float) -> list[int]:
        """The pids stopped (state ``T``) for ``stopped_s`` by ``now``; a pid seen running
        again starts over."""
        for pid, st in states.items():
            if st == "T":
                self.since.setdefault(pid, now)
            else:
                self.since.pop(pid, None)
        return [p for p, t in self.since.items() if now - t >= self.stopped_s and p not in self.killed]

    def kill(self, pid: int, now: float) -> None:
        """SIGKILLs a frozen worker (a stopped process takes SIGKILL) and remembers why."""
        why = f"stopped (SIGSTOP) for {now - self.since.get(pid, now):.1f}s: SIGKILLed by its launcher"
        self.killed[pid] = why
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        log.warning("in-process recovery: worker %d %s so that its peers go on", pid, why)


def victims(uids: list[str], published: list[str]) -> list[str]:
    """The members (``uids``) that a lost node's launcher published as its workers (pure)."""
    theirs = set(published)
    return [u for u in uids if u in theirs]


def generation(store: Any) -> tuple[int, list[str]]:
    """The running generation of a round's store (its namespace) and its members' uids (the
    starting generation's: its ranks' records; none yet: an empty list)."""
    gen = int(store.get(proto.GENERATION)) if store.check([proto.GENERATION]) else 0
    if store.check([proto.members(gen)]):
        return gen, list(proto.decode_members(store.get(proto.members(gen))).uids)
    uids, r = [], 0
    while store.check([proto.who(gen, r)]):
        uids.append(store.get(proto.who(gen, r)).decode())
        r += 1
    return gen, uids


class LostNodes:
    """Announces the workers of a lost node dead in the store, once per node (the watchdog's
    ``on_lost`` under ``--recovery inprocess``).

    Args:
        store_address: ``host:port`` of the rendezvous store.
        events: The launcher's ``EventLog`` (``inproc_detect`` with ``lost_node``), or None.
        host: This launcher's host (for the record).
    """

    def __init__(self, store_address: str, events: Any = None, host: str = "") -> None:
        self.store_address, self.events, self.host = store_address, events, host
        self.announced: set[int] = set()
        self._raw: Any = None

    def __call__(self, lost: Mapping[int, tuple[str, float]]) -> None:
        """``lost``: node rank -> (its host, seconds its beacon stood still)."""
        for rank, (host, silent) in lost.items():
            if rank in self.announced:
                continue
            try:
                n, gen = self._announce(rank, host, silent)
            except Exception as e:   # noqa: BLE001 - the store is busy or gone: next look
                log.warning("in-process recovery: cannot announce lost node %s: %s", host, e)
                self._raw = None
                continue
            if n is None:
                continue   # no running generation yet
            self.announced.add(rank)

    def _store(self) -> Any:
        import torch.distributed as dist

        if self._raw is None:
            h, _, p = self.store_address.rpartition(":")
            self._raw = dist.TCPStore(h, int(p), is_master=False, timeout=timedelta(seconds=5),
                                      wait_for_workers=False)
        return self._raw

    def _announce(self, rank: int, host: str, silent: float) -> tuple[int | None, int]:
        import torch.distributed as dist

        raw = self._store()
        if not raw.check([proto.ROOT + proto.CURRENT]):
            return None, 0
        store = dist.PrefixStore(raw.get(proto.ROOT + proto.CURRENT).decode(), raw)
        gen, uids = generation(store)
        key = proto.node_workers(rank)
        gone = victims(uids, json.loads(store.get(key)) if store.check([key]) else [])
        t = time.time()
        why = f"node {host} (node rank {rank}) lost: its launcher's beacon stood still {silent:.1f}s " \
              f"(seen from {self.host})"
        announce.dead(store, gone, why, gen=gen)
        log.warning("in-process recovery: %s; %d worker(s) there announced dead (generation %d), "
                    "the others go on", why, len(gone), gen)
        if self.events is not None:
            self.events.emit("inproc_detect", t=t, lost_node=host, lost_rank=rank, silent_s=round(silent, 2),
                             workers=gone, gen=gen)
        return len(gone), gen
