"""The failed step leaves no trace: errors of the step's collectives become a flag, not a crash.

An ordinary loop (``for step in s.steps(...)``) cannot be resumed once an exception has left
it, so in in-process mode no collective inside the step may raise. The step's collectives are
DDP's gradient all-reduces; :class:`StepGuard` runs them itself (a DDP comm hook):

- each all-reduce is bounded by the current stall deadline (gloo's per-operation timeout;
  gloo cannot be aborted, pytorch#130345, but a bounded operation ends by itself), and a
  failure (a peer died: its socket closed; or the bound ran out: a silent peer) marks the step
  failed and hands DDP the local gradient instead of raising; on NCCL (whose own per-operation
  timeout ends the process) the bound is a thread's that fails the step and aborts the
  generation's communicators (:mod:`runtime.inprocess.worker.nccl`);
- the optimizer's ``step`` is wrapped: on a failed step it does nothing, so the model and the
  optimizer stay exactly at the state the step started from;
- the small registered state (sampler cursor, LR scheduler, counters, RNG) is copied at each
  step's start and put back after a failed step (:meth:`StepGuard.rollback`).

So after a failed step a rank holds the whole state of the step *before* it, and a rank whose
step completed holds the state after it; the re-form takes the newest (one step is computed
twice at most). ``HPC_TEST_INPROC_FAULT=RANK:STEP:kill|fail`` injects a fault right after the
reduction and before the optimizer step; ``RANK:STEP:save`` makes the rank leave as it starts
the save after ``STEP`` steps, while its peers enter the save's collectives; ``RANK:GEN:group``
makes rank ``RANK`` of generation ``GEN`` die once that generation closed, before its group
forms (a second fault right after a re-form); ``RANK:STEP:repeat``
fails that step's all-reduce on that rank every time the rank runs it, before the reduction (a
failure that repeats: the re-forms go on from that step each time). Several faults: comma
separated (tests only).
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc.contract import recovery_settings
from runtime.inprocess import protocol as proto
from runtime.liveness import posted
from runtime.worker import rng

log = logging.getLogger("hpc.inprocess")
WATCH_EVERY_S = 0.1   # how often a worker asks the store whether its generation failed


class PeerLost(RuntimeError):
    """The generation failed while this rank waited at a step boundary."""


class StepGuard:
    """Turns a failed step into a flag and keeps the state of the step before it.

    Args:
        small_state: Registered objects other than modules and optimizers (``state_dict``
            and ``load_state_dict``): copied at every step's start, restored after a fault.
        timeout_s: A callable giving the bound of one all-reduce now (the stall deadline).
        rank: This rank (for the injected test fault).
    """

    def __init__(self, small_state: Mapping[str, Any], *, timeout_s: Any, rank: int = 0) -> None:
        self.small_state = dict(small_state)
        self.timeout_s = timeout_s
        self.rank = rank
        self.step = 0
        self.gen = 0
        self.error: str | None = None
        self.stepped = False      # the optimizer step of this step ran (its state is the next step's)
        self.uid = ""             # this process in the protocol (its fault watch says it is coming)
        self.joiners = False      # rank 0's fault watch saw a joiner the world has room for
        self._saved: dict[str, Any] = {}
        self._saved_rng: Any = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._saved_groups: list[list[dict[str, Any]]] = []
        self._faults = _parse_faults(recovery_settings.InProcessEnvironment.from_env(os.environ).faults)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[torch.futures.Future, torch.Tensor]] = {}
        self._inflight: dict[int, int] = {}   # gloo operations not finished yet: id -> generation
        self.bound: Any = None    # NCCL: the bound of its all-reduces (runtime.inprocess.worker.nccl.Bound)
        self._posted: list[Any] = []   # NCCL: this step's all-reduces (the optimizer step waits for them)

    # -- the step's start and end ------------------------------------------------------------
    def begin(self, step: int) -> None:
        """At a step's start: remember the small state (a failed step restores it). A failure
        of the generation stays marked until the recovery (:meth:`reset`)."""
        self.step = step
        self.stepped = False
        self._posted = []
        self._saved = {k: copy.deepcopy(v.state_dict()) for k, v in self.small_state.items()}
        self._saved_rng = rng.capture()
        self._saved_groups = [_hyperparameters(o) for o in self._optimizers]

    def reset(self, gen: int) -> None:
        """The recovery is done: the new generation ``gen`` has not failed."""
        with self._lock:
            self.error, self.gen, self._pending, self.joiners = None, gen, {}, False

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, why: str, gen: int | None = None) -> None:
        """Marks the step failed and releases every all-reduce DDP still waits for (with the
        local gradient): a peer that left does not answer, and gloo cannot be interrupted."""
        with self._lock:
            if gen is not None and gen != self.gen:   # a late word about an older generation
                return
            if self.error is None:
                log.warning("step %d failed on rank %d: %s", self.step, self.rank, why)
                self.error = why
            pending, self._pending = self._pending, {}
        for fut, tensor in pending.values():
            _complete(fut, tensor)

    def settle(self, works: list[Any], poll_s: float = 0.0005) -> None:
        """Waits for posted collectives of the step boundary, leaving as soon as the step is
        marked failed (:func:`runtime.liveness.posted.settle`).

        Raises:
            PeerLost: The generation failed while waiting.
        """
        if not posted.settle(works, lambda: self.failed, poll_s=poll_s):
            raise PeerLost(self.error or "peer lost")

    def rollback(self) -> None:
        """Puts the small state back to the failed step's start. The model and the optimizer's
        state never left it (the optimizer step did nothing), but its parameter groups' values
        did: an LR scheduler stepped after the skipped optimizer step wrote the next step's
        ``lr`` into them, which the scheduler's own state does not hold. Redone with it, the
        step was not the uninterrupted run's (train_gpt: weights off by ~1e-4 from there on)."""
        for k, v in self.small_state.items():
            if k in self._saved:
                v.load_state_dict(self._saved[k])
        for optim, groups in zip(self._optimizers, self._saved_groups):
            for group, saved in zip(optim.param_groups, groups):
                group.update(copy.deepcopy(saved))
        if self._saved_rng is not None:
            rng.restore(self._saved_rng)

    # -- the hooks -----------------------------------------------------------------------------
    @property
    def comm_hook(self) -> Any:
        """DDP comm hook (``register_comm_hook(None, guard.comm_hook)``): the mean all-reduce,
        bounded, that never raises. (Unannotated: DDP checks a hook's annotations.)"""
        def hook(process_group, bucket):  # type: ignore[no-untyped-def]
            return self._all_reduce(process_group, bucket)
        return hook

    def _all_reduce(self, process_group: Any, bucket: Any) -> torch.futures.Future:
        tensor = bucket.buffer()
        if self.failed:   # the group is broken: do not wait on it again in this step
            return _done(tensor)
        if (self.rank, self.step, "repeat") in self._faults:
            self.fail(f"injected repeating fault in step {self.step}'s all-reduce")
            return _done(tensor)
        group = process_group or dist.group.WORLD
        gen = self.gen   # a late failure of this operation says nothing about a later generation
        tensor.div_(group.size())
        if self.bound is not None:
            return self._all_reduce_nccl(group, tensor, gen)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = timedelta(seconds=float(self.timeout_s()))
        try:
            work = group.allreduce([tensor], opts).get_future()
        except Exception as e:   # noqa: BLE001 - any error of the group is a failed step
            self.fail(f"all-reduce: {e}")
            return _done(tensor)
        # DDP waits on this future, which completes when gloo's does, or at once when the
        # step is marked failed (a peer announced the fault: :class:`FaultWatch`).
        mine: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self.error is not None:   # no callback: gloo may finish it whenever it likes
                return _done(tensor)
            self._pending[id(mine)] = (mine, tensor)
            self._inflight[id(work)] = gen

        def finished(f: torch.futures.Future) -> None:
            with self._lock:
                self._inflight.pop(id(work), None)
            try:
                f.value()
            except Exception as e:   # noqa: BLE001
                self.fail(f"all-reduce: {_first_line(e)}", gen=gen)
                return
            with self._lock:
                if self._pending.pop(id(mine), None) is None:
                    return   # released already (the step failed)
            _complete(mine, tensor)

        work.add_done_callback(finished)
        return mine

    def _all_reduce_nccl(self, group: Any, tensor: torch.Tensor, gen: int) -> torch.futures.Future:
        """The NCCL all-reduce: no per-operation timeout (torch's watchdog would end the
        process at it); the bound is :attr:`bound`'s, which fails the step and aborts the
        generation's communicators. The future is NCCL's own (CUDA-aware: DDP's use of the
        result waits on the operation's stream, not the CPU); an aborted operation ends it."""
        try:
            work = group.allreduce([tensor], dist.AllreduceOptions())
        except Exception as e:   # noqa: BLE001 - an aborted or errored group: a failed step
            self.fail(f"all-reduce: {_first_line(e)}", gen=gen)
            return _done(tensor)
        self.bound.watch(work, gen, float(self.timeout_s()))
        self._posted.append(work)

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()[0]
            except Exception as e:   # noqa: BLE001 - an error of the group is a failed step, never DDP's
                self.fail(f"all-reduce: {_first_line(e)}", gen=gen)
                return tensor
        return work.get_future().then(reduced)

    def wait_reduced(self, poll_s: float = 0.0005) -> None:
        """NCCL: waits until this step's all-reduces finished, or the step failed.

        An NCCL operation runs on its stream while the CPU goes on: the optimizer's kernels
        would be queued behind an all-reduce that a lost peer never ends, and the abort that
        ends it leaves a partly reduced gradient, which they would then apply as a completed
        step. So the optimizer step waits here (the CPU; the GPU waited anyway) for the
        reduction to end without error, and a step whose reduction failed or was aborted is a
        failed step (the state stays at its start, as on gloo).
        """
        posted, self._posted = self._posted, []
        for work in posted:
            wait = 0.00002   # from 20 us up to poll_s: the wait adds little to a short step
            while not self.failed and not work.is_completed():
                time.sleep(wait)
                wait = min(2 * wait, poll_s)
            if self.failed:
                return
            error = work_error(work)
            if error is not None:
                self.fail(f"all-reduce: {_first_line(error)}")
                return

    def track(self, key: int, gen: int) -> None:
        """Counts a gloo operation of generation ``gen`` as in flight (FSDP2's guarded comms)."""
        with self._lock:
            self._inflight[key] = gen

    def untrack(self, key: int) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def in_flight(self, *, before_gen: int | None = None) -> int:
        """How many of this guard's gloo operations have not finished (of generations before
        ``before_gen``, or all)."""
        with self._lock:
            return sum(1 for g in self._inflight.values() if before_gen is None or g < before_gen)

    def drain(self, timeout_s: float, *, before_gen: int | None = None, poll_s: float = 0.01) -> int:
        """Waits up to ``timeout_s`` for the gloo operations of generations before
        ``before_gen`` (or all) to finish; returns how many are still running.

        An operation still running when the interpreter exits finishes on gloo's thread
        during finalization, and its Python callback then ends the process
        (:mod:`runtime.inprocess.worker.sockets`).
        """
        deadline = time.monotonic() + timeout_s
        while (left := self.in_flight(before_gen=before_gen)) and time.monotonic() < deadline:
            time.sleep(poll_s)
        return left

    def guard_optimizer(self, optim: torch.optim.Optimizer) -> None:
        """Wraps ``optim.step``: it does nothing on a failed step."""
        if getattr(optim.step, "_hpc_guarded", False):
            return
        self._optimizers.append(optim)
        inner = optim.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.wait_reduced()
            self._inject()
            if self.failed:
                return None
            out = inner(*args, **kwargs)
            self.stepped = True
            return out

        step._hpc_guarded = True   # type: ignore[attr-defined]
        optim.step = step          # type: ignore[method-assign]

    def inject_at_save(self, steps_done: int) -> None:
        """The ``save`` test fault: this rank leaves the step boundary as its save starts.

        Raises:
            PeerLost: The fault is set for this rank and ``steps_done``.
        """
        if (self.rank, steps_done, "save") in self._faults:
            self._faults.remove((self.rank, steps_done, "save"))
            raise PeerLost("injected fault: left as the save started (its peers are in its collectives)")

    def inject_in_transfer(self, gen: int) -> None:
        """The ``transfer`` test fault (``RANK:GEN:transfer``: a generation, not a step): rank
        ``RANK`` of generation ``gen`` dies, as a node dies, in that generation's state
        transfer, after its first tensor broadcast (its peers are part way through it)."""
        if (self.rank, gen, "transfer") in self._faults:
            self._faults.remove((self.rank, gen, "transfer"))
            os.kill(os.getpid(), signal.SIGKILL)

    def inject_in_group(self, gen: int) -> None:
        """The ``group`` test fault (``RANK:GEN:group``): rank ``RANK`` of the closed generation
        ``gen`` dies (SIGKILL) before its group forms; its peers wait for it there. The ``late``
        one (``RANK:GEN:late``): rank ``RANK`` starts forming only once a fault of ``gen`` was
        announced to it (at most 60 s): the fault comes before its group's store connection."""
        if (self.rank, gen, "group") in self._faults:
            self._faults.remove((self.rank, gen, "group"))
            os.kill(os.getpid(), signal.SIGKILL)
        if (self.rank, gen, "late") in self._faults:
            self._faults.remove((self.rank, gen, "late"))
            end = time.monotonic() + 60.0
            while not self.failed and time.monotonic() < end:
                time.sleep(0.01)

    def _inject(self) -> None:
        fault = next((f for f in self._faults if f[:2] == (self.rank, self.step)
                      and f[2] in ("kill", "fail")), None)
        if fault is None:
            return
        self._faults.remove(fault)
        if fault[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        self.fail("injected fault between the reduction and the optimizer step")


def _hyperparameters(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's values but its parameters (``lr``, ``betas``, a scheduler's
    ``initial_lr``...): a few numbers, copied at every step's start."""
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optim.param_groups]


