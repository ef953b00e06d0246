"""One state transfer: the source rank's state to every other rank of a new group, no disk.

Used by every in-process recovery and by every join (a restarted worker, a hot spare): the
member that holds the agreed step broadcasts its whole training state, and the others load it.
A state is any nest of dicts, lists and tuples with tensors and plain values at the leaves
(model and optimizer ``state_dict``s, the sampler's cursor, RNG states). It travels in two
parts: the skeleton with each tensor replaced by its dtype and shape (one pickled broadcast),
then the tensors flattened into one buffer per dtype (one broadcast each). So a receiver needs
nothing in advance: a joiner whose optimizer has no state yet receives it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in the skeleton."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def split(tree: Any, out: list[torch.Tensor]) -> Any:
    """The skeleton of ``tree``; its tensors are appended to ``out`` (detached, CPU)."""
    if isinstance(tree, torch.Tensor):
        out.append(tree.detach().cpu())
        return _Slot(len(out) - 1, tree.dtype, tuple(tree.shape))
    if isinstance(tree, dict):
        return {k: split(v, out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(split(v, out) for v in tree)
    return tree


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split`."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        return type(skeleton)(join(v, tensors) for v in skeleton)
    return skeleton


def broadcast_state(state: Any, *, src: int, rank: int, group: Any = None,
                    between: Callable[[], None] | None = None) -> tuple[Any, int]:
    """Broadcasts ``state`` from rank ``src``; returns (the state as received, bytes moved).

    On ``src`` the returned state is ``state`` itself; elsewhere ``state`` is ignored. A
    receiver receives into buffers of its own: a failure part way leaves its state untouched.
    ``between`` runs after each tensor broadcast (tests: a fault injected mid-transfer).
    """
    tensors: list[torch.Tensor] = []
    skeleton = split(state, tensors) if rank == src else None
    box = [skeleton]
    dist.broadcast_object_list(box, src=src, group=group)
    skeleton = box[0]
    slots: list[_Slot] = []
    _slots(skeleton, slots)
    slots.sort(key=lambda s: s.index)
    if rank != src:
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    moved = 0
    shapes = {s.index: s.shape for s in slots}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for s in slots:
        by_dtype.setdefault(s.dtype, []).append(s.index)
    for dtype in sorted(by_dtype, key=str):
        idx = by_dtype[dtype]
        parts = [tensors[i].reshape(-1) if tensors[i].dim() else tensors[i].reshape(1) for i in idx]
        flat = _flatten_dense_tensors(parts) if rank == src else \
            torch.empty(sum(p.numel() for p in parts), dtype=dtype)
        dist.broadcast(flat, src=src, group=group)
        moved += flat.numel() * flat.element_size()
        if rank != src:
            for i, t in zip(idx, _unflatten_dense_tensors(flat, parts)):
                tensors[i] = t.reshape(shapes[i]).clone()
        if between is not None:
            between()
    return (state if rank == src else join(skeleton, tensors)), moved


def _slots(skeleton: Any, out: list[_Slot]) -> None:
    if isinstance(skeleton, _Slot):
        out.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _slots(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _slots(v, out)


def load_into(received: Any, loaders: dict[str, Callable[[Any], None]]) -> None:
    """Hands each part of a received state to its loader (``{"model": module.load_state_dict, ...}``)."""
    for key, load in loaders.items():
        if key in received:
            load(received[key])


def send_state(state: Any, *, dst: int, group: Any = None, tag: int = 0) -> int:
    """Sends ``state`` to rank ``dst`` alone (point to point); returns the bytes sent."""
    tensors: list[torch.Tensor] = []
    skeleton = split(state, tensors)
    dist.send_object_list([skeleton], dst=dst, group=group)
    moved = 0
    for dtype, idx in _by_dtype(skeleton):
        flat = _flatten_dense_tensors([tensors[i].reshape(-1) for i in idx])
        dist.send(flat, dst=dst, group=group, tag=tag)
        moved += flat.numel() * flat.element_size()
    return moved


def recv_state(*, src: int, group: Any = None, tag: int = 0) -> Any:
    """Receives what :func:`send_state` sent from rank ``src``."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    skeleton = box[0]
    slots: list[_Slot] = []
    _slots(skeleton, slots)
    tensors: list[torch.Tensor | None] = [None] * (max((s.index for s in slots), default=-1) + 1)
    shapes = {s.index: s.shape for s in slots}
    for dtype, idx in _by_dtype(skeleton):
        parts = [torch.empty(shapes[i], dtype=dtype).reshape(-1) for i in idx]
        flat = torch.empty(sum(p.numel() for p in parts), dtype=dtype)
        dist.recv(flat, src=src, group=group, tag=tag)
        for i, t in zip(idx, _unflatten_dense_tensors(flat, parts)):
            tensors[i] = t.reshape(shapes[i]).clone()
    return join(skeleton, tensors)   # type: ignore[arg-type]


def _by_dtype(skeleton: Any) -> list[tuple[torch.dtype, list[int]]]:
    slots: list[_Slot] = []
    _slots(skeleton, slots)
    by: dict[torch.dtype, list[int]] = {}
    for s in sorted(slots, key=lambda s: s.index):
        by.setdefault(s.dtype, []).append(s.index)
    return [(d, by[d]) for d in sorted(by, key=str)]
