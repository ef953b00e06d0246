"""Agreeing on a new generation in the store: who is in it, in which rank order, from which step.

The keys and the pure rules are :mod:`runtime.inprocess.protocol`; this module runs them against a
real ``torch.distributed.Store`` (the launcher's TCPStore; tests may pass a ``HashStore``).
A survivor calls :meth:`Membership.reform` after it left a failed step: it arrives at the next
generation, and either leads it (the first arrival waits for the others by
:func:`~runtime.inprocess.rules.close_decision` and writes the member list) or waits for the
leader's list. The leader counts ``g/G/lead`` up while it decides, which may take minutes (a
member in an announced long phase); a follower waits as long as that count moves, and only a
leader silent for :func:`~runtime.inprocess.rules.leader_silent_s` (it died while closing) is
replaced, by going to the generation after. A follower that left a live, deciding leader on
its own clock would open a second world beside the first (split brain).

A joiner (a restarted worker, a hot spare's) calls :meth:`Membership.join`: it writes its
arrival under ``join/N`` and waits until a closed generation lists it. The leader of every
generation takes in the joiners that fit (:func:`~runtime.inprocess.rules.admit`), and waits
for the replacement a launcher promised for a dead member.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from runtime.inprocess.protocol import Arrival, Members

log = logging.getLogger("hpc.inprocess")
POLL_S = 0.02
FOLLOW_SLICE_S = 2.0   # a follower checks its leader (dead? its beat?) at least this often


def admitted(store: Any) -> int:
    """How many joiners the generations took in or passed over (``join/admitted``)."""
    return int(store.get(proto.JOIN_ADMITTED)) if store.check([proto.JOIN_ADMITTED]) else 0


def joiners_waiting(store: Any, world: int, max_world: int) -> bool:
    """Whether a joiner waits that a world of ``world`` has room for: no request when the
    world is full, else two small reads (rank 0's fault watch asks every 0.1 s)."""
    if world >= max(max_world, world):
        return False
    return store.add(proto.JOIN_COUNT, 0) > admitted(store)


class Excluded(RuntimeError):
    """This process arrived after its generation closed without it (it was too slow)."""


class Membership:
    """This worker's view of the generations (the store protocol, one process's side).

    Args:
        store: The store that outlives the workers.
        me: This process's uid (:func:`runtime.inprocess.protocol.uid`).
        host: Its host name.
        window_s: How long a leader waits for silent members of the old generation.
        max_world: The largest world joiners may fill (0: the starting one).
        leader_silent_s: How long a follower waits for a leader whose beat stands still
            (None: :func:`~runtime.inprocess.rules.leader_silent_s` of ``window_s``).
    """

    def __init__(self, store: Any, me: str, *, host: str = "",
                 window_s: float = recovery_settings.DEFAULT_WINDOW_S, max_world: int = 0,
                 leader_silent_s: float | None = None) -> None:
        self.store, self.me, self.host, self.window_s = store, me, host, window_s
        self.leader_silent_s = (rules.leader_silent_s(window_s) if leader_silent_s is None
                                else leader_silent_s)
        self.max_world = max_world   # the largest world joiners may fill (0: the starting one)
        self.gen = 0
        self.uids: tuple[str, ...] = ()

    def join(self, *, timeout_s: float, poll_s: float = 0.05) -> Members | None:
        """Asks to join and waits until a closed generation lists this process.

        Returns:
            That generation, or None when the job finished first (``done``: not needed).

        Raises:
            TimeoutError: Not admitted within ``timeout_s``.
        """
        index = self.store.add(proto.JOIN_COUNT, 1) - 1
        self.store.set(proto.join(index), proto.encode(
            Arrival(self.me, proto.JOINER_RANK + index, -1, self.host)))
        seen, deadline = -1, time.time() + timeout_s
        while time.time() < deadline:
            if self.store.check([proto.DONE]):
                return None
            if self.store.check([proto.GENERATION]):
                newest = int(self.store.get(proto.GENERATION))
                for gen in range(max(seen + 1, newest - 8), newest + 1):
                    if not self.store.check([proto.members(gen)]):
                        continue
                    members = proto.decode_members(self.store.get(proto.members(gen)))
                    if members.rank_of(self.me) is not None:
                        self.gen, self.uids = members.gen, members.uids
                        return members
                seen = newest
            time.sleep(poll_s)
        raise TimeoutError(f"join: no generation took {self.me} in within {timeout_s:.0f} s "
                           f"(join index {index})")

    def _max_world(self) -> int:
        return max(self.max_world, len(self.uids))

    def _admitted(self) -> int:
        return admitted(self.store)

    def start(self, rank: int, world_size: int, *, gen: int = 0) -> None:
        """Records this rank in the starting generation and learns its members (a barrier
        in the store: every rank of the starting world writes, then reads all)."""
        self.gen = gen
        self.store.set(proto.who(gen, rank), self.me)
        keys = [proto.who(gen, r) for r in range(world_size)]
        self.store.wait(keys, timedelta(seconds=600))
        self.uids = tuple(v.decode() for v in self.store.multi_get(keys))

    def announce_fault(self, why: str) -> None:
        """Tells every member (and tools) that this generation failed."""
        try:
            self.store.set(proto.fault(self.gen), f"{self.me}: {why}")
        except Exception as e:   # the store host is gone: the re-form will say so
            log.warning("cannot announce the fault in the store: %s", e)

    def fault_seen(self) -> bool:
        """Whether someone announced that the current generation failed."""
        return bool(self.store.check([proto.fault(self.gen)]))

    def set_busy(self, until: float | None) -> None:
        """Announces (or, with None, withdraws) a long phase lasting until wall time ``until``."""
        key = proto.busy(self.me)
        if until is None:
            self.store.delete_key(key)
        else:
            self.store.set(key, f"{until:.3f}")

    def reform(self, step: int, old_rank: int, *, reason: str) -> Members:
        """Arrives at the next generation and returns it once closed.

        Args:
            step: The newest step whose state this process holds whole.
            old_rank: Its rank in the generation that failed.
            reason: Why (for the leader's record).

        Raises:
            Excluded: The generation closed without this process.
        """
        target = self.gen + 1
        while True:
            members = self._arrive(target, Arrival(self.me, old_rank, step, self.host), reason)
            if members is not None:
                self.gen, self.uids = members.gen, members.uids
                return members
            log.warning("generation %d did not close (its leader is gone?): trying %d",
                        target, target + 1)
            target += 1

    def _arrive(self, gen: int, me: Arrival, reason: str) -> Members | None:
        index = self.store.add(proto.arrive(gen), 1) - 1
        self.store.set(proto.arrival(gen, index), proto.encode(me))
        if index == 0:
            return self._lead(gen, reason)
        if not self._follow(gen):   # the leader died before it closed: the next generation
            return None
        members = proto.decode_members(self.store.get(proto.members(gen)))
        if members.rank_of(self.me) is None:
            raise Excluded(f"generation {gen} closed without this process ({self.me}): it arrived "
                           f"late; members {', '.join(members.uids)}")
        return members

    def _follow(self, gen: int) -> bool:
        """Waits for the leader's member list while the leader's beat moves and the leader is
        not announced dead.

        Returns:
            True once the list is there; False when the leader was announced dead (its
            launcher or its lifeline saw it end: a second fault that took the leader), when
            the beat stood still for ``leader_silent_s`` (on this process's clock: a leader
            lost with its node, announced by nobody yet), or when the store is gone.
        """
        key, beat = proto.members(gen), proto.lead(gen)
        # Waits in slices (the list wakes it at once); between slices it reads the beat and
        # whether the leader is dead: a quarter of the silence bound, at most FOLLOW_SLICE_S (a
        # dead leader is left within that; a long wait logs torch's socket timeout warning
        # only every few seconds).
        slice_s = max(proto.LEAD_BEAT_S, min(self.leader_silent_s / 4, FOLLOW_SLICE_S))
        try:
            seen, since = self.store.add(beat, 0), time.monotonic()
            leader = proto.decode_arrival(self.store.get(proto.arrival(gen, 0))).uid
        except Exception:   # noqa: BLE001 - the store is gone: the next arrival says so
            return False
        while True:
            try:
                self.store.wait([key], timedelta(seconds=slice_s))
                return True
            except Exception:   # noqa: BLE001 - not yet (or the store is gone: the add says)
                pass
            try:
                count = self.store.add(beat, 0)
                if self.store.check([key]):
                    return True
                if self.store.check([proto.dead(leader)]):
                    log.warning("generation %d: its leader %s is dead: leaving it", gen, leader)
                    return False
            except Exception:   # noqa: BLE001 - the store is gone: the next arrival says so
                return False
            now = time.monotonic()
            if count != seen:
                seen, since = count, now
            elif now - since >= self.leader_silent_s:
                log.warning("generation %d: its leader has been silent %.0f s (beat %d): "
                            "leaving it", gen, now - since, count)
                return False

    def _lead(self, gen: int, reason: str) -> Members:
        opened = time.time()
        old = self.uids
        start = self._admitted()
        beat = proto.lead(gen)
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:   # followers: alive and deciding
                self.store.add(beat, 1)
                next_beat = time.monotonic() + proto.LEAD_BEAT_S
            dead = self._dead(old)
            # A member that arrived and died since (a second fault 0.5 s after the first) is no
            # member: counted, it took a joiner's room, and the leader waited out the 120-s
            # promise of the replacement it had no room for (randomized trials, seed 28).
            arrivals = [a for a in self._arrivals(gen) if a.uid not in dead or a.uid == self.me]
            joiners = self._joiners(start)
            taken = rules.admit(joiners, members=len(arrivals), max_world=self._max_world(),
                                dead=self._dead([j.uid for j in joiners]))
            now = time.time()
            decision = rules.close_decision(old, [a.uid for a in arrivals], dead=dead,
                                            busy_until=self._busy(old), coming=self._coming(gen, old),
                                            now=now, opened=opened, window_s=self.window_s,
                                            promised=self._promised(dead), joiners=len(taken))
            if decision.close:
                break
            time.sleep(POLL_S)
        # Taken and dead joiners are done with; one not taken (no room) and those after it wait.
        done = {j.uid for j in taken} | set(self._dead([j.uid for j in joiners]))
        scanned = start + next((i for i, j in enumerate(joiners) if j.uid not in done), len(joiners))
        if taken:
            reason = "; ".join(x for x in (reason, f"joined: {', '.join(j.uid for j in taken)}") if x)
        if all(a.step < 0 for a in (*arrivals, *taken)):   # every survivor half-loaded: the disk
            members = rules.unsourced(gen, [*arrivals, *taken], old=old, reason=reason)
        else:
            members = rules.plan_members(gen, [*arrivals, *taken], old=old, reason=reason,
                                         keep_ranks=self.store.check([proto.SHARDED]))
        members = dataclasses.replace(members, in_row=rules.in_row(self._last_closed(), members.step))
        self.store.set(proto.JOIN_ADMITTED, str(scanned))
        self.store.set(proto.members(gen), proto.encode(members))
        self.store.set(proto.GENERATION, str(gen))
        return members

    def _last_closed(self) -> Members | None:
        """The last generation a re-form closed (None before the first re-form)."""
        if not self.store.check([proto.GENERATION]):
            return None
        key = proto.members(int(self.store.get(proto.GENERATION)))
        return proto.decode_members(self.store.get(key)) if self.store.check([key]) else None

    def _joiners(self, start: int) -> list[Arrival]:
        """The joiners from index ``start`` whose records are written (in join order)."""
        count = self.store.add(proto.JOIN_COUNT, 0)
        out: list[Arrival] = []
        for i in range(start, count):
            if not self.store.check([proto.join(i)]):
                break   # counted, not yet written: the next poll (or generation) takes it
            out.append(proto.decode_arrival(self.store.get(proto.join(i))))
        return out

    def _promised(self, dead: Sequence[str]) -> dict[str, float]:
        out = {}
        for u in dead:
            if self.store.check([proto.replace(u)]):
                try:
                    out[u] = float(self.store.get(proto.replace(u)))
                except (ValueError, RuntimeError):
                    pass
        return out

    def _arrivals(self, gen: int) -> list[Arrival]:
        n = self.store.add(proto.arrive(gen), 0)
        keys = [proto.arrival(gen, i) for i in range(n)]
        # An arrival counted but not yet written: read what is there, the rest next poll.
        present = [k for k in keys if self.store.check([k])]
        return [proto.decode_arrival(v) for v in self.store.multi_get(present)] if present else []

    def _coming(self, gen: int, old: Sequence[str]) -> list[str]:
        return [u for u in old if self.store.check([proto.coming(gen, u)])]

    def _dead(self, old: Sequence[str]) -> list[str]:
        return [u for u in old if self.store.check([proto.dead(u)])]

    def _busy(self, old: Sequence[str]) -> dict[str, float]:
        out = {}
        for u in old:
            if u != self.me and self.store.check([proto.busy(u)]):
                try:
                    out[u] = float(self.store.get(proto.busy(u)))
                except (ValueError, RuntimeError):
                    pass
        return out
