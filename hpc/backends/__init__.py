"""Backends: ways to submit the same JobSpec to Slurm, behind one small interface.

A backend is a module with two functions (see :class:`Backend`)::

    plan(spec) -> Plan          # pure: the exact script/command; Plan.describe() is the dry run
    execute(plan, client) -> str  # the one place that submits; returns the Slurm job id

Every backend derives the Slurm options and the per-node launcher command from the same
helpers (:mod:`hpc.backends.slurm_options`), so an option means the same thing whichever
backend carries it. ``hpc run`` (:mod:`hpc.backends.local`) starts the launchers as local
processes and is not a submission backend.

Backends are imported lazily, by name, from :data:`REGISTRY` (TorchX's scheduler registry is
the model): submitit and torchx stay optional at import time, and adding a backend is one
module plus one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from hpc.contract.errors import SpecError

if TYPE_CHECKING:
    from hpc.contract.jobspec import JobSpec
    from hpc.contract.slurm import SlurmClient

REGISTRY: dict[str, str] = {
    "sbatch": "hpc.backends.sbatch",
    "submitit": "hpc.backends.submitit_backend",
    "torchx": "hpc.backends.torchx_component",
}
"""Backend name -> module implementing :class:`Backend`."""

DEFAULT = "sbatch"


class Plan(Protocol):
    """A planned submission: decided, not yet done."""

    spec: JobSpec

    def describe(self) -> str:
        """Exactly what :meth:`Backend.execute` would run (``hpc render`` / ``--dry-run``)."""
        ...


class Backend(Protocol):
    """What ``hpc submit`` needs of a backend module."""

    def plan(self, spec: JobSpec) -> Plan:
        """Plans the submission (pure; refuses what the backend cannot carry with SpecError)."""
        ...

    def execute(self, plan: Plan, client: SlurmClient) -> str:
        """Submits the plan through ``client``; returns the Slurm job id."""
        ...


def names() -> tuple[str, ...]:
    """The registered backend names, default first."""
    return (DEFAULT, *sorted(n for n in REGISTRY if n != DEFAULT))


def get(name: str) -> Backend:
    """The backend module registered as ``name`` (imported on first use).

    Raises:
        SpecError: for an unknown name, listing the valid ones.
    """
    if name not in REGISTRY:
        raise SpecError("--backend", name, "one of " + ", ".join(names()), f"--backend {DEFAULT}")
    module: Backend = importlib.import_module(REGISTRY[name])  # type: ignore[assignment]
    return module