def _parse_faults(raw: str) -> list[tuple[int, int, str]]:
    out = []
    for one in filter(None, (x.strip() for x in raw.split(","))):
        rank, step, kind = one.split(":")
        if kind not in ("kill", "fail", "save", "repeat", "transfer", "group", "late"):
            raise ValueError(f"{recovery_settings.FAULT_ENV}={raw!r}: the kind must be kill, fail, save, repeat, "
                             "transfer, group or late")
        out.append((int(rank), int(step), kind))
    return out


class FaultWatch(threading.Thread):
    """Watches the store for the announcement that the current generation failed, and then
    fails the step at once (pushed detection: a survivor blocked in an all-reduce whose peer
    left or died is released within :data:`WATCH_EVERY_S` instead of at the operation's bound).

    It uses its own store connection (a client is not shared between threads) and asks every
    :data:`WATCH_EVERY_S` (one small request; a blocking store ``wait`` would leave a thread in
    C++ that aborts the interpreter at exit).

    On rank 0 it also asks whether a joiner waits (``joins``) and raises ``guard.joiners``,
    which the Session puts into its next preemption agreement: no request on the step's path.

    Args:
        connect: ``() -> store``: a new client of the job's store.
        gen: The generation watched.
        guard: The guard to fail.
        joins: ``(store) -> bool``: a joiner waits (rank 0), or None.
        on_fault: ``(gen) -> None``, called after the guard was failed: ends this rank's
            waits in the generation's other groups (:meth:`InProcess._break_generation`).
    """

    def __init__(self, connect: Any, gen: int, guard: StepGuard, joins: Any = None,
                 on_fault: Any = None) -> None:
        super().__init__(name="hpc-fault-watch", daemon=True)
        self.connect, self.gen, self.guard, self.joins = connect, gen, guard, joins
        self.on_fault = on_fault
        self.key = proto.fault(gen)
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            store = self.connect()
        except Exception as e:   # noqa: BLE001 - no store: the operations' bound still holds
            log.warning("fault watch: cannot reach the store (%s)", e)
            return
        while not self.stopped.wait(WATCH_EVERY_S):
            try:
                if self.joins is not None and not self.guard.joiners and self.joins(store):
                    self.guard.joiners = True
                if not store.check([self.key]):
                    continue
                why = store.get(self.key).decode(errors="replace")
            except Exception:   # noqa: BLE001 - the store went away: the bound still holds
                return
            if self.stopped.is_set():
                return
            me = getattr(self.guard, "uid", "")
            if me:   # alive and aware: the next generation's leader waits for this process
                try:
                    store.set(proto.coming(self.gen + 1, me), "1")
                except Exception:   # noqa: BLE001
                    pass
            self.guard.fail(f"fault announced: {why}", gen=self.gen)
            if self.on_fault is not None:
                self.on_fault(self.gen)
            return

    def stop(self, join: bool = False) -> None:
        self.stopped.set()
        if join and self.is_alive():
            self.join(timeout=2 * WATCH_EVERY_S + 1)


def _complete(fut: torch.futures.Future, tensor: torch.Tensor) -> None:
    if not fut.done():
        try:
            fut.set_result(tensor)
        except RuntimeError:   # completed meanwhile
            pass


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def work_error(work: Any) -> BaseException | None:
    """A finished operation's error, or None.

    ``Work.exception()`` is the reader; where torch cannot convert the exception it holds to a
    Python one it raises ``TypeError`` ("Unable to convert function return value to a Python
    type"): seen with NCCL on torch 2.11 (an H200, a world of one), where every step then counted
    as failed. The operation's future then decides: its ``value()`` raises the operation's
    error, translated, or returns the reduced tensors.
    """
    try:
        return work.exception()
    except TypeError as unreadable:
        try:
            work.get_future().value()
        except Exception as e:   # noqa: BLE001
            return e
        global _UNREADABLE_SEEN
        if not _UNREADABLE_SEEN:
            _UNREADABLE_SEEN = True
            log.warning("in-process recovery: torch cannot show a finished all-reduce's exception "
                        "(%s); its future completed without error, so the step goes on (logged once)",
                        _first_line(unreadable))
        return None
    except Exception as e:   # noqa: BLE001
        return e


_UNREADABLE_SEEN = False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
