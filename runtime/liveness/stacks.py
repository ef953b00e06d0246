"""Python stacks of stuck workers: registered in each worker, collected by the launcher.

Each worker registers :mod:`faulthandler` on :data:`DUMP_SIGNAL` with ``all_threads=True``,
writing to ``stacks-<pid>.txt`` in the node-local heartbeat directory (``runtime.worker`` does
it before the user's script runs, so a script that hangs while importing or loading data can
be dumped too). faulthandler's handler is C code: it dumps even while the main thread sits
inside a blocking C call (a gloo/NCCL wait), where a Python-level handler would never run.

Why ``SIGRTMIN+6``: SIGUSR1 belongs to NCCL (and was given up by submitit for that reason),
SIGUSR2 is our default warning signal, torch's agent owns INT/TERM/HUP/QUIT, SIGABRT would
take faulthandler's crash path, and glibc reserves the first real-time signals for its
threads (Python's ``SIGRTMIN`` already starts after them). A real-time signal nobody else
sends is also queued, not merged, and cannot be mistaken for a user's Ctrl-\\.

:func:`report` writes a stall's stack file (the verdict, a table of the ranks, each rank's
stacks); :func:`head` is the main thread's top for a log line about a rank running long.

The launcher sends the signal only to workers whose dump file exists (they registered);
a process stopped with SIGSTOP gets the signal and then SIGCONT, so it dumps where it froze.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from runtime.liveness import proc
from runtime.liveness.heartbeat import stacks_path

if TYPE_CHECKING:
    from runtime.liveness.verdict import Verdict

DUMP_SIGNAL = signal.SIGRTMIN + 6
HEAD_LINES = 12   # lines of a busy rank's stack in the launcher log
_registered: list[IO[str]] = []   # the open dump file must outlive the registration


def install(directory: str) -> Path | None:
    """Worker side: dump every thread's stack into ``directory`` on :data:`DUMP_SIGNAL`."""
    if not directory or not os.path.isdir(directory):
        return None
    path = stacks_path(Path(directory), os.getpid())
    try:
        f = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the process's life)
    except OSError:
        return None
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    _registered.append(f)
    return path


def main_thread_first(dump: str, marker: str = "runtime/worker/start.py") -> str:
    """A faulthandler dump with the main thread's block (the one started in ``marker``) first (pure)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    main = [b for b in blocks if any(marker in line for line in b)]
    rest = [b for b in blocks if not any(marker in line for line in b)]
    return "\n".join("\n".join(b).rstrip() + "\n" for b in main + rest).rstrip("\n") + ("\n" if dump else "")


def collect(directory: Path, pids: Mapping[int, int], *, timeout_s: float = 3.0) -> dict[int, str]:
    """Launcher side: asks workers for their stacks and returns ``rank -> text``.

    Args:
        directory: The heartbeat directory holding the workers' dump files.
        pids: ``pid -> rank`` of the workers to dump.
        timeout_s: How long to wait for the dumps (a process in uninterruptible sleep, a
            driver call that never returns to the kernel, never dumps).
    """
    sizes: dict[int, int] = {}
    for pid in pids:
        path = stacks_path(directory, pid)
        if not path.exists():
            continue
        sizes[pid] = path.stat().st_size
        was_stopped = proc.stopped(pid)
        try:
            os.kill(pid, DUMP_SIGNAL)
            if was_stopped:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            sizes.pop(pid)
    end = time.monotonic() + timeout_s
    grown: dict[int, int] = {}
    while time.monotonic() < end:
        now = {pid: stacks_path(directory, pid).stat().st_size for pid in sizes
               if stacks_path(directory, pid).exists()}
        done = [pid for pid, size in now.items() if size > sizes[pid] and grown.get(pid) == size]
        grown = now
        if len(done) == len(sizes):
            break
        time.sleep(0.1)
    out = {}
    for pid, start in sizes.items():
        try:
            with open(stacks_path(directory, pid)) as f:
                f.seek(start)
                out[pids[pid]] = main_thread_first(f.read())
        except OSError:
            continue
    return out


def head(dump: str, lines: int = HEAD_LINES) -> str:
    """The first block of a dump (the main thread, see :func:`main_thread_first`), indented."""
    block = dump.strip().split("\n\n", 1)[0].splitlines()[:lines]
    return "\n".join("  " + line for line in block)


def report(verdict: Verdict, dumps: dict[int, str], *, host: str, node_rank: int) -> str:
    """The stack file: the verdict, a table of the node's ranks, then each rank's stacks."""
    suspect = (f"rank {verdict.suspect_rank}" if verdict.suspect_rank is not None
               else f"node {verdict.lost_node}" if verdict.lost_node else "a peer on another node")
    lines = [f"hpc-elastic stall report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
             f"node {host} (node rank {node_rank})", f"suspect: {suspect}", f"why: {verdict.reason}",
             "", "ranks on this node:"]
    lines += [f"  {r.describe()}" for r in verdict.ranks]
    for r in verdict.ranks:
        mark = "   <== SUSPECT" if r.beat.rank == verdict.suspect_rank else ""
        lines += ["", f"=== rank {r.beat.rank} (pid {r.beat.pid}){mark} ==="]
        text = dumps.get(r.beat.rank, "").rstrip()
        lines.append(text or "(no stack: the process did not answer the dump signal in time; "
                             "it may sit in uninterruptible sleep, e.g. a driver call)")
    return "\n".join(lines) + "\n"
