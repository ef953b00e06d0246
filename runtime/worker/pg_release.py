"""The process groups a script destroys live on until the script has ended.

torch binds DDP's ``Reducer`` to Python so that its destructor runs with the interpreter's
lock (the GIL) held, and the Reducer holds its process group. A script that calls
``destroy_process_group()`` while its DDP model is alive (the usual end of a torchrun script)
leaves the model's Reducer the group's last holder: when the model goes, ``~ProcessGroupGloo``
joins gloo's worker threads under the GIL while one of them waits for the GIL to release a
finished collective's tensor, and the worker never exits (seen at the end of a Hydra task on
the test cluster: the main thread in ``std::thread::join`` from ``~Reducer``, a gloo thread
in ``gil_scoped_acquire``; the same family as pytorch#56297). A loop of 300 such group
lifetimes hangs within the first 50 without this.

:func:`install` makes ``destroy_process_group`` keep a reference to each group it
unregisters; :func:`release` (the worker's exit) drops them from Python, where torch's
``ProcessGroup`` binding releases the GIL while it destroys a group. The group is
unregistered as before (``dist.is_initialized()`` is False, a new ``init_process_group`` works);
only its memory and threads outlive the call, until the script ends.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

C10D = "torch.distributed.distributed_c10d"
_KEPT: list[Any] = []


def install() -> None:
    """Patches ``destroy_process_group`` now, or as soon as the script imports torch.distributed."""
    if C10D in sys.modules:
        _patch(sys.modules[C10D])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def release() -> int:
    """Drops the kept groups (from Python: torch destroys each without the GIL); returns how many."""
    n = len(_KEPT)
    _KEPT.clear()
    return n


def _patch(c10d: Any) -> None:
    original = c10d.destroy_process_group
    if getattr(original, "keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        _KEPT.extend(list(c10d._world.pg_map) if group is None else [group])
        return original(group)

    destroy_process_group.keeps_groups = True   # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _Finder(importlib.abc.MetaPathFinder):
    """Patches torch's c10d module right after it runs, before ``torch.distributed`` takes
    its names (``from .distributed_c10d import *``)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module   # type: ignore[method-assign]
        return spec
