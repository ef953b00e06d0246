"""``hangs.jsonl``: one line per stall a node's watchdog acted on (any node appends).

A stall ends one worker group, not the allocation: the agents re-form and the job goes on,
so it is not an outcome of its own in ``outcomes.jsonl`` (one line per allocation). The
detail lives here, written when the watchdog acts; the allocation's outcome then sums it up
(kind ``hang`` when the allocation ended because of one, a note when it recovered).

The same stall twice (:func:`repeated`: same node, step, suspect and evidence) is a pattern,
not a fault that goes away with a restart: the launcher then stops restarting and ends with
:meth:`HangEvent.advice`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpc.contract import jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import HangEvent

HANGS = jobpaths.HANGS
__all__ = ["HANGS", "HangEvent", "append", "read", "repeated", "take_unreported"]


def append(job_dir: Path, event: HangEvent) -> None:
    records.append(JobPaths(job_dir).hangs, event)


def read(job_dir: Path, allocation: int | None = None) -> list[HangEvent]:
    """The recorded stalls (of one allocation when given); damaged lines are skipped and reported."""
    return [e for e in records.read(JobPaths(job_dir).hangs, HangEvent)
            if allocation is None or e.allocation == allocation]


def repeated(hangs: Sequence[HangEvent]) -> HangEvent | None:
    """The latest stall, when it repeats an earlier identical one (:meth:`HangEvent.same_as`)."""
    if hangs and any(hangs[-1].same_as(h) for h in hangs[:-1]):
        return hangs[-1]
    return None


def take_unreported(job_dir: Path) -> list[HangEvent]:
    """The stalls not yet logged to the job's W&B run, marking them logged (rank 0 only)."""
    hangs = read(job_dir)
    marker = JobPaths(job_dir).liveness_reported
    try:
        done = int(marker.read_text())
    except (OSError, ValueError):
        done = 0
    if len(hangs) <= done:
        return []
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(len(hangs)))
    except OSError:
        return []   # better to log a stall never than on every restart
    return hangs[done:]
