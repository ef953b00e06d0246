"""Stage 4 of an FSDP2 recovery: agree on the step every shard still has, and move the shards.

Every member of the new generation (same world, every rank kept, joiners at the lost ranks'
places) says what it holds (:meth:`runtime.inprocess.worker.shard_copy.PeerCopies.holding`:
its live step, its own snapshots, the copies it keeps); one ``all_gather_object`` gives every
member the same list, so every member computes the same :class:`~runtime.inprocess.worker.peers.Plan`
(:func:`~runtime.inprocess.worker.peers.agree`) with no leader. Then each shard that must travel
goes point to point from the holder of its copy to its rank (one pair at a time, in shard
order), a rank ahead of the agreed step loads its own snapshot, and a rank at it keeps its live
state. No file is read. When a shard is nowhere, :func:`give_up` tells the launchers (the
store's ``fallback`` key: replace nobody, take torch's restart path from the last checkpoint)
and the error names the shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from runtime.inprocess import protocol as proto
from runtime.inprocess.worker import peers, transfer
from runtime.inprocess.worker.peers import ShardedFallback
from runtime.inprocess.worker.shard_copy import PeerCopies, nbytes

log = logging.getLogger("hpc.inprocess")
SETTLE_S = 5.0   # how long the agreement waits for this rank's exchange in flight to end


def give_up(store: Any, why: str) -> ShardedFallback:
    """Tells the launchers that in-process recovery gave up (``fallback`` in the store) and
    returns the error to raise."""
    try:
        store.set(proto.FALLBACK, why)
    except Exception as e:   # noqa: BLE001 - the store is gone: the launchers' own rules hold
        log.warning("cannot tell the launchers that in-process recovery gave up: %s", e)
    return ShardedFallback(why)


def recover_shards(copies: PeerCopies, store: Any, *, rank: int, world: int,
                   held: int | None, between: Callable[[], None] | None = None) -> tuple[peers.Plan, int]:
    """Every member (a collective on the new default group): agrees and moves the shards.

    Args:
        copies: This rank's snapshots and kept copies.
        store: The job's store (for :func:`give_up`).
        rank: This rank (it owns shard ``rank``).
        world: The world size (kept).
        held: The step this rank's live state is at (None: a joiner).
        between: Runs after each shard's move (tests: a fault injected mid-transfer).

    Returns:
        (the plan, bytes this rank sent or received).

    Raises:
        ShardedFallback: A shard is nowhere (names it); the disk checkpoint is the fallback.
    """
    copies.settle(timeout_s=SETTLE_S)
    mine = copies.holding(rank, held)
    box: list[Any] = [None] * world
    dist.all_gather_object(box, (mine.rank, mine.live, mine.own, dict(mine.peer)))
    held_all = [peers.Holding(r, live=live, own=tuple(own), peer=peer) for r, live, own, peer in box]
    try:
        plan = peers.agree(held_all, world)
    except peers.NoCopy as e:
        raise give_up(store, f"no peer copy to recover the FSDP2 shards in memory: {e}; the "
                             "restart path from the last checkpoint") from e
    moved, state = 0, None
    for holder, owner in plan.sends():
        if rank == holder:
            moved += transfer.send_state(copies.snapshot_of(owner, plan.step), dst=owner)
        elif rank == owner:
            state = transfer.recv_state(src=holder)
            moved += nbytes(state)
        if between is not None:
            between()
    source, kind = plan.sources[rank]
    if kind == peers.OWN:
        state = copies.snapshot_of(None, plan.step)
    if state is not None:
        copies.load(state)
    copies.drop_after(plan.step)
    log.info("in-process recovery: FSDP2 shards at step %d: this rank's from %s (rank %d); "
             "%d bytes moved; no checkpoint read", plan.step, kind, source, moved)
    return plan, moved
