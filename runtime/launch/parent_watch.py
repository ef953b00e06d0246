"""A local launcher's tie to the ``hpc run`` that started it.

``hpc run`` starts its launchers in their own session (so that a terminal's Ctrl-C reaches
only ``hpc run``, which decides what to do), and asks the kernel to send each one SIGTERM when
``hpc run`` dies (``PR_SET_PDEATHSIG``, set between fork and exec). The launcher treats that
SIGTERM as it treats a preemption: the workers are warned, save a checkpoint and exit, and the
outcome is recorded.

Nobody is left to escalate if the workers do not stop (a script that ignores SIGTERM, a hung
collective), so this watchdog does: once the parent is gone it gives the workers
``grace_s`` seconds, then interrupts the agent (SIGINT: torch's agent stops its workers and
the launcher records the allocation as cancelled), and finally kills the launcher outright;
its workers die with it (:mod:`runtime.worker` binds them to the agent). No process of a
local job outlives ``hpc run`` by more than the grace period, unless its workers are in the
middle of the very save the SIGTERM asked for: then, as the kill after a SIGTERM does
(:mod:`runtime.launch.save_watch`, :mod:`runtime.stopping`), the stop waits while the save
shows progress (looking again every :data:`runtime.stopping.KILL_RECHECK_S`, at most
:data:`runtime.stopping.KILL_MAX_WAIT_S`), so that a checkpoint is not lost half-written; a
worker hung outside a save shows none and is stopped at the grace period as before.

Slurm jobs do not use this: there, slurmstepd owns the launcher and Slurm's own kill
escalation applies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from runtime.stopping import KILL_MAX_WAIT_S, KILL_RECHECK_S

log = logging.getLogger("hpc.launch")

GRACE_S = 30.0          # for the workers to save after hpc run died, as Slurm's GraceTime
AGENT_STOP_S = 45.0     # for torch's agent to stop its workers (it waits 30 s, then SIGKILL)


def watch_parent(parent: int, grace_s: float = GRACE_S, agent_stop_s: float = AGENT_STOP_S,
                 poll_s: float = 0.5, still_saving: Callable[[], str | None] | None = None,
                 recheck_s: float = KILL_RECHECK_S, max_wait_s: float = KILL_MAX_WAIT_S) -> threading.Thread:
    """Starts a daemon thread that ends this process some time after ``parent`` is gone.

    Args:
        parent: ``hpc run``'s pid.
        grace_s: For the workers to save and stop after ``parent`` is gone.
        agent_stop_s: For torch's agent to stop its workers after the SIGINT.
        poll_s: How often to look for ``parent``.
        still_saving: When the grace is over, why the workers are still saving (then the stop
            waits ``recheck_s`` and asks again, up to ``max_wait_s`` after ``parent`` is gone),
            or None: no evidence of a save, stop them (:class:`runtime.launch.save_watch.SaveWatch`).
        recheck_s: See ``still_saving``.
        max_wait_s: See ``still_saving``.
    """
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        gone = time.monotonic()
        log.warning("hpc run (pid %d) is gone: the workers were asked to save and stop; they "
                    "are stopped in %.0f s if they have not", parent, grace_s)
        time.sleep(grace_s)
        while still_saving is not None and time.monotonic() - gone < max_wait_s:
            try:
                why = still_saving()
            except Exception as e:   # noqa: BLE001 - no evidence: the stop goes on
                log.warning("could not tell whether the workers are saving (%s)", e)
                break
            if not why:
                break
            log.warning("the workers outlived hpc run by %.0f s but are still saving (%s): not "
                        "stopped; looking again in %.0f s", time.monotonic() - gone, why, recheck_s)
            time.sleep(recheck_s)
        log.error("the workers did not stop within %.0f s of hpc run's end and showed no save "
                  "progressing: stopping them", time.monotonic() - gone)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(agent_stop_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="hpc-parent-watch", daemon=True)
    thread.start()
    return thread
