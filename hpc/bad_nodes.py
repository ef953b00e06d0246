"""A memory of bad nodes across jobs: a history of jobs in; each node's record, the nodes to avoid out.

A job already keeps its own bad nodes out of its next allocations (:mod:`runtime.exclusions`):
its launchers write ``exclusions.jsonl`` when a node crashed or lost its link (``lost``: Slurm
dropped it from the running job), when a rank on it froze or it went silent (``stall``, only
on evidence that no work could be going on: never a busy rank running the user's code), or when
it failed the pre-join health check (``health``). A new job forgets all that. This module
weighs those records over the user's recent jobs (:mod:`hpc.node_history` reads them), so that
``hpc submit`` can leave out the nodes that keep failing (``sbatch --exclude``).

The rule: a node is avoided when it faulted in at least N (``--bad-node-faults``, 2) of the last
M jobs that ran on it (``--bad-node-jobs``, 5). One bad job is bad luck; the same node failing
again in another job is the node. A node whose last M jobs ran without a fault is trusted
again; and since an avoided node runs none of your jobs, a fault also lapses after
:data:`FORGET_AFTER_S` (a week: nodes are repaired), so no node stays out for good.

What never counts, because it says nothing about the node:

* an allocation that ended by the user's own error (``app_error``: the script raised, or a bad
  argument): a failing script can leave its peers waiting in a way that looks like a silent node;
* what happened once an allocation was being stopped by preemption, its time limit or a
  cancellation (from its stop notice on): nodes leave such an allocation at slightly different
  times, and a peer may see one go silent;
* a health check that every node of an allocation of two or more failed: a request no node can
  meet (a job directory none can write) is the job's, not a node's.

When the job's partition is known (``hpc submit`` reads it), only its nodes are avoided, and at
most as many as leave the job room to start there (MIN nodes and its spares); the oldest faults
lapse first, as in :func:`runtime.exclusions.effective`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpc.contract.records import EXCLUSION_KINDS, HEALTH_EXCLUSION as HEALTH

NODE_FAULT_KINDS = EXCLUSION_KINDS   # stall, lost, health: each names a node's own fault
USER_ENDINGS = ("app_error",)                     # the script's own error
STOP_ENDINGS = ("preempted", "time_limit", "cancelled")   # the scheduler or the user stopped it
DEFAULT_FAULTS = 2
DEFAULT_JOBS = 5
FORGET_AFTER_S = 7 * 24 * 3600.0   # a fault older than this no longer avoids its node


@dataclass(frozen=True)
class Fault:
    """One node fault a job recorded (one line of its ``exclusions.jsonl``)."""

    node: str
    kind: str
    time: float
    reason: str = ""


@dataclass(frozen=True)
class Allocation:
    """One run of a job on some nodes, and how it ended.

    Attributes:
        nodes: The nodes it ran on (their launchers' logs).
        faults: The node faults recorded in it.
        ending: Its outcome kind (``""``: none recorded, e.g. still running).
        stopping_since: When its stop began (the stop notice), else None.
    """

    nodes: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = ()
    ending: str = ""
    stopping_since: float | None = None


@dataclass(frozen=True)
class JobNodes:
    """What one job's directory says about its nodes: its allocations, in order."""

    key: str            # the job id (cluster:id) or its directory
    time: float         # when it was submitted: orders the jobs
    allocations: tuple[Allocation, ...] = ()

    @property
    def nodes(self) -> frozenset[str]:
        """Every node the job ran on."""
        return frozenset(n for a in self.allocations for n in (*a.nodes, *(f.node for f in a.faults)))


def counted_faults(job: JobNodes) -> list[Fault]:
    """The job's faults that count against their nodes (the rules of the module docstring)."""
    out = []
    for alloc in job.allocations:
        if alloc.ending in USER_ENDINGS:
            continue
        faults = [f for f in alloc.faults if f.kind in NODE_FAULT_KINDS]
        if alloc.ending in STOP_ENDINGS and alloc.stopping_since is not None:
            faults = [f for f in faults if f.time < alloc.stopping_since]
        failed_health = {f.node for f in faults if f.kind == HEALTH}
        if len(alloc.nodes) >= 2 and set(alloc.nodes) <= failed_health:
            faults = [f for f in faults if f.kind != HEALTH]
        out += faults
    return out


@dataclass(frozen=True)
class Policy:
    """When a node is avoided: ``faults`` of the last ``jobs`` jobs that ran on it faulted it."""

    faults: int = DEFAULT_FAULTS
    jobs: int = DEFAULT_JOBS
    forget_after_s: float = FORGET_AFTER_S

    def __post_init__(self) -> None:
        assert 1 <= self.faults <= self.jobs and self.forget_after_s > 0, self

    def describe(self) -> str:
        return f"faulted in {self.faults} or more of the last {self.jobs} jobs that ran on it"


@dataclass(frozen=True)
class NodeRecord:
    """One node's history over the jobs read.

    Attributes:
        jobs: Jobs it ran in.
        faulted: Jobs in which it faulted (counted faults only).
        kinds: Its counted faults by kind, most frequent first: ``(("stall", 2), ("lost", 1))``.
        last_fault: When it last faulted (0.0: never).
        recent_jobs: Of the last ``Policy.jobs`` jobs that ran on it, how many there were ...
        recent_faulted: ... and in how many it faulted (faults that have not lapsed).
        avoid: Whether the policy avoids it (before any partition cap).
    """

    node: str
    jobs: int
    faulted: int
    kinds: tuple[tuple[str, int], ...]
    last_fault: float
    recent_jobs: int
    recent_faulted: int
    avoid: bool
    last_reason: str = ""

    def kinds_text(self) -> str:
        return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in self.kinds) or "-"


