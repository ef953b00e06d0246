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
local job outlives ``hpc run`` by more than the grace period.

Slurm jobs do not use this: there, slurmstepd owns the launcher and Slurm's own kill
escalation applies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("hpc.launch")

GRACE_S = 30.0          # for the workers to save after hpc run died, as Slurm's GraceTime
AGENT_STOP_S = 45.0     # for torch's agent to stop its workers (it waits 30 s, then SIGKILL)


def watch_parent(parent: int, grace_s: float = GRACE_S, agent_stop_s: float = AGENT_STOP_S,
                 poll_s: float = 0.5) -> threading.Thread:
    """Starts a daemon thread that ends this process some time after ``parent`` is gone."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("hpc run (pid %d) is gone: the workers were asked to save and stop; they "
                    "are stopped in %.0f s if they have not", parent, grace_s)
        time.sleep(grace_s)
        log.error("the workers did not stop within %.0f s of hpc run's end: stopping them", grace_s)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(agent_stop_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="hpc-lifeline", daemon=True)
    thread.start()
    return thread
