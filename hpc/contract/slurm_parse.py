"""Pure parsers for the output of Slurm's commands (sbatch, squeue, sacct, scontrol, sinfo).

Why a separate module: parsing is where Slurm integrations break (a job name with a space, a
requeued job with two accounting records, ``Partition_Limit`` where a time was expected), and pure
functions can be tested on recorded real output (``tests/fixtures/slurm``) without a cluster.
:mod:`hpc.contract.slurm` runs the commands with the formats declared here and hands the text to these
functions; nothing here starts a process.

The formats put free-text fields (job name, comment) last and split on ``|`` from the left, so a
``|`` inside a job name still parses; a ``|`` inside a comment does not (our comments are tags).
"""

from __future__ import annotations

import enum
import itertools
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Mapping


class JobState(enum.Enum):
    """The states we act on. Slurm's many state names map onto these through ``_STATE_TABLE``."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    PREEMPTED = "PREEMPTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        """True when this record of the job will not change any more.

        A job submitted with ``--requeue`` can still come back under the same id after
        ``PREEMPTED`` or ``NODE_FAIL``: Slurm then starts a new record (``sacct --duplicates``
        shows both), which is not terminal.
        """
        return self in _TERMINAL


_TERMINAL = frozenset({
    JobState.PREEMPTED, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
    JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL, JobState.DEADLINE,
})

# Long names (squeue %T, sacct State, scontrol JobState) and the short codes (squeue %t).
_STATE_TABLE: Mapping[str, JobState] = {
    **{s.value: s for s in JobState},
    "PD": JobState.PENDING, "CF": JobState.CONFIGURING, "R": JobState.RUNNING,
    "CG": JobState.COMPLETING, "S": JobState.SUSPENDED, "RS": JobState.RESIZING,
    "RQ": JobState.REQUEUED, "RH": JobState.REQUEUE_HOLD, "PR": JobState.PREEMPTED,
    "CD": JobState.COMPLETED, "F": JobState.FAILED, "CA": JobState.CANCELLED,
    "TO": JobState.TIMEOUT, "NF": JobState.NODE_FAIL, "OOM": JobState.OUT_OF_MEMORY,
    "BF": JobState.BOOT_FAIL, "DL": JobState.DEADLINE,
    # Rarer states folded onto the nearest one we act on.
    "REQUEUE_FED": JobState.REQUEUED, "RF": JobState.REQUEUED,
    "RESV_DEL_HOLD": JobState.PENDING, "RD": JobState.PENDING,
    "STOPPED": JobState.SUSPENDED, "ST": JobState.SUSPENDED,
    # SIGNALING: Slurm is delivering a signal (a preemption's or time limit's warning, a
    # ``scancel --signal``) to a job that still runs; a user's cancel reads CANCELLED or
    # COMPLETING instead. Read as COMPLETING, a preemption looked like a cancel.
    "SIGNALING": JobState.RUNNING, "SI": JobState.RUNNING,
    "STAGE_OUT": JobState.COMPLETING, "SO": JobState.COMPLETING,
    "SPECIAL_EXIT": JobState.FAILED, "SE": JobState.FAILED,
    "REVOKED": JobState.CANCELLED, "RV": JobState.CANCELLED,
}


def parse_cluster_name(text: str) -> str:
    """``ClusterName`` from ``scontrol show config`` (``""`` when absent)."""
    m = re.search(r"^ClusterName\s*=\s*(\S+)\s*$", text, re.MULTILINE)
    return m.group(1) if m else ""


def parse_job_state(text: str) -> JobState:
    """Map a Slurm state string to a :class:`JobState`.

    Accepts long names, short codes, ``CANCELLED by 0`` and the ``+`` that sacct appends when
    it truncates. Unknown names give ``JobState.UNKNOWN`` rather than an error, so a newer Slurm
    with a new state does not break status reporting.
    """
    word = text.strip().split(" ", 1)[0].rstrip("+").upper()
    return _STATE_TABLE.get(word, JobState.UNKNOWN)


# --------------------------------------------------------------------------- scalar values

_NO_LIMIT = frozenset({"UNLIMITED", "INFINITE", "PARTITION_LIMIT", "NONE", "N/A"})
_DURATION = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?(?:\.\d+)?")


def parse_duration(text: str) -> int | None:
    """Parse a Slurm time field of command *output* into seconds.

    ``1-02:03:04`` (days-hours:minutes:seconds), ``1:00:00``, ``05:06`` (minutes:seconds, as
    squeue and sacct print durations under an hour), ``2-03`` (days-hours), ``00:01.234``
    (fraction dropped). ``UNLIMITED``, ``INFINITE``, ``Partition_Limit``, ``NONE`` and ``N/A``
    mean the job has no limit of its own and give ``None``.

    Raises:
        ValueError: if the text is not a Slurm time.
    """
    raw = text.strip()
    if raw.upper() in _NO_LIMIT:
        return None
    m = _DURATION.fullmatch(raw)
    if not m:
        raise ValueError(f"not a Slurm time: {text!r} (expected e.g. 1-02:03:04, 05:06, UNLIMITED)")
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if c is not None:  # H:M:S
        return (int(a) * 60 + int(b)) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60  # bare number: minutes


def parse_timestamp(text: str) -> datetime | None:
    """Parse ``2026-11-22T03:36:11``; ``Unknown``, ``None``, ``N/A`` or empty give ``None``."""
    raw = text.strip()
    if raw in ("", "Unknown", "None", "N/A", "(null)"):
        return None
    return datetime.fromisoformat(raw)


def parse_exit_code(text: str) -> tuple[int, int] | None:
    """Parse Slurm's ``EXIT:SIGNAL`` (``3:0``, ``0:15``); empty gives ``None``."""
    raw = text.strip()
    if not raw:
        return None
    code, _, sig = raw.partition(":")
    return int(code), int(sig or 0)


