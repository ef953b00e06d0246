"""When the allocations of an ``hpc run`` job ran, and whether one runs now.

For a Slurm job, ``hpc status`` takes each allocation's elapsed time from sacct and squeue.
A local job has no Slurm: each ``hpc run`` on a job directory is one allocation, and its times
are in the job directory itself:

- ``events.jsonl``: every launcher writes ``alloc_start`` when it starts and ``alloc_end`` when
  its allocation is over (:mod:`hpc.contract.events`);
- ``outcomes.jsonl``: when the allocation's outcome was recorded (an end, where the launcher
  left no ``alloc_end``);
- the job-directory lock (:mod:`hpc.contract.joblock`): an ``hpc run`` whose processes are alive
  holds it, so the allocation it runs is running now, since the lock's time at the latest.

:func:`local_clock` joins them (pure); :func:`read_local_clock` reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.contract import events as job_events
from hpc.contract import jobdir, joblock


@dataclass(frozen=True)
class Span:
    """One allocation's wall-clock start and end (``None`` while it runs or when unknown)."""

    start: float
    end: float | None = None

    def elapsed_s(self, now: float) -> int:
        """Seconds from start to end, or to ``now`` while it has no end."""
        return max(0, int((self.end if self.end is not None else now) - self.start))


@dataclass(frozen=True)
class LocalClock:
    """The times of a local job's allocations.

    Args:
        spans: Allocation number -> its span, for the allocations whose start is known.
        running: The allocation an ``hpc run`` runs now, or None.
    """

    spans: Mapping[int, Span] = field(default_factory=dict)
    running: int | None = None


def local_clock(events: Iterable[Mapping[str, Any]], outcomes: Sequence[jobdir.Outcome],
                running_since: float | None) -> LocalClock:
    """Joins a local job's events, outcomes and lock into its allocations' spans (pure).

    Args:
        events: ``events.jsonl`` records (each with ``t``, ``ev`` and ``alloc``).
        outcomes: ``outcomes.jsonl`` records.
        running_since: When the live ``hpc run`` holding the job directory took it, or None
            when none does.
    """
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    seen: dict[int, float] = {}      # each allocation's first and last event: the span of one
    last: dict[int, float] = {}      # whose launcher died before writing its own start or end
    for ev in events:
        alloc, t = ev.get("alloc"), ev.get("t")
        if not isinstance(alloc, int) or isinstance(alloc, bool) or not isinstance(t, (int, float)):
            continue
        seen[alloc] = min(seen.get(alloc, t), t)
        last[alloc] = max(last.get(alloc, t), t)
        if ev.get("ev") == "alloc_start":
            starts[alloc] = min(starts.get(alloc, t), t)
        elif ev.get("ev") == "alloc_end":
            ends[alloc] = max(ends.get(alloc, t), t)
    for o in outcomes:
        if o.time and o.allocation not in ends:
            ends[o.allocation] = o.time
    running = None
    if running_since is not None:   # the allocation hpc run numbers next (backends.local)
        running = max([len(outcomes), *(o.allocation + 1 for o in outcomes)])
        starts.setdefault(running, seen.get(running, running_since))
    spans = {a: Span(starts.get(a, seen.get(a, 0.0)),
                     None if a == running else ends.get(a, last.get(a)))
             for a in {*starts, *seen}}
    return LocalClock(spans=spans, running=running)


def read_local_clock(job_dir: Path) -> LocalClock:
    """:func:`local_clock` of a job directory: its events, outcomes and lock."""
    holder = joblock.read_holder(job_dir)
    running_since = None
    if holder is not None and holder.command == "hpc run" \
            and joblock.why_held(job_dir, holder, here=joblock.me("hpc status")) is not None:
        running_since = holder.since
    return local_clock(job_events.read_events(job_dir), jobdir.read_outcomes(job_dir),
                       running_since)
