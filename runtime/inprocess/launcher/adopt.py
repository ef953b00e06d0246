"""Keeping the workers through the rendezvous host's loss under ``--recovery inprocess``.

The in-process membership lives in the rendezvous host's store. When that host is lost, each
surviving launcher's fence (:mod:`runtime.launch.main`) restarts the launcher into the
succession election (:mod:`runtime.succession`: the same board, the same strict majority and
fencing as the restart path), but it no longer kills its workers first: ``execv`` keeps the
children, and the new image is started with ``--adopt PID,...``. If this node is a member of
the new epoch, the new agent *adopts* them instead of starting workers
(:class:`AdoptedProcesses` stands in for torch's process context: it watches, reaps and, if
torch's restart path runs after all, stops them), and, once the new round has its store,
names it to them in a node-local file (:func:`publish`, a
:class:`~runtime.inprocess.protocol.Rebind` at ``HPC_INPROC_CHANNEL``): they re-form there, in
process (:mod:`runtime.inprocess.worker.rebind`). If not (no majority, this node left out or
cut off), the adopted workers are killed and an ``inproc_fallback`` says why.

What still takes today's restart path (:func:`why_not`, recorded in ``inproc_fallback``):
no succession (``hpc run``: no Slurm, no board), a job with hot spares (their joiners wait on
the old store), and a node whose workers are not all alive (a local rank not running).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc.contract import environment as job_env
from hpc.contract import recovery_settings
from runtime import node_files
from runtime.inprocess import protocol as proto
from hpc.contract import jobdir
from runtime.liveness import proc

log = logging.getLogger("hpc.launch")

LOST_STATUS = 1 << 8   # ``waitpid`` form of exit 1: a worker whose real status is gone
_KEPT_CONTEXTS: list[Any] = []   # torch's process contexts of workers kept in place (see keep_handles)


def keep_handles(pcontext: Any) -> None:
    """Keeps torch's process context of workers kept through the host's loss in place.

    Dropped with its agent, its ``Popen`` objects of still-running workers would go to
    ``subprocess``'s list of orphans, which the next ``Popen`` of this process (a joiner)
    reaps: the worker's exit status would then be gone when :class:`AdoptedProcesses` asks
    for it. Kept here, nobody but :class:`AdoptedProcesses` reaps them.
    """
    if pcontext is not None:
        _KEPT_CONTEXTS.append(pcontext)


def channel_path(launcher_pid: int) -> Path:
    """The node-local file where launcher ``launcher_pid`` names a new epoch's store (it
    keeps its PID across ``execv``, so its workers find the file where they were told): in the
    user's own 0700 directory (:func:`~runtime.node_files.private_dir`), where no other
    user can plant one that sends the kept workers to another store."""
    return Path(node_files.private_dir()) / f"channel-{launcher_pid}.json"


def why_not(*, succession: bool, spares: int, kept: Mapping[int, int], nproc: int) -> str | None:
    """Why this launcher cannot keep its workers through the host's loss, or None (pure).

    Args:
        succession: A new host can be elected (Slurm: the job directory's board).
        spares: The job's ``--spare-nodes``.
        kept: This node's live workers, local rank -> PID.
        nproc: Workers per node.
    """
    if not succession:
        return "no succession outside Slurm: the job ends as a node failure"
    if spares:
        return (f"the job has {spares} hot spare node(s), whose joiners wait on the old store: a new "
                "rendezvous host is elected and the workers start again from the last checkpoint")
    missing = sorted(set(range(nproc)) - set(kept))
    if missing:
        return (f"local rank(s) {', '.join(map(str, missing))} not running here: a new rendezvous host is "
                "elected and the workers start again from the last checkpoint")
    return None


def live_workers(launcher_pid: int) -> dict[int, int]:
    """This launcher's live in-process workers, local rank -> PID (from ``/proc``: the
    ``LOCAL_RANK`` they were started with; a zombie is not alive)."""
    out: dict[int, int] = {}
    for pid in proc.children(launcher_pid, zombies=True):
        state = proc.state(pid)
        if state is None:
            continue
        env = proc.environ(pid)
        if state == "Z" or env.get(recovery_settings.RECOVERY_ENV) != recovery_settings.INPROCESS or "LOCAL_RANK" not in env:
            continue
        out[int(env["LOCAL_RANK"])] = pid
    return out


def parse_adopt(text: str | None) -> dict[int, int]:
    """``--adopt``'s value (``LR:PID,...``) as local rank -> PID (pure)."""
    out = {}
    for item in (text or "").split(","):
        lr, sep, pid = item.partition(":")
        if sep and lr.isdigit() and pid.isdigit():
            out[int(lr)] = int(pid)
    return out


def format_adopt(kept: Mapping[int, int]) -> str:
    return ",".join(f"{lr}:{pid}" for lr, pid in sorted(kept.items()))


