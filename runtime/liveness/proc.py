"""The node's processes as the watchdog needs them: the agent's workers and their states.

Read from ``/proc`` (Linux): torch's agent runs in the launcher's process, so the workers
are the launcher's children. A worker stopped by SIGSTOP (or a debugger) is in state ``T``:
the strongest evidence of which rank froze.
"""

from __future__ import annotations

import os


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(ppid: int) -> list[int]:
    """PIDs whose parent is ``ppid`` (zombies left out)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and int(fields[1]) == ppid and fields[0] != "Z":
                out.append(int(entry.name))
    return sorted(out)


def state(pid: int) -> str | None:
    """The kernel's one-letter state (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``), None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def stopped(pid: int) -> bool:
    """Stopped by a signal or a tracer."""
    return state(pid) in ("T", "t")


def workers(ppid: int, marker: bytes = b"runtime.worker") -> list[int]:
    """The agent's worker processes: its children started as ``python -m runtime.worker``.

    Other children (a multiprocessing resource tracker, a Slurm command) are left alone.
    """
    out = []
    for pid in children(ppid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(pid)
        except OSError:
            continue
    return out
