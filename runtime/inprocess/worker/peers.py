"""Who keeps whose shard copy, and which step every shard still has (pure logic).

With FSDP2 each rank owns one shard of the parameters and of the optimizer state; no other rank
holds it. Under in-process recovery every rank therefore keeps, in host memory, a copy of the
shards of a *buddy* rank on another node (:mod:`runtime.inprocess.worker.shard_copy` moves the
tensors): the copies form a ring over the nodes, so the loss of one node (all its ranks) leaves
a copy of each of its shards on the next node. With one node there is no other node to keep a
copy on, and none is kept (a copy in the same node's memory dies with it).

After a loss the new generation (same world size, the lost ranks replaced by joiners, every
member at its old rank) must agree on one step to go on from. Each member says what it holds
(:class:`Holding`): its live state (the step it trained to), its own buffered snapshots and the
copies of other ranks' shards. :func:`agree` picks the newest step at which every shard is
somewhere, and for each shard where it comes from: the rank itself (live, or rolled back to its
own snapshot), else the holder of its copy. When a shard is nowhere (the rank and the holder of
its copy were both lost), :class:`NoCopy` names it: the disk checkpoint is then the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

LIVE, OWN, PEER = "live", "own", "peer"   # where a shard at the agreed step comes from


def holders(nodes: Sequence[str]) -> dict[int, int]:
    """Rank -> the rank that keeps its copy: the rank at the same place on the next node.

    Args:
        nodes: Each rank's node (any key; ranks of one node need not be contiguous).

    Returns:
        The ring over nodes; empty when all ranks share one node (no copy is kept).
    """
    order: list[str] = []
    on: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in on:
            order.append(node)
            on[node] = []
        on[node].append(rank)
    if len(order) < 2:
        return {}
    out: dict[int, int] = {}
    for i, node in enumerate(order):
        nxt = on[order[(i + 1) % len(order)]]
        for place, rank in enumerate(on[node]):
            out[rank] = nxt[place % len(nxt)]
    return out


def owners(holder: Mapping[int, int], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` keeps (one with even nodes; more on uneven ones)."""
    return sorted(r for r, h in holder.items() if h == rank)


@dataclass(frozen=True)
class Holding:
    """What one member of the new generation holds.

    Attributes:
        rank: Its rank (the shard it owns; ranks are kept across a sharded recovery).
        live: The step its live state is at (None: a joiner, it holds nothing).
        own: The steps of its own buffered snapshots.
        peer: Owner rank -> the steps of the copies of that rank's shards it keeps.
    """

    rank: int
    live: int | None = None
    own: tuple[int, ...] = ()
    peer: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The agreed step and, per shard, who provides it.

    Attributes:
        step: The step every rank goes on from.
        sources: Shard (rank) -> (the rank that provides it, :data:`LIVE`, :data:`OWN` or
            :data:`PEER`).
    """

    step: int
    sources: Mapping[int, tuple[int, str]]

    def sends(self) -> list[tuple[int, int]]:
        """(holder, owner) for every shard that travels (from a peer copy), in shard order."""
        return [(src, shard) for shard, (src, kind) in sorted(self.sources.items()) if kind == PEER]


class ShardedFallback(RuntimeError):
    """In-process recovery gives up and the disk checkpoint must be used: the sharded state
    cannot be carried in memory, or a failure repeats at one step (the restart path)."""


class NoCopy(RuntimeError):
    """No step at which every shard is somewhere (the disk checkpoint is the fallback).

    Attributes:
        missing: The shards (ranks) held nowhere at any step.
    """

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


def _sources(step: int, held: Sequence[Holding], world: int) -> dict[int, tuple[int, str]] | None:
    out: dict[int, tuple[int, str]] = {}
    by_rank = {h.rank: h for h in held}
    for shard in range(world):
        me = by_rank.get(shard)
        if me is not None and me.live == step:
            out[shard] = (shard, LIVE)
        elif me is not None and step in me.own:
            out[shard] = (shard, OWN)
        else:
            keeper = next((h.rank for h in sorted(held, key=lambda h: h.rank)
                           if step in h.peer.get(shard, ())), None)
            if keeper is None:
                return None
            out[shard] = (keeper, PEER)
    return out


def agree(held: Sequence[Holding], world: int, *, lost: Sequence[int] = ()) -> Plan:
    """The newest step at which every one of ``world`` shards is held, and their sources.

    Args:
        held: Every member's holding (one per rank ``0..world-1``).
        world: The number of shards (the world size, kept).
        lost: The ranks whose processes were lost (for the message only).

    Raises:
        NoCopy: No such step; names the shards held nowhere.
    """
    steps = sorted({s for h in held for s in (*((h.live,) if h.live is not None else ()), *h.own,
                                             *(x for v in h.peer.values() for x in v))},
                   reverse=True)
    for step in steps:
        sources = _sources(step, held, world)
        if sources is not None:
            return Plan(step, sources)
    somewhere = {h.rank for h in held if h.live is not None or h.own} | \
        {owner for h in held for owner, v in h.peer.items() if v}
    missing = [r for r in range(world) if r not in somewhere]
    if missing:
        why = (f"the shards of rank(s) {', '.join(map(str, missing))} have no copy left: each rank "
               f"and the holder of its peer copy were both lost" +
               (f" (lost: {', '.join(map(str, sorted(lost)))})" if lost else ""))
    else:
        have = {r: sorted({s for h in held for s in
                           ((*(((h.live,) if h.live is not None else ())), *h.own) if h.rank == r else ())
                           + h.peer.get(r, ())}) for r in range(world)}
        why = "no step is held for every shard: " + "; ".join(f"rank {r}: steps {v}" for r, v in have.items())
    raise NoCopy(why, missing)
