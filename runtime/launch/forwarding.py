"""The launcher's signal forwarding: warnings go on to the workers while the agent stays alive.

Slurm's ``--signal`` and a preemption's SIGTERM reach the per-node launcher; torch's elastic
agent would kill its workers on SIGTERM. :class:`SignalForwarder` records each signal, writes
the stop notice, and passes the signal on to the launcher's children (the workers), whose own
handlers only record it; they then agree, save and exit (:mod:`runtime.preemption`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from hpc.contract import environment as job_env
from hpc.contract import slurm
from runtime import stopping
from runtime.launch import early_signals
from runtime.liveness import proc
from runtime.liveness.proc import workers

log = logging.getLogger("hpc.launch")

# The fence asks the main thread by this signal to restart the launcher keeping its workers
# (in-process recovery through the rendezvous host's loss): they die with the thread that
# started them (PR_SET_PDEATHSIG, runtime/worker/start.py), and an execv from another thread
# ends that one. Not forwarded: the recovery installs its handler for the agent's run.
KEEP_SIGNAL = signal.SIGRTMIN + 2


class SignalForwarder:
    """Records warning signals and forwards them to the workers; never raises in the agent.

    Slurm's ``--signal`` and a preemption's SIGTERM reach the launcher; torch's agent would
    kill the workers on SIGTERM. Instead we pass the signal on to our child processes (the
    workers), whose own handlers only record it; they then agree, save and exit.
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: list[tuple[float, str]] = []
        self.stop: stopping.StopTracker | None = None   # writes the stop notice (HPC_STOP_FILE)

    def install(self) -> None:
        """Installs the handlers; a signal that came while the launcher started
        (:mod:`runtime.launch.early_signals`) is acted on now, at the time it came."""
        for sig in self.signals:
            signal.signal(sig, self._handle)
        for at, signum in early_signals.take(tuple(int(s) for s in self.signals)):
            log.warning("%s came while this launcher started (%.1f s ago)",
                        signal.Signals(signum).name, time.time() - at)
            self._handle(signum, None, at=at)

    def _handle(self, signum: int, frame: Any, *, at: float | None = None) -> None:
        name = signal.Signals(signum).name
        now = time.time() if at is None else at
        self.received.append((now, name))
        # Workers (re)started from now on learn of the warning from their environment.
        job_env.JobEnvironment(pending_warning=f"{name}@{now:.3f}").export(os.environ, keep_set=True)
        # Forwarded first: the stop tracker then starts a Slurm query, a child of this process
        # too, which must not get the signal (nor any later one while it runs: IN_FLIGHT).
        workers = [pid for pid in children(os.getpid()) if pid not in slurm.IN_FLIGHT]
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if self.stop is not None:
            self.stop.on_signal(name, now)
        log.warning("received %s: forwarded to workers %s", name, workers)


def kill_workers(ppid: int, parent: int | None = None) -> list[int]:
    """SIGKILLs the worker processes of launcher ``ppid``; returns their pids.

    With ``parent`` (``hpc run``'s pid): nothing when that is gone, for then the parent watch
    (:mod:`runtime.launch.parent_watch`) ends the job and records it as cancelled.
    """
    if parent is not None and os.getppid() != parent:
        return []
    killed = []
    for pid in workers(ppid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def children(ppid: int) -> list[int]:
    """PIDs whose parent is ``ppid``, zombies too (the agent's workers; :mod:`runtime.liveness.proc`)."""
    return proc.children(ppid, zombies=True)
