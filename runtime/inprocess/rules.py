"""In-process recovery's decisions, pure: who is dead to a re-form, when a leader closes a
generation, whom it takes in, where the state comes from, when the recovery gives up.

The records they decide on are :mod:`runtime.inprocess.protocol`'s; the workers
(:mod:`runtime.inprocess.worker.membership`) and the launchers run them against the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc.contract import recovery_settings
from runtime.inprocess.protocol import COMING_S, HOLDS_NOTHING, LOADED, LOADING, UNTOUCHED, Arrival, Members


def leader_silent_s(window_s: float) -> float:
    """How long a follower waits for a leader whose ``g/G/lead`` count stands still before it
    goes to the next generation: many beats, so a leader descheduled on a loaded node (or
    its store client in a short reconnect) is not left; a dead one is in under a minute."""
    return window_s * 4 + 30


def lost_uids(uids: Sequence[str], members: Sequence[str]) -> list[str]:
    """The workers of ``uids`` (``host/pid``) whose host is not among the new epoch's
    ``members``: lost with their node (a re-form in the new store does not wait for them)."""
    keep = set(members)
    return [u for u in uids if u.rpartition("/")[0] not in keep]


def lifeline_dead(closed: Mapping[str, str], launchers_closed: Sequence[str] | set[str], *,
                  replacement: str) -> list[str]:
    """The workers whose lifeline closed that are dead to the re-form now (pure).

    A worker's line closed without its last words: the process ended (its kernel closed the
    socket); a slow, stopped or cut-off process keeps its line open and is never named here.
    Under ``--replacement wait`` its launcher may still promise a joiner, so the worker is
    named only once its launcher's line closed too (the node crashed: nobody will); under
    ``shrink`` nobody waits for a replacement, so at once.

    Args:
        closed: Worker uid -> its launcher's uid, for the workers whose line closed.
        launchers_closed: Launchers whose line closed.
        replacement: The job's ``--replacement``.
    """
    gone = set(launchers_closed)
    return [w for w, parent in closed.items() if replacement == recovery_settings.SHRINK or parent in gone]


def in_row(previous: Members | None, step: int) -> int:
    """How many generations in a row go on from ``step``, the new one included (pure): one
    more than the previous generation's count when it went on from the same step (no step
    completed since: the failure repeats), else 1 (a step completed resets the count)."""
    return previous.in_row + 1 if previous is not None and previous.step == step else 1


def held_after(held: int, agreed: int, phase: str) -> int:
    """The step a rank holds whole after its recovery failed part way (pure): what it says
    at the next re-form, where the newest step held decides the source (:func:`plan_members`).

    A rank whose state was not touched (the source, a rank that failed before or during the
    transfer's receipt: it receives into buffers of its own) still holds ``held``; one that
    loaded the agreed step's state whole holds ``agreed``; one that had begun to load it holds
    a mix of two steps, so nothing (:data:`HOLDS_NOTHING`): it is never a source again.

    Raises:
        ValueError: An unknown ``phase`` (names the valid ones).
    """
    if phase == UNTOUCHED:
        return held
    if phase == LOADED:
        return agreed
    if phase == LOADING:
        return HOLDS_NOTHING
    raise ValueError(f"phase {phase!r}: expected {UNTOUCHED}, {LOADING} or {LOADED}")


def repeats(members: Members, max_reforms: int) -> str | None:
    """Why in-process recovery gives up at ``members`` (pure): no member holds the state
    whole (:func:`unsourced`), or the generation is past ``max_reforms`` re-forms in a row at
    one step (a failure that repeats, e.g. a bad batch, would loop forever), or None to go on."""
    if members.source < 0:   # nobody holds any step whole (:func:`unsourced`)
        return members.reason
    if members.in_row <= max_reforms:
        return None
    return (f"{members.in_row} re-forms in a row at step {members.step} without a step completed "
            f"(at most {max_reforms}, {recovery_settings.MAX_REFORMS_ENV}): the failure repeats: {members.reason}; "
            "torch's restart path from the last checkpoint (bounded by --max-restarts)")


@dataclass(frozen=True)
class CloseDecision:
    """Whether the leader closes the membership now, and whom it stops waiting for."""

    close: bool
    waiting_for: tuple[str, ...]


def close_decision(old: Sequence[str], arrived: Sequence[str], *, dead: Sequence[str] = (),
                   busy_until: Mapping[str, float] | None = None, coming: Sequence[str] = (),
                   now: float, opened: float, window_s: float,
                   coming_s: float = COMING_S, promised: Mapping[str, float] | None = None,
                   joiners: int = 0) -> CloseDecision:
    """The leader's rule for closing a generation (pure).

    Close when every old member has arrived or is known dead; else when the join window since
    the generation opened has run out, except for members that announced a long phase (they
    are waited for until the time they announced) and members that said they are coming
    (alive, they learnt of the fault while in a wait of their own; waited for ``coming_s``).

    Args:
        old: The previous generation's members.
        arrived: The members (and joiners) that arrived so far.
        dead: Members a launcher announced dead.
        busy_until: Member -> wall time its announced phase ends.
        now: The wall time now.
        opened: When this generation was opened (the leader's arrival).
        window_s: How long silent members are waited for.
        coming: Members that said they are coming.
        coming_s: How long those are waited for.
        promised: Dead member -> wall time until which its launcher's replacement is
            waited for (``replace/UID``): the world keeps its size when the joiner comes.
        joiners: Joiners waiting now.
    """
    gone = set(arrived) | set(dead)
    missing = tuple(u for u in old if u not in gone)
    owed = [u for u, until in (promised or {}).items() if u in dead and until > now]
    if not missing and joiners < len(owed):
        return CloseDecision(False, tuple(f"replacement of {u}" for u in owed[joiners:]))
    if not missing:
        return CloseDecision(True, ())
    busy = busy_until or {}
    late = set(coming)
    waiting = tuple(u for u in missing if now < opened + window_s or busy.get(u, 0.0) > now
                    or (u in late and now < opened + coming_s))
    return CloseDecision(not waiting, waiting)


def admit(joiners: Sequence[Arrival], *, members: int, max_world: int,
          dead: Sequence[str] = ()) -> tuple[Arrival, ...]:
    """The joiners a generation takes in (pure): in their join order, the live ones, as many
    as fit beside ``members`` in ``max_world`` (the others wait: a hot spare stays a spare)."""
    room = max(0, max_world - members)
    return tuple(j for j in joiners if j.uid not in set(dead))[:room]


def plan_members(gen: int, arrivals: Sequence[Arrival], *, old: Sequence[str],
                 reason: str, keep_ranks: bool = False) -> Members:
    """The closed generation for these arrivals (pure).

    Ranks follow the old ranks (joiners last, in their arrival order); the state comes from the
    lowest-ranked member holding the newest step. With ``keep_ranks`` (a sharded job: rank
    ``r`` owns shard ``r``) every member keeps its old rank where it fits the new world and
    joiners fill the ranks of the lost members, lowest first.

    Raises:
        ValueError: When nobody arrived, or nobody holds any step (only joiners).
    """
    seen: dict[str, Arrival] = {}
    for a in arrivals:
        seen.setdefault(a.uid, a)
    ordered = sorted(seen.values(), key=lambda a: (a.old_rank, list(seen).index(a.uid)))
    if keep_ranks:
        n = len(ordered)
        slots: list[Arrival | None] = [None] * n
        rest = []
        for a in ordered:
            if 0 <= a.old_rank < n and slots[a.old_rank] is None:
                slots[a.old_rank] = a
            else:
                rest.append(a)
        free = iter(i for i, a in enumerate(slots) if a is None)
        for a in rest:
            slots[next(free)] = a
        ordered = [a for a in slots if a is not None]
    if not ordered:
        raise ValueError(f"generation {gen}: nobody arrived")
    step = max(a.step for a in ordered)
    if step < 0:
        raise ValueError(f"generation {gen}: only joiners arrived ({len(ordered)}), no member "
                         "holds the training state")
    source = next(i for i, a in enumerate(ordered) if a.step == step)
    uids = tuple(a.uid for a in ordered)
    return Members(gen=gen, uids=uids, step=step, source=source, reason=reason,
                   left=tuple(u for u in old if u not in uids))


def unsourced(gen: int, arrivals: Sequence[Arrival], *, old: Sequence[str], reason: str) -> Members:
    """The closed generation when no arrival holds any step whole (pure): every survivor
    had begun to load a state a failed recovery sent (:func:`held_after`), or only joiners
    came. ``source`` is -1 and the reason says why; every member then gives up in-process
    recovery (:func:`repeats`): the disk checkpoint is the only whole state left."""
    uids = tuple(dict.fromkeys(a.uid for a in arrivals))
    why = (f"generation {gen}: no member holds the training state whole ({len(uids)} arrived: "
           f"a state transfer failed part way on every survivor, or only joiners came; after: "
           f"{reason}); the restart path from the last checkpoint")
    return Members(gen=gen, uids=uids, step=HOLDS_NOTHING, source=-1, reason=why,
                   left=tuple(u for u in old if u not in uids))
