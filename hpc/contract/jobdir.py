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
      wandb_run_id                 one W&B run for the job's whole life
      wandb_state.json, wandb/     the last step logged (exactly-once history), W&B's files
      metrics.jsonl                rank 0's metrics when W&B is disabled or failing
      slurm_job_id                 the Slurm job id (Slurm backends)
      requeue-claim-alloc-<A>      who requeued allocation A (one node, atomically)
      result.json                  written by the example trainer

Job directories are created private to the user (0700): they hold logs and may hold
secrets a user's script prints.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

JOBSPEC = "jobspec.json"
OUTCOMES = "outcomes.jsonl"
EXIT_INTENT = "exit-intent.json"
PROGRESS = "progress.json"
RESULT = "result.json"
SBATCH = "job.sbatch"
SLURM_JOB_ID = "slurm_job_id"
CHECKPOINTS = "checkpoints"            # the default checkpoint directory
WANDB_RUN_ID = "wandb_run_id"
WANDB_STATE = "wandb_state.json"       # the last step logged to W&B (exactly-once history)
METRICS_JSONL = "metrics.jsonl"        # rank 0's metrics when W&B is disabled or failing

OUTCOME_KINDS = ("finished", "preempted", "time_limit", "node_failure", "app_error", "cancelled")


def default_job_dir(name: str, root: Path | None = None, now: float | None = None) -> Path:
    """``./jobs/<name>-<YYYYmmdd-HHMMSS>`` (unique by time)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "job"
    return (root or Path.cwd() / "jobs") / f"{safe}-{stamp}"


def create(job_dir: Path) -> Path:
    """Creates the job directory (and ``logs/``) private to the user; returns it absolute."""
    job_dir = job_dir.expanduser().absolute()
    job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(job_dir, 0o700)
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


def claim_path(job_dir: Path, allocation: int, duty: str) -> Path:
    """The file whose atomic creation claims ``duty`` (requeue, record) for one allocation."""
    return Path(job_dir) / f"{duty}-claim-alloc-{allocation}"


def alloc_log_dir(job_dir: Path, allocation: int) -> Path:
    return Path(job_dir) / "logs" / f"alloc-{allocation}"


def rank_log(job_dir: Path, allocation: int, restart: int, rank: int) -> Path:
    return alloc_log_dir(job_dir, allocation) / f"restart-{restart}" / f"rank-{rank}.log"


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

    def describe(self) -> str:
        """One line for ``hpc status``: what happened and what it cost."""
        parts = [self.kind]
        if self.start_step is not None and self.last_step is not None:
            parts.append(f"steps {self.start_step}->{self.last_step}")
        if self.step is not None:
            parts.append(f"checkpoint {self.step}")
        if self.lost_steps:
            parts.append(f"{self.lost_steps} steps lost")
        return ", ".join(parts) + (f": {self.reason}" if self.reason else "")

    def __post_init__(self) -> None:
        assert self.kind in OUTCOME_KINDS, self.kind


def append_outcome(job_dir: Path, outcome: Outcome) -> None:
    """Appends one record to ``outcomes.jsonl`` (a single write, so lines never interleave)."""
    data = asdict(outcome)
    data["time"] = data["time"] or time.time()
    line = json.dumps(data, sort_keys=True) + "\n"
    fd = os.open(Path(job_dir) / OUTCOMES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
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
            data = json.loads(line)
            known = {k: v for k, v in data.items() if k in Outcome.__dataclass_fields__}
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
