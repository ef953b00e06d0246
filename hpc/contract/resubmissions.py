"""A job continued as a new Slurm job where Slurm refuses to requeue it: the record of the chain.

Some clusters cannot requeue (``PreemptMode=CANCEL``, ``JobRequeue=0``, a submit plugin that
forces ``--no-requeue``): ``scontrol requeue`` fails there. The job then continues as a fresh
submission of the same ``JOB_DIR/job.sbatch`` into the same job directory (same checkpoints, same
W&B run), a new Slurm job id chained with ``--dependency=afterany:OLD`` (see
``runtime/resubmit.py``). ``JOB_DIR/resubmissions.jsonl`` records each link: the new job id,
the job it continues, and the first allocation index of the new job, because allocation numbers
(outcomes, claims, logs) go on across the chain while Slurm's restart count starts again at 0.

Pure readers over the file's lines, shared by the launcher (the allocation number) and
``hpc status`` (which allocations belong to which job id).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = "resubmissions.jsonl"


@dataclass(frozen=True)
class Link:
    """One resubmission: ``job_id`` continues ``previous`` from allocation ``allocation_base``."""

    job_id: str
    previous: str
    allocation_base: int
    reason: str = ""
    time: float = 0.0

    def to_line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"


def parse(text: str) -> list[Link]:
    """The links in a ``resubmissions.jsonl`` text, in order (unreadable lines skipped)."""
    out = []
    for line in text.splitlines():
        try:
            out.append(Link(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def read(job_dir: Path) -> list[Link]:
    try:
        return parse((Path(job_dir) / FILE).read_text())
    except (OSError, UnicodeDecodeError):
        return []


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
