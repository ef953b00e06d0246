"""Launchers' keepalive through the rendezvous store: which peer node stopped answering.

Files on a shared filesystem cannot tell a cut link (the node's processes live on and may
still reach the filesystem through another network) from a healthy peer. The c10d store on
the rendezvous node can: every launcher's :class:`PeerBeacon` thread adds 1 to its own
counter in that store about once a second and reads the others'. A node whose counter stops
advancing while this one still reaches the store is cut off from the job (or its launcher
died). When the local ranks make no progress either, the watchdog acts at once, in whatever
phase the ranks are (a cut during a checkpoint save must not wait for the save's budget).

:class:`PeerTracker` is the pure bookkeeping (fake clocks in tests); the beacon is the thin
thread around torch's ``TCPStore`` client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("hpc.liveness")
BEAT_S = 1.0
LOST_AFTER_S = 10.0     # a peer counter this long without advancing: the peer is lost
STORE_TIMEOUT_S = 3.0


@dataclass
class PeerTracker:
    """When each peer's counter last advanced, as seen from here (pure)."""

    node_rank: int
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)   # rank -> (count, since)
    hosts: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    store_ok_at: float | None = None
    # rank -> its count when this node's current worker group formed; such a peer is watched
    # again only once its counter moves past it (a node lost before the group formed is none
    # of the group's: the rendezvous round that formed it went on without it).
    frozen: dict[int, int] = field(default_factory=dict)

    def observe(self, rank: int, count: int, now: float) -> None:
        if rank == self.node_rank or count <= 0:
            return
        if rank in self.frozen:
            if count == self.frozen[rank]:
                return
            del self.frozen[rank]
            self.seen.pop(rank, None)
        old = self.seen.get(rank)
        if old is None or count != old[0]:
            self.seen[rank] = (count, now)

    def new_group(self) -> None:
        """This node's workers started again (a new rendezvous round, maybe with a hot spare in
        a lost node's place): a peer counts again only once its counter advances, so a node that
        went silent before the round (a crash, seconds ago) is not taken for the new group's."""
        self.frozen = {rank: count for rank, (count, _) in self.seen.items()}
        self.seen = {}

    def lost(self, now: float, after_s: float = LOST_AFTER_S) -> dict[int, float]:
        """Peers (node rank -> seconds silent) silent for ``after_s`` while the store answers us.

        Nothing is lost when this launcher itself has not reached the store within
        ``after_s``: then the store (the rendezvous node) is the one out of reach.
        """
        if self.store_ok_at is None or now - self.store_ok_at > after_s:
            return {}
        return {rank: now - since for rank, (_, since) in self.seen.items()
                if rank not in self.done and now - since > after_s}

    def name(self, rank: int) -> str:
        return f"{self.hosts.get(rank, '?')} (node rank {rank})"


class PeerBeacon:
    """The thread that keeps this launcher's counter going and reads its peers'.

    Args:
        endpoint: ``host:port`` of the c10d rendezvous store.
        run_id: The allocation's rendezvous id (keys are per allocation).
        node_rank: This node's index.
        host: This node's name (others name it in their verdicts).
        max_nodes: How many node ranks to read.
    """

    def __init__(self, endpoint: str, run_id: str, *, node_rank: int, host: str, max_nodes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host_port = endpoint.rsplit(":", 1)
        self.prefix = f"hpc-liveness/{run_id}"
        self.host, self.max_nodes = host, max_nodes
        self.tracker = PeerTracker(node_rank)
        self.clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc-peer-beacon", daemon=True)
        self._store = None

    def start(self) -> None:
        if self.max_nodes > 1:
            self._thread.start()

    def stop(self) -> None:
        """Says this node is done (peers then do not count it as lost), stops the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * STORE_TIMEOUT_S)
        try:
            if self._store is not None:
                self._store.set(f"{self.prefix}/done/{self.tracker.node_rank}", "1")
        except Exception:   # the store may be gone with its node; nothing to tell then
            pass

    def _connect(self):  # noqa: ANN202 (torch type)
        from datetime import timedelta

        from torch.distributed import TCPStore

        host, port = self.host_port
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                         wait_for_workers=False)
        store.set(f"{self.prefix}/host/{self.tracker.node_rank}", self.host)
        return store

    def _run(self) -> None:
        me = self.tracker.node_rank
        while not self._stop.wait(BEAT_S):
            try:
                if self._store is None:
                    self._store = self._connect()
                store = self._store
                store.add(f"{self.prefix}/beat/{me}", 1)
                now = self.clock()
                for rank in range(self.max_nodes):
                    if rank == me:
                        continue
                    self.tracker.observe(rank, store.add(f"{self.prefix}/beat/{rank}", 0), now)
                    if rank not in self.tracker.hosts and store.check([f"{self.prefix}/host/{rank}"]):
                        self.tracker.hosts[rank] = store.get(f"{self.prefix}/host/{rank}").decode()
                    if store.check([f"{self.prefix}/done/{rank}"]):
                        self.tracker.done.add(rank)
                self.tracker.store_ok_at = self.clock()
            except Exception as e:  # unreachable store: the tracker's clock says for how long
                log.debug("peer beacon: %s", e)
                self._store = None
