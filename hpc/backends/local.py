"""The local backend: ``hpc run``, the embedded default. No Slurm needed.

It writes the same job directory a Slurm job writes, then starts one per-node launcher per
(simulated) node on this machine, all meeting at a c10d rendezvous on 127.0.0.1 on a free
port. Rank 0's output streams to the terminal; every rank's output is in the job
directory.

``hpc run`` owns its job: nothing it started outlives it.

- It holds the job directory's lock (:mod:`hpc.contract.joblock`) while the job runs; a
  second ``hpc run`` or ``hpc submit`` on the same directory is refused.
- The first Ctrl-C (SIGINT) is passed on as the job's warning signal (``--signal``, SIGUSR2 by
  default): the one a time limit or a preemption sends, which the Session and scripts with
  their own handler save on; they exit and the job ends resumable (status 75), with the exact
  command that resumes it. Workers that ignore the warning get SIGTERM ~27 s later. A second
  Ctrl-C stops at once (SIGINT to the launchers: torch's agent ends its workers), and still
  says how to resume (from the last committed checkpoint). SIGTERM and SIGHUP (the terminal
  closed, the ssh session dropped) are passed on as SIGTERM, which the launchers pass to the
  workers (the Session takes it as a warning too). The warning signal sent to ``hpc run`` by
  hand (``kill -USR2 PID``) goes to the workers as is: the way to test a script's handler.
- The launchers run in their own session (a terminal's signals reach only ``hpc run``, which
  decides), and the kernel sends them SIGTERM when ``hpc run`` dies, even by SIGKILL
  (``PR_SET_PDEATHSIG``): the workers save and stop, and a launcher whose ``hpc run`` is gone
  stops them for good after a grace period (:mod:`runtime.launch.parent_watch`). The workers are bound
  to their launcher in turn (:mod:`runtime.worker`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import shlex
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc.contract import diskspace, joblock, jobdir
from hpc.contract import environment as job_env
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.records import JobRecord
from hpc.contract.index import record_job
from hpc.prechecks import checkpoint_warning
from hpc.secrets import check_no_secrets


def rdzv_listener(port: int = 0) -> socket.socket:
    """The rendezvous store's listening socket, on loopback (``port`` 0: a free one).

    Bound and listening here, then handed to node 0's launcher, whose store serves on it
    (``--rdzv-listen-fd``): no other process can take the port between its choice and the
    store's start (other jobs' connections draw from the same ephemeral ports), launchers that
    connect early wait in its backlog, and nothing off this machine reaches the job's store.

    Raises:
        SpecError: ``--rdzv-port`` names a port this machine cannot listen on.
    """
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1024)
    except OSError as e:
        s.close()
        raise SpecError("--rdzv-port", port, "a TCP port free on this machine, or 0 for any free one",
                        "--rdzv-port 0", f"binding 127.0.0.1:{port} failed: {e.strerror}") from None
    return s


def _refuse_full_disk(job_dir: Path, problem: str) -> SpecError:
    return SpecError("--job-dir", str(job_dir), "a directory on a filesystem with free space",
                     "--job-dir /scratch/$USER/run1", problem)


def prepare(spec: JobSpec) -> tuple[Path, joblock.JobLock]:
    """Creates (or reuses) the job directory, locks it and writes ``jobspec.json``.

    Returns:
        The job directory and its lock, which the caller releases when the job has ended.

    Raises:
        SpecError: for a secret in ``spec.env`` or the script's arguments (nothing is created),
            a ``--job-dir`` that is not a job directory, one in use by another job
            (:class:`~hpc.contract.joblock.JobDirInUse`), or a full disk.
    """
    check_no_secrets(spec)
    problem = diskspace.check_room(Path(spec.job_dir))
    if problem:
        raise _refuse_full_disk(Path(spec.job_dir), problem)
    job_dir = jobdir.create(Path(spec.job_dir))
    lock = joblock.acquire(job_dir, "hpc run")
    try:
        path = job_dir / jobdir.JOBSPEC
        if path.exists():
            old = JobSpec.load(job_dir)
            if (old.script, old.nproc_per_node) != (spec.script, spec.nproc_per_node):
                print(f"hpc: note: {job_dir} held another job's spec; it is replaced "
                      "(checkpoints there are reused when compatible)", file=sys.stderr)
        jobdir.write_atomic(path, spec.to_json())
    except OSError as e:
        lock.release()
        if e.errno in diskspace.DISK_FULL_ERRNOS:
            raise _refuse_full_disk(job_dir, diskspace.refusal(job_dir)) from None
        raise
    except BaseException:
        lock.release()
        raise
    return job_dir, lock


PR_SET_PDEATHSIG = 1


def _die_with_parent(prctl: Any, parent: int) -> None:
    """In a launcher, between fork and exec: SIGTERM when ``hpc run`` dies (even by SIGKILL)."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:        # it died before prctl: nobody will ever signal us
        os.kill(os.getpid(), signal.SIGKILL)


