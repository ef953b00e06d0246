"""Async-save staging: the one copy an async save must block for, into buffers made ahead of time.

An async save may return to the training loop only once it holds a copy of the local state
that later steps cannot change. That copy is the physical floor of the stall (memory bandwidth
on CPU, the device-to-host link on GPU); everything else is kept off the critical path:

* **Buffers are made ahead.** Allocating them inside the stall is what made the first save
  ~40x the floor (on this VM a first touch of fresh pages costs more than the copy itself).
  :meth:`Staging.warm_up` allocates and first-touches them on a background thread; the
  checkpointer calls it right after restore, or after the first optimizer step on a fresh
  start (before it the optimizer has no state to size buffers from, and asking DCP for it
  would run a zero step that changes the training, see ``Checkpointer``).
* **Reused while the structure holds.** The buffers are kept while the state's layout
  (:func:`layout_of`: tree, tensor shapes, dtypes, strides, devices, DTensor placements) is
  unchanged, and remade when it changes: a save after such a change pays the allocation, as
  every save did before.
* **Nothing else on the stall.** CPU state is copied in one flat pass, tensor by tensor, into
  the buffers (DCP's ``BlockingAsyncStager`` walks its generic iterator and its buffer creation
  deep-copies every DTensor first). DCP's planning already runs on the writer thread.
* **Accelerator state** goes through torch's own ``DefaultStager`` with ``StagingOptions`` for
  pinned host buffers and non-blocking copies on its side stream (its own thread); its buffers
  are cached per source storage, so they too are made once (by the warm-up) and reused. The
  compute stream is synchronized first, so the copy sees the state as of the call. Which one a
  state gets is :func:`staging_kind` (pure, tested without a GPU). torch 2.11's
  ``DefaultStager`` closes its inner ``StateDictStager`` after every staging (pytorch#183413):
  the cached buffers are dropped and the second save fails with ``KeyError: <class 'type'>``
  (seen on an H200 with torch 2.11.0). The stager here gets one that only we close
  (:class:`_KeptStateDictStager`), so the buffers are reused on every release.

Cost: one copy of the local state in host memory, kept between saves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

log = logging.getLogger("hpc.checkpoint")

CPU_BUFFERS = "cpu-buffers"
PINNED_SIDE_STREAM = "pinned-side-stream"
_DESCRIPTION = {CPU_BUFFERS: "reused CPU buffers, one flat copy",
                PINNED_SIDE_STREAM: "pinned host buffers, non-blocking copies on a side stream (torch DefaultStager)"}


def flatten(obj: Any, leaves: list[Any]) -> Any:
    """Appends ``obj``'s leaves to ``leaves``; returns its tree (containers and keys, no values).

    Mappings, lists and tuples are containers; anything else is a leaf. A plain recursion: it
    runs on every save, inside the stall (0.16 ms for an AdamW state of 85 layers, against
    0.35 ms for ``torch.utils._pytree``'s flatten plus the walk that found the devices).
    """
    if isinstance(obj, Mapping):
        return (type(obj), tuple((k, flatten(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return (type(obj), tuple(flatten(v, leaves) for v in obj))
    leaves.append(obj)
    return None


def unflatten(tree: Any, leaves: Iterable[Any]) -> Any:
    """The inverse of :func:`flatten`: ``tree`` rebuilt with ``leaves`` in order (mappings as dicts)."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if node is None:
            return next(it)
        kind, children = node
        if issubclass(kind, Mapping):
            return {k: build(child) for k, child in children}
        items = [build(child) for child in children]
        if kind is list:
            return items
        return kind(*items) if hasattr(kind, "_fields") else kind(items)  # namedtuples take fields
    return build(tree)


def leaf_layout(value: Any) -> tuple[Any, ...]:
    """What a staging buffer for ``value`` depends on; for a non-tensor, only its type.

    A DTensor contributes its local shard's shape, dtype, stride and device plus its global
    shape and placements (the staged DTensor wraps the buffer with those).
    """
    if isinstance(value, DTensor):
        local = value._local_tensor
        return ("dtensor", tuple(local.shape), local.dtype, local.stride(), local.device.type,
                tuple(value.shape), tuple(value.placements))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride(), value.device.type)
    return ("value", type(value))


def layout_of(state_dict: Any) -> tuple[Any, tuple[tuple[Any, ...], ...]]:
    """The state's structure as staging sees it: the tree (keys, nesting) and each leaf's layout.

    Two states with equal layouts can be staged into the same buffers; values of non-tensor
    leaves (a learning rate, a step count) may differ.
    """
    leaves: list[Any] = []
    tree = flatten(state_dict, leaves)
    return tree, tuple(leaf_layout(v) for v in leaves)


