"""Gradient-norm clipping for a model whose parameters live on different meshes.

Under FSDP2 x TP a TP-split weight is a DTensor on the 2-D ``dp x tp`` mesh, while a layer
outside the TP plan (a LayerNorm) is a DTensor on the ``dp`` mesh alone, and without FSDP it is
a plain tensor: ``torch.nn.utils.clip_grad_norm_`` cannot put their norms in one stack. Here
each mesh's gradients get their norm on that mesh (a DTensor norm is reduced to its full
value over the mesh, so a replicated weight is counted once, not once per TP rank), the
per-mesh norms combine into the total, and every gradient is scaled by one factor: the same
result as the unsplit model's clipping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clips the gradients of ``parameters`` (plain tensors or DTensors) to a total norm of
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does for one mesh.

    Returns:
        The total norm before clipping (a plain tensor, the same on every rank of the model).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for params in groups.values():     # one foreach scaling per mesh: torch's mixes none
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
