"""The job directory: one place per job that holds everything about it.

Both a Slurm job and a local ``hpc run`` write the same layout, so ``hpc status`` and
``hpc logs`` and the tests read one format::

    JOB_DIR/
      jobspec.json                 what was asked (written once, on the login node)
      job.sbatch                   the rendered batch script (Slurm backends)
      logs/
        slurm-<jobid>.out          the batch script's own output (Slurm)
        alloc-<A>/node-<host>.log  the per-node launcher's log for allocation A
        alloc-<A>/restart-<K>/rank-<R>.log   each worker's stdout+stderr
      checkpoints/                 step-000123/ ... and the ``latest`` pointer
      outcomes.jsonl               one record per allocation: why it ended
      exit-intent.json             rank 0's reason for a clean exit (preempted, ...)
      progress.json                rank 0's latest step (every few seconds): work lost on a crash
      hangs.jsonl                  one record per stall a node's watchdog acted on (who, where)
      exclusions.jsonl             nodes found bad (stall, lost, health check): kept out next time
      stragglers.jsonl             ranks rank 0 found persistently slower than the others
      logs/alloc-<A>/hang-<host>-<n>.txt   that stall's verdict and the node's Python stacks
      liveness/alloc-<A>/node-<N>.json     each node's latest liveness summary (watchdogs)
      wandb_run_id                 one W&B run for the job's whole life
      wandb_state.json, wandb/     the last step logged (exactly-once history), W&B's files
      metrics.jsonl                rank 0's metrics when W&B is disabled or failing
      slurm_job_id                 the Slurm job id (Slurm backends)
      requeue-claim-alloc-<A>      who requeued allocation A (one node, atomically)
      result.json                  written by the example trainer
      .hpc-lock.json               who runs the job now (hpc.contract.joblock)
      .hpc-reserve                 space given back on a full disk so the outcome is recorded
      events.jsonl, resubmissions.jsonl, health/, .rdzv/, sweep.json   (see their modules)

The names and paths are declared once in :mod:`hpc.contract.jobpaths` (``JobPaths``); what
each JSONL file holds, who writes and who reads it, in :mod:`hpc.contract.records`.

Job directories that hpc creates are private to the user (0700): they hold logs and may hold
secrets a user's script prints. An existing directory is never re-moded: it is reused only
when it is a job directory already (or empty), so ``--job-dir .`` or ``--job-dir ~`` is
refused instead of being made private and filled with a job's files.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from hpc.contract import jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import OUTCOME_KINDS, Outcome
from hpc.contract.errors import SpecError

# The names are declared in hpc.contract.jobpaths; these aliases keep the callers' spelling.
JOBSPEC, OUTCOMES, EXIT_INTENT, PROGRESS = jobpaths.JOBSPEC, jobpaths.OUTCOMES, jobpaths.EXIT_INTENT, jobpaths.PROGRESS
RESULT, SBATCH, SLURM_JOB_ID, LOCK = jobpaths.RESULT, jobpaths.SBATCH, jobpaths.SLURM_JOB_ID, jobpaths.LOCK
# Any of these makes a directory a job directory that `hpc run`/`hpc submit` may reuse.
JOB_MARKERS = (JOBSPEC, LOCK, OUTCOMES)
CHECKPOINTS = jobpaths.CHECKPOINTS     # the default checkpoint directory
WANDB_RUN_ID = jobpaths.WANDB_RUN_ID
WANDB_STATE = jobpaths.WANDB_STATE     # the last step logged to W&B (exactly-once history)
METRICS_JSONL = jobpaths.METRICS_JSONL  # rank 0's metrics when W&B is disabled or failing
REQUEUE_REQUEST_PREFIX = jobpaths.REQUEUE_REQUEST_PREFIX


def default_job_dir(name: str, root: Path | None = None, now: float | None = None) -> Path:
    """``./jobs/<name>-<YYYYmmdd-HHMMSS>-<8 hex>``: unique even for launches in the same second.

    The time makes the name readable and sortable; the random suffix (32 bits) keeps parallel
    launches apart, and :func:`create` makes a new directory with ``exist_ok=False``.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "job"
    return (root or Path.cwd() / "jobs") / f"{safe}-{stamp}-{secrets.token_hex(4)}"


def is_job_dir(path: Path) -> bool:
    """True when ``path`` holds a job (its spec, lock or outcome records)."""
    return any((Path(path) / name).exists() for name in JOB_MARKERS)