def device_types(layout: tuple[Any, tuple[tuple[Any, ...], ...]]) -> set[str]:
    """The devices of a layout's tensors (local shards)."""
    return {leaf[4] for leaf in layout[1] if leaf[0] in ("tensor", "dtensor")}


def staging_kind(device_types: Iterable[str], accelerator_available: bool) -> str:
    """Which staging a state gets: pinned buffers and a side-stream copy when any tensor is on
    an accelerator (and one is present), else plain CPU buffers (pinning helps only a device copy).

    Args:
        device_types: ``tensor.device.type`` of every tensor in the state (local shards).
        accelerator_available: ``torch.accelerator.is_available()``.
    """
    on_device = any(t not in ("cpu", "meta") for t in device_types)
    return PINNED_SIDE_STREAM if on_device and accelerator_available else CPU_BUFFERS


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


class _CpuBuffers:
    """One CPU buffer per tensor leaf of a given layout, and the staged tree that holds them."""

    def __init__(self, state_dict: Any) -> None:
        leaves: list[Any] = []
        self.spec = flatten(state_dict, leaves)
        self.layout = (self.spec, tuple(leaf_layout(v) for v in leaves))
        self.buffers: list[torch.Tensor | None] = []
        self.staged: list[Any] = []
        with torch.no_grad():
            for value in leaves:
                if not isinstance(value, torch.Tensor):
                    self.buffers.append(None)
                    self.staged.append(value)
                    continue
                src = _local(value)
                # same strides where they are dense; a dense layout for expanded or gapped views
                buf = torch.empty_like(src, device="cpu", memory_format=torch.preserve_format)
                buf.copy_(src)  # first touch: the page faults happen here, not in a save
                self.buffers.append(buf)
                self.staged.append(DTensor.from_local(buf, value.device_mesh, value.placements, run_check=False,
                                                      shape=value.shape, stride=value.stride())
                                   if isinstance(value, DTensor) else buf)
        self.nbytes = sum(b.nbytes for b in self.buffers if b is not None)

    def copy_from(self, leaves: list[Any]) -> Any:
        """Copies ``leaves`` (same layout) into the buffers; returns the staged tree."""
        staged = list(self.staged)
        with torch.no_grad():
            for i, (value, buf) in enumerate(zip(leaves, self.buffers)):
                if buf is None:
                    staged[i] = value
                else:
                    buf.copy_(_local(value))
        return unflatten(self.spec, staged)


def _log_pinned_ready(done: Future[Any], t0: float) -> None:
    """The pinned warm-up's end, as the CPU one logs it (the DefaultStager's thread runs this)."""
    if done.cancelled() or done.exception() is not None:
        return   # join_warm_up names the failure
    leaves: list[Any] = []
    flatten(done.result(), leaves)
    nbytes = sum(v.nbytes for v in leaves if isinstance(v, torch.Tensor))
    log.info("checkpoint: staging buffers ready (pinned, %.1f MB in %.2fs, background)", nbytes / 1e6,
             time.monotonic() - t0)


class _KeptStateDictStager(StateDictStager):
    """torch's ``StateDictStager``, closed only by :meth:`release`.

    ``DefaultStager._stage`` in torch 2.11 ends with ``self._state_dict_stager.close()``, which
    clears the pinned buffers cached per source storage and the deep-copy dispatch table that
    only ``__init__`` fills: a reused stager then fails on the next staging (pytorch#183413).
    Staging reuses one stager for every save, so its inner stager ignores that close.
    """

    def close(self) -> None:
        """Ignored: see the class; :meth:`release` closes."""

    def release(self) -> None:
        super().close()