def _optional(text: str) -> str | None:
    raw = text.strip()
    return None if raw in ("", "(null)", "None", "N/A") else raw


def _int_or_none(text: str) -> int | None:
    raw = text.strip()
    return None if raw.upper() in _NO_LIMIT or not raw else int(raw)


# --------------------------------------------------------------------------- host lists

def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list {whole!r}")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi if sep else lo) + 1)]
    return out


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Expand a Slurm host list into host names, in order.

    ``node[1-3,5]`` -> node1 node2 node3 node5; ``gpu-a[01-02],cpu7`` -> gpu-a01 gpu-a02 cpu7;
    ``n[001-003]-ib`` -> n001-ib n002-ib n003-ib; several brackets give their product
    (``rack[1-2]-n[1-2]``). Empty, ``(null)`` and ``None assigned`` give ``()``.

    Raises:
        ValueError: on an unbalanced bracket or a bad range.
    """
    raw = text.strip()
    if raw in ("", "(null)", "None assigned", "None"):
        return ()
    hosts: list[str] = []
    for part in _split_top_level(raw):
        pieces = re.split(r"\[([^\[\]]*)\]", part)
        if any(c in p for p in pieces[::2] for c in "[]"):
            raise ValueError(f"unbalanced brackets in host list {text!r}")
        choices = [[p] if i % 2 == 0 else _expand_range(p, text) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return tuple(hosts)


# --------------------------------------------------------------------------- sbatch

@dataclass(frozen=True)
class Submission:
    """What ``sbatch --parsable`` printed: the job id and, in a federation, the cluster."""

    job_id: str
    cluster: str | None = None


def parse_sbatch(stdout: str) -> Submission:
    """Parse ``sbatch --parsable`` output (``123`` or ``123;cluster``).

    Raises:
        ValueError: if no job id is found.
    """
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    m = re.fullmatch(r"(\d+)(?:;(\S+))?", lines[-1]) if lines else None
    if not m:
        raise ValueError(f"sbatch --parsable printed no job id: {stdout!r}")
    return Submission(job_id=m.group(1), cluster=m.group(2))


# --------------------------------------------------------------------------- squeue

SQUEUE_FORMAT = "%i|%T|%r|%N|%P|%l|%M|%D|%j|%k"
"""squeue ``-o`` format matching :func:`parse_squeue` (use with ``--noheader``)."""


@dataclass(frozen=True)
class QueueEntry:
    """One job as squeue reports it."""

    job_id: str
    state: JobState
    raw_state: str
    reason: str | None
    nodes: tuple[str, ...]
    partition: str
    time_limit_s: int | None
    elapsed_s: int
    num_nodes: int
    name: str
    comment: str | None


def parse_squeue(text: str) -> tuple[QueueEntry, ...]:
    """Parse squeue output in :data:`SQUEUE_FORMAT`."""
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        head = line.split("|", 8)
        if len(head) != 9:
            raise ValueError(f"squeue line does not match {SQUEUE_FORMAT!r}: {line!r}")
        job_id, state, reason, nodes, partition, limit, used, count, rest = head
        name, _, comment = rest.rpartition("|")
        entries.append(QueueEntry(
            job_id=job_id, state=parse_job_state(state), raw_state=state,
            reason=_optional(reason), nodes=expand_hostlist(nodes), partition=partition,
            time_limit_s=parse_duration(limit), elapsed_s=parse_duration(used) or 0,
            num_nodes=int(count), name=name, comment=_optional(comment)))
    return tuple(entries)


# --------------------------------------------------------------------------- sacct

SACCT_FIELDS = ("JobID", "JobIDRaw", "JobName", "Partition", "State", "ExitCode", "Elapsed",
                "NodeList", "Start", "End", "Submit", "Reason", "Comment")
"""sacct ``--format`` fields matching :func:`parse_sacct` (with ``--parsable2 --noheader``)."""


@dataclass(frozen=True)
class AccountingRecord:
    """One sacct line: a job allocation (``step is None``) or one of its steps."""

    job_id: str
    step: str | None
    name: str
    partition: str | None
    state: JobState
    raw_state: str
    exit_code: tuple[int, int] | None
    elapsed_s: int
    nodes: tuple[str, ...]
    start: datetime | None
    end: datetime | None
    submit: datetime | None
    reason: str | None
    comment: str | None


def parse_sacct(text: str) -> tuple[AccountingRecord, ...]:
    """Parse ``sacct --parsable2 --noheader --format=`` :data:`SACCT_FIELDS` output, in order.

    With ``--duplicates`` a requeued job has one allocation record per run (the earlier ones
    ``REQUEUED``, ``PREEMPTED`` or ``NODE_FAIL``); :func:`latest_runs` picks the current one.
    """
    records = []
    n = len(SACCT_FIELDS)
    for line in text.splitlines():
        if not line.strip():
            continue
        head = line.split("|", n - 2)
        if len(head) != n - 1:
            raise ValueError(f"sacct line does not match {','.join(SACCT_FIELDS)}: {line!r}")
        _, raw_id, name, partition, state, exit_code, elapsed, nodes, start, end, submit, rest = head
        reason, _, comment = rest.rpartition("|")
        job_id, _, step = raw_id.partition(".")
        records.append(AccountingRecord(
            job_id=job_id, step=step or None, name=name, partition=_optional(partition),
            state=parse_job_state(state), raw_state=state, exit_code=parse_exit_code(exit_code),
            elapsed_s=parse_duration(elapsed) or 0, nodes=expand_hostlist(nodes),
            start=parse_timestamp(start), end=parse_timestamp(end), submit=parse_timestamp(submit),
            reason=_optional(reason), comment=_optional(comment)))
    return tuple(records)


def latest_runs(records: tuple[AccountingRecord, ...]) -> dict[str, AccountingRecord]:
    """The current allocation record of each job: the one submitted last (ties: printed last)."""
    latest: dict[str, AccountingRecord] = {}
    for rec in records:
        if rec.step is not None:
            continue
        old = latest.get(rec.job_id)
        if old is None or (rec.submit or datetime.min) >= (old.submit or datetime.min):
            latest[rec.job_id] = rec
    return latest


# --------------------------------------------------------------------------- scontrol

_KEY = re.compile(r"(?:^|\s)([A-Z][A-Za-z0-9_:/]*)=")


def parse_key_values(line: str) -> dict[str, str]:
    """Split one ``scontrol show ... -o`` line into ``{key: value}``.

    Values may contain spaces (``JobName=low job``, ``Reason=...``): a field ends only where the
    next ``Key=`` starts, a key being a capitalised word (``AllocNode:Sid``, ``CPUs/Task``).
    A value that itself contains `` Word=`` cannot be told apart and is split there.
    """
    matches = list(_KEY.finditer(line))
    out: dict[str, str] = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        value = line[m.end():nxt.start() if nxt else len(line)]
        out[m.group(1)] = value.strip()
    return out


@dataclass(frozen=True)
class JobInfo:
    """The fields of ``scontrol show job -o`` that we act on, plus all of them in ``fields``."""

    job_id: str
    name: str
    state: JobState
    raw_state: str
    reason: str | None
    restarts: int
    requeue: bool
    nodes: tuple[str, ...]
    batch_host: str | None
    partition: str
    time_limit_s: int | None
    run_time_s: int
    exit_code: tuple[int, int] | None
    comment: str | None
    work_dir: str | None
    command: str | None
    std_out: str | None
    end_time: datetime | None = None
    """``EndTime``: the time limit's end; once the job is picked for preemption, Slurm
    rewrites it to ``PreemptTime`` plus the partition's GraceTime (its SIGTERM then)."""
    preempt_time: datetime | None = None
    """``PreemptTime``: when the job was picked for preemption, None while it is not."""
    fields: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False, repr=False)


