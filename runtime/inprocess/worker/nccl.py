"""The NCCL side of in-process recovery: what each backend needs, the abort, and the bound.

In-process recovery began on gloo, which cannot be aborted (pytorch#130345): an abandoned gloo
operation ends at its per-operation bound or when its sockets are broken
(:mod:`runtime.inprocess.worker.sockets`). On CUDA the training group is NCCL, whose
communicators *can* be aborted (``ncclCommAbort``): the kernels of an operation blocked on a
lost peer exit, and a thread blocked waiting for them (``loss.item()``, a stream sync) goes
on. :func:`plan` says, per backend, what the recovery does; it is pure and unit-tested.

The NCCL path, from the facts read in torch 2.13 and in the anchors:

- **Who aborts.** torch's watchdog must not: by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``)
  it ends the whole process on a communicator's error, a lost peer's included, which is the
  opposite of keeping the survivors. :func:`env_changes` sets it to ``0`` (torch's docstring of
  ``_abort_process_group``: use the abort API with it off), ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``
  and ``NCCL_NVLS_ENABLE=0`` (NVIDIA's resiliency extension, whose in-process restart aborts
  NCCL the same way, lists both as requirements), never over a value the user set (a value that
  defeats the recovery is warned about). These are read when a group is made: the Session sets
  them before its first group.
- **The abort.** :func:`abort_all` calls ``abort()`` on the NCCL *backend* of every registered
  group (``ProcessGroup._get_backend(cuda)``; ``ProcessGroupNCCL.abort`` aborts its communicators
  and stops its watchdog), inside one ``ncclGroupStart/End`` as torch's own
  ``_abort_process_group`` does (pytorch#119797: aborts of several communicators can deadlock
  each other otherwise). It runs from the fault watch's thread, as the anchors' abort does (NVIDIA's
  from its monitor thread, torchft's from a timer). It does **not** call
  ``_abort_process_group``: that also calls ``abort()`` on the gloo groups, and a gloo group's
  ``abort()`` waits for its operation in flight (measured on this machine, torch 2.13 CPU: 30.2 s,
  until the peer exited). The gloo side groups (control, preemption agreement, checkpointer)
  keep today's path: unregistered and their sockets broken.
- **The bound.** A gloo all-reduce takes a per-operation timeout; an NCCL operation's timeout
  belongs to torch's watchdog, which ends the process. So the bound of a training all-reduce is
  kept here instead (torchft's approach): :class:`Bound` watches each posted NCCL operation
  (``Work.is_completed()``, a CUDA event query) and, past its bound, fails the step and aborts the
  generation's communicators. The group's own timeout stays the long backstop it is.
- **The new generation** makes a fresh NCCL group bound to this rank's device (``device_id``:
  the communicator is made at once, not at the first collective), and a gloo side group of the
  same members for the control traffic and the state transfer (CPU tensors).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from hpc.contract import recovery_settings

log = logging.getLogger("hpc.inprocess")
BACKENDS = ("gloo", "nccl")
BOUND_POLL_S = 0.05   # how often the bound thread queries the posted NCCL operations


@dataclass(frozen=True)
class Plan:
    """What the recovery does for a training group of one backend.

    Attributes:
        backend: The training group's backend.
        abort_nccl: Abort every NCCL communicator of the old generation (the fault watch's
            thread at the announcement, and the recovery itself).
        break_sockets: Break the connections of the old generation's gloo groups (always: the
            side groups are gloo whatever the training backend).
        op_timeout: Bound a training all-reduce by its per-operation timeout (gloo); else by
            :class:`Bound` (NCCL, whose own timeout ends the process).
        side_group: Make a gloo group of the same members beside the training group, for the
            control traffic and the state transfer (the training group takes CUDA tensors).
        device_bound: Bind the new group to this rank's device (``device_id``).
    """

    backend: str
    abort_nccl: bool
    break_sockets: bool
    op_timeout: bool
    side_group: bool
    device_bound: bool


def plan(backend: str) -> Plan:
    """The recovery's plan for a training group on ``backend``.

    Raises:
        ValueError: An unknown backend (names the valid ones).
    """
    if backend == "gloo":
        return Plan("gloo", abort_nccl=False, break_sockets=True, op_timeout=True, side_group=False,
                    device_bound=False)
    if backend == "nccl":
        return Plan("nccl", abort_nccl=True, break_sockets=True, op_timeout=False, side_group=True,
                    device_bound=True)
    raise ValueError(f"in-process recovery: backend {backend!r} is not carried; valid: "
                     f"{', '.join(BACKENDS)} (use --recovery restart for another backend)")


PLAN_ENV = "HPC_TEST_INPROC_PLAN"   # tests: "nccl": the NCCL plan's steps on a gloo training group


def plan_for(backend: str, environ: Mapping[str, str]) -> Plan:
    """The plan for ``backend``; with ``HPC_TEST_INPROC_PLAN=nccl`` on gloo (tests, CPU), the
    NCCL plan's steps that need no CUDA (the side group, the thread's bound, the optimizer's
    wait, the abort's search, which finds no NCCL backend) on the gloo training group, so that
    the NCCL path's plumbing runs in real multi-process recoveries on a machine with no GPU.

    Raises:
        ValueError: An unknown backend, or an unknown ``HPC_TEST_INPROC_PLAN``.
    """
    chosen = plan(backend)
    wanted = environ.get(PLAN_ENV, "")
    if not wanted:
        return chosen
    if wanted != "nccl":
        raise ValueError(f"{PLAN_ENV}={wanted!r}: the only test plan is 'nccl' (or unset)")
    if backend != "gloo":
        return chosen
    return Plan("gloo", abort_nccl=True, break_sockets=True, op_timeout=False, side_group=True,
                device_bound=False)


@dataclass(frozen=True)
class EnvChange:
    """One variable the NCCL path sets: its value, the value it had, and why."""

    name: str
    value: str
    old: str | None
    why: str


NCCL_ENV = recovery_settings.NCCL_ENV   # the table, declared once in the contract (the launcher sets it too)


def env_changes(environ: Mapping[str, str]) -> tuple[list[EnvChange], list[str]]:
    """The variables to set for the NCCL path, and warnings for values the user set that
    defeat it (never overridden).

    Args:
        environ: The worker's environment.

    Returns:
        (changes to make, warnings).
    """
    changes, warnings = [], []
    for name, (value, why, fine) in NCCL_ENV.items():
        old = environ.get(name)
        if old is None or old == "":
            changes.append(EnvChange(name, value, old, why))
        elif old not in fine:
            warnings.append(f"{name}={old} (set by you, kept): in-process recovery on NCCL needs "
                            f"{' or '.join(fine)} ({why}); a lost peer may end this process, "
                            "and the job then recovers by restart")
    return changes, warnings


def apply_env(environ: MutableMapping[str, str]) -> list[EnvChange]:
    """Sets :func:`env_changes` in ``environ`` and logs each change and each warning."""
    changes, warnings = env_changes(environ)
    for c in changes:
        environ[c.name] = c.value
        log.info("in-process recovery on NCCL: set %s=%s (was %s): %s", c.name, c.value,
                 "unset" if c.old is None else repr(c.old), c.why)
    for w in warnings:
        log.warning("in-process recovery on NCCL: %s", w)
    return changes


# -- the abort ---------------------------------------------------------------------------------
def nccl_backends(groups: Iterable[Any] | None = None) -> list[Any]:
    """The NCCL backends of ``groups`` (default: every registered process group)."""
    import torch
    import torch.distributed as dist

    nccl_class = getattr(dist.distributed_c10d, "ProcessGroupNCCL", None)
    if nccl_class is None:   # a build without NCCL
        return []
    if groups is None:
        groups = list(dist.distributed_c10d._world.pg_names)
    found = []
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):   # no CUDA backend in this group
            continue
        if isinstance(backend, nccl_class) and all(backend is not b for b in found):
            found.append(backend)
    return found


def abort_all(groups: Iterable[Any] | None = None) -> int:
    """Aborts the NCCL communicators of ``groups`` (default: every registered group); returns
    how many backends were aborted. Idempotent: an aborted backend has no communicator left."""
    backends = nccl_backends(groups)
    if not backends:
        return 0
    backends[0]._group_start()   # one ncclGroupStart/End around all aborts, as torch's own does
    try:
        for b in backends:
            try:
                b.abort()
            except Exception as e:   # noqa: BLE001 - an errored communicator may fail its abort
                log.warning("in-process recovery: NCCL abort: %s", e)
    finally:
        backends[0]._group_end()
    return len(backends)


# -- the bound of a training all-reduce --------------------------------------------------------
@dataclass
class Watched:
    """One posted NCCL operation under a bound."""

    work: Any
    gen: int
    deadline: float
    bound_s: float


def overdue(watched: list[Watched], now: float) -> tuple[list[Watched], list[Watched]]:
    """Splits the watched operations into (still running within their bound, past their bound);
    finished ones are dropped."""
    running, late = [], []
    for w in watched:
        if w.work.is_completed():
            continue
        (late if now >= w.deadline else running).append(w)
    return running, late


class Bound(threading.Thread):
    """Bounds the training all-reduces of an NCCL group: one thread queries the posted
    operations every :data:`BOUND_POLL_S` and calls ``on_overdue(gen, bound_s)`` once per
    generation whose operation ran past its bound (a silent peer: no error, no end).

    Args:
        on_overdue: ``(gen, bound_s) -> None``: fails the step and aborts the generation.
        clock: The clock (tests).
    """

    def __init__(self, on_overdue: Callable[[int, float], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="hpc-nccl-bound", daemon=True)
        self.on_overdue = on_overdue
        self.clock = clock
        self._lock = threading.Lock()
        self._watched: list[Watched] = []
        self._fired: set[int] = set()
        self.stopped = threading.Event()

    def watch(self, work: Any, gen: int, bound_s: float) -> None:
        """Puts a posted operation of generation ``gen`` under ``bound_s`` seconds."""
        with self._lock:
            self._watched.append(Watched(work, gen, self.clock() + bound_s, bound_s))

    def check(self) -> list[int]:
        """One pass: the generations found past a bound now (each reported once)."""
        with self._lock:
            self._watched, late = overdue(self._watched, self.clock())
            gens = sorted({w.gen for w in late} - self._fired)
            self._fired.update(gens)
            bound = {w.gen: w.bound_s for w in late}
        for gen in gens:
            self.on_overdue(gen, bound[gen])
        return gens

    def pending(self) -> int:
        with self._lock:
            return len(self._watched)

    def run(self) -> None:
        while not self.stopped.wait(BOUND_POLL_S):
            try:
                self.check()
            except Exception as e:   # noqa: BLE001 - the group's own timeout still backs it up
                log.warning("in-process recovery: NCCL bound: %s", e)

    def stop(self) -> None:
        self.stopped.set()