class Staging(AsyncStager):
    """DCP async stager with buffers made ahead (:meth:`warm_up`) and reused across saves.

    Thread-safe against its own warm-up thread; ``stage`` is called by DCP on the caller's thread.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cpu: _CpuBuffers | None = None
        self._pinned: DefaultStager | None = None
        self._warming: threading.Thread | Future[Any] | None = None
        self.rebuilds = 0
        """How many times a save found no buffers of its state's layout (and made them in the stall)."""
        self.last_kind: str | None = None

    # --- warm-up ---------------------------------------------------------------------------
    def warm_up(self, state_dict: Any) -> None:
        """Makes (allocates and first-touches) buffers for ``state_dict``'s layout in the background.

        Call on the training thread with a state dict taken there (the values it copies are
        overwritten by the next save; only the buffers matter). A no-op when buffers of this
        layout exist or a warm-up is running.
        """
        if self._warming is not None:
            return
        kind = self._kind(state_dict)
        if kind == PINNED_SIDE_STREAM:
            # DefaultStager stages on its own thread and side stream; its buffers are cached per
            # source storage, so this one staging makes them (pinned) for every later save.
            t0 = time.monotonic()
            self._warming = self._pinned_stager().stage(state_dict)
            self._warming.add_done_callback(lambda done: _log_pinned_ready(done, t0))
            return
        if self._cpu is not None and self._cpu.layout == layout_of(state_dict):
            return
        self._warming = threading.Thread(target=self._build_cpu, args=(state_dict,), name="hpc-ckpt-staging",
                                         daemon=True)
        self._warming.start()

    def _build_cpu(self, state_dict: Any) -> None:
        t0 = time.monotonic()
        try:
            buffers = _CpuBuffers(state_dict)
        except Exception as e:  # a warm-up is an optimization: the save makes them itself then
            log.warning("checkpoint: staging warm-up failed (%r); the next save allocates its buffers", e)
            return
        with self._lock:
            self._cpu = buffers
        log.info("checkpoint: staging buffers ready (%.1f MB in %.2fs, background)", buffers.nbytes / 1e6,
                 time.monotonic() - t0)

    def join_warm_up(self) -> None:
        """Waits for a warm-up in progress (if any)."""
        warming, self._warming = self._warming, None
        if isinstance(warming, threading.Thread):
            warming.join()
        elif warming is not None:
            try:
                warming.result()
            except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation: the save allocates its own buffers
                log.warning("checkpoint: staging warm-up failed (%r)", e)

    @property
    def warm(self) -> bool:
        """Whether a warm-up has finished (buffers of some layout exist)."""
        done = self._warming is None or (self._warming.done() if isinstance(self._warming, Future)
                                         else not self._warming.is_alive())
        return done and (self._cpu is not None or self._pinned is not None)

    # --- AsyncStager -----------------------------------------------------------------------
    def stage(self, state_dict: Any) -> Any:  # type: ignore[override]
        """Copies ``state_dict`` into the buffers (made now when its layout is new); returns the copy."""
        self.join_warm_up()
        leaves: list[Any] = []
        tree = flatten(state_dict, leaves)
        layout = (tree, tuple(leaf_layout(v) for v in leaves))
        same = self._cpu is not None and self._cpu.layout == layout
        kind = CPU_BUFFERS if same else staging_kind(device_types(layout), torch.accelerator.is_available())
        if kind != self.last_kind:
            log.info("checkpoint: async staging: %s", _DESCRIPTION[kind])
            self.last_kind = kind
        if kind == PINNED_SIDE_STREAM:
            # the side stream must see the compute stream's last writes (DefaultStager does not order them)
            torch.accelerator.current_stream().synchronize()
            return self._pinned_stager().stage(state_dict).result()
        with self._lock:
            if not same or self._cpu is None:
                t0 = time.monotonic()
                why = "no warm-up ran" if self._cpu is None else "the state's structure changed"
                self._cpu = None  # free the old buffers before making the new ones
                self._cpu = _CpuBuffers(state_dict)
                self.rebuilds += 1
                log.info("checkpoint: staging buffers made in the save (%.1f MB in %.2fs): %s",
                         self._cpu.nbytes / 1e6, time.monotonic() - t0, why)
                return unflatten(self._cpu.spec, self._cpu.staged)
            return self._cpu.copy_from(leaves)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a finished copy."""

    def close(self) -> None:
        """Waits for a warm-up and frees the buffers."""
        self.join_warm_up()
        if self._pinned is not None:
            self._pinned.close()
            inner = getattr(self._pinned, "_state_dict_stager", None)
            if isinstance(inner, _KeptStateDictStager):
                inner.release()
            self._pinned = None
        self._cpu = None

    # --- internals -------------------------------------------------------------------------
    def _kind(self, state_dict: Any) -> str:
        return staging_kind(device_types(layout_of(state_dict)), torch.accelerator.is_available())

    def _pinned_stager(self) -> DefaultStager:
        if self._pinned is None:  # made on the training thread: DefaultStager creates its stream here
            self._pinned = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=True))
            if isinstance(getattr(self._pinned, "_state_dict_stager", None), StateDictStager):
                self._pinned._state_dict_stager = _KeptStateDictStager(pin_memory=True, share_memory=False)
        return self._pinned
