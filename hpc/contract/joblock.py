"""One job directory, one running job: the job-directory lock.

Two jobs writing one job directory corrupt each other's checkpoints, ``latest`` pointer,
outcome records and W&B run. ``hpc run`` and ``hpc submit`` therefore take a lock on the job
directory before they write to it, and refuse (exit 2) a directory that another job holds,
naming the holder and what to do.

Why not ``fcntl``/``flock``: on NFS those are unreliable (lockd, client caches, locks lost
on server restarts), and a lock must outlive ``hpc submit`` (the Slurm job holds it while it
is queued and running). The lock is a file, ``JOB_DIR/.hpc-lock.json``, made with ``link(2)``
from a complete temporary file, which is atomic on local filesystems, NFSv3/v4, Lustre and
GPFS (``open(O_EXCL)`` is the fallback where hard links are not supported). It records who
holds it: the command, host, pid (with the process's start time, so that a reused pid is not
taken for the holder), the machine's boot id, and when.

A lock is *stale*, and is broken by the next taker, when:

- ``hpc run`` on this host: neither its pid nor any process it registered (its launchers)
  is alive, or this host has rebooted since;
- ``hpc submit`` (and ``hpc sweep``): the submitting process has exited and the Slurm job
  (or job array) it submitted, whose id is in ``JOB_DIR/slurm_job_id`` (written after the
  lock), is no longer queued or running, or no job was submitted at all.

A holder on another host cannot be checked (its pids mean nothing here): the lock is then
respected, and the message says how to remove it once that job is known to be gone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hpc.contract import jobdir, records
from hpc.contract.errors import SpecError
from hpc.contract.slurm import SlurmClient

log = logging.getLogger("hpc.joblock")
LOCK = jobdir.LOCK
SLURM_JOB_ID = jobdir.SLURM_JOB_ID
# A lock file that is still being written (the O_EXCL fallback) is never broken while younger.
_WRITING_GRACE_S = 10.0
# A breaker that died while breaking a stale lock leaves this marker; it expires.
_BREAK_EXPIRY_S = 30.0
# A submission from another host that recorded no job id within this long has failed.
_SUBMIT_WINDOW_S = 600.0


@dataclass(frozen=True)
class Holder:
    """Who holds a job directory."""

    command: str                      # "hpc run" or "hpc submit"
    host: str
    pid: int
    since: float
    start_ticks: int | None = None    # the pid's start time (/proc/PID/stat field 22)
    boot_id: str = ""
    processes: tuple[tuple[int, int | None], ...] = ()   # (pid, start ticks) it started

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        return f"`{self.command}` (pid {self.pid} on host {self.host}, since {when})"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Holder:
        """The holder a lock file names.

        Raises:
            ValueError: the text is not UTF-8, not JSON, or not a holder's shape (a damaged
                lock file: it names no one).
        """
        data = json.loads(text)     # bytes: UnicodeDecodeError, a ValueError
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but {type(data).__name__}")
        try:
            processes = tuple((int(p), None if t is None else int(t))
                              for p, t in data.get("processes", ()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"processes: {e}") from None
        return records.from_dict(cls, {**data, "processes": ()}).with_processes(processes)

    def with_processes(self, processes: tuple[tuple[int, int | None], ...]) -> Holder:
        return replace(self, processes=processes)


class JobDirInUse(SpecError):
    """The job directory is held by another job (exit status 2)."""

    def __init__(self, job_dir: Path, holder: Holder, why: str, todo: str) -> None:
        self.job_dir, self.holder = job_dir, holder
        super().__init__("--job-dir", str(job_dir),
                         f"a job directory that no other job is using; it is in use by "
                         f"{holder.describe()}{why}",
                         f"--job-dir {job_dir.parent / (job_dir.name + '-2')}", todo)


# --------------------------------------------------------------------------- this machine


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone (or a
    zombie: it has exited, only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_comm = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if after_comm[0] in ("Z", "X"):
        return None
    return int(after_comm[19])


def process_alive(pid: int, ticks: int | None) -> bool:
    """True when ``pid`` runs and is the process that was recorded (same start time)."""
    now = start_ticks(pid)
    if now is None:
        try:
            os.kill(pid, 0)             # no /proc (not Linux): existence is all we can tell
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()
    return ticks is None or now == ticks


def me(command: str) -> Holder:
    pid = os.getpid()
    return Holder(command=command, host=socket.gethostname(), pid=pid, since=time.time(),
                  start_ticks=start_ticks(pid), boot_id=boot_id())


# --------------------------------------------------------------------------- staleness


def slurm_job_active(job_id: str) -> bool | None:
    """True while Slurm has the job (or a task of the job array) queued or running, False
    once it ended or is forgotten, None when Slurm cannot be asked."""
    try:
        entries = SlurmClient(retry_total_s=5, command_timeout_s=10).queue([job_id])
    except Exception:  # noqa: BLE001 - no Slurm here, or it does not answer: the caller says so (None)
        return None
    return any(not e.state.is_terminal for jid, e in entries.items()
               if jid == job_id or jid.startswith(job_id + "_"))


def why_held(job_dir: Path, holder: Holder, *, here: Holder,
             slurm_active: Callable[[str], bool | None] = slurm_job_active) -> tuple[str, str] | None:
    """(why the lock still holds, what the user can do), or None when it is stale."""
    rebooted = (holder.host == here.host and bool(holder.boot_id) and bool(here.boot_id)
                and holder.boot_id != here.boot_id)
    if holder.command != "hpc run":
        return _submission_held(job_dir, holder, here, rebooted, slurm_active)
    if rebooted:
        return None
    if holder.host != here.host:
        return ("", f"It runs on another host, which cannot be checked from here: stop it there, "
                    f"or, once it is gone, remove {job_dir / LOCK} and run again")
    running = [pid for pid, ticks in ((holder.pid, holder.start_ticks), *holder.processes)
               if process_alive(pid, ticks)]
    if not running:
        return None
    return ("", f"Wait for it to end, stop it (`kill -TERM {holder.pid}`: the workers save a "
                f"checkpoint and stop; processes still running: {', '.join(map(str, running))}), "
                "or use another --job-dir")


def _submission_held(job_dir: Path, holder: Holder, here: Holder, rebooted: bool,
                     slurm_active: Callable[[str], bool | None]) -> tuple[str, str] | None:
    """``hpc submit``, ``hpc sweep``: the Slurm job they submitted holds the directory, whatever
    became of the submitting process (a notebook lives on) and wherever it ran."""
    job_id = None
    try:
        id_file = job_dir / SLURM_JOB_ID
        if id_file.stat().st_mtime >= holder.since - 1:   # else an older job's id
            job_id = jobdir.read_slurm_job_id(job_dir)
    except OSError:
        pass
    if job_id is None:                                   # not submitted (yet)
        local = holder.host == here.host and not rebooted
        if local and not process_alive(holder.pid, holder.start_ticks):
            return None
        if not local and time.time() - holder.since > _SUBMIT_WINDOW_S:
            return None
        return ("", "It is submitting the job now; wait for it to finish")
    active = slurm_active(job_id)
    if active is False:
        return None
    if active is None:
        return (f", held by Slurm job {job_id}",
                f"Slurm cannot be asked from here whether job {job_id} still runs; if it has "
                f"ended (`sacct -j {job_id}`), remove {job_dir / LOCK} and run again")
    return (f", held by Slurm job {job_id} (queued or running)",
            f"Wait for it to end or cancel it (`hpc cancel {job_id}`), or use another --job-dir")


# --------------------------------------------------------------------------- the lock file


def read_holder(job_dir: Path) -> Holder | None:
    """The current holder, or None when the directory is not locked (or the file is being
    written or is unreadable)."""
    try:
        return Holder.from_json((Path(job_dir) / LOCK).read_bytes())
    except (OSError, ValueError):
        return None


def _publish(lock: Path, text: str) -> bool:
    """Creates ``lock`` holding ``text`` atomically; False if it already exists."""
    tmp = lock.with_name(f".{lock.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            return _publish_excl(lock, text)              # no hard links on this filesystem
        # NFS: the reply to a successful link can be lost; the link count tells.
        if os.stat(tmp).st_nlink == 2:
            return True
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _publish_excl(lock: Path, text: str) -> bool:
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _break_stale(lock: Path, stale_text: bytes) -> bool:
    """Removes ``lock`` if it still holds ``stale_text``; one breaker at a time. False when
    another taker is breaking it.

    Without the breaker's own lock, two takers that both found the same stale lock could
    each delete it, the second deleting the fresh lock the first had just made.
    """
    breaker = lock.with_name(lock.name + ".break")
    try:
        if time.time() - breaker.stat().st_mtime > _BREAK_EXPIRY_S:
            breaker.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    if not _publish(breaker, f"{socket.gethostname()} {os.getpid()}\n"):
        return False
    try:
        try:
            if lock.read_bytes() == stale_text:
                lock.unlink()
        except FileNotFoundError:
            pass
    finally:
        breaker.unlink(missing_ok=True)
    return True


@dataclass
class JobLock:
    """A held job-directory lock."""

    job_dir: Path
    holder: Holder
    released: bool = field(default=False)

    @property
    def path(self) -> Path:
        return self.job_dir / LOCK

    def add_processes(self, pids: Sequence[int]) -> None:
        """Registers processes this holder started: the lock holds while any of them lives
        (the launchers outlive a killed ``hpc run`` for as long as their workers save)."""
        extra = tuple((pid, start_ticks(pid)) for pid in pids)
        self.holder = replace(self.holder, processes=self.holder.processes + extra)
        tmp = self.path.with_name(f".{LOCK}.{os.getpid()}.update")
        tmp.write_text(self.holder.to_json())
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Removes the lock if it is still ours."""
        if self.released:
            return
        self.released = True
        current = read_holder(self.job_dir)
        if current is not None and (current.host, current.pid, current.since) == (
                self.holder.host, self.holder.pid, self.holder.since):
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(job_dir: Path, command: str, *,
            slurm_active: Callable[[str], bool | None] = slurm_job_active) -> JobLock:
    """Takes the job directory's lock for ``command`` (``"hpc run"``, ``"hpc submit"``).

    Raises:
        JobDirInUse: another job holds it (exit status 2, with what to do).
    """
    job_dir = Path(job_dir)
    lock = job_dir / LOCK
    holder = me(command)
    text = holder.to_json()
    for _ in range(5):
        if _publish(lock, text):
            return JobLock(job_dir, holder)
        try:
            current_text = lock.read_bytes()
            current = Holder.from_json(current_text)
        except FileNotFoundError:
            continue                                      # released meanwhile: try again
        except (OSError, ValueError) as e:
            try:
                age = time.time() - lock.stat().st_mtime
                if age < _WRITING_GRACE_S:
                    time.sleep(0.2)
                    continue
                current_text, current = lock.read_bytes(), None
            except FileNotFoundError:
                continue
            log.warning("the lock %s names no holder (%s) and is %.0f s old: taking it over", lock,
                        str(e)[:120], age)
        if current is not None:
            held = why_held(job_dir, current, here=holder, slurm_active=slurm_active)
            if held is not None:
                raise JobDirInUse(job_dir, current, *held)
        if not _break_stale(lock, current_text):
            time.sleep(0.05)                              # another taker is breaking it
    raise JobDirInUse(job_dir, read_holder(job_dir) or holder, "",
                      f"Several jobs are starting in it at once; try again, or remove {lock} "
                      "if none is running")
