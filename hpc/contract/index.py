"""The user's job index: which jobs were submitted from here, and where their directories are.

``hpc submit`` appends one line per job to ``$HPC_HOME/jobs.jsonl`` (default ``~/.hpc``,
private to the user), and ``hpc run`` one per run (no job id; its key is the job directory, so
a directory run again is one job); ``hpc status``, ``hpc logs`` and ``hpc cancel`` resolve a
job id or a job directory through it.

Job ids are unique only within one Slurm cluster (a rebuilt cluster, or another cluster sharing
the home directory, starts again at 1), so each record names its cluster (``ClusterName``), and
a job id resolves to the record of the cluster this command talks to. Records written before
that have ``cluster == ""``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from hpc.contract import jobdir, jobpaths, records
from hpc.contract.errors import SpecError
from hpc.contract.jobpaths import hpc_home
from hpc.contract.records import JobRecord
from hpc.contract.slurm import SlurmClient, SlurmError


_CLUSTER: dict[str, str] = {}


def current_cluster(client: SlurmClient | None = None,
                    env: Mapping[str, str] = os.environ) -> str:
    """The name of the cluster this process talks to: ``SLURM_CLUSTER_NAME`` inside a job, else
    ``scontrol show config``'s ``ClusterName`` (asked once per process); ``""`` if unknown."""
    if env.get("SLURM_CLUSTER_NAME"):
        return env["SLURM_CLUSTER_NAME"]
    conf = env.get("SLURM_CONF", "")
    if conf not in _CLUSTER:
        try:
            _CLUSTER[conf] = (client or SlurmClient(retry_total_s=10)).cluster_name()
        except SlurmError:
            return ""
    return _CLUSTER[conf]


def record_job(record: JobRecord, home: Path | None = None) -> None:
    """Appends a job to ``$HPC_HOME/jobs.jsonl`` (private to the user)."""
    home = home or hpc_home()
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    records.append(home / jobpaths.JOBS, record)


def read_index(home: Path | None = None) -> list[JobRecord]:
    """All recorded jobs, oldest first (damaged lines skipped and reported)."""
    return records.read((home or hpc_home()) / jobpaths.JOBS, JobRecord)


def resolve(ref: str, home: Path | None = None, cluster: str = "") -> JobRecord:
    """A job id or a job directory -> its record (job id and directory).

    A job directory made by ``hpc run`` (no Slurm job id) resolves to a record with
    ``job_id == ""``. A job id resolves to the newest record of ``cluster`` (the cluster this
    command talks to), else to the newest record that names no cluster, else to the newest of
    another cluster (which callers show, never act on: see :meth:`JobRecord.elsewhere`).

    Raises:
        SpecError: when neither the index nor the directory knows the job.
    """
    path = Path(ref).expanduser()
    job_id = jobdir.read_slurm_job_id(path) if path.is_dir() else None
    if job_id is not None:
        records = [r for r in read_index(home) if r.job_id == job_id
                   and Path(r.job_dir) == path.absolute()]
        named = records[-1].cluster if records else ""
        return JobRecord(job_id, str(path.absolute()), path.name, "", 0.0, named)
    if path.is_dir() and jobdir.is_job_dir(path):   # hpc run: outcomes, no Slurm job
        return JobRecord("", str(path.absolute()), path.name, "local", 0.0)
    records = read_index(home)
    same = [r for r in records if r.job_id == ref]
    for wanted in (lambda r: cluster and r.cluster == cluster, lambda r: not r.cluster,
                   lambda r: True):
        found = [r for r in same if wanted(r)]
        if found:
            return found[-1]
    array_id, _, task = ref.partition("_")
    for rec in reversed(records):   # a task of a sweep we submitted: ARRAY_TASK
        if task.isascii() and task.isdigit() and rec.job_id == array_id and rec.job_dir:
            task_dir = jobdir.sweep_task_dir(Path(rec.job_dir), int(task))
            if task_dir.is_dir():
                return JobRecord(ref, str(task_dir), f"{rec.name}[{task}]", rec.backend,
                                 rec.submitted, rec.cluster)
    if jobdir.SLURM_JOB_ID_RE.fullmatch(ref):   # ASCII digits only (\d and int() take any script)
        return JobRecord(ref, "", "", "", 0.0)  # a job id we did not submit: Slurm may know it
    raise SpecError("JOB", ref, "a Slurm job id or a job directory (made by hpc submit, "
                    "hpc sweep or hpc run)", "hpc status 1234")