def node_records(jobs: Iterable[JobNodes], policy: Policy = Policy(),
                 now: float | None = None) -> list[NodeRecord]:
    """Each node's record over ``jobs`` (any order), sorted by node name.

    Args:
        jobs: The history.
        policy: The rule.
        now: The time; faults older than ``policy.forget_after_s`` before it lapse (None:
            none lapses).
    """
    seen: dict[str, list[tuple[float, str, list[Fault]]]] = {}
    for job in sorted(jobs, key=lambda j: (j.time, j.key)):
        faults = counted_faults(job)
        for node in job.nodes:
            seen.setdefault(node, []).append((job.time, job.key, [f for f in faults if f.node == node]))
    out = []
    for node, history in sorted(seen.items()):
        faulty = [fs for _, _, fs in history if fs]
        recent = history[-policy.jobs:]
        fresh = [[f for f in fs if now is None or f.time >= now - policy.forget_after_s]
                 for _, _, fs in recent]
        recent_faulted = sum(1 for fs in fresh if fs)
        every = sorted((f for fs in faulty for f in fs), key=lambda f: f.time)
        kinds = Counter(f.kind for f in every)
        out.append(NodeRecord(
            node=node, jobs=len(history), faulted=len(faulty),
            kinds=tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
            last_fault=every[-1].time if every else 0.0, recent_jobs=len(recent),
            recent_faulted=recent_faulted, avoid=recent_faulted >= policy.faults,
            last_reason=every[-1].reason if every else ""))
    return out


@dataclass(frozen=True)
class Avoidance:
    """The nodes one submission leaves out, and those the policy named but the job keeps."""

    avoided: tuple[NodeRecord, ...] = ()
    kept: tuple[NodeRecord, ...] = ()      # avoided by the policy, kept so the job fits
    notes: tuple[str, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.avoided)


def to_avoid(records: Sequence[NodeRecord], *, partition_nodes: Sequence[str] | None = None,
             needed: int = 1, excluded: Sequence[str] = ()) -> Avoidance:
    """The nodes to leave out of one submission.

    Args:
        records: From :func:`node_records`.
        partition_nodes: The nodes of the job's partition (None: unknown; then no cap).
        needed: Nodes the job needs to start (MIN nodes and its spares).
        excluded: Nodes the user excludes already (not named again, and counted in the cap).
    """
    bad = sorted((r for r in records if r.avoid and r.node not in excluded), key=lambda r: r.last_fault)
    if partition_nodes is None:
        return Avoidance(tuple(sorted(bad, key=lambda r: r.node)))
    members = set(partition_nodes)
    bad = [r for r in bad if r.node in members]
    room = max(0, len(members - set(excluded)) - needed)
    kept, bad = bad[:max(0, len(bad) - room)], bad[max(0, len(bad) - room):]
    notes = tuple(f"{r.node} faulted in {r.recent_faulted} of its last {r.recent_jobs} jobs but is "
                  f"kept: the job needs {needed} of the partition's {len(members)} nodes" for r in kept)
    return Avoidance(tuple(sorted(bad, key=lambda r: r.node)), tuple(kept), notes)


def describe(avoidance: Avoidance, policy: Policy) -> str:
    """The one line ``hpc submit`` prints about the nodes it avoids ('' when none)."""
    if not avoidance.avoided:
        return ""
    each = "; ".join(f"{r.node}: {r.recent_faulted} of its last {r.recent_jobs} jobs ({r.kinds_text()})"
                     for r in avoidance.avoided)
    return (f"avoiding {len(avoidance.avoided)} node(s) that {policy.describe()}: {each} "
            "(hpc nodes shows their history; --no-avoid-bad-nodes keeps them)")
