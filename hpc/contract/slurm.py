"""The one place that runs Slurm commands (sbatch, squeue, sacct, scontrol, scancel).

Why one place: a controller that is restarting, overloaded or briefly unreachable answers with
"Socket timed out" or "Unable to contact slurm controller"; a submission that timed out may still
have created a job. Handling that once, here, keeps the rest of the code base free of subprocess
calls and of half-done retry loops. Parsing lives in :mod:`hpc.contract.slurm_parse` (pure, tested on
recorded output); this module only builds argv lists, runs them and decides about retries.

Retries: transient errors (see :data:`TRANSIENT_MARKERS`) and command timeouts are retried with
exponential backoff (tenacity) for at most ``retry_total_s`` seconds, each retry logged. Anything
else raises :class:`SlurmError` at once, phrased for the user.

Double submission: every ``sbatch`` carries ``--comment=hpc-tag:<tag>``. Before a retried submit,
the client looks for a job of the current user with that tag and returns its id instead of
submitting a second job.
"""

from __future__ import annotations

import datetime
import getpass
import logging
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import tenacity

from hpc.contract.errors import HpcError
from hpc.contract.slurm_parse import (
    SACCT_FIELDS, SQUEUE_FORMAT, AccountingRecord, JobInfo, PartitionInfo, QueueEntry,
    parse_cluster_name, parse_sacct, parse_sbatch, parse_show_job, parse_show_partitions, parse_squeue,
)

log = logging.getLogger(__name__)

TAG_PREFIX = "hpc-tag:"
TRANSIENT_MARKERS = (
    "Socket timed out",
    "Unable to contact slurm controller",
    "Slurm temporarily unable to accept job",
    "Resource temporarily unavailable",
    "Connection refused",
    "Connection timed out",
    "Zero Bytes were transmitted or received",
    "Transport endpoint is not connected",
)
"""Substrings of stderr that mean "try again later", not "your request is wrong"."""

Runner = Callable[[Sequence[str], "str | None", float, Mapping[str, str]],
                  "subprocess.CompletedProcess[str]"]
"""How a command is run: ``(argv, stdin_text, timeout_s, env) -> CompletedProcess``."""

T = TypeVar("T")


class SlurmError(HpcError):
    """A Slurm command failed in a way that retrying will not fix (or retries ran out).

    Attributes:
        argv: The command that failed.
        returncode: Its exit status (``None`` if it did not finish).
        stderr: What it printed on stderr.
    """

    def __init__(self, message: str, argv: Sequence[str], returncode: int | None,
                 stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"{message} (command: {' '.join(argv)}; exit status {returncode})")


class TransientSlurmError(SlurmError):
    """The controller could not be reached or was busy; the same request may succeed later."""


class UnknownJobError(SlurmError):
    """The controller does not know the job (finished more than MinJobAge ago, or never ran)."""


def controller_unavailable(stderr: str) -> bool:
    """True if a failed command's stderr says the controller was unreachable or busy."""
    return any(marker.lower() in stderr.lower() for marker in TRANSIENT_MARKERS)


def _clean_stderr(stderr: str) -> str:
    """``sbatch: error: Batch job submission failed: X`` -> ``Batch job submission failed: X``."""
    lines = []
    for line in stderr.splitlines():
        line = line.strip()
        for prefix in ("error: ", "fatal: "):
            if prefix in line and line.split(prefix, 1)[0].rstrip(": ").isidentifier():
                line = line.split(prefix, 1)[1]
        if line and line not in lines:
            lines.append(line)
    return "; ".join(lines) or "(no error message)"


_JOB_ID = re.compile(r"[0-9]+([_+][0-9]+)?")


def _job_id(job_id: str) -> str:
    """``job_id`` if it is one (``1234``, an array task ``1234_5``, a het component ``1234+1``):
    the last guard before a command that acts on jobs (``--me`` would cancel all of the user's)."""
    if not _JOB_ID.fullmatch(str(job_id)):
        raise ValueError(f"{job_id!r} is not a Slurm job id (such as 1234 or 1234_5)")
    return job_id


