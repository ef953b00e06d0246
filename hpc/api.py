"""The Python API: submit, watch and collect jobs from a script or a notebook.

The CLI is a thin layer over these functions; they raise what it prints (:class:`SpecError`
for a bad value, :class:`UsageError` for a request Slurm or the job directory refuses,
:class:`HpcError` for an operational failure) instead of printing and returning a status.
Importing this module imports no torch, wandb or torchx::

    import hpc

    spec = hpc.JobSpec(script="/home/me/train.py", job_dir="/scratch/me/jobs/gpt-1",
                       job_name="gpt", nodes=(2, 4), time_limit_s=4 * 3600)
    job = hpc.submit(spec)            # a Job handle
    job.wait(timeout=3600)            # until it ends (polls squeue/sacct politely)
    job.outcomes()                    # why each allocation ended
    job.result()                      # the script's JOB_DIR/result.json, if it wrote one

    job = hpc.Job.attach("1234")      # or a job directory, from any later process
"""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hpc import backends, node_history, prechecks
from hpc.contract import joblock, jobdir
from hpc.contract.errors import UsageError
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.index import JobRecord, current_cluster, record_job, resolve


def submit(spec: JobSpec, backend: str = backends.DEFAULT, *,
           on_notes: Callable[[Sequence[str]], None] | None = None) -> Job:
    """Checks ``spec`` against the cluster, creates the job directory and submits it.

    Unless ``spec.avoid_bad_nodes`` is False, the nodes that faulted in the user's recent jobs
    (:mod:`hpc.node_history`) are added to ``spec.exclude``; ``jobspec.json`` records the result.

    Args:
        spec: The job (its ``job_dir`` absolute).
        backend: A registered backend name (``hpc.backends.names()``).
        on_notes: Called with advice about a valid but probably unmeant request (the CLI
            prints it); ignored when None.

    Returns:
        The submitted job.

    Raises:
        SpecError: a value the backend or the cluster cannot take (unknown partition, too many
            nodes, a secret in the arguments...); nothing was created.
        UsageError: Slurm refused the job (its words, explained), or the job directory is in
            use by another job; nothing was submitted.
    """
    chosen = backends.get(backend)
    chosen.plan(spec)  # renders and refuses secrets before anything is created
    client = SlurmClient()
    partition = prechecks.check_partition(spec, client.partitions())
    advice = prechecks.notes(spec, partition)
    # The nodes that faulted in the user's recent jobs on this cluster stay out (its --exclude).
    plan, avoiding = node_history.plan_avoiding(chosen, spec, partition=partition,
                                                cluster=current_cluster(client))
    spec = plan.spec
    if avoiding:
        advice.append(avoiding)
    if advice and on_notes is not None:
        on_notes(advice)
    job_dir = Path(spec.job_dir)
    fresh = not job_dir.exists()
    jobdir.create(job_dir)
    joblock.acquire(job_dir, "hpc submit")  # held by the Slurm job once submitted
    jobdir.write_atomic(job_dir / jobdir.JOBSPEC, spec.to_json())
    started = time.time()
    try:
        job_id = chosen.execute(plan, client)
    except SlurmError as e:
        if fresh:
            shutil.rmtree(job_dir, ignore_errors=True)
        message = prechecks.explain_rejection(e.stderr or str(e))
        if message is None:
            raise
        raise UsageError(message) from e
    jobdir.write_atomic(job_dir / jobdir.SLURM_JOB_ID, job_id + "\n")

    record = JobRecord(job_id, str(job_dir), spec.job_name, backend, started,
                       current_cluster(client))
    record_job(record)
    return Job(record)


def sweep(spec: JobSpec, arg_sets: Sequence[Sequence[str]], *, throttle: int = 0,
          on_notes: Callable[[Sequence[str]], None] | None = None) -> Sweep:
    """Submits one Slurm job array, a task per argument set (see :mod:`hpc.sweeps`).

    Args:
        spec: The job every task runs; ``spec.job_dir`` becomes the sweep directory.
        arg_sets: Script arguments per task, after ``spec.script_args``
            (``hpc.sweeps.expand_grid([("lr", ["1e-3", "3e-4"])])``).
        throttle: At most this many tasks at once (0: no limit).
        on_notes: Called with advice about the request, as for :func:`submit` (the nodes
            avoided among them: those that faulted in recent jobs, as for :func:`submit`).

    Raises:
        SpecError, UsageError: as :func:`submit`; nothing is submitted.
    """
    from hpc import sweeps

    plan = sweeps.plan(spec, arg_sets, throttle=throttle)   # its own errors first
    client = SlurmClient()
    partition = prechecks.check_partition(spec, client.partitions())
    advice = prechecks.notes(spec, partition)
    # The nodes that faulted in the user's recent jobs stay out of every task, as for submit().
    avoided = node_history.avoid(spec, partition=partition, cluster=current_cluster(client))
    if avoided.spec is not spec:
        spec = avoided.spec
        plan = sweeps.plan(spec, arg_sets, throttle=throttle)
    if avoided.line:
        advice.append(avoided.line)
    if advice and on_notes is not None:
        on_notes(advice)
    fresh = not Path(spec.job_dir).exists()
    try:
        record = sweeps.submit(plan, client)
    except SlurmError as e:
        if fresh:
            shutil.rmtree(spec.job_dir, ignore_errors=True)
        message = prechecks.explain_rejection(e.stderr or str(e))
        if message is None:
            raise
        raise UsageError(message) from e
    return Sweep(record)


def run(spec: JobSpec) -> int:
    """Runs ``spec`` on this machine (``hpc run``), blocking; returns the launchers' status
    (0 finished, 75 stopped and resumable, 1 application error, 2 refused)."""
    from hpc.backends import local

    return local.run(spec)


