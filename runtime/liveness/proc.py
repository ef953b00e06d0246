"""The node's processes as the watchdog and the launcher need them: children, states, exits.

Read from ``/proc`` (Linux): torch's agent runs in the launcher's process, so the workers
are the launcher's children. A worker stopped by SIGSTOP (or a debugger) is in state ``T``:
the strongest evidence of which rank froze. The one reader of ``/proc/PID/stat`` in the job's
processes (:func:`_stat`; the login side's lock, :mod:`hpc.contract.joblock`, reads its own).
"""

from __future__ import annotations

import os
import stat

from runtime import node_files


def _stat(pid: int, *, main_thread: bool = False) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(ppid: int, *, zombies: bool = False) -> list[int]:
    """PIDs whose parent is ``ppid`` (zombies left out unless ``zombies``: a child that has
    ended and is not yet reaped)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and int(fields[1]) == ppid and (zombies or fields[0] != "Z"):
                out.append(int(entry.name))
    return sorted(out)


def exit_status(pid: int) -> int | None:
    """A child's exit status (``waitpid`` form: a signal in the low 7 bits, else code << 8)
    once it has ended and before it is reaped; None while it runs; 0 when it is reaped
    already (its reaper saw it end)."""
    fields = _stat(pid)
    if fields is None:
        return 0
    if fields[0] != "Z":
        return None
    return int(fields[-1]) if len(fields) >= 50 else 0


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when gone."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def state(pid: int) -> str | None:
    """The kernel's one-letter state (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``), None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def stopped(pid: int) -> bool:
    """Stopped by a signal or a tracer."""
    return state(pid) in ("T", "t")


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time the process used so far, in clock ticks; None if gone."""
    fields = _stat(pid)
    try:
        return int(fields[11]) + int(fields[12]) if fields else None
    except (IndexError, ValueError):
        return None


def main_thread(pid: int) -> tuple[int, str] | None:
    """The main thread's own CPU time in clock ticks (its process's other threads left out)
    and its state (``D``: waiting on I/O); None if gone."""
    fields = _stat(pid, main_thread=True)
    try:
        return (int(fields[11]) + int(fields[12]), fields[0]) if fields else None
    except (IndexError, ValueError):
        return None


def running(pid: int) -> bool:
    """On a CPU, runnable, or in uninterruptible I/O: the kernel is working for it now."""
    return state(pid) in ("R", "D")


def workers(ppid: int, marker: str = "runtime.worker") -> list[int]:
    """The agent's worker processes: its children started as ``python -m runtime.worker``
    (a warm standby once it became one: :func:`cmdline`).

    Other children (a multiprocessing resource tracker, a Slurm command, an idle standby) are
    left alone.
    """
    return [pid for pid in children(ppid) if marker in cmdline(pid)]


def cmdline(pid: int) -> list[str]:
    """The command line ``pid`` runs as ([] when unreadable): for a warm standby that became a
    worker (:class:`runtime.node_files.Order`), the worker's."""
    order = _order(pid)
    return list(order.argv) if order is not None else _started_as(pid)


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` runs with ({} when unreadable): the one it started with, or for a
    warm standby that became a worker, the worker's."""
    order = _order(pid)
    return dict(order.env) if order is not None else _started_with(pid)


def _started_as(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _started_with(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _order(pid: int) -> node_files.Order | None:
    """A standby's or a forked worker's order, once it has one (None: neither, or a standby
    still waiting)."""
    started_as = _started_as(pid)
    if node_files.STANDBY_MODULE not in started_as and node_files.FORK_MODULE not in started_as:
        return None
    try:
        with open(node_files.order_file(pid), "rb") as f:
            return node_files.Order.decode(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget_stale_orders() -> list[str]:
    """Removes the orders and channels (:func:`runtime.node_files.private_dir`) of processes
    that are gone, or whose pid now runs something else: a worker killed with SIGKILL leaves
    its order (its whole environment) behind. Returns the names removed."""
    try:
        root = node_files.private_dir()
        names = os.listdir(root)
    except OSError:
        return []
    gone = []
    for name in names:
        stem, _, ext = name.rpartition(".")
        kind, _, pid = stem.partition("-")
        if ext != "json" or not pid.isdigit() or kind not in ("standby", "channel"):
            continue
        argv = _started_as(int(pid))
        live = bool(argv) and (kind == "channel" or node_files.STANDBY_MODULE in argv or node_files.FORK_MODULE in argv)
        if not live:
            try:
                os.unlink(os.path.join(root, name))
                gone.append(name)
            except OSError:
                pass
    return gone


def started_at(pid: int) -> float | None:
    """Wall-clock time ``pid`` started (from its start tick and the boot time), None if gone."""
    fields = _stat(pid)
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK") if fields else None
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def last_output(pid: int) -> float | None:
    """When ``pid`` last wrote to its stdout or stderr, when those are files (the agent's rank
    logs), else None."""
    latest = None
    for fd in (1, 2):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")   # follows the link to the open file
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            latest = max(latest or 0.0, st.st_mtime)
    return latest


def wrote_output(pid: int) -> bool | None:
    """Whether ``pid``'s stdout or stderr file (the agent's rank log) holds anything yet;
    None when neither is a file."""
    seen = None
    for fd in (1, 2):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            seen = bool(seen) or st.st_size > 0
    return seen
