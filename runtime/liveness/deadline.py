"""How long a rank may go without progress before it counts as stalled (pure).

An ordinary step gets ``max(floor_s, k x p99)`` of the recent step times: adaptive, so a job
with 50-ms steps is caught in seconds and one with 40-s steps is not killed for a slow step,
and based on a high quantile with a wide factor, so heavy jitter does not trip it. Phases that
are known to be long and rare get their own budget instead: start-up (imports, process-group
init, rendezvous), restore, the first steps after a (re)start (compilation, warm-up, allocator
growth), a checkpoint save, evaluation, and any phase a user marks with ``session.phase(...)``.
Once a phase has run to its end in this process, its next runs get ``k x`` the longest
measured run instead (never less than an ordinary step's deadline), so a save that takes a
second is not given 15 minutes when a rank freezes in it.
A rank that is past such a deadline but alive (its alive beat fresh, not stopped) and
working outside any collective is *busy*, not stalled (:mod:`.verdict`): it gets
``busy_s`` (``--busy-timeout``, 30 minutes by default) instead.
Every function here is pure: the tests feed recorded step-time series.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpc.contract.components import LivenessConfig
from hpc.contract.stall import BUSY_TIMEOUT_S

STEP = "step"
# A worker that publishes no heartbeat (a script without the Session): its output is all that
# tells progress. Watched only against an explicit ``--stall-timeout SECONDS``: how often such a
# script prints is unknown, so ``auto`` never calls it stalled (a stopped process excepted).
OUTPUT = "output"
# Budgets of the phases known to be long, in seconds.
# Generous: they hold only until a phase has been measured once in the process (see above).
PHASE_BUDGETS_S: Mapping[str, float] = {
    "startup": 1800.0,  # imports, process-group init, rendezvous; the PG init has its own timeout
    "restore": 1800.0,  # loading (and resharding) a checkpoint
    "save": 1800.0,     # a blocking checkpoint save
    "eval": 1800.0,
    "exit": 1800.0,     # flushing the last save, the final barrier
}
USER_PHASE_S = 1800.0   # a phase a user named without a budget


@dataclass(frozen=True)
class StallPolicy:
    """The knobs of the stall deadline.

    Args:
        floor_s: The least deadline of an ordinary step (auto mode).
        k: Multiple of the recent p99 step time (auto mode).
        fixed_s: A fixed ordinary-step deadline (``--stall-timeout SECONDS``); None: auto.
        first_steps: Steps after a (re)start that get ``first_steps_s`` (compilation, warm-up).
        first_steps_s: Budget of each of those first steps.
        phase_budgets_s: Budgets of the named long phases.
        min_samples: Step times needed before the p99 counts; fewer: the floor alone.
        busy_s: How long a rank that is alive and works outside any collective may go
            without progress (``--busy-timeout``).
        alive_s: An alive beat older than this says the process no longer runs (frozen).
    """

    floor_s: float = 20.0
    k: float = 10.0
    fixed_s: float | None = None
    first_steps: int = 3
    first_steps_s: float = 1800.0
    phase_budgets_s: Mapping[str, float] = field(default_factory=lambda: dict(PHASE_BUDGETS_S))
    min_samples: int = 5
    busy_s: float = float(BUSY_TIMEOUT_S)
    alive_s: float = 10.0

    def __post_init__(self) -> None:
        assert self.floor_s > 0 and self.k > 0 and self.first_steps >= 0
        assert self.fixed_s is None or self.fixed_s > 0
        assert self.busy_s > 0 and self.alive_s > 0

    @property
    def longest_s(self) -> float:
        """The longest any rank may legitimately wait (the collective timeout must exceed it)."""
        return max([self.first_steps_s, USER_PHASE_S, self.busy_s, *self.phase_budgets_s.values()])


def collective_timeout_s(policy: StallPolicy) -> float:
    """The process groups' (and NCCL's) timeouts with the stall watch on: only a backstop, it
    must outlast the longest phase a peer may legitimately be in while others wait."""
    return policy.longest_s + 60


def policy_for(config: LivenessConfig) -> StallPolicy | None:
    """The stall policy of a job's :class:`~hpc.contract.components.LivenessConfig`
    (``JobSpec.liveness``); None: the watch is off."""
    if not config.watch:
        return None
    return StallPolicy(fixed_s=config.fixed_step_s, busy_s=config.busy_s)


def p99(times: Sequence[float]) -> float | None:
    """The 99th percentile (nearest rank) of ``times``, or None when empty."""
    if not times:
        return None
    ordered = sorted(times)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def step_deadline_s(policy: StallPolicy, p99_s: float | None, samples: int) -> float:
    """The deadline of an ordinary step after the first ones."""
    if policy.fixed_s is not None:
        return policy.fixed_s
    if p99_s is None or samples < policy.min_samples:
        return policy.floor_s
    return max(policy.floor_s, policy.k * p99_s)


def deadline_s(policy: StallPolicy, *, phase: str, steps_done: int, p99_s: float | None,
               samples: int, budget_s: float | None = None, measured_s: float | None = None) -> float:
    """Seconds a rank in ``phase`` may go without a new heartbeat.

    Args:
        policy: The knobs.
        phase: ``step`` (training) or a long phase (``save``, ``eval``, a user's name).
        steps_done: Steps this worker completed since it (re)started.
        p99_s: Its recent p99 step time, if measured.
        samples: How many step times that p99 is over.
        budget_s: The budget the phase was opened with (``session.phase(name, budget_s=)``).
        measured_s: The longest earlier run of this phase in this process, if any.
    """
    if phase == OUTPUT:
        return policy.fixed_s if policy.fixed_s is not None else math.inf
    ordinary = step_deadline_s(policy, p99_s, samples)
    if phase == STEP:
        if steps_done < policy.first_steps:
            return max(ordinary, policy.first_steps_s)
        return ordinary
    if budget_s is not None:
        return max(ordinary, budget_s)
    if measured_s is not None and policy.fixed_s is None:
        return max(ordinary, policy.k * measured_s)
    if measured_s is not None:
        return max(ordinary, 2 * measured_s)    # a fixed deadline: the user chose it short
    return max(ordinary, policy.phase_budgets_s.get(phase, USER_PHASE_S))
