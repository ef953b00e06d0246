"""Launchers' keepalive through the rendezvous store: which peer node stopped answering.

Files on a shared filesystem cannot tell a cut link (the node's processes live on and may
still reach the filesystem through another network) from a healthy peer, and NFS caches their
attributes for 30-60 s. The c10d store on the rendezvous node can: every launcher's
:class:`PeerBeacon` thread adds 1 to its own counter in that store about once a second. A node
whose counter stops advancing while the store still answers is cut off from the job (or its
launcher died). When the local ranks make no progress either, the watchdog acts at once, in
whatever phase the ranks are (a cut during a checkpoint save must not wait for the save's budget).

Nobody reads every counter: the counters are read by one watcher per group of nodes and folded
into one summary (:mod:`.groups`), so a node's store traffic is about three requests a beat
whatever the job's size. The summary also carries the latest progress and busy rank of the
other nodes (what each node's stall watch published), so no node reads the others' records on
the shared filesystem.

:class:`PeerTracker` is the pure bookkeeping (fake clocks in tests); the beacon is the thin
thread around torch's ``TCPStore`` client.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.liveness import groups
from runtime.liveness.groups import DONE, WATCH_LOST_AFTER_S
from runtime.liveness.nodes import FRESH_S

log = logging.getLogger("hpc.liveness")
BEAT_S = 1.0
LOST_AFTER_S = 10.0     # a peer's counter this long without advancing: every node names it lost
STORE_TIMEOUT_S = 3.0
PUBLISH_EVERY_S = 2.0   # this node's record, unless its busy ranks changed


@dataclass
class PeerTracker:
    """What this node knows of its peers' liveness (pure).

    ``seen`` holds the counters this node reads itself (its group's, while it watches it);
    ``keys`` when a group or summary key last changed; ``reported`` the nodes the latest
    summary names lost, ``unseen`` the nodes it cannot see (their watcher is lost).
    """

    node_rank: int
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)   # rank -> (count, since)
    hosts: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    store_ok_at: float | None = None
    keys: dict[str, tuple[object, float]] = field(default_factory=dict)   # key -> (value, since)
    summary: dict = field(default_factory=dict)
    summary_mine: bool = False        # this node wrote the summary (the root)
    # rank -> its count when this node's current worker group formed; such a peer is watched
    # again only once its counter moves past it (a node lost before the group formed is none
    # of the group's: the rendezvous round that formed it went on without it).
    frozen: dict[int, int] = field(default_factory=dict)
    group_at: float | None = None     # when the current worker group formed (this clock)
    last_now: float | None = None

    def observe(self, rank: int, count: int, now: float) -> None:
        self.last_now = now
        if rank == self.node_rank or count <= 0:
            return
        if count >= DONE:
            self.done.add(rank)
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
        went silent before the round (a crash, seconds ago) is not taken for the new group's;
        nor is one the summary names whose silence began before the round."""
        self.frozen = {rank: count for rank, (count, _) in self.seen.items()}
        self.seen = {}
        self.group_at = self.last_now

    def stop_watching(self) -> None:
        """This node no longer reads its group's counters: what it read says nothing now."""
        self.seen, self.frozen = {}, {}

    def note(self, key: str, value: object, now: float) -> float:
        """Records a key's value; returns how long it has stood still."""
        old = self.keys.get(key)
        self.last_now = now
        if old is None or old[0] != value:
            self.keys[key] = (value, now)
            return 0.0
        return now - old[1]

    def still(self, key: str, now: float) -> float:
        old = self.keys.get(key)
        return 0.0 if old is None else now - old[1]

    def take_summary(self, summary: dict, now: float, *, mine: bool = False) -> None:
        """The latest summary (read from the store, or written by this node as the root)."""
        self.summary, self.summary_mine = summary, mine
        for rank, (host, _) in self._named(summary).items():
            self.hosts.setdefault(rank, host)
        if "by" in summary and "host" in summary:
            self.hosts.setdefault(int(summary["by"]), str(summary["host"]))
        if not mine:
            self.note("summary", (summary.get("by"), summary.get("seq")), now)

    @staticmethod
    def _named(summary: dict) -> dict[int, tuple[str, float]]:
        out = {}
        for rank, entry in summary.get("lost", {}).items():
            try:
                out[int(rank)] = (str(entry[0]), float(entry[1]))
            except (TypeError, ValueError, IndexError):
                continue
        return out

    def unavailable(self, now: float, after_s: float = WATCH_LOST_AFTER_S) -> set[int]:
        """Nodes that cannot watch: named lost, done, or the root whose summary stood still."""
        out = set(self._named(self.summary)) | set(self.summary.get("done", [])) | self.done
        if self._root_silent(now, after_s):
            out.add(int(self.summary["by"]))
        return out

    def _root_silent(self, now: float, after_s: float) -> bool:
        s = self.summary
        return (not self.summary_mine and "by" in s and int(s["by"]) != self.node_rank
                and int(s["by"]) not in s.get("done", []) and self.still("summary", now) > after_s)

    def lost(self, now: float, after_s: float = WATCH_LOST_AFTER_S) -> dict[int, float]:
        """Peers (node rank -> seconds silent) lost while the store answers us.

        Those whose counter this node reads (while it watches its group) silent for
        ``after_s``; those the summary names; the root itself when the summary stood still
        ``after_s``. Nothing is lost when this launcher itself has not reached the store within
        ``after_s``: then the store (the rendezvous node) is the one out of reach.
        """
        if self.store_ok_at is None or now - self.store_ok_at > after_s:
            return {}
        out = {rank: now - since for rank, (_, since) in self.seen.items()
               if rank not in self.done and now - since > after_s}
        for rank, (_, silent) in self._named(self.summary).items():
            silent += self.still("summary", now)
            if self.group_at is None or now - silent >= self.group_at:
                out.setdefault(rank, silent)
        if self._root_silent(now, after_s):
            out[int(self.summary["by"])] = self.still("summary", now)
        return {r: s for r, s in out.items() if r != self.node_rank and r not in self.done}

    def all_heard(self, now: float, within_s: float) -> bool:
        """The store answered within ``within_s`` (this clock) and every peer this node
        watches advanced its counter within it, none named lost: what the peers say is
        current. Ranks here waiting for a peer that went silent (its link cut, its node gone)
        are the lost-peer rule's, not a deadlock among themselves."""
        if self.store_ok_at is None or now - self.store_ok_at > within_s or self._named(self.summary):
            return False
        return all(now - since <= within_s for rank, (_, since) in self.seen.items()
                   if rank != self.node_rank and rank not in self.done)

    def in_sight(self, now: float, within_s: float, sizes: dict[int, int]) -> int:
        """Other nodes seen alive in the last ``within_s`` seconds: this node's group's members
        whose counter advanced, and (as the root) the members of the groups whose key advanced
        (``sizes``: group -> its nodes). Not "not yet named lost": a node cut off from the
        others sees their counters stop one after another, and while the first is named the
        others are as still, only not for as long."""
        n = sum(1 for rank, (_, since) in self.seen.items()
                if rank != self.node_rank and rank not in self.done and now - since <= within_s)
        mine = groups.group_of(self.node_rank)
        for g, size in sizes.items():
            key = self.keys.get(f"group/{g}")
            if g != mine and key is not None and now - key[1] <= within_s:
                n += size
        return n

    def out_of_sight(self, now: float) -> int:
        """Nodes lost or unseen (their watcher lost): what the host's majority rule weighs."""
        return len(self.lost(now)) + int(self.summary.get("unseen", 0) or 0)

    def peer_progress_age(self, wall_now: float) -> float | None:
        """Seconds since another node's ranks last progressed, per the summary (None: unknown)."""
        latest = groups.latest_other(self.summary.get("progress", []), self.node_rank)
        return None if latest is None else max(0.0, wall_now - latest[0])

    def peer_working_age(self, wall_now: float) -> float | None:
        """Seconds since a main thread of another node's ranks last used the CPU (None:
        unknown): while one works, ranks here idle in collectives may be waiting for it."""
        latest = groups.latest_other(self.summary.get("working", []), self.node_rank)
        return None if latest is None else max(0.0, wall_now - latest[0])

    def peer_busy(self) -> str:
        """A busy rank another node reported (its description), or ""."""
        latest = groups.latest_other(self.summary.get("busy", []), self.node_rank)
        return "" if latest is None else latest[1]

    def name(self, rank: int) -> str:
        return f"{self.hosts.get(rank, '?')} (node rank {rank})"


class PeerBeacon:
    """The thread that keeps this launcher's counter going, and watches its group (and, as
    the root, the groups) when it is its turn (:func:`.groups.watches`).

    Args:
        endpoint: ``host:port`` of the c10d rendezvous store.
        run_id: The allocation's rendezvous id (keys are per allocation).
        node_rank: This node's index.
        host: This node's name (others name it in their verdicts).
        max_nodes: How many node ranks there may be.
    """

    def __init__(self, endpoint: str, run_id: str, *, node_rank: int, host: str, max_nodes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host_port = endpoint.rsplit(":", 1)
        self.prefix = f"hpc-liveness/{run_id}"
        self.host, self.max_nodes = host, max_nodes
        self.tracker = PeerTracker(node_rank, hosts={node_rank: host})
        self.clock = clock
        self.group = groups.group_of(node_rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc-peer-beacon", daemon=True)
        self._store = None
        self._seq = 0
        self._prepared: set[str] = set()      # roles whose keys this node made sure exist
        self._record: dict = {"host": host}
        self._record_sent: dict | None = None
        self._record_at = float("-inf")
        self._last_group: dict = {}
        self._last_summary: dict = {}
        self.watching = False

    def start(self) -> None:
        if self.max_nodes > 1:
            self._thread.start()

    def publish(self, progress: float | None, busy: Sequence[str], working: float | None = None) -> None:
        """What this node's stall watch tells the others (sent by the beacon thread: at once
        when its busy ranks change, else at most every :data:`PUBLISH_EVERY_S`): its latest
        progress, its busy ranks, and when a main thread of its ranks last used the CPU."""
        self._record = {"host": self.host, "progress": progress, "busy": list(busy)[:1],
                        "working": working, "time": time.time()}

    def stop(self) -> None:
        """Says this node is done (peers then do not count it as lost), stops the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * STORE_TIMEOUT_S)
        try:
            if self._store is not None:
                self._say_done(self._store)
        except Exception:   # the store may be gone with its node; nothing to tell then
            pass

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def _say_done(self, store) -> None:  # noqa: ANN001 (torch type)
        me = self.tracker.node_rank
        store.add(self._key("beat", me), DONE)
        for key, last in ((self._key("group", self.group), self._last_group),
                          (self._key("summary"), self._last_summary)):
            if last.get("by") == me:   # what it watched: it ended, it is not lost
                store.set(key, json.dumps(dict(last, done=sorted({*last.get("done", []), me}))))

    def _connect(self):  # noqa: ANN202 (torch type)
        from datetime import timedelta

        from torch.distributed import TCPStore

        host, port = self.host_port
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                         wait_for_workers=False)
        self.greet(store)
        return store

    def greet(self, store) -> None:  # noqa: ANN001 (torch type)
        """This node's record, and the keys every beat reads (created empty if missing)."""
        me = self.tracker.node_rank
        store.set(self._key("rec", me), json.dumps(self._record))
        for key in (self._key("summary"), self._key("group", self.group)):
            store.compare_set(key, "", "{}")   # multi_get waits for a missing key

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.step()

    def step(self) -> None:
        """One beat of the thread: (re)connects when needed, then :meth:`beat`. Public so that
        the scale harness (benchmarks/scale) can drive many nodes' beacons from a few threads
        with this very code."""
        try:
            if self._store is None:
                self._prepared.clear()
                self._store = self._connect()
            self.beat(self._store)
        except Exception as e:  # unreachable store: the tracker's clock says for how long
            log.debug("peer beacon: %s", e)
            self._store = None

    def in_sight(self, within_s: float) -> int:
        """Other nodes seen alive in the last ``within_s`` seconds (:meth:`PeerTracker.in_sight`)."""
        sizes = {g: len(groups.members(g, self.max_nodes)) for g in groups.groups(self.max_nodes)}
        return self.tracker.in_sight(self.clock(), within_s, sizes)

    def beat(self, store) -> None:  # noqa: ANN001 (torch type)
        """One beat: add to the counter, read the summary and the group key, send this node's
        record when it changed, and watch (and fold) when it is this node's turn."""
        t, me = self.tracker, self.tracker.node_rank
        store.add(self._key("beat", me), 1)
        summary_raw, group_raw = store.multi_get([self._key("summary"), self._key("group", self.group)])
        now = self.clock()
        t.take_summary(groups.parse(summary_raw), now)
        gkey = groups.parse(group_raw)
        others = gkey.get("by") != me
        silent = t.note("group", (gkey.get("by"), gkey.get("seq")), now) if others else t.still("group", now)
        position = me - groups.members(self.group, self.max_nodes).start
        watching = groups.watches(me, max_nodes=self.max_nodes, unavailable=t.unavailable(now),
                                  group_stale=silent > WATCH_LOST_AFTER_S + position * BEAT_S)
        self._send_record(store)
        if watching:
            # Taking over from a watcher that stood still: its silence counts from when its
            # group key last changed, not from now (it is named at once, not 8 s later).
            inherit = {int(gkey["by"]): t.keys["group"][1]} if (
                not self.watching and others and "by" in gkey and "group" in t.keys) else {}
            self._watch(store, now, inherit)
        elif self.watching:
            t.stop_watching()
        self.watching = watching
        t.store_ok_at = self.clock()

    def _send_record(self, store) -> None:  # noqa: ANN001 (torch type)
        rec, sent = self._record, self._record_sent
        changed = sent is None or rec.get("busy") != sent.get("busy")
        moved = sent is not None and any(rec.get(k) != sent.get(k) for k in ("progress", "working"))
        if changed or (moved and self.clock() - self._record_at >= PUBLISH_EVERY_S):
            store.set(self._key("rec", self.tracker.node_rank), json.dumps(rec))
            self._record_sent, self._record_at = rec, self.clock()

    def _prepare(self, store, role: str, keys: list[str], empty: str) -> None:  # noqa: ANN001
        """Makes sure the keys a role reads exist (once per role and connection)."""
        if role not in self._prepared:
            for key in keys:
                store.compare_set(key, "", empty)
            self._prepared.add(role)

    def _watch(self, store, now: float, inherit: dict[int, float]) -> None:  # noqa: ANN001
        t, me = self.tracker, self.tracker.node_rank
        ranks = [r for r in groups.members(self.group, self.max_nodes) if r != me]
        beats = [self._key("beat", r) for r in ranks]
        recs = [self._key("rec", r) for r in ranks]
        self._prepare(store, "group", beats, "0")
        self._prepare(store, "records", recs, "{}")
        values = store.multi_get(beats + recs) if ranks else []
        records: dict[int, dict] = {me: dict(self._record)}
        wall = time.time()
        for r, count, raw in zip(ranks, values[:len(ranks)], values[len(ranks):]):
            t.observe(r, int(count), now)
            rec = groups.parse(raw)
            if rec.get("host"):
                t.hosts[r] = str(rec["host"])
            try:   # a record older than FRESH_S says nothing about now (its node died, its busy rank too)
                fresh = wall - float(rec["time"]) < FRESH_S
            except (KeyError, TypeError, ValueError):
                fresh = False
            if fresh and r not in t.done:
                records[r] = rec
        for r, since in inherit.items():
            if r in t.seen:
                t.seen[r] = (t.seen[r][0], min(t.seen[r][1], since))
        self._seq += 1
        direct = {r: now - since for r, (_, since) in t.seen.items()
                  if r in ranks and r not in t.done and now - since > WATCH_LOST_AFTER_S}
        self._last_group = groups.fold_group(
            seq=self._seq, by=me, host=self.host, lost=direct, hosts=t.hosts,
            done=[r for r in ranks if r in t.done], records=records)
        store.set(self._key("group", self.group), json.dumps(self._last_group))
        if self.group == 0:
            self._fold(store, now)

    def _fold(self, store, now: float) -> None:  # noqa: ANN001 (torch type)
        """The root's part: the group keys into the summary."""
        t, me = self.tracker, self.tracker.node_rank
        indices = list(groups.groups(self.max_nodes))
        keys = [self._key("group", g) for g in indices]
        self._prepare(store, "root", keys, "{}")
        gkeys = [groups.parse(raw) for raw in store.multi_get(keys)]
        gkeys[0] = self._last_group
        stale = {}
        for g, key in zip(indices[1:], gkeys[1:]):
            still = t.note(f"group/{g}", (key.get("by"), key.get("seq")), now)
            if "by" in key and key["by"] not in key.get("done", []) and still > WATCH_LOST_AFTER_S:
                stale[g] = still
        summary = groups.fold_summary(
            seq=self._seq, by=me, host=self.host, group_keys=gkeys, stale=stale,
            sizes={g: len(groups.members(g, self.max_nodes)) for g in indices})
        store.set(self._key("summary"), json.dumps(summary))
        self._last_summary = summary
        t.take_summary(summary, now, mine=True)