IN_FLIGHT: set[int] = set()
"""PIDs of the Slurm commands this process is running now. A job's launcher passes the signals
it gets on to its children (the workers); a command it runs at that moment (``scontrol show
job`` on a warning) is its child too, and would die of the forwarded signal (seen on the test
cluster: exit status -12, SIGUSR2). The launcher skips these."""


def _subprocess_runner(argv: Sequence[str], stdin: str | None, timeout_s: float,
                       env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env))
    IN_FLIGHT.add(proc.pid)
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()   # as subprocess.run: not for its pipes, which a grandchild may hold open
        raise
    finally:
        IN_FLIGHT.discard(proc.pid)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


class SlurmClient:
    """Runs Slurm commands with retries on transient controller errors.

    Args:
        env: Environment for the commands (default: this process's); pass ``SLURM_CONF`` here.
        retry_total_s: Give up retrying a transient error after this many seconds.
        command_timeout_s: Kill one command after this many seconds (counts as transient).
        runner: How to run a command; tests of the retry decision pass a fake.
        user: Whose jobs a tag lookup searches (default: the current user).
    """

    def __init__(self, env: Mapping[str, str] | None = None, *, retry_total_s: float = 60.0,
                 command_timeout_s: float = 30.0, runner: Runner | None = None,
                 user: str | None = None) -> None:
        if retry_total_s < 0 or command_timeout_s <= 0:
            raise ValueError("retry_total_s must be >= 0 and command_timeout_s > 0, got "
                             f"{retry_total_s} and {command_timeout_s}")
        self.env: Mapping[str, str] = dict(os.environ if env is None else env)
        self.retry_total_s = retry_total_s
        self.command_timeout_s = command_timeout_s
        self._runner = runner or _subprocess_runner
        self._user = user

    # ------------------------------------------------------------------ running

    def _run_once(self, argv: Sequence[str], what: str, stdin: str | None = None,
                  ok_stderr: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
        """Run one command once; raise TransientSlurmError or SlurmError on failure."""
        try:
            proc = self._runner(argv, stdin, self.command_timeout_s, self.env)
        except subprocess.TimeoutExpired as exc:
            raise TransientSlurmError(f"{what}: no answer within {self.command_timeout_s:.0f} s",
                                      argv, None, str(exc.stderr or "")) from exc
        except FileNotFoundError as exc:
            raise SlurmError(f"{what}: the Slurm command {argv[0]!r} is not installed here; run "
                             "this on a login node of the cluster", argv, None, "") from exc
        if proc.returncode == 0 or any(s in proc.stderr for s in ok_stderr):
            return proc
        cls = TransientSlurmError if controller_unavailable(proc.stderr) else SlurmError
        raise cls(f"{what}: {_clean_stderr(proc.stderr)}", argv, proc.returncode, proc.stderr)

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s: transient Slurm error, retry %d in %.1f s: %s", what,
                        state.attempt_number, state.next_action.sleep if state.next_action else 0,
                        exc)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientSlurmError),
            stop=tenacity.stop_after_delay(self.retry_total_s),
            wait=tenacity.wait_exponential(multiplier=0.5, min=0.5, max=10.0),
            before_sleep=before_sleep, reraise=True)
        return retrying(fn)

    def _run(self, argv: Sequence[str], what: str, stdin: str | None = None,
             ok_stderr: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
        return self._retrying(lambda: self._run_once(argv, what, stdin, tuple(ok_stderr)), what)

    # ------------------------------------------------------------------ submit

    def submit(self, script: Path | str, args: Sequence[str] = (), tag: str | None = None) -> str:
        """Submit a batch script with ``sbatch --parsable`` and return the job id.

        Args:
            script: A path to the script, or the script's text (sent on stdin).
            args: More sbatch options, e.g. ``["-N", "2", "--partition", "gpu"]``.
            tag: Unique submission tag (default: a new uuid); stored as ``--comment=hpc-tag:TAG``
                so that a retried submission finds the job instead of submitting twice.

        Raises:
            SlurmError: if sbatch rejects the job, or the controller stays unreachable.
            ValueError: if ``args`` already sets ``--comment`` (the tag lives there).
        """
        if any(a == "--comment" or a.startswith("--comment=") for a in args):
            raise ValueError("sbatch --comment is reserved for the submission tag; put your note "
                             "in the job name (--job-name) instead")
        tag = tag or uuid.uuid4().hex
        argv = ["sbatch", "--parsable", f"--comment={TAG_PREFIX}{tag}", *args]
        stdin = None
        if isinstance(script, Path):
            argv.append(str(script))
        else:
            stdin = script
        tried = False
        # Accounting outlives clusters and reuses nothing but job ids: only a job submitted since
        # this call began (less a margin for clock skew) can be ours.
        since = datetime.datetime.now() - datetime.timedelta(minutes=5)

        def attempt() -> str:
            nonlocal tried
            if tried:  # the last try may have created the job before failing
                existing = self.find_by_tag(tag, since=since)
                if existing is not None:
                    log.warning("sbatch: job %s with tag %s exists already; not submitting again",
                                existing, tag)
                    return existing
            tried = True
            return parse_sbatch(self._run_once(argv, "sbatch rejected the job", stdin).stdout
                                ).job_id

        return self._retrying(attempt, "sbatch")

    def find_by_tag(self, tag: str, since: datetime.datetime | None = None) -> str | None:
        """Id of the current user's job submitted with ``tag``, or None (squeue, then sacct).

        Args:
            tag: The submission tag given to :meth:`submit`.
            since: Look in accounting only at jobs active since then (sacct's default: midnight).
        """
        user = self._user or getpass.getuser()
        comment = f"{TAG_PREFIX}{tag}"
        out = self._run_once(["squeue", "--noheader", "--states=all", f"--user={user}",
                              f"--format={SQUEUE_FORMAT}"], "squeue failed").stdout
        for entry in parse_squeue(out):
            if entry.comment == comment:
                return entry.job_id
        try:
            window = [f"--starttime={since:%Y-%m-%dT%H:%M:%S}"] if since is not None else []
            out = self._run_once(["sacct", "--parsable2", "--noheader", f"--user={user}", *window,
                                  f"--format={','.join(SACCT_FIELDS)}"], "sacct failed").stdout
        except TransientSlurmError:
            raise
        except SlurmError:  # no accounting on this cluster: squeue was the only source
            return None
        for record in parse_sacct(out):
            if record.step is None and record.comment == comment:
                return record.job_id
        return None

    # ------------------------------------------------------------------ query

    def queue(self, job_ids: Iterable[str]) -> dict[str, QueueEntry]:
        """The controller's view of many jobs in one squeue call; ids it forgot are missing."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        # --array: one line per array task (a sweep's pending tasks would otherwise be one
        # collapsed line, 123_[2-5%2], matching no task id)
        proc = self._run(["squeue", "--noheader", "--array", "--states=all", f"--jobs={','.join(ids)}",
                          f"--format={SQUEUE_FORMAT}"], "squeue failed",
                         ok_stderr=("Invalid job id specified",))
        if proc.returncode != 0:
            return {}
        return {e.job_id: e for e in parse_squeue(proc.stdout)}

    def accounting(self, job_ids: Iterable[str]) -> tuple[AccountingRecord, ...]:
        """All sacct records (every run with ``--duplicates``, and steps) of the jobs, in order."""
        ids = sorted(set(job_ids))
        if not ids:
            return ()
        proc = self._run(["sacct", "--parsable2", "--noheader", "--duplicates",
                          f"--jobs={','.join(ids)}", f"--format={','.join(SACCT_FIELDS)}"],
                         "sacct failed")
        return parse_sacct(proc.stdout)

    def show_job(self, job_id: str) -> JobInfo:
        """``scontrol show job -o`` for one job.

        Raises:
            UnknownJobError: if the controller no longer knows the job.
        """
        argv = ["scontrol", "show", "job", "-o", job_id]
        proc = self._run(argv, "scontrol show job failed", ok_stderr=("Invalid job id specified",))
        if proc.returncode != 0:
            raise UnknownJobError(
                f"job {job_id} is not known to the Slurm controller (it ended more than "
                "MinJobAge ago, or never existed); use sacct for finished jobs",
                argv, proc.returncode, proc.stderr)
        return parse_show_job(proc.stdout)

    def cluster_name(self) -> str:
        """The cluster's ``ClusterName`` (``scontrol show config``); job ids are unique only
        within one cluster (a fresh cluster starts again at 1)."""
        return parse_cluster_name(self._run(["scontrol", "show", "config"],
                                            "scontrol show config failed").stdout)

    def partitions(self) -> tuple[PartitionInfo, ...]:
        """All partitions (``scontrol show partition -o``)."""
        return parse_show_partitions(self._run(["scontrol", "show", "partition", "-o"],
                                               "scontrol show partition failed").stdout)

    def show_partition(self, name: str) -> PartitionInfo:
        """One partition by name.

        Raises:
            SlurmError: if there is no such partition (the message lists the ones that exist).
        """
        found = self.partitions()
        for part in found:
            if part.name == name:
                return part
        valid = ", ".join(p.name for p in found) or "(none)"
        raise SlurmError(f"there is no Slurm partition {name!r}; partitions are: {valid}",
                         ["scontrol", "show", "partition", "-o"], 0, "")

    # ------------------------------------------------------------------ act

    def ping(self) -> bool:
        """True when the controller answers (``scontrol ping``); a node cut off from the
        network gets no answer."""
        proc = self._run_once(["scontrol", "ping"], "scontrol ping failed", None, ())
        return proc.returncode == 0 and "UP" in proc.stdout

    def requeue(self, job_id: str) -> None:
        """Requeue a job (``scontrol requeue``): it ends and goes back to pending, same id."""
        self._run(["scontrol", "requeue", _job_id(job_id)], f"could not requeue job {job_id}")

    def resize(self, job_id: str, nodes: Sequence[str]) -> None:
        """Shrinks a running job to ``nodes`` (``scontrol update JobId=J NodeList=...``); the
        others go back to Slurm. Slurm refuses to drop the batch host."""
        self._run(["scontrol", "update", f"JobId={_job_id(job_id)}", f"NodeList={','.join(nodes)}"],
                  f"could not shrink job {job_id} to {','.join(nodes)}")

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None:
        """Cancel a job, or only send it ``signal`` (e.g. ``"USR2"``) when one is given.

        Args:
            job_id: The job.
            signal: Signal name or number to send instead of cancelling.
            batch_only: Signal only the batch shell, not every process of every step.
        """
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        if batch_only:
            argv.append("--batch")
        what = f"could not signal job {job_id}" if signal else f"could not cancel job {job_id}"
        self._run([*argv, _job_id(job_id)], what)

    def srun(self, argv: Sequence[str], *, nodes: int, extra: Sequence[str] = ()) -> int:
        """Run ``argv`` once per node of the current allocation (``srun --ntasks-per-node=1``).

        Output streams to this process's stdout/stderr; returns srun's exit status. Used by
        ``hpc doctor --nodes N`` inside ``salloc``/``sbatch``; not retried (it is not idempotent).
        """
        cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *extra, *argv]
        try:
            return subprocess.run(cmd, env=dict(self.env)).returncode
        except FileNotFoundError as exc:
            raise SlurmError("srun is not installed here; run this inside a Slurm allocation",
                             cmd, None, "") from exc
