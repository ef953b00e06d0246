"""Backends: ways to submit the same JobSpec to Slurm, behind one small interface.

A backend is a module with two functions and one declaration (see :class:`Backend`)::

    plan(spec) -> Plan          # pure: the exact script/command; Plan.describe() is the dry run
    execute(plan, client) -> str  # the one place that submits; returns the Slurm job id
    ENFORCES: frozenset[str]    # which of the BATCH_STEPS its batch script carries

Some of a job's life happens outside the per-node launcher, in the batch shell, because it must
happen before the launchers start or outside a container (:data:`BATCH_STEPS`: giving the nodes
the job found bad back to Slurm; a container's deadlines and requeue). Each backend declares
which of them its batch script carries; :func:`get` hands out a backend whose ``plan`` refuses a
JobSpec that needs a step the backend does not carry (naming the backend, the step and the
backends that carry it), so no step is ever silently skipped.

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
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BatchStep:
    """A step of the job that its batch script must carry (the per-node launcher cannot).

    Attributes:
        name: The name backends list in their ``ENFORCES``.
        does: What the step does, in words (for the refusal).
        asked_by: The option that makes a job need it (for the refusal).
        needed: Whether ``spec`` needs the step (pure).
    """

    name: str
    does: str
    asked_by: Callable[[JobSpec], str]
    needed: Callable[[JobSpec], bool]


BATCH_STEPS: tuple[BatchStep, ...] = (
    BatchStep("exclusions", "give the nodes the job found bad (exclusions.jsonl: a stall, a crash, "
              "a failed health check) back to Slurm before the launchers start "
              "(python -m runtime.exclusions in the batch shell)",
              lambda spec: f"--nodes {spec.nodes_text}" + (
                  f" --spare-nodes {spec.spare_nodes}" if spec.spare_nodes else ""),
              # Only an allocation above MIN can shrink (runtime.exclusions.plan_release);
              # spares make one (MIN to MAX + spares: slurm_options.nodes_range).
              lambda spec: spec.min_nodes < spec.allocated_nodes),
    BatchStep("container", "ask Slurm for the job's end time and GraceTime and requeue the job "
              "from the batch shell, outside the container, where Slurm's commands are",
              lambda spec: f"--container-image {spec.container_image}",
              lambda spec: bool(spec.container_image)),
)
"""Every step a batch script may have to carry, whichever backend writes the script."""


class Plan(Protocol):
    """A planned submission: decided, not yet done."""

    spec: JobSpec

    def describe(self) -> str:
        """Exactly what :meth:`Backend.execute` would run (``hpc render`` / ``--dry-run``)."""
        ...


class Backend(Protocol):
    """What ``hpc submit`` needs of a backend module."""

    ENFORCES: frozenset[str]
    """The :data:`BATCH_STEPS` (by name) its batch script carries for every JobSpec it accepts."""

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
    """The backend registered as ``name`` (its module imported on first use), whose ``plan``
    refuses a JobSpec that needs a batch step the backend does not carry.

    Raises:
        SpecError: for an unknown name, listing the valid ones.
    """
    return _Checked(name, _module(name))


def _module(name: str) -> Backend:
    if name not in REGISTRY:
        raise SpecError("--backend", name, "one of " + ", ".join(names()), f"--backend {DEFAULT}")
    module: Backend = importlib.import_module(REGISTRY[name])  # type: ignore[assignment]
    unknown = set(module.ENFORCES) - {step.name for step in BATCH_STEPS}
    assert not unknown, f"{REGISTRY[name]}.ENFORCES names unknown batch steps {sorted(unknown)}"
    return module


def enforcing(step: str) -> list[str]:
    """The registered backends whose batch script carries ``step`` (imports each)."""
    return [name for name in names() if step in _module(name).ENFORCES]


def check_enforced(name: str, spec: JobSpec) -> None:
    """Refuses ``spec`` when it needs a batch step that backend ``name`` does not carry.

    Raises:
        SpecError: naming the backend, the option that asks for the step, what the step does,
            and the backends that carry it.
    """
    enforces = _module(name).ENFORCES
    for step in BATCH_STEPS:
        if step.needed(spec) and step.name not in enforces:
            others = [b for b in enforcing(step.name) if b != name]
            raise SpecError(
                f"--backend {name}", step.asked_by(spec),
                f"the {name} backend's batch script cannot {step.does}; backends that can: "
                + (", ".join(others) or "none"),
                f"hpc submit --backend {others[0] if others else DEFAULT} {step.asked_by(spec)} ...",
                f"Use --backend {others[0]}" if others else "")


@dataclass(frozen=True)
class _Checked:
    """A backend module, with :func:`check_enforced` before its ``plan``."""

    name: str
    module: Backend

    @property
    def ENFORCES(self) -> frozenset[str]:  # noqa: N802 - the Backend attribute
        return self.module.ENFORCES

    def plan(self, spec: JobSpec) -> Plan:
        planned = self.module.plan(spec)   # first its own refusals (options it cannot carry)
        check_enforced(self.name, spec)
        return planned

    def execute(self, plan: Plan, client: SlurmClient) -> str:
        return self.module.execute(plan, client)
