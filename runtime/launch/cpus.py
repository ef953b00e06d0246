"""How many CPUs this job may really use, for ``OMP_NUM_THREADS``.

``os.cpu_count()`` is the host's count. On a shared node Slurm gives the job fewer: its task is
bound to a CPU set (``task/affinity``, ``task/cgroup``: ``sched_getaffinity``) and may be held
to a CPU quota (cgroup v2 ``cpu.max``). Sizing each worker's thread pool from the host's count
oversubscribes such a node: every worker of every job spins up one thread per host CPU.

:func:`cpu_allowance` and :func:`omp_threads` are pure (tests pass the facts);
:func:`job_cpus` reads them from this process.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cpu_allowance(affinity: int | None, cpu_max: str | None, host: int | None) -> int:
    """The CPUs a process may use: its affinity set, capped by a cgroup quota (pure).

    Args:
        affinity: Size of the process's CPU affinity set (None: unknown).
        cpu_max: The cgroup v2 ``cpu.max`` text (``"max 100000"``: no quota;
            ``"200000 100000"``: two CPUs' worth), or None.
        host: The host's CPU count (None: unknown).
    """
    count = affinity or host or 1
    if cpu_max:
        parts = cpu_max.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                quota = period = 0
            if quota > 0 and period > 0:
                count = min(count, max(1, math.ceil(quota / period)))
    return max(1, count)


def omp_threads(cpus: int, workers: int) -> int:
    """Threads per worker: an equal share of ``cpus``, at least one (pure)."""
    return max(1, cpus // max(1, workers))


def _cgroup_cpu_max(proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """The tightest ``cpu.max`` on this process's cgroup v2 path (None: v1 or unreadable)."""
    try:
        line = next((ln for ln in proc_cgroup.read_text().splitlines() if ln.startswith("0::")), None)
    except OSError:
        return None
    if line is None:
        return None
    best: tuple[float, str] | None = None
    path = root / line[3:].lstrip("/")
    for d in (path, *path.parents):
        if not str(d).startswith(str(root)):
            break
        try:
            text = (d / "cpu.max").read_text().strip()
        except OSError:
            continue
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max" and parts[0].isdigit() and parts[1].isdigit() \
                and int(parts[1]) > 0:
            ratio = int(parts[0]) / int(parts[1])
            if best is None or ratio < best[0]:
                best = (ratio, text)
    return best[1] if best else None


def job_cpus() -> int:
    """The CPUs this process may use (affinity set, cgroup v2 quota), else the host's count."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return cpu_allowance(affinity, _cgroup_cpu_max(), os.cpu_count())
