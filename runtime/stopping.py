"""A stopping allocation: what its workers learn, and why none of them is started again.

Slurm warns a job before it stops it (the job's ``--signal``, SIGUSR2 by default, ahead of the
time limit or at a preemption with ``preempt_send_user_signal``), then sends SIGTERM, then
SIGKILL ``KillWait`` later. A script built on our Session saves and exits on the warning. A
user's own script may ignore it: its workers then die of the SIGTERM, and torch's elastic agent,
seeing failed workers, would *restart* them inside the dying allocation: they reload their
snapshot, are SIGKILLed seconds later, and the launcher, busy restarting, is killed before it
records why the allocation ended (seen on a real cluster).

So once the launcher got a warning or SIGTERM (a :class:`StopTracker` records it):

* it writes a :class:`StopNotice` (kind, signal, deadline) where ``HPC_STOP_FILE`` points, for
  scripts that want to know how long they have; node 0's launcher then asks Slurm for the real
  deadline (:mod:`runtime.stop_deadline`, bounded) and rewrites the notice with the earlier of
  the two, which the Session's save decision reads;
* torch's agent restarts no workers (:class:`runtime.launch.agent.StopAware` sets the agent's
  remaining restarts to 0, as torch itself does for a wedged worker);
* a worker started anyway (a membership change, a torch without that hook) exits at once with
  status 0 and, on global rank 0, an exit intent naming the stop (:func:`exit_if_stopping`);
* workers still running shortly before the expected SIGTERM get one from the launcher
  (:func:`enforce_in`): at a time limit, so that the allocation ends while the job can still be
  requeued; at a preemption, so that a worker can finish its W&B run before Slurm's SIGTERM
  kills wandb's service;
* under ``hpc run`` (no Slurm to escalate), workers still running :data:`KILL_AFTER_S` after a
  SIGTERM are killed (SIGKILL), as Slurm's ``KillWait`` would: a handler that hangs (Lightning's
  broadcasts from inside its SIGTERM handler; with a peer rank blocked in the step's collective
  the two never match and wait out the 30-minute collective timeout) would otherwise keep the
  job, and ``hpc run``, from ever ending. Unless they show a save progressing (checkpoint bytes
  growing, a Session in its save phase: :mod:`runtime.launch.save_watch`): a long healthy save
  is let finish (looked at every :data:`KILL_RECHECK_S`, up to :data:`KILL_MAX_WAIT_S`);
* workers that then die of the stop are a stopped allocation, not an application error
  (:func:`amend_outcome`): the outcome is recorded as ``preempted`` or ``time_limit`` and the
  job is requeued.

torch-free: the worker wrapper imports this module before the user's script, and the
launcher's signal handler calls into it (nothing is imported there).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpc.contract import environment as job_env
from hpc.contract import jobdir
from hpc.contract.jobpaths import JobPaths
from hpc.contract.environment import STOPPED_EXIT
from hpc.contract.slurm import SlurmError
from runtime import stop_deadline
from runtime.stop_deadline import STOP_KINDS, StopNotice  # noqa: F401 - re-exported
from runtime.preemption import DEFAULT_GRACE_S, classify_warning, deadline_for

log = logging.getLogger("hpc.launch")

# Without Slurm: seconds from a SIGTERM to the SIGKILL of workers still running (Slurm's
# default KillWait; the same grace the watch of hpc run gives, runtime/launch/parent_watch.py).
KILL_AFTER_S = 30.0
# While the workers show a save progressing (``still_saving``), the kill waits, looking again
# this often, at most this long after the SIGTERM (the stall watch's budget for a save).
KILL_RECHECK_S = 5.0
KILL_MAX_WAIT_S = 1800.0

def notice_path(job_dir: Path, allocation: int) -> Path:
    """Where an allocation's stop notice goes: ``logs/alloc-A/stop.json``."""
    return JobPaths(job_dir).stop_notice(allocation)


def notice_for(signal_name: str, received_at: float, *, allocation: int,
               job_end_time: float | None, lead_s: float, grace_s: float | None,
               under_slurm: bool = True) -> StopNotice:
    """Which stop a signal announces and when the hard stop comes (pure).

    The same rules as the Session's watcher (:mod:`runtime.preemption`): a warning close to the
    job's end time is the time limit's, any other warning or a SIGTERM a preemption's.
    """
    kind = classify_warning(signal_name, received_at, job_end_time=job_end_time, lead_s=lead_s,
                            under_slurm=under_slurm)
    if signal_name == "SIGTERM":
        deadline = received_at
    else:
        deadline = deadline_for(kind, received_at, job_end_time=job_end_time, lead_s=lead_s,
                                grace_s=grace_s or DEFAULT_GRACE_S)
    return StopNotice(allocation=allocation, kind=kind, signal=signal_name,
                      received_at=round(received_at, 3), deadline=round(deadline, 3))


