"""Reads what a ledger needs from a job directory, and Slurm's queue times when it can.

The job directory alone is enough (``hpc run`` jobs, or a cluster whose accounting is down):
``events.jsonl``, ``hangs.jsonl`` and ``outcomes.jsonl``. With a Slurm job id, sacct adds each
allocation's submit and start times (queue wait) and its start and end as Slurm saw them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.contract import jobdir, records
from hpc.contract.events import read_events
from hpc.contract.interval import prior_mtbf_s
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import HangEvent
from hpc.contract import young_daly
from hpc.contract.ledger import Ledger, build

if TYPE_CHECKING:   # Slurm's client and parsers only for a job id (slurm_runs): a directory needs none
    from hpc.contract.slurm_parse import AccountingRecord

log = logging.getLogger("hpc.report")


def hang_events(job_dir: Path) -> list[dict[str, Any]]:
    """The watchdogs' stall records as ``hang`` events."""
    return [{"t": float(h.time), "ev": "hang", "alloc": h.allocation, "node": h.node,
             "reason": h.reason, "step": h.step}
            for h in records.read(JobPaths(job_dir).hangs, HangEvent)]


def runs_from_accounting(records: Sequence[AccountingRecord], job_id: str
                         ) -> dict[int, dict[str, Any]]:
    """Per allocation, Slurm's submit, start and end times and when each node left it (pure).

    Allocations are the job's allocation records in order of start. A ``--no-kill`` job that
    loses a node is *resized*: sacct then shows a ``RESIZING`` record up to the loss and a new
    record for the survivors, starting when the ``RESIZING`` one ended, on some of its nodes;
    both are one allocation, and the lost node's time ends at the resize. A record that follows
    a ``RESIZING`` one later, or on a node it did not hold, is the next allocation (the job was
    requeued while resized): merged, the two allocations and the gap between them were one
    frame, and the ledger counted the nodes of both twice over the gap and the second one.
    """
    allocs = sorted((r for r in records if r.step is None and r.job_id == job_id and r.start),
                    key=lambda r: r.start)
    ts = lambda d: d.timestamp() if d is not None else None  # noqa: E731
    runs: list[dict[str, Any]] = []
    prev: AccountingRecord | None = None
    for r in allocs:
        if not (runs and prev is not None and resized_into(prev, r)):
            runs.append({"submit": ts(r.submit), "start": ts(r.start), "end": None, "node_ends": {}})
        run = runs[-1]
        run["end"] = ts(r.end)
        for node in r.nodes:
            run["node_ends"][node] = ts(r.end)
        prev = r
    return dict(enumerate(runs))


RESIZE_SLACK_S = 2.0   # sacct's times are whole seconds; a resize's two records meet exactly


def resized_into(before: AccountingRecord, after: AccountingRecord) -> bool:
    """Whether ``after`` is ``before``'s allocation going on after a resize (pure)."""
    if not before.raw_state.upper().startswith("RESIZING") or before.end is None or after.start is None:
        return False
    return abs(after.start.timestamp() - before.end.timestamp()) <= RESIZE_SLACK_S and \
        set(after.nodes) <= set(before.nodes)


def slurm_runs(job_id: str) -> dict[int, dict[str, Any]]:
    """:func:`runs_from_accounting` from sacct; empty when sacct is unavailable (the report then
    goes without queue times)."""
    from hpc.contract.slurm import SlurmClient, SlurmError

    try:
        records = SlurmClient(retry_total_s=10).accounting([job_id])
    except (SlurmError, OSError) as e:
        log.warning("no Slurm accounting for job %s (%s): no queue times", job_id, e)
        return {}
    return runs_from_accounting(records, job_id)


def load(job_dir: Path, job_id: str = "", *, events: list[dict[str, Any]] | None = None) -> Ledger:
    """The ledger of the job in ``job_dir`` (Slurm's times added when ``job_id`` is given).

    Args:
        job_dir: The job directory.
        job_id: Its Slurm job id ("" for none: no queue times).
        events: Its :func:`~hpc.contract.events.read_events`, when the caller has read them.
    """
    job_dir = Path(job_dir)
    events = (read_events(job_dir) if events is None else events) + hang_events(job_dir)
    outcomes = [asdict(o) for o in jobdir.read_outcomes(job_dir)]
    prior = young_daly.DEFAULT_MTBF_S
    spec = jobdir.read_json(job_dir / jobdir.JOBSPEC) or {}
    if isinstance(spec.get("checkpoint_interval"), str):
        prior = prior_mtbf_s(spec["checkpoint_interval"]) or prior
    runs = slurm_runs(job_id) if job_id else {}
    return build(events, outcomes=outcomes, slurm_runs=runs, prior_mtbf_s=prior)
