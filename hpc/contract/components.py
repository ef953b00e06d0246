"""The settings each runtime component owns, as small frozen configs (torchtitan's pattern).

The ``JobSpec`` keeps one flat option per flag (that is what users type, what profiles hold and
what ``jobspec.json`` stores); each component takes its own config whole, built by the spec
(:attr:`JobSpec.checkpoint`, :attr:`JobSpec.preemption`, :attr:`JobSpec.wandb`) or, for a
plain ``torchrun``/``python`` start without a spec, from these defaults. Each default is
written once, here, and the ``JobSpec``'s option defaults are taken from these classes.
A flag's text is parsed once, on the way in (``--stall-timeout auto|off|SECONDS`` becomes a
:class:`LivenessConfig`), so no process parses it again.

"Off" is 0 everywhere (an interval or a retention rule of 0 is not applied), never None.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc.contract import stall


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


@dataclass(frozen=True, kw_only=True)
class LivenessConfig:
    """What the stall watch (:mod:`runtime.liveness`) needs: the launcher's watchdog, the NCCL
    settings the launcher plans and the Session's collective timeout all take this one value."""

    watch: bool = True
    """False: ``--stall-timeout off`` (a stalled job waits for the collective timeout)."""
    fixed_step_s: float | None = None
    """A fixed deadline of an ordinary step (``--stall-timeout SECONDS``); None: auto, adapted to
    the measured step time."""
    busy_s: float = float(stall.BUSY_TIMEOUT_S)
    """How long a rank that is alive and works outside any collective may go without progress
    (``--busy-timeout``)."""

    def __post_init__(self) -> None:
        if self.fixed_step_s is not None and self.fixed_step_s < stall.MIN_SECONDS:
            raise ValueError(f"fixed_step_s={self.fixed_step_s!r}: at least "
                             f"{stall.MIN_SECONDS:g} s, or None for auto")
        if not stall.MIN_BUSY_TIMEOUT_S <= self.busy_s <= stall.MAX_BUSY_TIMEOUT_S:
            raise ValueError(f"busy_s={self.busy_s!r}: {stall.MIN_BUSY_TIMEOUT_S} "
                             f"to {stall.MAX_BUSY_TIMEOUT_S} s")

    @classmethod
    def from_flags(cls, stall_timeout: str = stall.AUTO,
                   busy_timeout_s: float = stall.BUSY_TIMEOUT_S) -> LivenessConfig:
        """The config of ``--stall-timeout`` (``auto``, ``off`` or seconds, as the user typed it
        or normalized) and ``--busy-timeout``.

        Raises:
            SpecError: a ``--stall-timeout`` that is none of those (it names the flag).
        """
        text = stall.parse_stall_timeout(stall_timeout)
        return cls(watch=text != stall.OFF, fixed_step_s=stall.stall_seconds(text),
                   busy_s=float(busy_timeout_s))


CHECKPOINT = CheckpointConfig()
PREEMPTION = PreemptionConfig()
WANDB = WandbConfig()
LIVENESS = LivenessConfig()
