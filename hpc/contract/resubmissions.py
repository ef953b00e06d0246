"""A job continued as a new Slurm job where Slurm refuses to requeue it: the record of the chain.

Some clusters cannot requeue (``PreemptMode=CANCEL``, ``JobRequeue=0``, a submit plugin that
forces ``--no-requeue``): ``scontrol requeue`` fails there. The job then continues as a fresh
submission of the same ``JOB_DIR/job.sbatch`` into the same job directory (same checkpoints, same
W&B run), a new Slurm job id chained with ``--dependency=afterany:OLD`` (see
``runtime/ending/resubmit.py``). ``JOB_DIR/resubmissions.jsonl`` records each link: the new job id,
the job it continues, and the first allocation index of the new job, because allocation numbers
(outcomes, claims, logs) go on across the chain while Slurm's restart count starts again at 0.

Pure readers over the file's lines, shared by the launcher (the allocation number) and
``hpc status`` (which allocations belong to which job id).
"""

from __future__ import annotations

from pathlib import Path

from hpc.contract import jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import Link

__all__ = ["FILE", "Link", "allocation_base", "allocation_range", "append", "continued_as", "parse", "read"]

FILE = jobpaths.RESUBMISSIONS


def parse(text: str) -> list[Link]:
    """The links in a ``resubmissions.jsonl`` text, in order (damaged lines skipped)."""
    return records.parse(text.encode(), Link)[0]


def read(job_dir: Path) -> list[Link]:
    return records.read(JobPaths(job_dir).resubmissions, Link)


def append(job_dir: Path, link: Link) -> None:
    """Records one link (durable: the new job must find it)."""
    records.append(JobPaths(job_dir).resubmissions, link, durable=True)


def allocation_base(links: list[Link], job_id: str) -> int:
    """The first allocation index of Slurm job ``job_id`` in the chain (0: the original job)."""
    return next((link.allocation_base for link in links if link.job_id == job_id), 0)


def allocation_range(links: list[Link], job_id: str) -> tuple[int, int | None]:
    """The allocation indexes ``[lo, hi)`` that job ``job_id`` ran (``hi`` None: still open)."""
    lo = allocation_base(links, job_id)
    later = [link.allocation_base for link in links if link.allocation_base > lo]
    return lo, (min(later) if later else None)


def continued_as(links: list[Link], job_id: str) -> str:
    """The job that continues ``job_id`` (``""``: none)."""
    return next((link.job_id for link in links if link.previous == job_id), "")
