"""The stop deadline from Slurm itself, read once on the warning.

Without it the launcher *assumes* when the hard stop comes: the warning plus the partition's
GraceTime at a preemption, the job's end time at a time limit. The assumption is wrong when
the warning is late: on the project's cluster a preemption warning once reached the launcher
3.9 s before Slurm's SIGTERM with a GraceTime of 10 s (the signal travels slurmctld -> slurmd
-> slurmstepd -> the task; on a loaded node it waits). Slurm knows better: when it picks a
job for preemption it sets ``PreemptTime`` and rewrites ``EndTime`` to ``PreemptTime +
GraceTime`` (recorded from Slurm 22.05 in ``tests/fixtures/slurm/scontrol_show_job_preempt_grace.txt``),
and at a time limit ``EndTime`` is that limit. So on a warning one launcher asks
(``scontrol show job``) and the stop is planned against the *earlier* of the assumed and the
real deadline; both are logged and written into the stop notice (``HPC_STOP_FILE``).

The warning window is short, so the question is bounded (:data:`QUERY_BUDGET_S`): without
an answer in time the assumption stands, and the notice says so. One launcher asks (node 0's;
a thousand nodes asking slurmctld at once while it preempts would be a storm); the others
wait briefly for its notice. No Slurm here (``hpc run``, a container): the assumption,
unchanged.

The stop notice itself (:class:`StopNotice`, what ``HPC_STOP_FILE`` holds) is declared here;
the launcher's :class:`runtime.stopping.StopTracker` writes it. The decisions are pure
(:func:`slurm_stop`, :func:`refine`, :func:`plan`); :func:`ask_slurm` and
:func:`await_answer` are the two that touch the world.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from hpc.contract import jobdir
from hpc.contract.slurm import SlurmClient
from hpc.contract.slurm_parse import JobInfo, JobState
from runtime.preemption import TIME_LIMIT_SLACK_S

QUERY_BUDGET_S = 1.5
"""How long the launcher waits for ``scontrol show job`` on a warning before it goes on with
the assumption (the command is killed then; no retry: the window is too short)."""

ANSWER_WAIT_S = QUERY_BUDGET_S + 1.0
"""How long after the warning a reader (another node's launcher, rank 0's save decision) waits
for the asking launcher's answer in the notice."""

# StopNotice.query: where the notice's deadline stands.
NO_SLURM = ""            # nothing to ask (hpc run, a container): the assumption is final
ASKING = "asking"        # a launcher is asking Slurm: readers wait up to ANSWER_WAIT_S
ANSWERED = "answered"    # the deadline is the earlier of the assumed and Slurm's
UNANSWERED = "unanswered"  # no usable answer in time (the reason follows): the assumption


STOP_KINDS = ("preempted", "time_limit")

SIGNALING_STATES = ("SIGNALING", "SI")
"""Slurm's job state while a signal to it is pending: the job still runs."""


@dataclass(frozen=True)
class StopNotice:
    """A stop that began: what it is and when the hard stop is expected.

    Attributes:
        allocation: The allocation that is stopping.
        kind: ``preempted`` or ``time_limit``.
        signal: The first signal the launcher got (``SIGUSR2``, ``SIGTERM``).
        received_at: Wall time it arrived.
        deadline: Wall time of the expected SIGTERM from Slurm (SIGKILL follows ``KillWait``
            later), the one to plan against: the earlier of the assumed and Slurm's; after
            a SIGTERM, that moment.
        assumed_deadline: The launcher's own estimate (the warning plus GraceTime, or the
            job's end time), once Slurm was asked.
        slurm_deadline: Slurm's ``EndTime`` read on the warning, if it answered.
        query: Where Slurm's answer stands (this module): ``""`` (no Slurm
            here), ``asking``, ``answered``, ``unanswered: why``.
    """

    allocation: int
    kind: str
    signal: str
    received_at: float
    deadline: float
    assumed_deadline: float | None = None
    slurm_deadline: float | None = None
    query: str = NO_SLURM

    def __post_init__(self) -> None:
        assert self.kind in STOP_KINDS, self.kind

    @classmethod
    def read(cls, path: str | Path) -> StopNotice | None:
        """The notice at ``path``, or None when there is none (or it cannot be read)."""
        data = jobdir.read_json(Path(path)) if str(path) else None
        if not isinstance(data, dict) or not data:
            return None
        try:
            return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (KeyError, TypeError, AssertionError):
            return None


@dataclass(frozen=True)
class SlurmStop:
    """The stop as Slurm's controller sees it.

    Attributes:
        deadline: Wall time of Slurm's SIGTERM (``EndTime``).
        kind: ``preempted`` (``PreemptTime`` is set), ``time_limit`` (the end is within the
            warning's lead), or None when Slurm's schedule does not explain the signal (a
            user's ``scancel --signal``): the assumed kind stands then.
        preempt_time: Wall time ``PreemptTime``, if set.
    """

    deadline: float
    kind: str | None
    preempt_time: float | None = None


