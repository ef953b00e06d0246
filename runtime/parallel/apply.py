"""What ``Session.wrap`` does to a model on a mesh: tensor parallel first, then FSDP2.

Tensor parallel follows the user's plan (``parallelize_module``): a map from module names
(``fnmatch`` patterns such as ``blocks.*.q``) to ``"colwise"``, ``"rowwise"`` or any torch
``ParallelStyle``. The usual Megatron pairing splits a layer's output features (colwise: each
rank computes some heads, or some hidden units of the MLP) and then the next layer's input
features (rowwise: partial sums, all-reduced once), so one block costs two all-reduces forward
and two backward, within the TP group (a node). Modules outside the plan stay whole on every TP
rank; their gradients agree across the group because the colwise layers reduce their input
gradients.

FSDP2 (``fully_shard``) then shards every parameter over the data-parallel dimension, block by
block, and over ``dp_replicate x dp_shard`` (HSDP) when the job has replicas. With one
data-parallel rank there is nothing to shard and FSDP2 is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from runtime.parallel.mesh import MeshPlace

STYLES = ("colwise", "rowwise")


def styles(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The plan with ``"colwise"``/``"rowwise"`` made into torch's ``ParallelStyle`` objects.

    Raises:
        ValueError: For a style that is neither one of :data:`STYLES` nor a ``ParallelStyle``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    out: dict[str, Any] = {}
    for name, style in plan.items():
        if isinstance(style, ParallelStyle):
            out[name] = style
        elif style == "colwise":
            out[name] = ColwiseParallel()
        elif style == "rowwise":
            out[name] = RowwiseParallel()
        else:
            raise ValueError(f"tp_plan[{name!r}] is {style!r}: valid styles are "
                             f"{', '.join(map(repr, STYLES))} or a torch ParallelStyle")
    return out


def tensor_parallel(model: torch.nn.Module, place: MeshPlace, plan: Mapping[str, Any] | None) -> None:
    """Splits the planned modules over the TP dimension (nothing when ``tp`` is 1).

    Raises:
        ValueError: When the job has ``tp > 1`` but no plan, or a plan names no module.
    """
    if place.mesh.tp == 1:
        return
    if not plan:
        raise ValueError(f"the job runs tensor parallel {place.mesh.tp} (--tp) but wrap() got no "
                         "tp_plan: pass s.wrap(model, tp_plan={'blocks.*.fc': 'colwise', "
                         "'blocks.*.proj': 'rowwise', ...})")
    import fnmatch

    from torch.distributed.tensor.parallel import parallelize_module

    names = [n for n, _ in model.named_modules()]
    missing = [k for k in plan if not any(fnmatch.fnmatchcase(n, k) for n in names)]
    if missing:
        raise ValueError(f"tp_plan names no module of the model: {missing} (its modules include "
                         f"{names[1:8]})")
    parallelize_module(model, place["tp"], styles(plan))


def fully_shard(model: torch.nn.Module, place: MeshPlace, blocks: Iterable[torch.nn.Module],
                mp_policy: Any) -> None:
    """FSDP2 over the data-parallel ranks, each block its own unit (nothing when dp is 1)."""
    from torch.distributed.fsdp import fully_shard as shard

    if place.mesh.dp == 1:
        return
    mesh = place[("dp_replicate", "dp_shard")] if place.mesh.dp_replicate > 1 else place["dp_shard"]
    for block in blocks:
        shard(block, mesh=mesh, mp_policy=mp_policy)
    shard(model, mesh=mesh, mp_policy=mp_policy)
