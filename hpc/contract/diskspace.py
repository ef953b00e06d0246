"""Free space under the job directory: refuse a full disk up front, name it when it fills.

A job directory that fills up mid-run used to end with no outcome and no word of the disk:
a worker's log write failed with ENOSPC, its error file came out empty, torch's agent died
parsing it, and the outcome record itself could not be written. Three small pieces fix that:

- :func:`check_room` refuses to start a job on a filesystem that is already (nearly) full;
- a *reserve* file (:data:`RESERVE`, a few hundred KiB written when an allocation starts) is
  given back when a bookkeeping write hits ENOSPC, so the outcome can still be recorded;
- :func:`explain` turns a failure on a full disk into a reason that names ENOSPC, the path and
  the free space, for ``outcomes.jsonl`` and the user's terminal.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hpc.contract import jobpaths

RESERVE = jobpaths.RESERVE
RESERVE_BYTES = 256 * 1024
# Below this much free space a job directory counts as full: the launcher's and the workers'
# logs, the job spec and the outcome records need at least this much to say anything useful.
MIN_FREE_BYTES = 1024 * 1024

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: Path) -> tuple[int, int]:
    """(bytes free to this user, total bytes) of the filesystem holding ``path`` (or its
    nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def human(n: float) -> str:
    """``1.5 MiB``: bytes in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError(n)


def describe(path: Path) -> str:
    """``/path: 0 B free of 3.0 MiB``: the space left on the filesystem holding ``path``."""
    free, total = free_bytes(path)
    return f"{path}: {human(free)} free of {human(total)}"


def is_full(path: Path, min_free: int = MIN_FREE_BYTES) -> bool:
    """True when the filesystem holding ``path`` has less than ``min_free`` bytes left."""
    try:
        return free_bytes(path)[0] < min_free
    except OSError:
        return False


def is_disk_full_error(exc: BaseException) -> bool:
    """True for ENOSPC/EDQUOT, also when it is the cause or context of ``exc``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def check_room(job_dir: Path, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why a job cannot start in ``job_dir`` because its disk is full, or None when it can."""
    return refusal(job_dir, min_free) if is_full(job_dir, min_free) else None


def refusal(job_dir: Path, min_free: int = MIN_FREE_BYTES) -> str:
    """The message that refuses to start a job on a full disk."""
    return (f"no space left on device (ENOSPC) for the job directory {describe(job_dir)}; "
            f"a job needs at least {human(min_free)} there for its logs and records. Free some "
            "space or choose a --job-dir on another filesystem")


def explain(job_dir: Path, reason: str) -> str:
    """``reason``, prefixed with the disk's state when the job directory's disk is full."""
    if not is_full(job_dir):
        return reason
    return (f"disk full (ENOSPC) under the job directory, {describe(job_dir)}"
            + (f"; {reason}" if reason else ""))


def reserve(job_dir: Path, size: int = RESERVE_BYTES) -> bool:
    """Writes the reserve file (once); False when there is no room for it."""
    path = Path(job_dir) / RESERVE
    try:
        if path.exists() and path.stat().st_size >= size:
            return True
        with open(path, "wb") as f:
            f.write(b"\0" * size)   # real blocks: a sparse file would give nothing back
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        path.unlink(missing_ok=True)
        return False


def give_back_reserve(job_dir: Path) -> bool:
    """Deletes the reserve file so that a record can still be written; True if there was one."""
    try:
        (Path(job_dir) / RESERVE).unlink()
        return True
    except FileNotFoundError:
        return False