def enforcement_line(notice: StopNotice, delay: float, *, under_slurm: bool) -> str:
    """What the launcher says when it arms its own SIGTERM for a stop (pure).

    Under Slurm the SIGTERM comes ahead of Slurm's own; without Slurm (``hpc run``) a warning
    is a stop someone asked for, and there is no Slurm deadline to name.
    """
    at = time.strftime("%H:%M:%S", time.localtime(notice.received_at + delay))
    if not under_slurm:
        return (f"{notice.signal}: a stop was asked for: workers still running "
                f"at {at} ({delay:.0f} s from now) get SIGTERM")
    return (f"{notice.signal} ({notice.kind}): workers still running in {delay:.1f} s get SIGTERM, "
            f"ahead of Slurm's at {time.strftime('%H:%M:%S', time.localtime(notice.deadline))}")


class StopTracker:
    """The launcher's record of a stop in progress (fed by its signal handler).

    Args:
        path: Where to write the notice (``HPC_STOP_FILE``).
        allocation: This allocation.
        job_end_time: Wall time of the job's time limit, if known.
        lead_s: The job's warning lead before the time limit.
        grace_s: The partition's preemption GraceTime, if known.
        enforce: SIGTERM the launcher itself before a time limit (:func:`enforce_in`).
        ask_slurm: On a warning, returns this job's ``scontrol show job`` record, bounded in
            time (:func:`runtime.stop_deadline.ask_slurm`); given to one launcher (node 0's).
            It runs on a thread, so the signal is forwarded at once.
        restarts: This allocation's ``SLURM_RESTART_COUNT`` (to tell a stale record).
        follow: Another node's launcher asks Slurm: this one writes the notice only when
            there is none yet (never over the asking one's), and takes the earlier deadline
            from that launcher's notice when it comes within
            :data:`~runtime.stop_deadline.ANSWER_WAIT_S`.
        under_slurm: Whether the job runs under Slurm (else a warning is a preemption's).
        kill_workers: SIGKILLs the workers still running and returns their pids; called
            ``kill_after_s`` after the first SIGTERM (None: Slurm's KillWait escalates).
        kill_after_s: See ``kill_workers``.
        still_saving: When the kill is due, why the workers are still saving (then it waits
            :data:`KILL_RECHECK_S` and asks again), or None (kill). None: never wait.
    """

    def __init__(self, path: Path, *, allocation: int, job_end_time: float | None,
                 lead_s: float, grace_s: float | None, enforce: bool = False,
                 ask_slurm: Callable[[], Any] | None = None, restarts: int | None = None,
                 follow: bool = False, under_slurm: bool = True,
                 kill_workers: Callable[[], list[int]] | None = None,
                 kill_after_s: float = KILL_AFTER_S,
                 still_saving: Callable[[], str | None] | None = None) -> None:
        self.path = Path(path)
        self.under_slurm = under_slurm
        self.allocation = allocation
        self.job_end_time, self.lead_s, self.grace_s = job_end_time, lead_s, grace_s
        self.notice: StopNotice | None = None
        self.enforce = enforce
        self.timer: threading.Timer | None = None
        self.kill_workers, self.kill_after_s = kill_workers, kill_after_s
        self.kill_timer: threading.Timer | None = None
        self.still_saving = still_saving
        self._kill_armed_at: float | None = None
        self._cancelled = False
        self.ask_slurm, self.restarts, self.follow = ask_slurm, restarts, follow
        self.refined = threading.Event()   # set once Slurm's answer (or its absence) is in
        self._lock = threading.RLock()     # the handler (main thread) and the asking thread

    @property
    def stopping(self) -> bool:
        return self.notice is not None

    def on_signal(self, name: str, when: float) -> None:
        """Records the first stop signal and writes its notice; never raises (signal handler)."""
        with self._lock:
            if name == "SIGTERM":
                self._arm_kill()
            if self.notice is not None:
                if name == "SIGTERM" and when < self.notice.deadline:   # the kill came early
                    self.notice = dataclasses.replace(self.notice, deadline=round(when, 3))
                    self._write()
                return
            notice = notice_for(name, when, allocation=self.allocation,
                                job_end_time=self.job_end_time, lead_s=self.lead_s,
                                grace_s=self.grace_s, under_slurm=self.under_slurm)
            asks = name != "SIGTERM" and (self.ask_slurm is not None or self.follow)
            if asks:
                notice = dataclasses.replace(notice, query=stop_deadline.ASKING)
            self.notice = notice
            self._write()
            self._arm(when)
        if asks:
            threading.Thread(target=self._refine, name="hpc-stop-deadline", daemon=True).start()
        else:
            self.refined.set()

    def _arm(self, now: float) -> None:
        """(Re)starts the enforcement timer for the current notice."""
        delay = enforce_in(self.notice, now)
        if not self.enforce or delay is None:
            return
        if self.timer is not None:
            self.timer.cancel()
        # SIGTERM to the launcher itself: its handler forwards it to the workers.
        self.timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
        self.timer.daemon = True
        self.timer.start()
        log.warning("%s", enforcement_line(self.notice, delay, under_slurm=self.under_slurm))

    def _arm_kill(self) -> None:
        """Starts the countdown to the SIGKILL of the workers (once, at the first SIGTERM)."""
        if self.kill_workers is None or self.kill_timer is not None:
            return
        self._kill_armed_at = time.monotonic()
        self._kill_in(self.kill_after_s)

    def _kill_in(self, delay: float) -> None:
        with self._lock:
            if self._cancelled:
                return
            self.kill_timer = threading.Timer(delay, self._kill)
            self.kill_timer.daemon = True
            self.kill_timer.start()

    def _kill(self) -> None:
        """Kills the workers that outlived the SIGTERM by ``kill_after_s``, unless they show a
        save progressing (then looks again later); never raises."""
        waited = time.monotonic() - (self._kill_armed_at or time.monotonic())
        if self.still_saving is not None and waited < KILL_MAX_WAIT_S:
            try:
                why = self.still_saving()
            except Exception as e:   # noqa: BLE001 - no evidence: the kill goes on
                why = None
                log.warning("could not tell whether the workers are saving (%s)", e)
            if why:
                log.warning("the workers outlived the SIGTERM by %.0f s but are still saving (%s): "
                            "not killed; looking again in %.0f s", waited, why, KILL_RECHECK_S)
                self._kill_in(KILL_RECHECK_S)
                return
        if self._cancelled:   # the workers ended while we looked
            return
        try:
            killed = self.kill_workers() if self.kill_workers is not None else []
        except Exception as e:   # noqa: BLE001 - a timer thread; the launcher goes on
            log.warning("could not kill the workers after the SIGTERM: %s", e)
            return
        if killed:
            log.error("the workers did not stop within %.0f s of the SIGTERM (a signal handler that "
                      "hangs, e.g. one running a collective) and showed no save progressing: "
                      "killed %s (SIGKILL)%s", self.kill_after_s, killed,
                      f" after {waited:.0f} s in all" if waited > self.kill_after_s + KILL_RECHECK_S else "")

    def _refine(self) -> None:
        """Asks Slurm (or waits for the asking node's notice) and plans for the earlier
        deadline; logs both. Runs on its own thread; never raises."""
        try:
            if self.ask_slurm is not None:
                found, why = self._ask()
            else:
                theirs = stop_deadline.await_answer(self._theirs, self.notice.received_at)
                found = None if theirs is None or theirs.slurm_deadline is None else \
                    stop_deadline.SlurmStop(theirs.slurm_deadline, theirs.kind)
                why = "" if found else "node 0's launcher had no answer from Slurm in time" \
                    if stop_deadline.is_pending(theirs) else theirs.query
            with self._lock:
                before = self.notice
                self.notice = stop_deadline.refine(before, found, why)
                if self.ask_slurm is not None:
                    self._write()
                log.warning("stop (%s, %s): %s", self.notice.signal, self.notice.kind,
                            stop_deadline.describe(self.notice, time.time()))
                if (self.notice.deadline, self.notice.kind) != (before.deadline, before.kind):
                    self._arm(time.time())
        except Exception as e:   # noqa: BLE001 - the assumption stands; the stop goes on
            log.warning("could not refine the stop deadline (%s): keeping the assumption", e)
        finally:
            self.refined.set()

    def _ask(self) -> tuple[stop_deadline.SlurmStop | None, str]:
        started = time.monotonic()
        try:
            info = self.ask_slurm()
        except (SlurmError, ValueError) as e:
            return None, f"no answer in {time.monotonic() - started:.1f} s ({e})"
        return stop_deadline.slurm_stop(info, time.time(), lead_s=self.lead_s,
                                        restarts=self.restarts)

    def _theirs(self) -> StopNotice | None:
        """The asking launcher's notice of this allocation (None while it is not there)."""
        notice = StopNotice.read(self.path)
        if notice is None or notice.allocation != self.allocation:
            return None
        return notice

    def cancel(self) -> None:
        """Stops a pending enforcement and kill (the workers ended)."""
        with self._lock:
            self._cancelled = True
        for timer in (self.timer, self.kill_timer):
            if timer is not None:
                timer.cancel()

    def _write(self) -> None:
        try:
            if self.follow and self._theirs() is not None:
                return   # the asking launcher's notice (or another follower's) is there
            self.path.parent.mkdir(parents=True, exist_ok=True)
            jobdir.write_atomic(self.path, json.dumps(asdict(self.notice)) + "\n", durable=False)
        except OSError as e:     # a full disk must not kill the launcher in its handler
            log.warning("cannot write the stop notice %s: %s", self.path, e)


