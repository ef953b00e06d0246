"""What makes a pre-imported process the worker a cold start would be (the worker side).

A cold worker spends its first seconds starting python and importing torch, the Session's stack
(DCP pulls in DTensor and sympy), DDP's ``torch._dynamo`` and the script's own libraries. A warm
process (the node's fork server, :mod:`runtime.worker.forkserver`, whose forks are the workers;
in-process recovery's warm standby, :mod:`runtime.inprocess.worker.standby`) imports all that
once ahead of need (:func:`warm_up`) and then takes on a worker's :class:`~runtime.node_files.Order`
(:func:`become`): its files, directory and environment, and :func:`runtime.worker.start.main`,
as ``python -m runtime.worker SCRIPT ARGS`` would run it.
"""

from __future__ import annotations

import atexit
import os
import sys

from runtime import node_files
from runtime.worker.start import main as worker_main


# What every Session worker imports before its first step, some of it late (DDP's construction
# imports torch._dynamo: seconds, measured in a warm joiner that had not).
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


def become(order: node_files.Order) -> None:
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
    atexit.register(_forget, node_files.order_file(os.getpid()))   # (the launcher's record of it)
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