def launch_of(pids: Mapping[int, int], *, store: str, master_addr: str, master_port: int,
              epoch: int) -> dict[str, Any]:
    """What torch's start would have kept for the adopted workers (their command and
    environment, from ``/proc``), pointed at the new round: a dead one's joiner starts so.

    The rendezvous epoch is the new one too: with the old worker's (the epoch it started in),
    the joiner's epoch watch took the launcher's record of the current epoch for a new one and
    broke its own connections to the new store in its first seconds (the campaign: three
    joiners in a row died in the re-wrap, exit code 1, after a host loss)."""
    args, envs, outs, entry = {}, {}, {}, ""
    for lr, pid in pids.items():
        argv = proc.cmdline(pid)
        if not argv:
            continue
        entry, args[lr] = argv[0], tuple(argv[1:])
        envs[lr] = {**node_files.with_secrets(proc.environ(pid), os.environ), **recovery_settings.InProcessEnvironment(store=store).to_env(),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port), **job_env.JobEnvironment(rdzv_epoch=epoch).to_env()}
        outs[lr] = _log_file(pid)
    # ``outs``: where each worker writes (its stdout's file): a joiner in a dead one's place
    # writes there too. Without it an adopted worker's joiner wrote nowhere to be found (the
    # campaign: three joiners after a host loss died with exit code 1, no trace of why).
    return {"entrypoint": entry, "args": args, "envs": envs, "outs": outs}


def _log_file(pid: int) -> str:
    """The file ``pid``'s stdout goes to, or "" (a pipe, a terminal, gone)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""
    return target if target.startswith("/") and Path(target).is_file() else ""


def publish(launcher_pid: int, rebind: proto.Rebind) -> Path:
    """Names the new epoch's store to this launcher's workers (atomically)."""
    path = channel_path(launcher_pid)
    jobdir.write_atomic(path, rebind.encode(), durable=False)   # 0600
    return path


def kill(pids: Sequence[int]) -> None:
    """SIGKILLs the adopted workers (no new epoch for them) and reaps them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 3.0
    left = list(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    left.remove(pid)
            except ChildProcessError:
                left.remove(pid)
        time.sleep(0.05)


def stop_left(adopt: Mapping[int, int]) -> None:
    """SIGKILLs the adopted workers that are still this launcher's children (its agent ended
    without them ending: e.g. the new host never came)."""
    mine = set(proc.children(os.getpid(), zombies=True))
    kill([pid for pid in adopt.values() if pid in mine])


class AdoptedProcesses:
    """torch's process context (``PContext``: ``pids``, ``wait``, ``close``) for workers this
    launcher did not start in this image (they were its children before its ``execv``)."""

    def __init__(self, pids: Mapping[int, int], error_files: Mapping[int, str] | None = None,
                 finished: Callable[[], bool] | None = None) -> None:
        self._pids = dict(pids)
        self._errors = dict(error_files or {})
        self._codes: dict[int, int] = {}
        self._finished = finished   # did the training finish (rank 0's mark in the store)?

    def _unknown(self, pid: int) -> int:
        """The status of a worker reaped elsewhere (its own is gone): the evidence decides.
        The training finished (rank 0 marked it in the store): exit 0; else, or when the store
        cannot say, exit 1 (:data:`LOST_STATUS`), never a success that did not happen."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        try:
            done = bool(self._finished is not None and self._finished())
        except SignalException:   # the launcher's own stop, not the store's answer
            raise
        except Exception as e:   # noqa: BLE001 - the store is gone: it cannot say
            log.warning("in-process recovery: cannot ask whether the training finished: %s", e)
            done = False
        log.warning("in-process recovery: worker %d ended and was reaped elsewhere: its exit status "
                    "is lost; %s", pid, "the training finished: counted as exit 0" if done
                    else "the training did not finish: counted as failed")
        return 0 if done else LOST_STATUS

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def _status(self, pid: int) -> int | None:
        """The exit status (``waitpid`` form) once ended, reaping it; None while it runs.

        A worker already reaped by someone else has no status left to read: the evidence
        decides (:meth:`_unknown`). Read as exit 0 whatever happened, such a worker once ended
        an unfinished job as ``finished (exit 0)`` with nothing to requeue (the fault campaign,
        seed 2 at 12:58: 33 of 60 steps); read as failed whatever happened, a finished job
        ended as an application error (CI of 63b094e).
        """
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return self._unknown(pid)
        return status if got else None

    def wait(self, timeout: float = 0, period: float = 0.1) -> Any:
        """None while any adopted worker runs; else torch's ``RunProcsResult``. Nobody is
        reaped before all have ended (the agent reads a zombie's status from ``/proc``)."""
        from torch.distributed.elastic.multiprocessing.api import RunProcsResult
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        deadline = time.monotonic() + timeout
        while True:
            states = {lr: proc.state(pid) for lr, pid in self._pids.items() if lr not in self._codes}
            if all(s in ("Z", None) for s in states.values()):
                break
            if time.monotonic() >= deadline:
                return None
            time.sleep(period)
        for lr in states:
            status = self._status(self._pids[lr])
            self._codes[lr] = self._unknown(self._pids[lr]) if status is None else status
        result = RunProcsResult()
        for lr, status in self._codes.items():
            code = -(status & 0x7F) if status & 0x7F else status >> 8
            if code:
                result.failures[lr] = ProcessFailure(local_rank=lr, pid=self._pids[lr], exitcode=code,
                                                     error_file=self._errors.get(lr, ""))
            else:
                result.return_values[lr] = None
        return result

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        """Stops the adopted workers: ``death_sig``, then SIGKILL after ``timeout``."""
        live = [pid for lr, pid in self._pids.items() if lr not in self._codes]
        for pid in live:
            try:
                os.kill(pid, death_sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while live and time.monotonic() < deadline:
            live = [pid for pid in live if proc.state(pid) not in ("Z", None)]
            time.sleep(0.1)
        kill(list(self._pids.values()))