def _say(message: str) -> None:
    """Prints to the user's terminal, which may be gone (SIGHUP): then says nothing."""
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError as e:
        if e.errno not in (errno.EIO, errno.EPIPE):
            raise
    except RuntimeError:
        pass                            # a signal arrived while the main thread was printing


def launcher_argv(spec: JobSpec, job_dir: Path, node_rank: int, port: int, run_id: str,
                  listen_fd: int | None = None) -> list[str]:
    """Node ``node_rank``'s launcher command; ``listen_fd``: node 0's store socket (inherited)."""
    held = ["--rdzv-listen-fd", str(listen_fd)] if listen_fd is not None else []
    return [spec.python, "-m", "runtime.launch", "--job-dir", str(job_dir), "--node-rank",
            str(node_rank), "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port), "--run-id", run_id,
            "--local", *held]


def resume_hint(last: jobdir.Outcome, job_dir: Path) -> str:
    """How to go on after a stop, saying only what is known (pure): the checkpoint's step, else
    the step reached, else that hpc saw no checkpoint (a script's own snapshot is not seen)."""
    how = f"run the same command with --job-dir {job_dir}"
    if last.step is not None:
        return f"to resume from step {last.step}, {how}"
    if last.last_step is not None:
        return (f"no checkpoint was saved (the run reached step {last.last_step}); to start "
                f"it again, {how}")
    return (f"to resume, {how} (hpc saw no checkpoint of its own: a script that saves its own "
            "resumes from it)")


def resume_command(argv: Sequence[str] | None, job_dir: Path) -> str:
    """What resumes this job: the user's own ``hpc`` command with ``--job-dir`` (pure).

    Args:
        argv: The command's arguments after ``hpc`` (None: not started from the CLI).
        job_dir: The job directory (added when the command does not name it).
    """
    if argv is None:
        return f"the same hpc.run(spec) with job_dir={str(job_dir)!r}"
    args = list(argv)
    cut = args.index("--") if "--" in args else len(args)
    head, tail = args[:cut], args[cut:]
    if not any(a == "--job-dir" or a.startswith("--job-dir=") for a in head):
        head += ["--job-dir", str(job_dir)]
    return "hpc " + shlex.join(head + tail)


def run(spec: JobSpec, *, verbose: bool = False, argv: Sequence[str] | None = None) -> int:
    """Runs ``spec`` locally; returns the job's exit status. The run is recorded in the job
    index (:mod:`hpc.contract.index`), so ``hpc status`` lists it with the submitted jobs.

    Args:
        spec: The job.
        verbose: Every log line on the console, not only what matters (``hpc run -v``).
        argv: The ``hpc`` command's arguments, to tell the user how to resume it.
    """
    done = already_finished(spec)
    if done is not None:
        result = Path(spec.job_dir) / jobdir.RESULT
        at = f"at step {done.last_step}" if done.last_step is not None else \
            "the script reports no step"
        _say(f"hpc run: {spec.job_dir} already finished this job ({at}); nothing to "
             f"run{f', its result stays in {result}' if result.exists() else ''}. To train again, "
             "use another --job-dir (or change the script's arguments to go on from its checkpoint)")
        return 0
    job_dir, lock = prepare(spec)
    with lock:
        try:
            record_job(JobRecord("", str(job_dir), spec.job_name, "local", time.time()))
        except OSError as e:   # an unwritable $HPC_HOME costs the listing, never the run
            _say(f"hpc run: note: not listed in hpc status ({e.strerror or e}); "
                 f"hpc status {job_dir} still shows it")
        return _run(spec, job_dir, lock, verbose, resume_command(argv, job_dir))


def already_finished(spec: JobSpec) -> jobdir.Outcome | None:
    """The ``finished`` outcome when ``spec`` is exactly the job its directory already ran to
    the end (the same command again: nothing to do), else None."""
    job_dir = Path(spec.job_dir)
    if not (job_dir / jobdir.JOBSPEC).is_file():
        return None
    outcomes = jobdir.read_outcomes(job_dir)
    if not outcomes or outcomes[-1].kind != "finished":
        return None
    try:
        same = JobSpec.load(job_dir) == spec
    except Exception:  # noqa: BLE001 - an unreadable spec: run, and prepare() says why
        return None
    return outcomes[-1] if same else None