def parse_show_job(text: str) -> JobInfo:
    """Parse ``scontrol show job -o JOBID`` (one line; a heterogeneous job's leader prints one
    per component: the job's nodes are then all its components' nodes, its other fields the
    leader's).

    Raises:
        ValueError: if the text is not a job record.
    """
    lines = [x for x in text.strip().splitlines() if x.strip()]
    f = parse_key_values(lines[0] if lines else "")
    if "JobId" not in f:
        raise ValueError(f"not an scontrol job record: {text[:200]!r}")
    nodes = expand_hostlist(f.get("NodeList", ""))
    if f.get("HetJobId"):   # TorchX submits one component per role
        for line in lines[1:]:
            g = parse_key_values(line)
            if g.get("HetJobId") == f["HetJobId"]:
                nodes += tuple(n for n in expand_hostlist(g.get("NodeList", "")) if n not in nodes)
    return JobInfo(
        job_id=f["JobId"], name=f.get("JobName", ""),
        state=parse_job_state(f.get("JobState", "")), raw_state=f.get("JobState", ""),
        reason=_optional(f.get("Reason", "")), restarts=int(f.get("Restarts", "0")),
        requeue=f.get("Requeue") == "1", nodes=nodes,
        batch_host=_optional(f.get("BatchHost", "")), partition=f.get("Partition", ""),
        time_limit_s=parse_duration(f.get("TimeLimit", "UNLIMITED")),
        run_time_s=parse_duration(f.get("RunTime", "0:0")) or 0,
        exit_code=parse_exit_code(f.get("ExitCode", "")), comment=_optional(f.get("Comment", "")),
        work_dir=_optional(f.get("WorkDir", "")), command=_optional(f.get("Command", "")),
        std_out=_optional(f.get("StdOut", "")), end_time=parse_timestamp(f.get("EndTime", "")),
        preempt_time=parse_timestamp(f.get("PreemptTime", "")), fields=f)


