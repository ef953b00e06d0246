"""The preemption protocol, worker side: record signals, agree across ranks, decide.

Signal handlers only record (a flag, the time, the signal's name). At a step boundary every
rank calls :meth:`PreemptionWatcher.poll` and all ranks learn the *same* answer from one
MAX all-reduce on a CPU (gloo) group, so no rank ever acts on a signal alone: rank-divergent
control flow around collectives deadlocks. The all-reduce is overlapped with the next step
(posted with ``async_op=True`` and waited one step later), so its cost hides behind compute;
the stop happens one step after the signal, on every rank at the same step.

What to do once agreed is a pure decision (:func:`decide`): save a checkpoint if the time
left before the hard kill exceeds the (measured) save time with a margin, otherwise leave on
the last committed checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpc.contract import components
from hpc.contract.components import PreemptionConfig
from hpc.contract.environment import JobEnvironment
from runtime.liveness import posted

DEFAULT_GRACE_S = 30.0          # SIGTERM -> SIGKILL on a preemption (Slurm's GraceTime/KillWait)
TIME_LIMIT_SLACK_S = 45.0       # Slurm checks time limits only about every 30 s


@dataclass(frozen=True)
class StopRequest:
    """The agreed request to stop: which signal, when the first one arrived, what it means."""

    kind: str            # "preempted" or "time_limit"
    signal_name: str
    received_at: float   # wall time of the earliest signal on any rank
    deadline: float      # wall time of the expected hard kill


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str


def classify_warning(signal_name: str, received_at: float, *, job_end_time: float | None,
                     lead_s: float, under_slurm: bool = True) -> str:
    """Is a warning the time limit's or a preemption's? (pure)

    Slurm sends the job's ``--signal`` both ahead of its time limit and, with
    ``preempt_send_user_signal``, at preemption. A warning that arrives within the lead time
    (plus Slurm's ~30 s check granularity) of the job's end time is the time limit's. Under
    Slurm with the end time unknown, a warning is taken as the time limit's; outside Slurm
    (``hpc run``, a plain torchrun) there is no time limit: a warning is a request to stop
    from outside (Ctrl-C, a signal sent by hand), a preemption.
    """
    if signal_name == "SIGTERM":
        return "preempted"
    if job_end_time and received_at >= job_end_time - lead_s - TIME_LIMIT_SLACK_S:
        return "time_limit"
    return "preempted" if job_end_time or not under_slurm else "time_limit"


def deadline_for(kind: str, received_at: float, *, job_end_time: float | None, lead_s: float,
                 grace_s: float = DEFAULT_GRACE_S) -> float:
    """When the hard kill is expected after a warning (pure)."""
    if kind == "time_limit":
        return job_end_time if job_end_time else received_at + lead_s
    return received_at + grace_s


def decide(now: float, deadline: float, estimated_save_s: float, *, margin: float = 1.5,
           slack_s: float = 2.0) -> Decision:
    """Save, or leave on the last committed checkpoint? (pure)"""
    left = deadline - now
    needed = estimated_save_s * margin + slack_s
    if left > needed:
        return Decision(True, f"{left:.1f}s left before the kill, a save needs ~{estimated_save_s:.1f}s")
    return Decision(False, f"only {left:.1f}s left before the kill and a save needs "
                           f"~{estimated_save_s:.1f}s: leaving on the last committed checkpoint")


class PreemptionWatcher:
    """Records warning signals in this process; :meth:`poll` agrees on them across ranks.

    Args:
        signals: Signal names to treat as a warning (e.g. ``("SIGUSR2", "SIGTERM")``).
        group: A CPU (gloo) process group for the agreement, or ``None`` when not distributed.
        job_end_time: Wall time of the job's time limit, if known (``HPC_JOB_END_TIME``).
        lead_s: The job's ``--signal-lead``.
        grace_s: Seconds between a preemption's SIGTERM and its SIGKILL.
        under_slurm: Whether the job runs under Slurm (else a warning is never a time limit's).
        clock: Wall clock (tests pass a fake).
    """

    def __init__(self, signals: Iterable[str], group: Any = None, *, job_end_time: float | None = None,
                 lead_s: float = components.PREEMPTION.lead_s, grace_s: float = DEFAULT_GRACE_S,
                 under_slurm: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.signal_names = tuple(dict.fromkeys(signals))
        self.group = group
        self.job_end_time = job_end_time
        self.lead_s = lead_s
        self.grace_s = grace_s
        self.under_slurm = under_slurm
        self.clock = clock
        self.received: list[tuple[float, str]] = []
        self._pending: Any = None
        self._tensor: Any = None
        self._previous: dict[int, Any] = {}
        # One more flag agreed in the same all-reduce (in-process recovery: a joiner waits).
        self.flag: Callable[[], bool] | None = None
        self.flagged = False

    @classmethod
    def from_config(cls, config: PreemptionConfig, group: Any = None, *,
                    job_end_time: float | None = None, grace_s: float = DEFAULT_GRACE_S,
                    under_slurm: bool = True) -> PreemptionWatcher:
        """The watcher for the job's preemption settings (``JobSpec.preemption``)."""
        return cls(config.signal_names, group, job_end_time=job_end_time, lead_s=config.lead_s,
                   grace_s=grace_s, under_slurm=under_slurm)

    # -- recording (signal context: no I/O, no collectives) -------------------------------
    def install(self, environ: Mapping[str, str] | None = None) -> None:
        """Installs the recording handlers; a warning that reached this process (or its
        launcher) before now is taken from ``HPC_PENDING_WARNING`` (``NAME@time``)."""
        pending = JobEnvironment.from_env(os.environ if environ is None else environ).pending_warning
        name, _, when = pending.partition("@")
        if name:
            try:
                self.received.append((float(when), name))
            except ValueError:
                self.received.append((self.clock(), name))
        for name in self.signal_names:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._record)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        self.received.append((self.clock(), signal.Signals(signum).name))

    def _local_code(self) -> tuple[float, float, float, float]:
        """(any signal?, SIGTERM seen?, -first arrival time, :attr:`flag`) for a MAX reduction."""
        flag = 1.0 if self.flag is not None and self.flag() else 0.0
        if not self.received:
            return 0.0, 0.0, float("-inf"), flag
        first = min(t for t, _ in self.received)
        term = any(n == "SIGTERM" for _, n in self.received)
        return 1.0, 1.0 if term else 0.0, -first, flag

    # -- agreement ------------------------------------------------------------------------
    def poll(self, *, overlap: bool = True) -> StopRequest | None:
        """Returns the agreed stop request, identical on every rank, or None.

        Every rank must call this at the same step boundaries. With ``overlap`` the
        collective posted at the previous call is waited now and a new one is posted, so a
        signal is acted on one step later, on all ranks at the same step.
        """
        if self.group is None:
            *code, flag = self._local_code()
            self.flagged = bool(flag)
            return self._to_request(*code)
        import torch
        import torch.distributed as dist

        if not overlap:
            t = torch.tensor(self._local_code(), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            *code, flag = t.tolist()
            self.flagged = bool(flag)
            return self._to_request(*code)
        result = None
        self.flagged = False
        if self._pending is not None:
            posted.wait(self._pending)
            *code, flag = self._tensor.tolist()
            self.flagged = bool(flag)
            result = self._to_request(*code)
        self._tensor = torch.tensor(self._local_code(), dtype=torch.float64)
        self._pending = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)
        return result

    def drain(self) -> None:
        """Waits for a posted collective (call before tearing the group down)."""
        if self._pending is not None:
            posted.wait(self._pending)
            self._pending = None

    def _to_request(self, any_signal: float, term: float, neg_first: float) -> StopRequest | None:
        if not any_signal:
            return None
        first = -neg_first
        name = "SIGTERM" if term else next((n for _, n in self.received if n != "SIGTERM"),
                                           self.signal_names[0])
        kind = classify_warning(name, first, job_end_time=self.job_end_time, lead_s=self.lead_s,
                                under_slurm=self.under_slurm)
        deadline = deadline_for(kind, first, job_end_time=self.job_end_time, lead_s=self.lead_s,
                                grace_s=self.grace_s)
        return StopRequest(kind=kind, signal_name=name, received_at=first, deadline=deadline)
