"""A warm standby: a worker process started ahead of need, waiting to become a dead one's joiner.

Under ``--recovery inprocess`` the survivors of a dead worker wait for its joiner (the world
keeps its size), and a cold joiner spends its first seconds starting python and importing torch
and the Session (~4.5 s of the campaign's 6.4-s worker-kill recovery on 3 nodes). So each
node's launcher keeps one process ready (:mod:`runtime.launch.standby`): this module. It binds
its life to the launcher, imports what every worker imports, and blocks on its stdin. When a
worker dies, the launcher writes the joiner's :class:`~hpc.contract.inprocess.Order` there
(its command, environment, directory and log files, exactly those a cold joiner would get);
the standby takes them on and runs :func:`runtime.worker.start.main`, as ``python -m
runtime.worker SCRIPT ARGS`` would. Its stdin closed without an order: it exits 0.

While it waits it ignores the job's warning signal (the launcher forwards it to its children;
a standby has nothing to save) and writes nothing. Usage: ``python -m runtime.worker.standby [SCRIPT]`` (its libraries are imported too).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

from hpc.contract import inprocess as proto
from hpc.contract.environment import JobEnvironment
from runtime.worker.start import bind_to_parent
from runtime.worker.start import main as worker_main


# What every Session worker imports before its first step, some of it late (DDP's construction
# imports torch._dynamo: seconds, measured in a warm joiner that had not).
READY_NAME = "hpc-standby"   # its process name once warm (before: python's)
WORKER_MODULES = ("numpy", "torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel",
                  "torch.optim", "runtime.session", "runtime.worker.start")


def script_imports(script: str) -> list[str]:
    """The installed libraries a script imports at its top level (pure but for the lookup of
    where each lives): not its own directory's modules, whose import may act on the job."""
    import ast
    import importlib.util

    try:
        tree = ast.parse(open(script, "rb").read(), script)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    home = os.path.dirname(os.path.abspath(script))
    out = []
    for name in dict.fromkeys(names):
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) or ""
        if spec is not None and not os.path.abspath(origin).startswith(home + os.sep):
            out.append(name)
    return out


def warm_up(script: str = "") -> None:
    """Imports what a worker will: the Session's stack, then the script's libraries (one that
    fails here is left to the worker, which imports it again and meets the error itself)."""
    import importlib

    for name in (*WORKER_MODULES, *(script_imports(script) if script else ())):
        try:
            importlib.import_module(name)
        except Exception:   # noqa: BLE001, S112 - the worker's own import decides
            continue


def become(order: proto.Order) -> None:
    """Takes on the order's files, directory and environment, then runs the worker."""
    for fd, path in ((1, order.stdout), (2, order.stderr)):
        if path:
            (sys.stdout if fd == 1 else sys.stderr).flush()
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
    name_process(os.path.basename(sys.executable))
    null = os.open(os.devnull, os.O_RDONLY)   # a cold worker reads nothing either
    os.dup2(null, 0)
    os.close(null)
    os.chdir(order.cwd)
    atexit.register(_forget, proto.order_file(os.getpid()))   # (the launcher's record of it)
    os.environ.clear()
    os.environ.update(order.env)
    args = list(order.argv[1:])
    if args[:2] != ["-m", "runtime.worker"]:
        sys.exit(f"[hpc standby] not a worker's command: {order.argv!r}")
    worker_main(args[2:])


def name_process(name: str) -> None:
    """Sets what ``ps`` and ``/proc/PID/comm`` show (Linux; 15 characters)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _forget(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
    become(proto.Order.decode(line))


if __name__ == "__main__":
    main()