def slurm_stop(info: JobInfo, now: float, *, lead_s: float,
               restarts: int | None = None) -> tuple[SlurmStop | None, str]:
    """Reads the real stop from a job record (pure); (None, why) when it tells nothing.

    Args:
        info: ``scontrol show job`` of this job, read just after the warning.
        now: Wall time of the reading.
        lead_s: The job's ``--signal-lead``.
        restarts: This allocation's ``SLURM_RESTART_COUNT``: a record of a later run (the
            job was already requeued) says nothing about this one.
    """
    # SIGNALING: Slurm is delivering a signal to the job (its warning), which still runs and
    # whose record is this run's (seen on the test cluster in CI of 32c4e0b, answering the
    # preemption's own warning). Completing or requeued records tell nothing.
    signaling = (info.raw_state or "").upper() in SIGNALING_STATES
    if info.state not in (JobState.RUNNING, JobState.SUSPENDED) and not signaling:
        return None, f"the job is {info.raw_state or info.state.name} already"
    if restarts is not None and info.restarts != restarts:
        return None, f"the record is of run {info.restarts}, this is run {restarts}"
    if info.end_time is None:
        return None, "the job has no EndTime"
    end = info.end_time.timestamp()
    preempt = info.preempt_time.timestamp() if info.preempt_time else None
    if preempt is not None:
        kind: str | None = "preempted"
    elif end - now <= lead_s + TIME_LIMIT_SLACK_S:
        kind = "time_limit"
    else:
        kind = None
    return SlurmStop(deadline=end, kind=kind, preempt_time=preempt), ""


def refine(notice: StopNotice, found: SlurmStop | None, why: str = "") -> StopNotice:
    """The notice once Slurm answered (or did not): the earlier deadline, Slurm's kind (pure).

    ``assumed_deadline`` keeps the launcher's own estimate, ``slurm_deadline`` Slurm's, and
    ``deadline`` the one to plan against: the earlier (a SIGTERM that already came counts).
    """
    assumed = notice.assumed_deadline if notice.assumed_deadline is not None else notice.deadline
    if found is None:
        return dataclasses.replace(notice, assumed_deadline=assumed,
                                   query=f"{UNANSWERED}: {why}" if why else UNANSWERED)
    return dataclasses.replace(
        notice, kind=found.kind or notice.kind, deadline=round(min(notice.deadline, found.deadline), 3),
        assumed_deadline=assumed, slurm_deadline=round(found.deadline, 3), query=ANSWERED)


def is_pending(notice: StopNotice | None) -> bool:
    """Whether a reader should still wait for Slurm's answer in this notice."""
    return notice is None or notice.query == ASKING


def plan(kind: str, deadline: float, notice: StopNotice | None, *,
         allocation: int) -> tuple[str, float, str]:
    """(kind, deadline, note) for a save decision (pure): the workers' own estimate, or
    Slurm's earlier deadline and its kind when this allocation's launcher got an answer.

    Only Slurm's answer is taken from the notice: the launcher's own estimate follows the same
    rules as the workers', except after a SIGTERM, which it records as the deadline itself,
    while the workers still have until Slurm's SIGKILL (``KillWait``, or a lifeline's grace).
    """
    if notice is None or notice.allocation != allocation:
        return kind, deadline, "assumed deadline (no stop notice)"
    if notice.query == ANSWERED and notice.slurm_deadline is not None:
        return notice.kind, min(deadline, notice.slurm_deadline), describe(notice)
    if notice.query.startswith(UNANSWERED):
        note = f"assumed deadline (Slurm: {notice.query})"
    elif notice.query == ASKING:
        note = "assumed deadline (Slurm did not answer in time)"
    else:
        note = "assumed deadline (nobody to ask)"
    return kind, deadline, note


def describe(notice: StopNotice, now: float | None = None) -> str:
    """One line with both deadlines, e.g. for the launcher's log."""
    now = notice.received_at if now is None else now
    assumed = notice.assumed_deadline if notice.assumed_deadline is not None else notice.deadline
    parts = [f"assumed deadline {_clock(assumed)} ({assumed - now:+.1f} s)"]
    if notice.slurm_deadline is not None:
        parts.append(f"Slurm's {_clock(notice.slurm_deadline)} ({notice.slurm_deadline - now:+.1f} s, "
                     f"{notice.kind})")
        parts.append(f"planning for {_clock(notice.deadline)}")
    else:
        parts.append(f"Slurm: {notice.query or 'not asked (no Slurm here)'}")
    return ", ".join(parts)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 10) % 10}"


def ask_slurm(job_id: str, env: Mapping[str, str] | None = None,
              budget_s: float = QUERY_BUDGET_S) -> JobInfo:
    """``scontrol show job`` through the Slurm client, bounded by ``budget_s`` (no retry).

    Raises:
        SlurmError: no answer within the budget, or the controller refused.
    """
    return SlurmClient(env, retry_total_s=0, command_timeout_s=budget_s).show_job(job_id)


def await_answer(read: Callable[[], StopNotice | None], since: float, *,
                 wait_s: float = ANSWER_WAIT_S, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> StopNotice | None:
    """Re-reads the notice until it is no longer :func:`is_pending`, at most until
    ``since + wait_s`` (wall time of the warning); returns the last one read."""
    notice = read()
    while is_pending(notice) and clock() < since + wait_s:
        sleep(0.05)
        notice = read()
    return notice


def read_notice(path: str | Path) -> StopNotice | None:
    """The notice at ``path``, or None."""
    return StopNotice.read(path)
