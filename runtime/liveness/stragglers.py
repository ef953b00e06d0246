"""Stragglers: ranks persistently slower than the others, reported (never killed).

At the loop boundary every rank's step time is the same: a synchronous job waits for its
slowest rank in each collective. What differs is how long a rank works *before* DDP's
reduction makes it wait for the others. The Session measures it (``compute`` time: from the
start of the step to the end of its backward pass, on about one step each 0.1 s, by
``runtime.worker.ddp.PaceProbe``; to the end of the step's body without DDP) and the heartbeat
carries its median over the last :data:`WINDOW` samples; each node's watchdog publishes its ranks' medians in the job directory
(``liveness/alloc-A/node-N.json``); rank 0 reads them every :data:`CHECK_EVERY_S` and calls
:func:`find`. A rank whose median is above ``RATIO x`` the median of the other ranks' (and
slower by at least :data:`MIN_GAP_S`) in :data:`PERSIST` checks in a row is a straggler: named in the
rank-0 log, the run's W&B events, ``stragglers.jsonl`` and, through the allocation's outcome,
``hpc status``.

Limits: slowness after a rank's backward pass (the optimizer step; under FSDP, whose
collectives run inside forward and backward, everything) is hidden behind the collectives and
not seen. On a GPU the hooks mark when the backward pass was queued, not when it ran.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.contract import jobdir, jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import Straggler

STRAGGLERS = jobpaths.STRAGGLERS
WINDOW = 20          # steps the per-rank median is over
RATIO = 1.5          # slower than this multiple of the median rank
MIN_GAP_S = 0.02     # and slower by at least this (noise on millisecond steps)
PERSIST = 2          # consecutive checks
CHECK_EVERY_S = 5.0


@dataclass(frozen=True)
class RankPace:
    """One rank's recent pace, as a node's watchdog published it."""

    rank: int
    node: str
    node_rank: int
    compute_s: float      # median compute time before the step's first collective


def find(paces: Sequence[RankPace], *, ratio: float = RATIO,
         min_gap_s: float = MIN_GAP_S) -> list[tuple[RankPace, float]]:
    """The ranks slower than ``ratio x`` the median of the other ranks (pure).

    Returns:
        (the slow ranks, slowest first, each with the others' median) as
        ``[(pace, median_s)]``. The others' median, not all ranks': with two ranks the median
        of both could never be exceeded 2x.
    """
    slow = []
    for p in paces:
        others = [q.compute_s for q in paces if q is not p]
        if not others:
            continue
        median = statistics.median(others)
        if p.compute_s > ratio * median and p.compute_s - median >= min_gap_s:
            slow.append((p, median))
    return sorted(slow, key=lambda pm: -pm[0].compute_s)


def paces_from_records(records: Sequence[dict]) -> list[RankPace]:
    """The per-rank paces in the nodes' published liveness records (malformed ones skipped)."""
    out = []
    for rec in records:
        pace = rec.get("pace", ())
        for r in pace if isinstance(pace, list) else ():
            try:
                out.append(RankPace(int(r["rank"]), str(rec["node"]), int(rec["node_rank"]),
                                    float(r["compute_s"])))
            except (KeyError, TypeError, ValueError):
                continue
    return out


class StragglerWatch:
    """Rank 0's bookkeeping: which ranks were slow in how many checks in a row (pure but
    for the clock and the files it reads)."""

    def __init__(self, job_dir: Path, allocation: int, *, every_s: float = CHECK_EVERY_S,
                 fresh_s: float = 15.0) -> None:
        self.job_dir, self.allocation = Path(job_dir), allocation
        self.every_s, self.fresh_s = every_s, fresh_s
        self.streak: dict[int, int] = {}
        self.reported: set[tuple[int, str]] = set()
        self._next = time.monotonic() + every_s

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True

    def check(self, step: int) -> list[Straggler]:
        """New stragglers (each rank on each node once per allocation)."""
        now = time.time()
        records = []
        for path in JobPaths(self.job_dir).liveness_nodes(self.allocation):
            rec = jobdir.read_json(path)        # None: missing, torn or not an object
            t = rec.get("time") if rec is not None else None
            if isinstance(t, (int, float)) and now - t < self.fresh_s:
                records.append(rec)
        slow = find(paces_from_records(records))
        self.streak = {p.rank: self.streak.get(p.rank, 0) + 1 for p, _ in slow}
        out = []
        for p, median in slow:
            if self.streak[p.rank] >= PERSIST and (p.rank, p.node) not in self.reported:
                self.reported.add((p.rank, p.node))
                out.append(Straggler(self.allocation, p.rank, p.node, p.node_rank, p.compute_s,
                                     median, step, now))
        return out


def append(job_dir: Path, s: Straggler) -> None:
    records.append(JobPaths(job_dir).stragglers, s)


def read(job_dir: Path, allocation: int | None = None) -> list[Straggler]:
    """The recorded stragglers (of one allocation when given); damaged lines skipped and reported."""
    return [s for s in records.read(JobPaths(job_dir).stragglers, Straggler)
            if allocation is None or s.allocation == allocation]
