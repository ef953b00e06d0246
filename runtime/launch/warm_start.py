"""Workers forked from the node's warm fork server instead of started cold.

A cold worker starts python and imports torch, the Session's stack and DDP's ``torch._dynamo``
before its first line of training: 4-8 CPU-s on the reference machine, paid by every worker of
every start and restart, all at once on the node. So each launcher starts one fork server
(:mod:`runtime.worker.forkserver`) as it begins, and torch's agent gets its workers from it: the
server imports once, each worker is a fork of it. A restart after a crash starts its workers in
a fraction of a second instead of seconds of imports.

The worker stays what a cold one is: the launcher's child (the launcher is a child subreaper,
and the server forks through a middle process that exits), in its own session, with the
command line, environment, directory and log files torch's agent gave it (its order, read by
``/proc`` readers through :func:`runtime.liveness.proc.cmdline`). torch's agent holds a
:class:`Forked` in place of the ``Popen`` it would have made: it polls, waits for and signals
the same pid.

A worker starts cold, as before, when the server is not ready within :data:`READY_S`, has
died, refuses (its imports started a thread), when the worker's environment differs from the
server's in a variable an import may read (:func:`runtime.launch.warm_start.differences`; named
in the log once), or when the command is not ``python -m runtime.worker``. ``HPC_WARM_START=0``
turns it off (every worker its own interpreter). Under in-process recovery (``--recovery
inprocess``) the workers of each start come from here too; a dead worker's joiner comes from the
node's warm standby (:mod:`runtime.inprocess.launcher.standby`), which the in-process agent starts itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hpc.contract import recovery_settings
from runtime import node_files
from hpc.contract.environment import WARM_START

log = logging.getLogger("hpc.launch")

READY_S = 120.0   # the server's imports: a cold worker would spend the same, so it is waited for
ANSWER_S = 30.0   # one fork: milliseconds
PR_SET_CHILD_SUBREAPER = 36

# Variables a worker reads after its imports (the rendezvous, its rank, the store, its
# process group's transport, W&B): a joiner's may differ from its standby's. Any other
# difference could have changed what an import did (OMP_NUM_THREADS, a library path...).
LATE_PREFIXES = ("HPC_", "TORCHELASTIC_", "MASTER_", "WANDB_", "NCCL_", "TORCH_NCCL_", "GLOO_")
LATE_NAMES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                        "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})
# Not given to a standby: with them /proc would show it as a worker of a local rank.
PER_RANK = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", recovery_settings.JOIN_ENV)


def differences(started_with: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The variables that differ between a standby's environment and a joiner's and may be
    read at import (pure): a joiner needs all of them equal to start from that standby."""
    names = set(started_with) | set(wanted)
    return sorted(n for n in names if started_with.get(n) != wanted.get(n)
                  and not n.startswith(LATE_PREFIXES) and n not in LATE_NAMES)


def cold_because(argv: Sequence[str], env: Mapping[str, str], python: str,
                 started_with: Mapping[str, str]) -> str:
    """Why the worker ``argv``/``env`` cannot come from a warm process started on ``python``
    with ``started_with`` (pure but for the interpreters' paths), or "": not a worker's command
    on that interpreter, or an environment that differs where an import may read it."""
    if not worker_command(argv) or os.path.realpath(argv[0]) != os.path.realpath(python):
        return f"the command is not {python} -m runtime.worker: {list(argv)[:3]}"
    if diff := differences(started_with, env):
        return f"its environment differs in {', '.join(diff)}"
    return ""


def worker_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a worker's command a standby can run (pure)."""
    return len(argv) >= 4 and list(argv[1:3]) == ["-m", "runtime.worker"]

def enabled(environ: Mapping[str, str]) -> bool:
    """Whether workers are forked from the warm server (``HPC_WARM_START``, default on)."""
    return environ.get(WARM_START, "1").strip().lower() not in ("0", "false", "no", "off")