# How long before the expected SIGTERM the launcher ends workers that are still running, and the
# largest share of the warning's lead that this may take. At a time limit: enough to record the
# outcome and run `scontrol requeue` while the job still runs (a job being killed for its time
# limit cannot be requeued). At a preemption: enough for a worker to finish its W&B run while
# wandb's service still lives (Slurm's SIGTERM reaches every process of the step, and wandb-core
# exits on it at once, losing an offline run's unwritten records).
RESERVE_S = {"time_limit": (10.0, 1 / 2), "preempted": (3.0, 1 / 4)}


def enforce_in(notice: StopNotice, now: float) -> float | None:
    """Seconds from ``now`` until the launcher sends SIGTERM to its workers, or None (pure).

    None after a SIGTERM (the stop is already here). A script that saves on the warning keeps
    most of its time: the reserve is at most half (time limit) or a quarter (preemption) of it.
    """
    if notice.signal == "SIGTERM":
        return None
    reserve_s, share = RESERVE_S[notice.kind]
    left = notice.deadline - now
    return max(0.0, left - min(reserve_s, left * share))


def amend_outcome(kind: str, reason: str, notice: StopNotice | None, *,
                  exit_codes: tuple[int, ...] = (),
                  intent: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """The outcome of an allocation whose workers failed after a stop began (pure).

    Workers of a script that ignores the warning die of the SIGTERM that follows it: that is
    the stop, not an application error, and the job must be requeued. So is a script that
    saved on the warning and exited with ``STOPPED_EXIT`` (75, "not done yet"), whichever rank
    torch's agent saw end first (the others may be stopped by the agent or lose their peers);
    an exit status 0 means the work is done, and stays ``finished``.

    ``intent`` is rank 0's exit intent for this allocation (``EXIT_INTENT``), written once the
    script saved for the stop and before it exits: evidence that it did stop for it even when
    its interpreter's teardown (torch, gloo, DeepSpeed: 6-15 s under load, measured) outlived
    the grace and the launcher's SIGTERM ended it first.
    """
    if notice is None or kind != "app_error":
        return kind, reason
    said = f"{notice.signal} ({notice.kind}): the script stopped for it"
    if STOPPED_EXIT in exit_codes:
        return notice.kind, f"{said} (exit {STOPPED_EXIT})"
    if intent is not None and intent.get("kind") == notice.kind:
        saved = intent.get("step")
        return notice.kind, (f"{said} (saved step {saved}; its exit was cut short: {reason})" if reason
                             else f"{said} (saved step {saved}; its exit was cut short)")
    said = f"{notice.signal} ({notice.kind}): the workers did not stop by themselves"
    return notice.kind, f"{said}; {reason}" if reason else said


def exit_if_stopping(job: job_env.JobEnvironment, rank: str | None) -> None:
    """In a worker, before the user's script: exit at once if the allocation is stopping.

    The launcher sets ``HPC_PENDING_WARNING`` in its own environment when a stop begins, so
    only workers it starts after that inherit it (``job`` must be read at the worker's start,
    before its own handler records a signal in its environment: all workers of one start then
    decide alike). Such a worker would only reload a snapshot to be killed seconds later: it
    exits with status 0 (a failure would make the agent try again), and global rank 0 writes
    an exit intent so that the launcher records the stop, not a finish.

    Args:
        job: The worker's ``HPC_*`` environment as it was at its start.
        rank: Its global rank (``RANK``).
    """
    if not job.pending_warning or job.agent_pid is None or job.agent_pid != os.getppid():
        return
    notice = StopNotice.read(job.stop_file)
    kind = notice.kind if notice else "preempted"
    allocation = job.requeue_count if job.requeue_count is not None else (job.allocation or 0)
    why = f"the allocation is stopping ({job.pending_warning}, {kind}): the script was not started again"
    if rank == "0" and job.job_dir:
        try:
            jobdir.write_atomic(Path(job.job_dir) / jobdir.EXIT_INTENT, json.dumps({
                "allocation": allocation, "kind": kind, "step": None, "reason": why,
                "time": time.time()}) + "\n")
        except OSError as e:
            print(f"[hpc worker] cannot write the exit intent: {e}", file=sys.stderr)
    print(f"[hpc worker] {why}", file=sys.stderr, flush=True)
    sys.exit(0)


def is_resumed(job_dir: Path, allocation: int) -> bool:
    """Whether an earlier allocation of this job ran (Slurm requeue, a second ``hpc run``)."""
    return allocation > 0 or bool(jobdir.read_outcomes(job_dir))