@dataclass(frozen=True)
class PartitionInfo:
    """The fields of ``scontrol show partition -o`` that we act on."""

    name: str
    state: str
    default: bool
    max_time_s: int | None
    default_time_s: int | None
    max_nodes: int | None
    total_nodes: int
    total_cpus: int
    nodes: tuple[str, ...]
    priority_tier: int
    preempt_mode: str
    grace_time_s: int


def parse_show_partitions(text: str) -> tuple[PartitionInfo, ...]:
    """Parse ``scontrol show partition -o`` (one partition per line)."""
    parts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        f = parse_key_values(line)
        parts.append(PartitionInfo(
            name=f["PartitionName"], state=f.get("State", ""), default=f.get("Default") == "YES",
            max_time_s=parse_duration(f.get("MaxTime", "UNLIMITED")),
            default_time_s=parse_duration(f.get("DefaultTime", "NONE")),
            max_nodes=_int_or_none(f.get("MaxNodes", "UNLIMITED")),
            total_nodes=int(f.get("TotalNodes", "0")), total_cpus=int(f.get("TotalCPUs", "0")),
            nodes=expand_hostlist(f.get("Nodes", "")),
            priority_tier=int(f.get("PriorityTier", "1")),
            preempt_mode=f.get("PreemptMode", ""), grace_time_s=int(f.get("GraceTime", "0"))))
    return tuple(parts)


# --------------------------------------------------------------------------- sinfo

SINFO_FORMAT = "%P|%a|%l|%D|%t|%N"
"""sinfo ``-o`` format matching :func:`parse_sinfo` (use with ``--noheader``)."""


@dataclass(frozen=True)
class SinfoRow:
    """One sinfo line: the nodes of a partition that share a state."""

    partition: str
    default: bool
    available: bool
    time_limit_s: int | None
    node_count: int
    state: str
    nodes: tuple[str, ...]


def parse_sinfo(text: str) -> tuple[SinfoRow, ...]:
    """Parse sinfo output in :data:`SINFO_FORMAT`."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        partition, avail, limit, count, state, nodes = line.split("|")
        rows.append(SinfoRow(
            partition=partition.rstrip("*"), default=partition.endswith("*"),
            available=avail == "up", time_limit_s=parse_duration(limit), node_count=int(count),
            state=state, nodes=expand_hostlist(nodes)))
    return tuple(rows)
