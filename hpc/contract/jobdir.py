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

Job directories that hpc creates are private to the user (0700): they hold logs and may hold
secrets a user's script prints. An existing directory is never re-moded: it is reused only
when it is a job directory already (or empty), so ``--job-dir .`` or ``--job-dir ~`` is
refused instead of being made private and filled with a job's files.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc.contract import diskspace
from hpc.contract.errors import SpecError

JOBSPEC = "jobspec.json"
OUTCOMES = "outcomes.jsonl"
EXIT_INTENT = "exit-intent.json"
PROGRESS = "progress.json"
RESULT = "result.json"
SBATCH = "job.sbatch"
SLURM_JOB_ID = "slurm_job_id"
LOCK = ".hpc-lock.json"
# Any of these makes a directory a job directory that `hpc run`/`hpc submit` may reuse.
JOB_MARKERS = (JOBSPEC, LOCK, OUTCOMES)
CHECKPOINTS = "checkpoints"            # the default checkpoint directory
WANDB_RUN_ID = "wandb_run_id"
WANDB_STATE = "wandb_state.json"       # the last step logged to W&B (exactly-once history)
METRICS_JSONL = "metrics.jsonl"        # rank 0's metrics when W&B is disabled or failing

OUTCOME_KINDS = ("finished", "preempted", "time_limit", "node_failure", "app_error", "cancelled",
                 "hang")


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
    (job_dir / "logs").mkdir(exist_ok=True, mode=0o700)
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
    return Path(sweep_dir) / f"task-{index}"


def claim_path(job_dir: Path, allocation: int, duty: str) -> Path:
    """The file whose atomic creation claims ``duty`` (requeue, record) for one allocation."""
    return Path(job_dir) / f"{duty}-claim-alloc-{allocation}"


REQUEUE_REQUEST_PREFIX = "requeue-request-alloc-"


def requeue_request_path(job_dir: Path, allocation: int) -> Path:
    """Under a container, node 0's launcher asks the batch shell (outside it, where scontrol
    works) to requeue the job by writing this file; the shell requeues after srun returns."""
    return Path(job_dir) / f"{REQUEUE_REQUEST_PREFIX}{allocation}"


def alloc_log_dir(job_dir: Path, allocation: int) -> Path:
    return Path(job_dir) / "logs" / f"alloc-{allocation}"


def rank_log(job_dir: Path, allocation: int, restart: int, rank: int, epoch: int = 0) -> Path:
    """A worker's log: ``alloc-A/restart-K/rank-R.log``; after the rendezvous host was lost and
    the survivors went on in epoch E (runtime.succession), ``alloc-A/epoch-E-restart-K/``."""
    restart_dir = f"restart-{restart}" if not epoch else f"epoch-{epoch}-restart-{restart}"
    return alloc_log_dir(job_dir, allocation) / restart_dir / f"rank-{rank}.log"


@dataclass(frozen=True)
class Outcome:
    """Why one allocation (one run of the job on some nodes) ended."""

    allocation: int
    kind: str
    exit_code: int
    step: int | None = None
    reason: str = ""
    node: str = ""
    slurm_job_id: str = ""
    time: float = 0.0
    restarts: int = 0
    world_size: int = 0
    start_step: int | None = None   # the step this allocation started (resumed) at
    last_step: int | None = None    # the last step it completed (from progress.json)
    lost_steps: int | None = None   # steps done after the last committed checkpoint
    hangs: tuple[str, ...] = ()     # stalls the watchdogs acted on (hangs.jsonl), one line each
    succession: tuple[str, ...] = ()  # rendezvous hosts lost and who took over, one line each
    excluded: tuple[str, ...] = ()  # nodes kept out of the next allocations (exclusions.jsonl)
    stragglers: tuple[str, ...] = ()  # ranks persistently slower than the others, one line each

    def describe(self) -> str:
        """One line for ``hpc status``: what happened and what it cost."""
        parts = [self.kind]
        if self.start_step is not None and self.last_step is not None:
            parts.append(f"steps {self.start_step}->{self.last_step}")
        if self.step is not None:
            parts.append(f"checkpoint {self.step}")
        if self.lost_steps:
            parts.append(f"{self.lost_steps} steps lost")
        if self.succession:
            parts.append(f"rendezvous moved: {self.succession[-1]}")
        if self.hangs and self.kind != "hang":
            parts.append(f"{len(self.hangs)} stall(s) recovered, last: {self.hangs[-1]}")
        if self.stragglers:
            parts.append(f"straggler: {self.stragglers[-1]}")
        if self.excluded:   # "node3 (stall in allocation 0: why...)": the why is in the file
            short = [x.split(": ", 1)[0] + (")" if ": " in x else "") for x in self.excluded]
            parts.append(f"excluded next time: {', '.join(short)}")
        return ", ".join(parts) + (f": {self.reason}" if self.reason else "")

    def __post_init__(self) -> None:
        assert self.kind in OUTCOME_KINDS, self.kind


def append_outcome(job_dir: Path, outcome: Outcome) -> None:
    """Appends one record to ``outcomes.jsonl`` (a single write, so lines never interleave).

    On a full disk the job's reserve (:mod:`hpc.contract.diskspace`) is given back and the
    write tried again: the one record that says the disk filled up must not be lost to it.
    """
    data = asdict(outcome)
    data["time"] = data["time"] or time.time()
    line = (json.dumps(data, sort_keys=True) + "\n").encode()
    fd = os.open(Path(job_dir) / OUTCOMES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        written = 0
        try:
            written = os.write(fd, line)
            if written < len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            if e.errno not in diskspace.DISK_FULL_ERRNOS or not diskspace.give_back_reserve(job_dir):
                raise
            os.write(fd, (b"\n" if written else b"") + line)   # a torn line stays a line of its own
        os.fsync(fd)
    finally:
        os.close(fd)


def read_outcomes(job_dir: Path) -> list[Outcome]:
    path = Path(job_dir) / OUTCOMES
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                data = json.loads(line)
            except ValueError:
                continue        # torn by a full disk; the record follows on the next line
            known = {k: v for k, v in data.items() if k in Outcome.__dataclass_fields__}
            for name in ("hangs", "succession", "excluded", "stragglers"):
                if name in known:
                    known[name] = tuple(known[name] or ())   # null: an older writer
            out.append(Outcome(**known))
    return out


def read_json(path: Path) -> dict[str, Any] | None:
    """A bookkeeping file's content, or None when it is missing or unreadable (a node that
    crashed before a non-durable write reached the disk can leave an empty file)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def latest_checkpoint_step(checkpoint_dir: Path) -> int | None:
    """The step the ``latest`` pointer names (``step-000123``), or None."""
    try:
        name = (Path(checkpoint_dir) / "latest").read_text().strip()
        return int(name.rsplit("-", 1)[-1])
    except (OSError, ValueError):
        return None
