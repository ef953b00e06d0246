"""A warm standby: a worker process started ahead of need, waiting to become a dead one's joiner.

Under ``--recovery inprocess`` the survivors of a dead worker wait for its joiner (the world
keeps its size), and a cold joiner spends its first seconds starting python and importing torch
and the Session (~4.5 s of the campaign's 6.4-s worker-kill recovery on 3 nodes). So each
node's launcher keeps one process ready (:mod:`runtime.inprocess.launcher.standby`): this module. It binds
its life to the launcher, imports what every worker imports, and blocks on its stdin. When a
worker dies, the launcher writes the joiner's :class:`~runtime.node_files.Order` there
(its command, environment, directory and log files, exactly those a cold joiner would get);
the standby takes them on and runs :func:`runtime.worker.start.main`, as ``python -m
runtime.worker SCRIPT ARGS`` would. Its stdin closed without an order: it exits 0.

While it waits it ignores the job's warning signal (the launcher forwards it to its children;
a standby has nothing to save) and writes nothing. Usage: ``python -m runtime.inprocess.worker.standby [SCRIPT]`` (its libraries are imported too).
"""

from __future__ import annotations

import os
import signal
import sys

from runtime import node_files
from hpc.contract.environment import JobEnvironment
from runtime.worker.start import bind_to_parent
from runtime.worker.warm import become, name_process, warm_up


READY_NAME = "hpc-standby"   # its process name once warm (before: python's)


def main() -> None:
    job = JobEnvironment.from_env(os.environ)
    bind_to_parent(job.agent_pid)
    if job.warning_signal and job.warning_signal not in ("SIGTERM", "SIGINT") \
            and hasattr(signal, job.warning_signal):
        signal.signal(getattr(signal, job.warning_signal), signal.SIG_IGN)
    warm_up(sys.argv[1] if len(sys.argv) > 1 else "")
    name_process(READY_NAME)   # ready: ps and /proc/PID/comm say so
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return   # the launcher ended without needing it
    become(node_files.Order.decode(line))


if __name__ == "__main__":
    main()
