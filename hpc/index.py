"""The user's job index: which jobs were submitted from here, and where their directories are.

``hpc submit`` appends one line per job to ``$HPC_HOME/jobs.jsonl`` (default ``~/.hpc``,
private to the user); ``hpc status``, ``hpc logs`` and ``hpc cancel`` resolve a job id or a
job directory through it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.contract import jobdir
from hpc.contract.errors import SpecError


def hpc_home(env: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where the job index lives: ``$HPC_HOME``, else ``~/.hpc``."""
    return Path(env.get("HPC_HOME") or Path.home() / ".hpc")


@dataclass(frozen=True)
class JobRecord:
    """One line of the job index: a submitted job and where its directory is."""

    job_id: str
    job_dir: str
    name: str
    backend: str
    submitted: float


def record_job(record: JobRecord, home: Path | None = None) -> None:
    """Appends a job to ``$HPC_HOME/jobs.jsonl`` (private to the user)."""
    home = home or hpc_home()
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(home / "jobs.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(asdict(record), sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def read_index(home: Path | None = None) -> list[JobRecord]:
    """All recorded jobs, oldest first (unreadable lines are skipped)."""
    path = (home or hpc_home()) / "jobs.jsonl"
    out: list[JobRecord] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(JobRecord(**json.loads(line)))
            except (ValueError, TypeError):
                continue
    return out


def resolve(ref: str, home: Path | None = None) -> JobRecord:
    """A job id or a job directory -> its record (job id and directory).

    Raises:
        SpecError: when neither the index nor the directory knows the job.
    """
    path = Path(ref).expanduser()
    if path.is_dir() and (path / jobdir.SLURM_JOB_ID).exists():
        job_id = (path / jobdir.SLURM_JOB_ID).read_text().strip()
        return JobRecord(job_id, str(path.absolute()), path.name, "", 0.0)
    records = read_index(home)
    for rec in reversed(records):
        if rec.job_id == ref:
            return rec
    array_id, _, task = ref.partition("_")
    for rec in reversed(records):   # a task of a sweep we submitted: ARRAY_TASK
        if task.isdigit() and rec.job_id == array_id and rec.job_dir:
            task_dir = jobdir.sweep_task_dir(Path(rec.job_dir), int(task))
            if task_dir.is_dir():
                return JobRecord(ref, str(task_dir), f"{rec.name}[{task}]", rec.backend, rec.submitted)
    if re.fullmatch(r"\d+(_\d+)?", ref):
        return JobRecord(ref, "", "", "", 0.0)  # a job id we did not submit: Slurm may know it
    raise SpecError("JOB", ref, "a Slurm job id or a job directory holding slurm_job_id",
                    "hpc status 1234")
