"""Continue the job as a new submission where Slurm refuses to requeue it.

On clusters that cannot requeue (``PreemptMode=CANCEL``, ``JobRequeue=0``, ``--no-requeue``
forced by a site plugin) ``scontrol requeue`` fails, and a job stopped for its time limit or a
preemption would end there. Instead, the node that claimed the requeue submits the job's own
``JOB_DIR/job.sbatch`` again, into the same job directory, with ``--dependency=afterany:OLD``:
the new job starts only once this one has ended, so two never run at once; it resumes from the
same checkpoints and logs to the same W&B run (both live in the job directory).

Exactly once per allocation: the caller holds the requeue claim, this module takes a second
claim (``resubmit``), and the submission tag is derived from the job id and the allocation, so
an sbatch retried after a lost answer finds the job instead of submitting twice. The link is
recorded (:mod:`hpc.contract.resubmissions`) before the old job can end, ``slurm_job_id`` moves
to the new job (which then holds the job lock), and the user's job index gets the new id.
Only the sbatch backend writes ``job.sbatch``; other backends (and sweep tasks, whose script is
the whole array's) are left to end, with the message to resubmit by hand.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from hpc.contract import jobdir, resubmissions
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.index import JobRecord, current_cluster, record_job
from runtime.ending.requeue import claim

log = logging.getLogger("hpc.resubmit")


def submission_args(job_id: str) -> list[str]:
    """sbatch's options for the continuation (pure): the environment as for every submission
    and the chain (``afterany``: whatever the old job's final state, once it has ended)."""
    return ["--export=ALL", f"--dependency=afterany:{job_id}"]


# Variables that describe this job, not the user's environment: the continuation must not
# inherit them through --export=ALL (a stale SLURM_RESTART_COUNT or HPC_ALLOCATION would number
# its allocations wrongly; node 0's NCCL_SOCKET_IFNAME would be taken for the user's choice).
_JOB_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "HPC_", "TORCHELASTIC_", "PMI_", "PMIX_")


def submission_env(environ: Mapping[str, str], set_by_launcher: Iterable[str]) -> dict[str, str]:
    """The environment to submit the continuation from (pure): the launcher's, less what the
    launcher set for its workers and what belongs to this job (``SLURM_CONF`` stays)."""
    drop = set(set_by_launcher)
    return {k: v for k, v in environ.items()
            if k == "SLURM_CONF" or (k not in drop and not k.startswith(_JOB_PREFIXES))}


def tag(job_id: str, allocation: int) -> str:
    """The submission tag: the same for every try of one continuation (pure)."""
    return f"continue-{job_id}-alloc-{allocation}"


def _cancelled(client: object, job_id: str) -> bool:
    """Whether accounting says ``job_id`` was cancelled. While the job's processes are still
    ending, ``scontrol show job`` says COMPLETING, but sacct already says ``CANCELLED by UID``;
    a cancelled job must not come back as a new one. Without accounting: False."""
    try:
        records = client.accounting([job_id])  # type: ignore[attr-defined]
    except SlurmError:
        return False
    return any(r.job_id == job_id and r.step is None and r.raw_state.startswith("CANCELLED")
               for r in records)


def continue_as_new_job(job_dir: Path, spec: JobSpec, *, job_id: str, allocation: int,
                        reason: str, set_by_launcher: Iterable[str] = (),
                        client: object | None = None,
                        env: Mapping[str, str] = os.environ) -> str | None:
    """Submits the continuation of ``job_id``; returns the new job id, or None (logged why).

    ``set_by_launcher`` names the variables the launcher set for its workers (they are left
    out of the continuation's environment, see :func:`submission_env`).

    Never raises: the allocation's outcome is already recorded; failing here only means the job
    ends as it would have before.
    """
    script = Path(job_dir) / jobdir.SBATCH
    by_hand = f"resubmit with the same --job-dir ({job_dir}) to resume"
    if not script.is_file():
        log.error("cannot continue job %s as a new job: no %s (only the sbatch backend writes "
                  "one, and a sweep task's is the whole array's); %s", job_id, script, by_hand)
        return None
    if not claim(Path(job_dir), allocation, "resubmit"):
        log.info("the continuation of job %s (allocation %d) is another node's", job_id, allocation)
        return None
    client = client or SlurmClient(submission_env(env, set_by_launcher))
    if _cancelled(client, job_id):
        log.warning("job %s was cancelled (scancel): not continuing it", job_id)
        return None
    try:
        new_id = client.submit(script, submission_args(job_id), tag=tag(job_id, allocation))  # type: ignore[attr-defined]
    except SlurmError as e:
        log.error("could not submit the continuation of job %s: %s; %s", job_id, e, by_hand)
        return None
    link = resubmissions.Link(job_id=new_id, previous=job_id, allocation_base=allocation + 1,
                              reason=reason, time=time.time())
    resubmissions.append(Path(job_dir), link)
    jobdir.write_atomic(Path(job_dir) / jobdir.SLURM_JOB_ID, new_id + "\n")   # it holds the lock now
    try:
        record_job(JobRecord(new_id, str(job_dir), spec.job_name, "sbatch", link.time,
                             current_cluster(env=env)))
    except OSError as e:   # the index is a convenience; the job directory has the truth
        log.warning("could not add job %s to the job index: %s", new_id, e)
    log.warning("Slurm refused to requeue job %s: continued as job %s (after it ends, same job "
                "directory, allocation %d on)", job_id, new_id, link.allocation_base)
    return new_id
