"""What happens to the job after an allocation ends: requeue it, or let it end.

Slurm requeues a preempted job by itself (``PreemptMode=REQUEUE``) only when it has to kill
it at the end of the grace time; a job that saved and exited cleanly before that is marked
FAILED and never comes back (measured on Slurm 22.05). Slurm also does not requeue a job
that ran into its time limit, nor one whose surviving nodes gave up after losing the
rendezvous host under ``--no-kill``. So we requeue all three ourselves, exactly once per
allocation (a job the user cancelled is recognised by the launcher and left alone): several nodes may reach the same conclusion, and the first to create
the allocation's claim file (``O_EXCL`` on the shared job directory) is the one that acts.
Application errors never requeue: a bug would otherwise loop until the allocation budget
is gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpc.contract import jobdir

# The outcomes after which we requeue (a preempted job exits before Slurm's kill, so Slurm
# itself does not requeue it). Every other outcome ends the job.
REQUEUE_KINDS = frozenset({"preempted", "time_limit", "node_failure"})


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: str


def decide_requeue(kind: str, *, policy: str, allocation: int, max_requeues: int,
                   under_slurm: bool) -> RequeueDecision:
    """Should this node ask Slurm to requeue the job? (pure)

    Args:
        kind: The allocation's outcome kind.
        policy: The job's requeue policy (``auto`` or ``never``).
        allocation: How many times the job was requeued before this allocation.
        max_requeues: The job's requeue budget.
        under_slurm: False for ``hpc run``: nothing to requeue.
    """
    if not under_slurm or kind not in REQUEUE_KINDS:
        return RequeueDecision(False, f"{kind}: nothing to requeue")
    if policy == "never":
        return RequeueDecision(False, f"{kind}: requeue policy is 'never'")
    if allocation >= max_requeues:
        return RequeueDecision(False, f"{kind}: requeue budget spent ({allocation} of {max_requeues})")
    return RequeueDecision(True, f"{kind}: requeue {allocation + 1} of at most {max_requeues}")


def claim(job_dir: Path, allocation: int, duty: str = "requeue") -> bool:
    """True for exactly one caller per allocation and duty (atomic create on the shared job dir).

    Args:
        job_dir: The job directory (shared by every node).
        allocation: The allocation index.
        duty: What is claimed: ``"requeue"`` (one node requeues the job) or ``"record"`` (one
            survivor records the outcome when node 0 is gone).
    """
    path = jobdir.claim_path(Path(job_dir), allocation, duty)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.uname().nodename} {os.getpid()}\n")
    return True


def request_batch_requeue(job_dir: Path, allocation: int, reason: str) -> Path:
    """Asks the batch shell to requeue the job (under a container, where ``scontrol`` is not
    available): writes ``requeue-request-alloc-N``, which the batch script reads after srun
    returns (see ``slurm_templates/sbatch_elastic.sh.j2``). Call it after winning :func:`claim`.
    """
    path = jobdir.requeue_request_path(Path(job_dir), allocation)
    jobdir.write_atomic(path, f"{reason}\n")
    return path