class Job:
    """A submitted job: its Slurm id and its job directory.

    Get one from :func:`submit` or :meth:`attach`. Every method reads Slurm (one squeue and
    one sacct call) or the job directory; nothing is cached.
    """

    def __init__(self, record: JobRecord) -> None:
        self.record = record

    @classmethod
    def attach(cls, ref: str | Path) -> Job:
        """The job with this Slurm id (from your job index) or this job directory.

        Raises:
            SpecError: when neither the index nor the directory knows the job.
        """
        return cls(resolve(str(ref)))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def job_dir(self) -> Path:
        return Path(self.record.job_dir)

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, job_dir={self.record.job_dir!r})"

    def status(self) -> Any:
        """The job's state, nodes, requeues and allocations (a :class:`hpc.status.JobView`)."""
        from hpc.status import collect

        return collect(SlurmClient(), [self.record])[0]

    def wait(self, timeout: float | None = None, *, max_interval_s: float = 30.0) -> Any:
        """Blocks until the job has ended (finished, failed, cancelled; not a requeue).

        Polls with backoff (1 s, doubling while nothing changes, at most ``max_interval_s``).

        Returns:
            The final :class:`hpc.status.JobView`.

        Raises:
            TimeoutError: when ``timeout`` seconds pass first (the job keeps running).
        """
        return _wait([self.record], timeout, max_interval_s)[0]

    def outcomes(self) -> list[jobdir.Outcome]:
        """Why each allocation ended (``outcomes.jsonl``), oldest first."""
        return jobdir.read_outcomes(self.job_dir)

    def result(self) -> dict[str, Any] | None:
        """The script's ``JOB_DIR/result.json`` (None until it writes one)."""
        return jobdir.read_json(self.job_dir / jobdir.RESULT)

    def logs(self, rank: int = 0) -> str:
        """Rank ``rank``'s output so far, across requeues and restarts, in order."""
        return "".join(_read_text(p) for p in self._log_files(rank))

    def follow(self, rank: int = 0, *, max_interval_s: float = 30.0) -> Iterator[str]:
        """Yields rank ``rank``'s output as it is written, until the job has ended."""
        from hpc.logs import Follower, following
        from hpc.status import Poller

        buffer = io.StringIO()
        follower = Follower(lambda: self._log_files(rank), buffer)
        poller = Poller(SlurmClient(), [self.record], max_interval_s=max_interval_s)
        for state in following(follower, lambda: poller.poll()[0].state):
            text = buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
            if text:
                yield text
            if state is None:
                poller.wait()

    def cancel(self) -> None:
        """Cancels the job (``scancel``); the runtime records it as ``cancelled``."""
        SlurmClient().cancel(self.job_id)

    def _log_files(self, rank: int) -> list[Path]:
        from hpc.logs import log_files

        return log_files(self.job_dir, self.job_id, rank)


def _wait(records: Sequence[JobRecord], timeout: float | None, max_interval_s: float) -> list[Any]:
    """Polls ``records`` (one squeue + one sacct per poll, with backoff) until all have ended."""
    from hpc.status import Poller

    poller = Poller(SlurmClient(), records, max_interval_s=max_interval_s)
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        views = poller.poll()
        if all(v.terminal for v in views):
            return views
        if end is not None and time.monotonic() + poller.interval > end:
            running = ", ".join(f"{v.job_id} {v.state}" for v in views if not v.terminal)
            raise TimeoutError(f"still running after {timeout:g} s: {running}")
        poller.wait()


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


class Sweep:
    """A submitted sweep: one Slurm job array, one :class:`Job` per task."""

    def __init__(self, record: JobRecord) -> None:
        from hpc import sweeps

        self.record = record
        self.jobs = [Job(r) for r in sweeps.task_records(record)]
        if not self.jobs:
            raise UsageError(f"{record.job_dir or record.job_id} is not a sweep (no sweep.json)")

    @classmethod
    def attach(cls, ref: str | Path) -> Sweep:
        """The sweep with this array id (from your job index) or this sweep directory."""
        return cls(resolve(str(ref)))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def __repr__(self) -> str:
        return f"Sweep({self.job_id!r}, {len(self.jobs)} tasks)"

    def status(self) -> list[Any]:
        """One :class:`hpc.status.JobView` per task."""
        from hpc.status import collect

        return collect(SlurmClient(), [j.record for j in self.jobs])

    def wait(self, timeout: float | None = None, *, max_interval_s: float = 30.0) -> list[Any]:
        """Blocks until every task has ended; returns their final views."""
        return _wait([j.record for j in self.jobs], timeout, max_interval_s)

    def results(self) -> list[dict[str, Any]]:
        """One row per task: its arguments, last outcome and ``result.json`` fields."""
        from hpc import sweeps

        args = {t["index"]: t["args"] for t in (sweeps.read(self.record.job_dir) or {}).get("tasks", [])}
        rows = load_results(self.jobs)
        for i, row in enumerate(rows):
            row["args"] = args.get(i, [])
        return rows

    def cancel(self) -> None:
        """Cancels every task of the array."""
        SlurmClient().cancel(self.job_id)


def load_results(jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """One row per job for a table (e.g. ``pandas.DataFrame(hpc.api.load_results(jobs))``):
    the job id and directory, its last outcome and its ``result.json`` fields."""
    rows = []
    for job in jobs:
        outcomes = job.outcomes()
        row: dict[str, Any] = {"job_id": job.job_id, "job_dir": str(job.job_dir),
                               "outcome": outcomes[-1].kind if outcomes else ""}
        row.update(job.result() or {})
        rows.append(row)
    return rows


__all__ = ["submit", "sweep", "run", "Job", "Sweep", "load_results"]
