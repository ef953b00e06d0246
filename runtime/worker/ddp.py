"""DDP as the Session builds it: no per-step cost beyond bare DDP's.

Three things a plain ``DDP(model)`` does not give the Session, each bought without a cost on
every step:

- **One gradient-bucket layout for the whole run.** DDP re-orders its buckets after the first
  step it runs (by the order gradients arrived). A resumed job's first step would then reduce
  with another layout than the uninterrupted run used at that step, and with more than two
  ranks the sums round differently. ``find_unused_parameters=True`` keeps the first layout,
  but costs an autograd-graph walk and an extra all-reduce of the used-parameter map on every
  step (~1.5 ms per step on gloo here). Instead :func:`fix_bucket_layout` makes DDP do its
  one rebuild at once, before the first step, from the parameters' order; DDP never rebuilds
  again. Buckets then follow the parameters' order, so on a model of more than one bucket
  (25 MB of gradients) DDP's first all-reduce waits for the end of the backward pass;
  ``Session.wrap(..., reproducible_resume=False)`` gives DDP's own layout instead.
- **A clear error for unused parameters.** Without ``find_unused_parameters`` DDP cannot
  reduce a model that leaves parameters out of the loss; torch stops at the next forward
  pass and tells the user to pass ``find_unused_parameters=True`` to DDP's constructor.
  :class:`SessionDDP` adds where that goes with the Session (``s.wrap(model,
  find_unused_parameters=True)``).
- **The rank's pace for the straggler watch** (``runtime.liveness.stragglers``): the time
  from the start of a step until this rank's backward pass has produced every gradient, the
  work it does before DDP's reduction waits on the other ranks. :class:`PaceProbe` measures it
  on sampled steps only (about one every :data:`PACE_EVERY_S`), with autograd hooks that are
  there only during those steps; DDP's comm hook slot stays free for the user's.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

PACE_EVERY_S = 0.1      # time one step about this often (every step when steps are longer)
UNUSED_ADVICE = ("With hpc's Session, wrap the model with "
                 "s.wrap(model, find_unused_parameters=True) instead.")


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option for no buffer broadcast in the forward pass, named as this torch names it:
    ``forward_sync_buffers`` since 2.13, ``broadcast_buffers`` before (which also leaves buffers
    out of the initial sync). torch 2.11 refused the new name (seen on an H200)."""
    name = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
        else "broadcast_buffers"
    return {name: False}


class SessionDDP(DDP):
    """``DistributedDataParallel`` whose unused-parameter error names the Session's option,
    and that can be rebuilt in place on a new process group (in-process recovery)."""

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._hpc_kwargs = dict(kwargs)

    def rebuild(self) -> None:
        """Builds DDP again around the same module on the current default group.

        The parameters stay the same objects, so the user's optimizer and references to
        this wrapper stay valid; the state was made equal beforehand (no initial broadcast).
        """
        kwargs = dict(self._hpc_kwargs, process_group=None, init_sync=False)
        DDP.__init__(self, self.module, **kwargs)
        self._hpc_kwargs = {k: v for k, v in kwargs.items() if k not in ("process_group", "init_sync")}

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as e:
            if "find_unused_parameters" in str(e) and not self.find_unused_parameters:
                raise RuntimeError(f"{e}\n{UNUSED_ADVICE}") from e
            raise


def fix_bucket_layout(ddp: DDP) -> bool:
    """Makes DDP build its final bucket layout now (all ranks; it syncs the layout), so no
    later step changes it.

    Returns:
        Whether the layout is fixed (False when DDP would not rebuild anyway, e.g. with
        ``find_unused_parameters=True``, or when this torch lacks the reducer's calls).
    """
    reducer = getattr(ddp, "reducer", None)
    push = getattr(reducer, "_push_all_rebuilt_params", None)
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if push is None or rebuild is None or ddp.find_unused_parameters:
        return False
    push()
    fixed = bool(rebuild())
    if fixed:
        ddp._has_rebuilt_buckets = True
    return fixed


class PaceProbe:
    """Times one step in a while: from the step's start until the backward pass has produced
    every gradient of ``params``.

    Args:
        params: The parameters whose gradients end this rank's own work of a step.
        every_s: Time a step when at least this long passed since the last timed one.
    """

    def __init__(self, params: list[torch.Tensor], *, every_s: float = PACE_EVERY_S) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.every_s = every_s
        self.done: float | None = None
        self._handle: Any = None
        self._last = float("-inf")

    def arm(self, now: float) -> bool:
        """At a step's start: hooks this step's backward pass if a sample is due."""
        if self._handle is not None or not self.params or now - self._last < self.every_s:
            return False
        self._last, self.done = now, None
        self._handle = torch.autograd.graph.register_multi_grad_hook(
            self.params, self._mark, mode="all")
        return True

    def _mark(self, grads: Any) -> None:
        self.done = time.perf_counter()   # the last backward pass of the step counts (micro-batches)

    def take(self) -> float | None:
        """At the step's end: when this step's gradients were all there (None when the step
        was not timed or ran no backward pass); removes the hooks."""
        if self._handle is None:
            return None
        self._handle.remove()
        self._handle = None
        done, self.done = self.done, None
        return done