def _run(spec: JobSpec, job_dir: Path, lock: joblock.JobLock, verbose: bool = False,
         resume: str = "") -> int:
    nodes = spec.allocated_nodes   # the hot spares' launchers too
    listener = rdzv_listener(spec.rdzv_port)
    port = int(listener.getsockname()[1])
    run_id = uuid.uuid4().hex[:12]
    if (warning := checkpoint_warning(spec)) is not None:
        _say(f"hpc run: warning: {warning}")
    started = time.monotonic()
    # Launchers get their own session so a terminal's Ctrl-C reaches only us: the first
    # Ctrl-C becomes the warning signal (workers save and exit), a second one stops hard.
    # SIGHUP (terminal gone) and SIGTERM become SIGTERM; our own death sends them SIGTERM.
    # Each `hpc run` on a job directory is a new allocation of that job (as a requeue is).
    earlier = jobdir.read_outcomes(job_dir)
    allocation = max([len(earlier), *(o.allocation + 1 for o in earlier)])
    env = dict(os.environ)
    # verbose: the launchers' consoles show every log line
    job_env.JobEnvironment(allocation=allocation, verbose=verbose).export(env)
    me, prctl = os.getpid(), ctypes.CDLL(None, use_errno=True).prctl   # loaded before fork
    procs: list[subprocess.Popen[bytes]] = []
    interrupts = [0]
    warned: list[str] = []   # a warning signal sent to hpc run itself (kill -USR2): a user's stop
    warning = signal.Signals[f"SIG{spec.signal}"]

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            signum = warning if interrupts[0] == 1 else signal.SIGINT
            _say(f"hpc run: Ctrl-C: sent the warning ({warning.name}) to the workers: they save "
                 "and stop (Ctrl-C again to stop now)" if interrupts[0] == 1 else
                 "hpc run: Ctrl-C again: stopping now")
        elif signum in (signal.SIGHUP, signal.SIGTERM):
            _say(f"hpc run: {signal.Signals(signum).name}: asking the workers to save and stop")
            signum = signal.SIGTERM
        elif not warned:
            warned.append(signal.Signals(signum).name)
            _say(f"hpc run: {warned[0]}: sent the warning to the workers: they save and stop")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward)
           for s in {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2, warning}}
    try:
        for i in range(nodes):
            held = (listener.fileno(),) if i == 0 else ()   # node 0 hosts the store
            procs.append(subprocess.Popen(launcher_argv(spec, job_dir, i, port, run_id, *held),
                                          cwd=os.getcwd(), env=env, start_new_session=True,
                                          pass_fds=held, preexec_fn=lambda: _die_with_parent(prctl, me)))
        listener.close()   # node 0's launcher holds it now
        lock.add_processes([p.pid for p in procs])
        codes = [p.wait() for p in procs]
    finally:
        listener.close()
        for s, h in old.items():
            signal.signal(s, h)
    code = codes[0] if codes[0] != 0 else max(codes, key=abs)
    if code < 0:                  # a launcher killed by a signal: the shell's convention
        code = 128 - code
    outcomes = [o for o in jobdir.read_outcomes(job_dir) if o.allocation == allocation]
    last = outcomes[-1] if outcomes else None   # never an earlier allocation's
    if last is not None:
        # The recorded outcome is the job's: a launcher killed on the way (a lost node a spare
        # replaced) must not turn a finished job into exit 137.
        code = last.exit_code
    if (interrupts[0] or warned) and last is not None and last.kind == "finished":
        # The warning was sent, but the script went on to its end: nothing to resume.
        sent = "Ctrl-C" if interrupts[0] else warned[0]
        _say(f"hpc run: finished (the {sent} came, but the script ran to its end) in "
             f"{time.monotonic() - started:.1f}s, exit {code}; job dir {job_dir}")
        if (result := job_dir / jobdir.RESULT).exists() and code == 0:
            _say(f"hpc run: result {result}")
        return code
    if interrupts[0]:
        _say(_interrupted(job_dir, spec, interrupts[0], last, code, time.monotonic() - started))
        _say(f"hpc run: resume with: {resume}")
        return code
    if warned and last is not None and last.kind in ("preempted", "time_limit"):
        # No Slurm here: the warning was a stop someone asked for, not a time limit's.
        _say(_interrupted(job_dir, spec, 1, last, code, time.monotonic() - started,
                          how=f"stopped by {warned[0]} (sent to hpc run)"))
        _say(f"hpc run: {resume_hint(last, job_dir)}")
        return code
    what = f"{last.kind}" + (f" ({last.reason})" if last and last.reason else "") if last else "no outcome recorded"
    _say(f"hpc run: {what} in {time.monotonic() - started:.1f}s, exit {code}; job dir {job_dir}")
    if last and last.kind in ("preempted", "time_limit"):
        _say(f"hpc run: {resume_hint(last, job_dir)}")
    result = job_dir / jobdir.RESULT
    if result.exists() and code == 0:
        _say(f"hpc run: result {result}")
    return code


def _interrupted(job_dir: Path, spec: JobSpec, presses: int, last: jobdir.Outcome | None,
                 code: int, took_s: float, how: str = "") -> str:
    """The summary of a run stopped by Ctrl-C (or ``how``): where it stopped and what was saved."""
    saved = jobdir.latest_checkpoint_step(Path(spec.resolved_checkpoint_dir))
    step = last.last_step if last is not None else None   # None: a script without the Session
    at = f" at step {step}" if step is not None else ""
    how = how or ("stopped by Ctrl-C" if presses == 1 else "stopped at once by a second Ctrl-C")
    kept = f" (checkpoint step {saved} saved)" if saved is not None else \
        " (no checkpoint saved)" if step is not None else ""   # a plain script's saves are its own
    return f"hpc run: {how}{at}{kept} in {took_s:.1f}s, exit {code}; job dir {job_dir}"