def create(job_dir: Path) -> Path:
    """Makes ``job_dir`` ready for a job; returns it absolute.

    A new directory is created private to the user (0700), with ``logs/``. An existing one is
    reused as it is (its mode untouched) when it is a job directory or empty.

    Raises:
        SpecError: ``job_dir`` is a file, or an existing non-empty directory that is not a job
            directory (``.``, ``~``, a project directory): hpc would mix a job's files into it.
    """
    job_dir = job_dir.expanduser().absolute()
    if job_dir.exists() and not job_dir.is_dir():
        raise SpecError("--job-dir", str(job_dir), "a directory (this is a file)", "--job-dir jobs/run1")
    try:
        job_dir.mkdir(parents=True, exist_ok=False, mode=0o700)
        os.chmod(job_dir, 0o700)
    except FileExistsError:
        if not is_job_dir(job_dir):
            entries = sorted(p.name for p in job_dir.iterdir())
            if entries:
                shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                raise SpecError(
                    "--job-dir", str(job_dir),
                    "a new directory (hpc creates it, private to you) or an existing job "
                    "directory (one holding jobspec.json) to resume",
                    f"--job-dir {job_dir / 'jobs' / 'run1'}",
                    f"{job_dir} exists, is not a job directory and holds {len(entries)} "
                    f"entr{'y' if len(entries) == 1 else 'ies'} ({shown}): a job's logs and "
                    "checkpoints would be mixed into it") from None
    JobPaths(job_dir).logs.mkdir(exist_ok=True, mode=0o700)
    return job_dir


def write_atomic(path: Path, text: str, mode: int = 0o600, *, durable: bool = True) -> None:
    """Writes ``text`` to ``path`` atomically (temp file, fsync, rename); the one such writer.

    The temporary file has a fresh random name next to ``path`` and is created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``: a symlink planted at a predictable temporary name can
    not redirect the write to another file, and ``os.replace`` replaces a symlink at ``path``
    itself rather than writing through it. The file gets ``mode`` (less the umask).

    ``durable=False`` skips the fsyncs: readers still see the old or the new text, never a torn
    one, but a crash of the node may lose the update. For bookkeeping written from the
    training loop, where an fsync on a shared filesystem can stall a step. ``durable=True``
    also fsyncs the directory, so the rename itself survives a crash.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for attempt in range(8):  # 48 random bits: only a planted name collides; pick another
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            if attempt == 7:
                raise
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def sweep_task_dir(sweep_dir: Path, index: int) -> Path:
    """Where task ``index`` of a sweep (a Slurm job array) runs: a job directory of its own."""
    return JobPaths(sweep_dir).sweep_task(index)


def claim_path(job_dir: Path, allocation: int, duty: str) -> Path:
    """The file whose atomic creation claims ``duty`` (requeue, record) for one allocation."""
    return JobPaths(job_dir).claim(allocation, duty)


def requeue_request_path(job_dir: Path, allocation: int) -> Path:
    """Under a container, node 0's launcher asks the batch shell (outside it, where scontrol
    works) to requeue the job by writing this file; the shell requeues after srun returns."""
    return JobPaths(job_dir).requeue_request(allocation)


def alloc_log_dir(job_dir: Path, allocation: int) -> Path:
    return JobPaths(job_dir).alloc_logs(allocation)


def rank_log(job_dir: Path, allocation: int, restart: int, rank: int, epoch: int = 0) -> Path:
    """A worker's log: ``alloc-A/restart-K/rank-R.log``; after the rendezvous host was lost and
    the survivors went on in epoch E (runtime.succession), ``alloc-A/epoch-E-restart-K/``."""
    return JobPaths(job_dir).rank_log(allocation, restart, rank, epoch)


def append_outcome(job_dir: Path, outcome: Outcome) -> None:
    """Appends one record to ``outcomes.jsonl`` (durable; on a full disk the job's reserve is
    given back: the one record that says the disk filled up must not be lost to it)."""
    records.append(JobPaths(job_dir).outcomes, outcome, durable=True, job_dir=Path(job_dir))


def read_outcomes(job_dir: Path) -> list[Outcome]:
    """Every readable outcome, oldest first (damaged lines skipped and reported)."""
    return records.read(JobPaths(job_dir).outcomes, Outcome)


def read_json(path: Path) -> dict[str, Any] | None:
    """A bookkeeping file's content, or None when it is missing or unreadable (a node that
    crashed before a non-durable write reached the disk can leave an empty file; a damaged
    one may hold anything but a JSON object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


SLURM_JOB_ID_RE = re.compile(r"[0-9]+(_[0-9]+)?")   # a job, or a task of a job array


def read_slurm_job_id(job_dir: Path) -> str | None:
    """The Slurm job id in ``JOB_DIR/slurm_job_id`` (None when there is none), checked.

    The value goes to ``scancel``, ``squeue`` and ``sacct``: ``--me`` in the file would
    cancel every job of the user. Only a job id (``1234``) or a job array's task
    (``1234_5``) is accepted.

    Raises:
        SpecError: the file holds anything else (named, with its value).
    """
    path = JobPaths(job_dir).slurm_job_id
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return None
    if not SLURM_JOB_ID_RE.fullmatch(text) or len(text) > 40:
        raise SpecError(str(path), text[:80], "a Slurm job id (digits, or ARRAY_TASK such as 1234_5) "
                        "as hpc submit wrote it", "1234",
                        "The file was changed or damaged; nothing was sent to Slurm. Put the job's "
                        "id back (`squeue --me` lists your jobs) or remove the file if no job runs")
    return text


def latest_checkpoint_step(checkpoint_dir: Path) -> int | None:
    """The step the ``latest`` pointer names (``step-000123``), or None."""
    try:
        name = (Path(checkpoint_dir) / jobpaths.CHECKPOINT_LATEST).read_text().strip()
        return int(name.rsplit("-", 1)[-1])
    except (OSError, ValueError):
        return None
