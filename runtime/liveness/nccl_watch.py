"""NCCL's own watchdog and flight recorder, set coherently with the stall watch (GPU jobs only).

The stall watch (:mod:`.watchdog`) is the first to act on a stall: in seconds, with the
Python stacks. torch's NCCL watchdog is the backstop behind it, and its flight recorder is the
evidence NCCL jobs need on top of the stacks (which collective each rank last entered):

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: on a collective error or timeout, abort the
  communicators and end the process, so the elastic agent sees a failed worker instead of a
  rank hung in a torn-down communicator;
* ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: keep the last
  collectives of each rank, and dump them (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, into the
  allocation's log directory, one file per rank) when NCCL times out;
* ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: a named pipe per rank, in the node-local heartbeat
  directory; the stall watch writes to it on a stall, and torch dumps the flight recorder too;
* ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: with the stall watch on, the same as the process
  groups' collective timeout (:func:`.deadline.collective_timeout_s`, the longest phase budget
  plus a minute): NCCL's monitor is a backstop, and must not end a rank inside a long phase
  (a 20-minute save) that the stall watch allows. With the watch off, torch's default stands.

Every value is a default: a variable the user set is kept (and logged as kept). Pure.
"""

from __future__ import annotations

from pathlib import Path

from hpc.contract import recovery_settings
from runtime.liveness.deadline import StallPolicy, collective_timeout_s

TRACE_ENTRIES = 2000
PIPE_PREFIX = "nccl-rank-"   # torch appends "<rank>.pipe"


def nccl_defaults(*, gpus_per_node: int, policy: StallPolicy | None, log_dir: Path,
                  heartbeat_dir: Path, recovery: str = recovery_settings.RESTART) -> dict[str, tuple[str, str]]:
    """The NCCL variables to set (name -> (value, reason)); for a CPU job only those of in-process
    recovery (``hpc run`` on a GPU node may not say ``--gpus-per-node``, and torch's agent would
    otherwise give each worker ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``)."""
    inprocess = {name: (value, f"in-process recovery: {why}")
                 for name, (value, why, _) in recovery_settings.NCCL_ENV.items()} if recovery == recovery_settings.INPROCESS else {}
    if not gpus_per_node:
        return inprocess
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
            "3", "a collective error or timeout ends the rank, so the elastic agent re-forms"),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": (
            str(TRACE_ENTRIES), "NCCL flight recorder: each rank's last collectives, for stall reports"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", "dump the flight recorder when NCCL times out"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": (
            str(Path(log_dir) / "nccl-trace-rank-"), "flight recorder dumps go to the job's logs"),
    }
    if policy is not None:
        wanted["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] = (
            str(Path(heartbeat_dir) / PIPE_PREFIX), "the stall watch asks for a flight recorder dump "
            "through this pipe before it ends stuck ranks")
        wanted["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = (
            f"{collective_timeout_s(policy):.0f}", "NCCL's monitor is the backstop behind the stall "
            "watch: the collective timeout, longer than any phase budget")
    return wanted | inprocess   # in-process recovery aborts the communicators itself: not 3


def request_dumps(heartbeat_dir: Path) -> int:
    """Writes to every rank's flight-recorder pipe (non-blocking); returns how many took it."""
    import os

    done = 0
    for fifo in Path(heartbeat_dir).glob(f"{PIPE_PREFIX}*.pipe"):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:   # ENXIO: no reader (the rank is gone)
            continue
        try:
            os.write(fd, b"1\n")
            done += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return done
