"""The settings each runtime component owns, as small frozen configs (torchtitan's pattern).

The ``JobSpec`` keeps one flat option per flag (that is what users type, what profiles hold and
what ``jobspec.json`` stores); each component takes its own config whole, built by the spec
(:attr:`JobSpec.checkpoint`, :attr:`JobSpec.preemption`, :attr:`JobSpec.wandb`) or, for a
plain ``torchrun``/``python`` start without a spec, from these defaults. Each default is
written once, here, and the ``JobSpec``'s option defaults are taken from these classes.

"Off" is 0 everywhere (an interval or a retention rule of 0 is not applied), never None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What :class:`runtime.checkpoint.Checkpointer` needs."""

    directory: str = ""
    """Where checkpoints go ("" only outside a job: the caller decides)."""
    every_steps: int = 0
    """Save every N optimizer steps (0: off)."""
    every_min: float = 0.0
    """Save every M minutes of wall time (0: off)."""
    keep_last: int = 3
    """Keep the newest k committed checkpoints."""
    keep_every: int = 0
    """Also keep every n-th step forever (0: off)."""


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """What :class:`runtime.preemption.PreemptionWatcher` needs from the job."""

    signal: str = "USR2"
    """The warning signal, without ``SIG`` (SIGTERM is always a warning too)."""
    lead_s: int = 120
    """Seconds between the warning and the time limit (0: no warning signal)."""

    @property
    def signal_names(self) -> tuple[str, ...]:
        """The signals the workers treat as a warning."""
        return tuple(dict.fromkeys((f"SIG{self.signal}", "SIGTERM")))


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """What rank 0's W&B sink needs."""

    project: str = ""
    """W&B project ("" : the sink's default)."""
    entity: str = ""
    """W&B entity ("": the API key's default)."""
    mode: str = "offline"
    """offline, online or disabled."""


CHECKPOINT = CheckpointConfig()
PREEMPTION = PreemptionConfig()
WANDB = WandbConfig()
