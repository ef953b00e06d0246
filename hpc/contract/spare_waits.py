"""Hot spares in the event stream: which node waited as a spare, and when it joined (pure).

A job with ``--spare-nodes K`` runs one launcher on each of ``MAX + K`` nodes. torch's c10d
rendezvous takes the first ``MAX`` into the group; the others wait on its redundancy list,
holding no rank, until a member is lost, and then one of them is taken into the next round
(:mod:`runtime.launch.spares`). Which node is the spare is torch's choice, so it is read back from
what the launchers recorded (:mod:`hpc.contract.events`):

- ``node_ready`` (with ``spare_nodes`` > 0): the node passed its health check and joins;
- ``workers_started``: the node's agent started workers (it holds ranks from then on).

A node is a waiting spare from the moment it was ready and another node's workers were
running, until its own workers start (its *join*) or its launcher ends. The members of one
rendezvous round start their workers within milliseconds of each other; a node whose workers
start :data:`JOIN_AFTER_S` or more after another's was not in that round: it waited.

Its waiting time is its own category in the goodput ledger (``spare``): allocated node-time
that trains nothing, the price of keeping the world size when a node is lost.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JOIN_AFTER_S = 1.0   # a group's members start their workers together, well within this


@dataclass(frozen=True)
class SpareWait:
    """One node's time as a waiting hot spare in one allocation.

    Attributes:
        node: The node's name (its host).
        t0: When it was ready while others trained (wall time).
        t1: When its workers started (``joined``) or its launcher ended.
        joined: Whether it took a lost node's place.
    """

    node: str
    t0: float
    t1: float
    joined: bool

    @property
    def seconds(self) -> float:
        return max(0.0, self.t1 - self.t0)


def _launcher(e: Mapping[str, Any]) -> tuple[str, int]:
    return str(e.get("node", "")), int(e.get("node_rank") or 0)


def labels(aevs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], str]:
    """Each launcher's name, by ``(host, node rank)``: its host, or ``host (node rank R)``
    where launchers share a host (``hpc run``: every node is this machine). Computed once per
    allocation and given to :func:`in_wait` (once per event was O(N^2) per allocation)."""
    launchers = {_launcher(e) for e in aevs if e.get("ev") in ("alloc_start", "node_ready")}
    hosts = Counter(h for h, _ in launchers)   # list.count per launcher was O(N^2) per allocation
    return {(h, r): h if hosts[h] == 1 else f"{h} (node rank {r})" for h, r in launchers}


def spare_waits(aevs: Sequence[Mapping[str, Any]], node_ends: Mapping[str, float]
                ) -> dict[str, SpareWait]:
    """The launchers of one allocation that waited as hot spares (node -> its wait).

    O(E log E) in the allocation's E events: another launcher's first start after a node
    was ready is found by bisection in the starts sorted once (a scan of every start for
    every ready node was O(N^2) with spares).

    Args:
        aevs: The allocation's events, in time order.
        node_ends: Each node's end (its launcher's ``alloc_end``, else when it was lost), by the
            names this returns (the host; ``host (node rank R)`` where hosts are shared).
    """
    ready: dict[tuple[str, int], float] = {}
    for e in aevs:
        if e.get("ev") == "node_ready" and int(e.get("spare_nodes") or 0) > 0:
            ready.setdefault(_launcher(e), float(e["t"]))
    if not ready:
        return {}
    names = labels(aevs)
    starts: dict[tuple[str, int], list[float]] = {}
    for e in aevs:
        if e.get("ev") == "workers_started":
            starts.setdefault(_launcher(e), []).append(float(e["t"]))
    every = sorted((t, who) for who, ts in starts.items() for t in ts)
    times = [t for t, _ in every]
    last_t = max(float(e["t"]) for e in aevs)
    out = {}
    for who, t_ready in ready.items():
        i = bisect_left(times, t_ready - JOIN_AFTER_S)
        while i < len(every) and every[i][1] == who:   # its own starts: at most its own count
            i += 1
        if i == len(every):
            continue   # no other launcher started workers after it was ready
        t0 = max(t_ready, every[i][0])
        name = names.get(who, who[0])
        end = node_ends.get(name, last_t)
        mine = [t for t in starts.get(who, []) if t >= t0 - JOIN_AFTER_S]
        if mine and min(mine) < t0 + JOIN_AFTER_S:
            continue   # a member of the group that formed: not a spare
        t1 = min(mine) if mine else end
        if t1 > t0:
            out[name] = SpareWait(name, t0, t1, joined=bool(mine))
    return out


def in_wait(waits: Mapping[str, SpareWait], names: Mapping[tuple[str, int], str],
            e: Mapping[str, Any]) -> tuple[float | None, float]:
    """The launcher event ``e``'s ``[t0, t]`` with the part its node spent waiting as a spare
    cut off (a spare's rendezvous round spans its whole wait, which was no re-form).

    Args:
        waits: The allocation's :func:`spare_waits`.
        names: The allocation's :func:`labels` (``{}`` when no spare waited).
        e: One of its launcher events.
    """
    t0, t1 = e.get("t0"), float(e["t"])
    if not waits or t0 is None:
        return t0, t1
    w = waits.get(names.get(_launcher(e), str(e.get("node", ""))))
    if w is None:
        return t0, t1
    return max(float(t0), w.t1), t1


def describe(events: Sequence[Mapping[str, Any]], spare_nodes: int) -> str:
    """``hpc status``'s line on a job's hot spares, from its events (pure); "" without any.

    Each allocation's spares: ``node3 joined 41s in`` (it took a lost node's place), or
    ``node3 waiting`` (it holds no rank; the last allocation while it runs), ``node3 not
    needed`` (an allocation that ended with it still waiting).
    """
    if spare_nodes <= 0:
        return ""
    by_alloc: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        by_alloc.setdefault(int(e.get("alloc", 0)), []).append(e)
    parts = []
    for alloc, aevs in sorted(by_alloc.items()):
        names = labels(aevs)
        ended = {names.get(_launcher(e), str(e.get("node", ""))): float(e["t"])
                 for e in aevs if e.get("ev") == "alloc_end"}
        start = min(float(e["t"]) for e in aevs)
        for w in spare_waits(aevs, ended).values():
            how = f"joined {w.t1 - start:.0f}s in" if w.joined else \
                "not needed" if w.node in ended else "waiting"
            parts.append(f"{w.node} {how}" + (f" (allocation {alloc})" if len(by_alloc) > 1 else ""))
    head = f"hot spares: {spare_nodes}"
    return f"{head}; {', '.join(parts)}" if parts else head
