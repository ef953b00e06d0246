"""The launcher's warm standby: one process per node ready to become a dead worker's joiner.

Under ``--recovery inprocess`` (``--replacement wait``) the survivors of a dead worker wait for
its joiner, so the joiner's start-up is the recovery's: a cold one starts python and imports
torch and the Session first (~4.5 s of a 6.4-s worker-kill recovery in the campaign, 3 nodes at
load ~2). The launcher therefore keeps one :mod:`runtime.inprocess.worker.standby` process per node,
started :data:`AFTER_S` (2 s) after its workers' first step (so it does not compete with their own
start; at once on a node with CPUs to spare, :func:`at_launch`), and hands it the joiner's :class:`~runtime.node_files.Order` when a worker dies; a
new standby follows the same delay later. A joiner starts cold, as before, when there is no live standby,
when the standby was started with an environment the joiner's differs from in a variable that
may be read at import (:func:`differences`, named in the log), or when the worker's command is
not ``python -m runtime.worker``. ``HPC_INPROC_WARM=0`` turns it off.

A standby holds what a worker imports (~300 MB of host memory) and sleeps on its stdin.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from hpc.contract import recovery_settings
from runtime import node_files
from hpc.contract import jobdir
from runtime.launch.warm_start import PER_RANK, cold_because, worker_command
from runtime.liveness.heartbeat import read_all

log = logging.getLogger("hpc.launch")

# A standby starts this long after a worker's first step (start-up is over) or after the last one
# was handed out. Short: a fault in the first seconds of training found none (the campaign's
# worker kill 0.1 s after the first step of a requeued allocation, a freeze 9 s after the first).
AFTER_S = 2.0
MAX_FAILURES = 3     # standbys that died unused before no more are started


def enabled(environ: Mapping[str, str]) -> bool:
    """Whether joiners start from a warm standby (``HPC_INPROC_WARM``, default on)."""
    return recovery_settings.InProcessEnvironment.parsed(environ).warm


def at_launch(cpus: int, local_workers: int) -> bool:
    """Whether the standby may start with the workers instead of after their first step (pure):
    on a node with CPUs to spare (4 per process: GPU nodes), its imports slow nobody's start."""
    return cpus >= 4 * (local_workers + 1)


def training(heartbeat_dir: str) -> bool:
    """Whether a worker of this node has done a step (its heartbeat says so): start-up is over."""
    return bool(heartbeat_dir) and any(b.steps_done >= 1 for b in read_all(Path(heartbeat_dir)))


class Standby:
    """This node's warm standby process (one at a time), started and handed out by the agent.

    Args:
        on: Whether to keep one (:func:`enabled`).
        after_s: Delay from the workers' start, and from the last hand-out, to the next one.
    """

    def __init__(self, on: bool = True, *, after_s: float = AFTER_S) -> None:
        self.on, self.after_s = on, after_s
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.python = ""
        self.armed_at: float | None = None
        self.failures = 0
        self.handed: list[int] = []   # pids that became workers (their orders' files)

    def settled(self) -> bool:
        """Nothing for :meth:`tend` to do: off, given up, or one alive (a cheap look first)."""
        return not self.on or self.failures >= MAX_FAILURES or \
            (self.proc is not None and self.proc.poll() is None)

    def tend(self, argv: Sequence[str], template: Mapping[str, str], now: float | None = None, *,
             ready: Callable[[], bool] = lambda: True) -> None:
        """Starts a standby once the delay has passed and none is alive; called at each of the
        agent's looks at its workers. ``argv``: a worker's command (its interpreter runs the
        standby, its script's libraries are imported); ``template``: a worker's environment
        (its rank's variables are left out); ``ready``: whether the workers' start-up is over
        (the delay counts from then: a standby importing beside starting workers slows them)."""
        if self.settled():
            return
        now = time.monotonic() if now is None else now
        if self.proc is not None:   # settled() saw it ended
            code = self.proc.poll()
            self.failures += 1
            log.warning("in-process recovery: the warm standby %d ended unused (exit %s)%s",
                        self.proc.pid, code, "; no more are started" if self.failures >= MAX_FAILURES else "")
            self.proc, self.armed_at = None, now
        if self.armed_at is None:
            if not ready():
                return
            self.armed_at = now
        if now - self.armed_at < self.after_s:
            return
        if not worker_command(argv):
            return
        python, script = argv[0], argv[3]
        env = {k: v for k, v in template.items() if k not in PER_RANK}
        try:
            self.proc = subprocess.Popen([python, "-m", node_files.STANDBY_MODULE, script], env=env,
                                         stdin=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            self.failures += 1
            log.warning("in-process recovery: cannot start a warm standby: %s", e)
            self.armed_at = now
            return
        self.env, self.python = env, python
        log.info("in-process recovery: warm standby %d started (a dead worker's joiner starts "
                 "from it)", self.proc.pid)

    def take(self, argv: Sequence[str], env: Mapping[str, str], stdout: str = "",
             stderr: str = "", cwd: str | None = None) -> subprocess.Popen | None:
        """The standby made the joiner ``argv``/``env`` (with its log files), or None: start it
        cold (none alive, an environment that differs where it matters, not a worker's command)."""
        proc = self.proc
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        why = cold_because(argv, env, self.python, self.env)
        if why:
            log.warning("in-process recovery: the joiner starts cold, not from the warm standby: %s", why)
            return None
        order = node_files.Order(argv=tuple(argv), env=dict(env), cwd=cwd or os.getcwd(),
                            stdout=stdout, stderr=stderr)
        path = None
        try:
            path = Path(node_files.order_file(proc.pid))
            jobdir.write_atomic(path, order.record(), durable=False)   # no secret values; 0600
            proc.stdin.write(order.encode().encode() + b"\n")
            proc.stdin.close()
        except OSError as e:   # it died meanwhile (a broken pipe), or no room for the record
            log.warning("in-process recovery: the warm standby %d cannot take the order (%s); "
                        "the joiner starts cold", proc.pid, e)
            if path is not None:
                path.unlink(missing_ok=True)
            return None
        self.handed.append(proc.pid)
        self.proc, self.armed_at = None, time.monotonic()
        return proc

    def close(self) -> None:
        """Ends an unused standby (SIGKILL: it holds nothing, and may still be importing) and
        forgets the orders of ended workers."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("in-process recovery: the warm standby %d did not end", proc.pid)
            if proc.stdin is not None:
                proc.stdin.close()
        for pid in self.handed:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                Path(node_files.order_file(pid)).unlink(missing_ok=True)
            except OSError:
                pass

