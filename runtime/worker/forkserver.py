"""The node's fork server: imports what a worker imports once, then forks each worker from it.

A worker's first seconds are python's start and its imports: torch, the Session's stack (DCP
pulls in DTensor and sympy), DDP's ``torch._dynamo``, the script's own libraries. On the
reference machine that is 4-8 CPU-s a worker, paid again by every worker at every restart.
Each launcher starts one of these (:mod:`runtime.launch.warm_start`) as the job begins; it
imports all that once (:func:`runtime.worker.warm.warm_up`) and then waits on its socket.

For each worker the launcher sends an :class:`~runtime.node_files.Order` (the command,
environment and directory a cold start would get) and the worker's stdin, stdout and stderr
(``SCM_RIGHTS``). The server forks twice: the middle process exits at once, so the worker is
reparented to the launcher (a child subreaper): it is the launcher's child as a cold worker is
(torch's agent waits for it, the stall watch lists it, it dies with the launcher). The worker
starts its own session (as torch's agent starts workers), records its order where ``/proc``
readers look (:func:`runtime.node_files.order_file`), takes on the order
(:func:`runtime.worker.warm.become`) and runs :func:`runtime.worker.start.main`, as ``python
-m runtime.worker SCRIPT ARGS`` would. The server answers with the worker's pid.

What a fork shares that a cold start would not: the interpreter's state after the imports. A
variable an import may read is the same by construction (the launcher only sends orders whose
environment equals the server's there: :func:`runtime.launch.warm_start.differences`); the
random generators are seeded afresh in each worker (Python's ``random`` does so itself at a
fork; numpy's global one is reseeded here). A server whose imports started a Python thread
(a lock it holds would stay held in the child) or loaded the CUDA driver (CUDA cannot be used
in a child forked after that) does not fork (:func:`unsafe`): it says so instead of ready, and
the launcher starts every worker cold.

Usage (the launcher builds it): ``python -m runtime.worker.forkserver FD SCRIPT``; FD is its end
of the launcher's socket. It ends when the launcher closes that socket.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from runtime import node_files
from hpc.contract import jobdir
from hpc.contract.environment import JobEnvironment
from runtime.worker.warm import become, name_process, warm_up
from runtime.worker.start import bind_to_parent

W_AND_B_MODULES = ("wandb", "wandb.apis.public")
MAX_ORDER = 4 << 20   # bytes: one order is a JSON line (an environment)
READY = b"ready\n"


def _recv_order(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One order line and the three descriptors sent with it; None when the launcher closed."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 3)
        fds += got
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None
        data += chunk
        if len(data) > MAX_ORDER:
            raise ValueError("an order longer than 4 MiB")
    return data, fds


def _fork_worker(order: node_files.Order, fds: list[int], sock: socket.socket) -> int:
    """Forks the worker (through a middle process that exits, so the launcher adopts it);
    returns its pid once it leads its own session and its order is recorded. In the worker
    itself this function does not return: it runs the script, and its exit status leaves as
    :class:`SystemExit` through the interpreter's own shutdown (atexit handlers run)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:   # the middle process: forks the worker and exits
        me = os.getpid()
        try:
            worker = os.fork()
        except BaseException:   # noqa: BLE001 - no worker: the server reads the empty pipe
            os._exit(1)
        if worker != 0:
            os._exit(0)
        _worker(order, fds, sock, r, w, me)   # the worker: never returns
    os.close(w)
    os.waitpid(middle, 0)     # gone: the worker is the launcher's child from here on
    with os.fdopen(r, "rb") as pipe:
        said = pipe.read().decode(errors="replace").strip()
    if not said.isdigit():
        raise OSError(f"the forked worker did not start: {said or 'no word from it'}")
    return int(said)


def _worker(order: node_files.Order, fds: list[int], sock: socket.socket, r: int, w: int, middle: int) -> None:
    """In the forked worker: its own session, the launcher as parent, the order's streams."""
    try:
        os.close(r)
        sock.close()
        os.setsid()   # as torch's agent starts workers: its signals go to the worker's group
        while os.getppid() == middle:   # the middle process exits at once
            time.sleep(0.0005)
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()   # (the server's list: its cleanup has nothing left to close here)
        _fresh_state()
        jobdir.write_atomic(Path(node_files.order_file(os.getpid())), order.record(), durable=False)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
    except BaseException as e:   # noqa: BLE001 - the server says why, the launcher starts it cold
        try:
            os.write(w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(1)
    try:
        become(order)   # returns when the script is done; sys.exit's status leaves as SystemExit
    except Exception:   # noqa: BLE001 - as an uncaught exception ends a cold worker
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


_IGNORED: list[int] = []   # the signals the server ignores (a worker starts with the default)


def _fresh_state() -> None:
    """What a fresh interpreter would have that the server's fork does not."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()   # from the OS's entropy, as at numpy's import
        except Exception:   # noqa: BLE001, S110 - a numpy without the legacy generator
            pass


def unsafe() -> str:
    """Why this process may not fork workers, or "" (after its imports): a Python thread (a lock
    it holds stays held in the child), or the CUDA driver loaded (a library that asked for the
    devices at its import: CUDA cannot be used in a child forked after that)."""
    if threading.active_count() > 1:
        return f"its imports started {threading.active_count() - 1} Python thread(s)"
    try:
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return "its imports loaded the CUDA driver (libcuda)"
    except OSError:
        pass
    return ""


def serve(sock: socket.socket) -> None:
    """Answers orders until the launcher closes the socket."""
    why = unsafe()
    sock.sendall(READY if not why else f"unsafe: {why}\n".encode())
    while True:
        got = _recv_order(sock)
        if got is None:
            return
        line, fds = got
        try:
            if why:
                raise OSError(f"it does not fork: {why}")
            if len(fds) != 3:
                raise OSError(f"{len(fds)} descriptors came with the order, not 3")
            order = node_files.Order.decode(line)
            sys.stdout.flush()
            sys.stderr.flush()
            answer = f"{_fork_worker(order, fds, sock)}\n"
        except (OSError, ValueError, KeyError, TypeError) as e:
            answer = "error " + f"{type(e).__name__}: {e}".replace("\n", " ") + "\n"
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(answer.encode())


def main(argv: list[str]) -> None:
    job = JobEnvironment.from_env(os.environ)
    bind_to_parent(job.agent_pid)
    # Signals for the launcher's workers reach this process too (it is a child): none is for it.
    for name in sorted({job.warning_signal, "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"} - {"", "SIGTERM"}):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
            _IGNORED.append(getattr(signal, name))
    sock = socket.socket(fileno=int(argv[0]))
    warm_up(argv[1] if len(argv) > 1 else "")
    if os.environ.get("WANDB_MODE", "") != "disabled":
        # Rank 0's W&B run: wandb and what its init imports (~1 CPU-s and ~1 s of every start
        # of rank 0 on the reference machine, while every other rank waits in its first step).
        for name in W_AND_B_MODULES:
            try:
                importlib.import_module(name)
            except Exception:   # noqa: BLE001, S112 - the worker's own import decides
                continue
    name_process("hpc-forkserver")
    serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])
