"""Checkpoints: barrier-guarded, verified, sharded saves on torch.distributed.checkpoint.

Four modules, one concern each:

* :mod:`runtime.checkpoint.checkpointer`: the save/load transaction across ranks (DCP, the
  barriers, rank 0's commit and the ``latest`` pointer, async saves);
* :mod:`runtime.checkpoint.storage`: how bytes reach the disk (checksummed writer, retrying
  reader, loading that runs no code);
* :mod:`runtime.checkpoint.staging`: the copy an async save blocks for, into host buffers made
  in the background ahead of the first save and reused;
* :mod:`runtime.checkpoint.manifest`: the manifest, its verification and the retention rules
  (pure and torch-free: unit tests and ``hpc status`` read it without torch).

``Checkpointer`` and ``CheckpointError`` are exported lazily, so importing the manifest does
not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Checkpointer", "CheckpointError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from runtime.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'runtime.checkpoint' has no attribute {name!r}")