class Forked:
    """What torch's agent holds for a forked worker in place of a ``subprocess.Popen``: the
    launcher's child ``pid``, waited for with ``waitpid`` as ``Popen`` does."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    got, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:   # reaped elsewhere: as Popen, taken for a clean exit
                    self.returncode = 0
                else:
                    if got:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This launcher's fork server: started once, asked for each worker, closed at the end.

    Args:
        python: The workers' interpreter (the server runs on it).
        script: The training script (its top-level libraries are imported too).
        env: The environment the server starts with (the launcher's, less a rank's variables).
    """

    def __init__(self, python: str, script: str, env: Mapping[str, str]) -> None:
        self.python, self.script = python, script
        self.env = {k: v for k, v in env.items() if k not in PER_RANK}
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.state = "new"      # new, starting, ready, gone
        self.why = ""           # why it is gone (said once)
        self.told: set[str] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the server (its imports run while the launcher forms the rendezvous)."""
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
            ours, theirs = socket.socketpair()
            try:
                self.proc = subprocess.Popen(
                    [self.python, "-m", node_files.FORK_MODULE, str(theirs.fileno()), self.script],
                    env=self.env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                    start_new_session=True)
            finally:
                theirs.close()
        except OSError as e:
            self._gone(f"it cannot start: {e}")
            return
        self.sock, self.state = ours, "starting"
        log.debug("warm start: fork server %d started", self.proc.pid)

    def _gone(self, why: str) -> None:
        if self.state != "gone":
            self.state, self.why = "gone", why
            log.warning("warm start: workers start cold from now on: the fork server %s", why)

    def _line(self, timeout_s: float) -> str | None:
        """One line from the server, None on a timeout."""
        assert self.sock is not None
        data = b""
        deadline = time.monotonic() + timeout_s
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            chunk = self.sock.recv(4096)
            if not chunk:
                raise OSError("it ended")
            data += chunk
        return data.decode(errors="replace").strip()

    def _ready(self) -> bool:
        if self.state == "starting":
            try:
                said = self._line(READY_S)
            except OSError as e:
                said = f"failed ({e}, exit {self.proc.poll() if self.proc else None})"
            if said == "ready":
                self.state = "ready"
            else:
                self._gone("was not ready in time" if said is None else f"refused: {said}")
                self.close()
        return self.state == "ready"

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], fds: Sequence[int],
              cwd: str | None = None) -> Forked | None:
        """The worker ``argv``/``env`` forked with stdin, stdout and stderr ``fds``, or None: start it cold."""
        with self._lock:
            if not self._ready():
                return None
            why = cold_because(argv, env, self.python, self.env)
            if why:
                if why not in self.told:
                    self.told.add(why)
                    log.warning("warm start: a worker starts cold: %s", why)
                return None
            order = node_files.Order(argv=tuple(argv), env=dict(env), cwd=cwd or os.getcwd())
            assert self.sock is not None
            try:
                socket.send_fds(self.sock, [order.encode().encode() + b"\n"], list(fds))
                said = self._line(ANSWER_S)
            except OSError as e:
                said = f"error {e}"
            if said is not None and said.isdigit():
                return Forked(int(said), argv)
            if said is None or not said.startswith("error"):
                self._gone("did not answer" if said is None else f"answered {said!r}")
                self.close()
            else:
                log.warning("warm start: a worker starts cold: the fork server says %s", said)
            return None

    def close(self) -> None:
        """Ends the server (its workers are the launcher's children: they live on)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=2)    # it ends when its socket closes
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        if self.state != "gone":
            self.state = "gone"


@contextlib.contextmanager
def serving(server: ForkServer | None) -> Iterator[None]:
    """While inside, torch's agent starts its workers through ``server`` (cold when it cannot).

    torch's ``SubprocessContext`` makes each worker's handler with its module's
    ``get_subprocess_handler``; inside, that gives a handler whose ``_popen`` asks the server.
    """
    if server is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class WarmHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            out = self._stdout.fileno() if self._stdout else 1
            err = self._stderr.fileno() if self._stderr else 2
            forked = server.spawn(args, env, (0, out, err))
            return forked if forked is not None else super()._popen(args, env)

    def handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str,
                local_rank_id: int, numa_options: Any = None) -> SubprocessHandler:
        return WarmHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                           local_rank_id=local_rank_id, numa_options=numa_options)

    made = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = made
