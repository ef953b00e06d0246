"""FSDP2 under in-process recovery: its collectives never raise, and it re-binds to a new group.

**Design** (compared with torchft). torchft builds the model on its own
``ProcessGroup`` subclass whose inner backend is swapped at each reconfiguration, and wraps
every operation so an error is reported to its manager instead of raised. We need the same two
properties with less machinery, and torch 2.13's FSDP2 gives the seams:

- **No collective inside the step raises.** FSDP2 runs its all-gathers (forward, backward) and
  reduce-scatters (backward) through replaceable comm objects (``set_custom_all_gather``,
  ``set_custom_reduce_scatter``). :class:`GuardedAllGather` and :class:`GuardedReduceScatter`
  run the same gloo operation bounded by the guard's per-operation timeout (as DDP's comm hook
  does, :mod:`runtime.inprocess.worker.guard`) and wait in slices; a failure, or a fault
  announced meanwhile, marks the step failed and returns, leaving the output as it is. The
  step then computes on garbage, but the guarded optimizer step does nothing, so the sharded
  parameters and the optimizer state stay at the step's start: the failed step leaves no trace,
  exactly as with DDP.
- **Re-binding without new user objects.** FSDP2's DTensors and its mesh name their process
  group; the mesh of ``fully_shard(model)`` on the default world resolves the group by its name
  (``"0"``), and a new default group made after ``destroy_process_group`` gets that name again
  (verified on torch 2.13), so DTensor operations (grad clipping, ``full_tensor``, DCP's state
  dicts) find the new generation's group by themselves. FSDP2 caches the group object in each
  parameter group's mesh info; :func:`rebind` points it at the new one. The model, its
  parameters and the optimizer stay the same objects, so user references stay valid. This
  holds at the same world size with every rank kept (rank ``r`` owns shard ``r``, and the
  mesh's coordinates stay true): a sharded re-form keeps ranks and joiners fill the lost ones
  (:func:`runtime.inprocess.rules.plan_members`); a shrink falls back to the restart path.

Meshes of their own (HSDP, TP: ``Session(parallel=...)``) are not carried (their sub-groups are
not re-made here) and keep the restart path.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

WAIT_SLICE_S = 0.01   # a waiting rank looks whether the step was failed this often
POLL_S = 0.0002       # an operation without a future (gloo's reduce-scatter) is polled this often


class _Done(dist.Work):
    """A finished operation (FSDP2 waits on it; the step is already marked failed, or done)."""

    def wait(self, timeout: Any = None) -> bool:   # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True


class _Guarded(dist.Work):
    """A gloo operation whose wait ends when it completes, fails, or the step is failed."""

    def __init__(self, guard: Any, work: Any, what: str, gen: int) -> None:
        super().__init__()
        self.guard, self.work, self.what, self.gen = guard, work, what, gen
        self.done = threading.Event()
        guard.track(id(work), gen)
        try:
            work.get_future().add_done_callback(self._finished)
        except RuntimeError:   # gloo's reduce-scatter has no future: its wait polls
            self.done = None   # type: ignore[assignment]

    def _finished(self, fut: Any) -> None:
        self.guard.untrack(id(self.work))
        self.done.set()

    def _completed(self) -> bool:
        if self.done is not None:
            return self.done.wait(WAIT_SLICE_S)
        if self.work.is_completed():
            self.guard.untrack(id(self.work))
            return True
        time.sleep(POLL_S)
        return False

    def wait(self, timeout: Any = None) -> bool:   # noqa: ARG002
        while not self._completed():
            if self.guard.failed:
                return True
        try:
            self.work.wait()
        except Exception as e:   # noqa: BLE001 - any error of the group is a failed step
            self.guard.fail(f"{self.what}: {str(e).splitlines()[0][:300] if str(e) else e}", gen=self.gen)
        return True

    def is_completed(self) -> bool:
        done = self.done.is_set() if self.done is not None else self.work.is_completed()
        return done or self.guard.failed


def _run(guard: Any, what: str, start: Any, async_op: bool) -> dist.Work | None:
    if guard.failed:   # the group is broken: do not wait on it again in this step
        return _Done() if async_op else None
    gen = guard.gen
    try:
        work = _Guarded(guard, start(timedelta(seconds=float(guard.timeout_s()))), what, gen)
    except Exception as e:   # noqa: BLE001
        guard.fail(f"{what}: {e}", gen=gen)
        return _Done() if async_op else None
    if async_op:
        return work
    work.wait()
    return None


class GuardedAllGather(DefaultAllGather):
    """FSDP2's all-gather, bounded, never raising (see the module docstring)."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> dist.Work | None:
        def start(timeout: timedelta) -> Any:
            opts = AllgatherOptions()
            opts.timeout = timeout
            return group._allgather_base(output_tensor, input_tensor, opts)
        return _run(self.guard, "all-gather", start, async_op)


class GuardedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, bounded, never raising (see the module docstring)."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        # Gloo's reduce-scatter completes only inside its wait() (no future, is_completed stays
        # False), which a lost peer could block for the whole timeout: it runs as an
        # all-reduce (which has a future) and this rank keeps its chunk.
        def start(timeout: timedelta) -> Any:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            opts.timeout = timeout
            return group.allreduce([input_tensor], opts)
        failed_before = self.guard.failed
        work = _run(self.guard, "reduce-scatter", start, async_op=False)
        if not self.guard.failed and not failed_before:
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return _Done() if async_op else work


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def install(model: torch.nn.Module, guard: Any) -> int:
    """Gives every FSDP2 unit of ``model`` the guarded comms; returns how many units."""
    units = fsdp_modules(model)
    for m in units:
        m.set_custom_all_gather(GuardedAllGather(guard))
        m.set_custom_reduce_scatter(GuardedReduceScatter(guard))
    return len(units)


def rebind(model: torch.nn.Module) -> None:
    """Points every FSDP2 unit's cached process group at its mesh's group now (the new
    generation's default group, found by name)."""
    for m in fsdp_modules(model):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for info in (group.mesh_info, getattr(group, "post_forward_mesh_info", None)):
                if info is not None and hasattr(info, "shard_process_group"):
                    info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
                    info.shard_mesh_rank = info.shard_process_group.rank()
