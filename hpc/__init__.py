"""hpc-elastic: the login-node side, and the Python API.

Everything under ``hpc`` runs on a login node, where start-up time matters and GPUs do not
exist, so nothing here imports torch, wandb or torchx at module load. Backends that need
those libraries import them inside the function that uses them. ``hpc/contract/`` is the part
the job itself also reads (see its docstring).

The Python API (:mod:`hpc.api`) is importable from here, lazily::

    import hpc
    job = hpc.submit(hpc.JobSpec(script=..., job_dir=..., nodes=(2, 4)))
    job.wait(); job.outcomes(); job.result()
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__version__ = "0.1.0"

_API = {"submit": "hpc.api", "sweep": "hpc.api", "run": "hpc.api", "Job": "hpc.api",
        "Sweep": "hpc.api", "load_results": "hpc.api",
        "JobSpec": "hpc.contract.jobspec", "SpecError": "hpc.contract.errors",
        "HpcError": "hpc.contract.errors", "UsageError": "hpc.contract.errors"}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'hpc' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API (what a notebook's completion offers for ``hpc.``), though it is loaded
    only when used; plus the subpackages already imported."""
    loaded = [k for k, v in globals().items()
              if isinstance(v, ModuleType) and v.__name__ == f"{__name__}.{k}"]
    return sorted({*__all__, *loaded})
