"""Job-directory records: every JSONL file, its record type, one writer and one tolerant reader.

The processes of a job (``hpc`` on the login node, the per-node launchers, the workers) talk
through a few append-only files in the job directory. Each is declared here once, with the
record type both sides use (torch-free, so ``hpc status`` and ``hpc report`` read what the
runtime wrote with the same code). torchft's ``proto/torchft.proto`` is the model: every
message in one place.

====================  ================  ==============================  ================================
file                  record            written by                      read by
====================  ================  ==============================  ================================
outcomes.jsonl        Outcome           the launcher that records the   hpc status/run/report; the
                                        allocation (node 0, or a        launchers (allocation number,
                                        survivor)                       node 0's outcome)
hangs.jsonl           HangEvent         each node's watchdog            the outcome; rank 0 (W&B
                                        (runtime.liveness.watchdog)     events); hpc status/report
exclusions.jsonl      Exclusion         watchdog (stall), outcome       the batch shell
                                        (lost), launcher (health)       (runtime.exclusions); the
                                                                        outcome; across jobs, hpc
                                                                        submit/render/nodes
                                                                        (hpc.node_history)
stragglers.jsonl      Straggler         rank 0                          the outcome; hpc status
                                        (runtime.liveness.stragglers)
resubmissions.jsonl   Link              the launcher that resubmits     the launchers (allocation base);
                                        (runtime.ending.resubmit)              hpc status
events.jsonl          event() (a dict)  the launchers and rank 0        hpc report; --checkpoint-
                                        (runtime.events)                interval auto
$HPC_HOME/jobs.jsonl  JobRecord         hpc submit/sweep/run; a         hpc status/logs/cancel
                                        resubmission
====================  ================  ==============================  ================================

Writing: :func:`append` writes one JSON object per line in a single ``O_APPEND`` write, so
lines from several processes and nodes never interleave; ``durable=True`` fsyncs, and with a
job directory given, a full disk gives back the job's reserve (:mod:`hpc.contract.diskspace`)
and tries again: the record that says the disk filled up must not be lost to it.

Reading: :func:`read` never raises on content. A line that is not UTF-8, not JSON, or not the
record's shape (a missing field, a string where a number belongs, an unknown outcome kind) is
skipped and reported once per process on the ``hpc.records`` logger, naming the file and the
line; an unreadable file (a directory, no permission) reads as empty, reported the same way.
A damaged job directory must cost its damaged lines, never a job (a non-UTF-8 byte in
``hangs.jsonl`` used to crash every worker and the launcher).

File names are declared in :mod:`hpc.contract.jobpaths`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import logging
import os
import time
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hpc.contract import diskspace

log = logging.getLogger("hpc.records")
T = TypeVar("T")
_DECODER = json.JSONDecoder()   # json.loads's own (its default arguments)

OUTCOME_KINDS = ("finished", "preempted", "time_limit", "node_failure", "app_error", "cancelled",
                 "hang")
HEALTH_EXCLUSION = "health"   # the exclusion of a node that failed its pre-join health check
EXCLUSION_KINDS = ("stall", "lost", HEALTH_EXCLUSION)


# --------------------------------------------------------------------------- record types


@dataclass(frozen=True)
class Outcome:
    """``outcomes.jsonl``: why one allocation (one run of the job on some nodes) ended."""

    KINDS: ClassVar[tuple[str, ...]] = OUTCOME_KINDS

    allocation: int
    kind: str
    exit_code: int
    step: int | None = None
    reason: str = ""
    node: str = ""
    slurm_job_id: str = ""
    time: float = 0.0
    restarts: int = 0
    world_size: int = 0
    start_step: int | None = None   # the step this allocation started (resumed) at
    last_step: int | None = None    # the last step it completed (from progress.json)
    lost_steps: int | None = None   # steps done after the last committed checkpoint
    hangs: tuple[str, ...] = ()     # stalls the watchdogs acted on (hangs.jsonl), one line each
    succession: tuple[str, ...] = ()  # rendezvous hosts lost and who took over, one line each
    excluded: tuple[str, ...] = ()  # nodes kept out of the next allocations (exclusions.jsonl)
    stragglers: tuple[str, ...] = ()  # ranks persistently slower than the others, one line each

    def describe(self) -> str:
        """One line for ``hpc status``: what happened and what it cost."""
        parts = [self.kind]
        if self.start_step is not None and self.last_step is not None:
            parts.append(f"steps {self.start_step}->{self.last_step}")
        if self.step is not None:
            parts.append(f"checkpoint {self.step}")
        if self.lost_steps:
            parts.append(f"{self.lost_steps} steps lost")
        if self.succession:
            parts.append(f"rendezvous moved: {self.succession[-1]}")
        if self.hangs and self.kind != "hang":
            parts.append(f"{len(self.hangs)} stall(s) recovered, last: {self.hangs[-1]}")
        if self.stragglers:
            parts.append(f"straggler: {self.stragglers[-1]}")
        if self.excluded:   # "node3 (stall in allocation 0: why...)": the why is in the file
            short = [x.split(": ", 1)[0] + (")" if ": " in x else "") for x in self.excluded]
            parts.append(f"excluded next time: {', '.join(short)}")
        return ", ".join(parts) + (f": {self.reason}" if self.reason else "")

    def __post_init__(self) -> None:
        assert self.kind in OUTCOME_KINDS, self.kind


@dataclass(frozen=True)
class HangEvent:
    """``hangs.jsonl``: one stall a node's watchdog detected and acted on.

    A stall ends one worker group, not the allocation: the agents re-form and the job goes on,
    so it is not an outcome of its own; the allocation's outcome sums the stalls up.
    """

    allocation: int
    node: str
    node_rank: int
    reason: str                      # the verdict: who and why
    suspect_rank: int | None
    stacks: str                      # the stack file, relative to the job directory
    step: int | None = None          # the lowest step among the node's ranks
    time: float = 0.0
    ranks: tuple[str, ...] = field(default_factory=tuple)   # one line per local rank
    suspect_node: str = ""           # a peer node that stopped answering, when that is why
    kind: str = ""                   # the evidence (runtime.liveness.verdict: busy, frozen, ...)

    @property
    def who(self) -> str:
        return (f"rank {self.suspect_rank}" if self.suspect_rank is not None
                else f"node {self.suspect_node}" if self.suspect_node else "a peer off this node")

    def summary(self) -> str:
        """One line for outcomes and ``hpc status``."""
        at = f" at step {self.step}" if self.step is not None else ""
        return f"stall on {self.node}{at}, suspect {self.who}: {self.reason} (stacks {self.stacks})"

    def same_as(self, other: HangEvent) -> bool:
        """The same stall: same node, step, suspect and evidence."""
        return (self.node, self.step, self.suspect_rank, self.suspect_node, self.kind) == \
            (other.node, other.step, other.suspect_rank, other.suspect_node, other.kind)

    def advice(self) -> str:
        """Why the job ends after this stall was seen twice, and what the user can do."""
        at = f"step {self.step}" if self.step is not None else "the same point"
        if self.kind in ("busy", "user"):
            todo = ("if that work is expected (an evaluation, a save of your own, a slow first "
                    "batch), mark it in the script with `with session.phase(\"eval\"):` (or "
                    "`session.phase(NAME, budget_s=SECONDS)`), or raise --busy-timeout; if not, "
                    "its stack shows where it stays")
        elif self.kind == "desync":
            todo = ("the ranks took different paths through their collectives (a save, an "
                    "evaluation or a metric decided on one rank's own clock, data or state): make "
                    "that decision the same on every rank; the stacks show each rank's call")
        else:
            todo = ("if that pause is expected, mark it with `session.phase(NAME, budget_s=SECONDS)` "
                    "or raise --stall-timeout; else the stacks show where the ranks wait")
        return (f"the same stall twice at {at} (suspect {self.who}: {self.reason}); restarting "
                f"again would only repeat it, so the job ends here: {todo} (stacks {self.stacks})")


@dataclass(frozen=True)
class Exclusion:
    """``exclusions.jsonl``: one node gone bad, and why (see runtime.exclusions)."""

    KINDS: ClassVar[tuple[str, ...]] = EXCLUSION_KINDS

    node: str
    kind: str           # stall, lost (Slurm dropped it from the job), health
    reason: str
    allocation: int
    time: float

    def describe(self) -> str:
        return f"{self.node} ({self.kind} in allocation {self.allocation}: {self.reason})"


@dataclass(frozen=True)
class Straggler:
    """``stragglers.jsonl``: one rank found persistently slow (see runtime.liveness.stragglers)."""

    allocation: int
    rank: int
    node: str
    node_rank: int
    compute_s: float
    median_s: float
    step: int
    time: float

    def summary(self) -> str:
        return (f"rank {self.rank} on {self.node} (node rank {self.node_rank}): {self.compute_s:.3f}s "
                f"per step before its collective, {self.compute_s / max(self.median_s, 1e-9):.1f}x the "
                f"others' median ({self.median_s:.3f}s), at step {self.step}")


@dataclass(frozen=True)
class Link:
    """``resubmissions.jsonl``: ``job_id`` continues ``previous`` from allocation
    ``allocation_base`` (see hpc.contract.resubmissions)."""

    job_id: str
    previous: str
    allocation_base: int
    reason: str = ""
    time: float = 0.0

    def to_line(self) -> str:
        return encode(self).decode()


@dataclass(frozen=True)
class JobRecord:
    """``$HPC_HOME/jobs.jsonl``: a submitted job and where its directory is (see hpc.contract.index)."""

    job_id: str
    job_dir: str
    name: str
    backend: str
    submitted: float
    cluster: str = ""

    @property
    def key(self) -> str:
        """Unique across clusters: ``CLUSTER:ID``; the id alone for older records, the job
        directory for a job with no Slurm id (``hpc run``)."""
        if not self.job_id:
            return self.job_dir
        return f"{self.cluster}:{self.job_id}" if self.cluster else self.job_id

    def elsewhere(self, cluster: str) -> bool:
        """Whether this job belongs to another cluster than ``cluster`` (known names only)."""
        return bool(self.cluster and cluster and self.cluster != cluster)


# The fields every reader does arithmetic or text on, by type: a line whose value does not fit
# is skipped (and reported), so no reader meets a string where it counts, or an infinity.
_EVENT_INTS = ("alloc", "first", "last", "count")
_EVENT_INTS_OR_NONE = ("step", "probe_step", "last_step", "saved_step", "restart", "rank", "node_rank",
                       "gen", "world_size", "old_world_size", "exit_code")
_EVENT_FLOATS = ("t0", "t_proc")
_EVENT_FLOATS_OR_NONE = ("save_s", "block_s", "every_s")
_EVENT_TEXTS = ("node", "kind", "reason")
_MAX_INT = 2**53
_MAX_T = 1e11     # seconds since 1970: year 5138


_EVENT_LIMIT = {**dict.fromkeys(_EVENT_INTS + _EVENT_INTS_OR_NONE, _MAX_INT),
                **dict.fromkeys(_EVENT_FLOATS + _EVENT_FLOATS_OR_NONE, _MAX_T),
                **dict.fromkeys(_EVENT_TEXTS, 0)}   # key -> bound of its number (0: text)
_EVENT_NONE_OK = frozenset(_EVENT_INTS_OR_NONE + _EVENT_FLOATS_OR_NONE + _EVENT_TEXTS)


def _number(value: Any, *, whole: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if whole:
        return isinstance(value, int) and abs(value) < _MAX_INT
    return math.isfinite(value) and abs(value) < _MAX_T


def event(data: Any) -> dict[str, Any]:
    """``events.jsonl``: an event is a JSON object with a time ``t`` (finite, in [0, 1e11)) and
    a name ``ev``, and its common fields of their types (the names and their fields:
    :mod:`hpc.contract.events`)."""
    if not isinstance(data, dict):
        raise ValueError(f"not an object but {type(data).__name__}")
    t = data.get("t")
    if not (type(t) is float and 0 <= t < _MAX_T or _number(t, whole=False) and not t < 0) or \
            not isinstance(data.get("ev"), str):
        raise ValueError("no time 't' in [0, 1e11) or no name 'ev'")
    # The fields this line has, by their JSON types (a reader of a long history checks every
    # line; 25 lookups a line were half its reading). Anything else: _event_fields decides.
    for key in data.keys() & _EVENT_LIMIT.keys():
        value, limit = data[key], _EVENT_LIMIT[key]
        kind = type(value)
        if kind is int:
            ok = abs(value) < limit
        elif kind is float:
            ok = limit == _MAX_T and abs(value) < limit   # False for inf and nan
        elif kind is str:
            ok = limit == 0
        else:
            ok = value is None and key in _EVENT_NONE_OK
        if not ok:
            _event_fields(data)
            break
    return data


def _event_fields(data: dict[str, Any]) -> None:
    """Raises the ``ValueError`` that names an event's first field (in their declared order)
    of the wrong type, if it has one."""
    for key in _EVENT_INTS + _EVENT_INTS_OR_NONE:
        if key in data and not _number(data[key], whole=True) and \
                not (data[key] is None and key in _EVENT_INTS_OR_NONE):
            raise ValueError(f"{key!r} is not a whole number: {str(data[key])[:40]!r}")
    for key in _EVENT_FLOATS + _EVENT_FLOATS_OR_NONE:
        if key in data and not _number(data[key], whole=False) and \
                not (data[key] is None and key in _EVENT_FLOATS_OR_NONE):
            raise ValueError(f"{key!r} is not a finite number: {str(data[key])[:40]!r}")
    for key in _EVENT_TEXTS:
        if key in data and data[key] is not None and not isinstance(data[key], str):
            raise ValueError(f"{key!r} is not text: {str(data[key])[:40]!r}")


# --------------------------------------------------------------------------- decoding


def _fits(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` (from JSON) fits the annotation ``hint``, and the value to keep."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, kept = _fits(value, arg)
            if ok:
                return True, kept
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is tuple:
        if value is None:
            return True, ()     # null: an older writer
        if not isinstance(value, (list, tuple)):
            return False, value
        inner = args[0] if args else Any
        kept = []
        for item in value:
            ok, k = _fits(item, inner)
            if not ok:
                return False, value
            kept.append(k)
        return True, tuple(kept)
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if hint is str:
        return isinstance(value, str), value
    return True, value


def from_dict(cls: type[T], data: Any) -> T:
    """A record of type ``cls`` from one decoded JSON line; unknown keys are ignored (a newer
    writer), a missing field or a value of the wrong type raises ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"not an object but {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kept: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"no field {f.name!r}")
            continue
        ok, value = _fits(data[f.name], hints[f.name])
        if not ok:
            raise ValueError(f"{f.name} = {data[f.name]!r} is not {hints[f.name]}")
        kept[f.name] = value
    kinds = getattr(cls, "KINDS", None)
    if kinds is not None and kept.get("kind") not in kinds:
        raise ValueError(f"kind {kept.get('kind')!r} is none of {', '.join(kinds)}")
    return cls(**kept)


@dataclass(frozen=True)
class BadLine:
    """A line (or a whole file, ``line == 0``) a reader skipped, and why."""

    path: Path
    line: int
    why: str

    def describe(self) -> str:
        return f"{self.path}{f', line {self.line}' if self.line else ''}: {self.why}"


def parse(data: bytes, decode: type[T] | Callable[[Any], T], path: Path = Path("-")
          ) -> tuple[list[T], list[BadLine]]:
    """The records in a JSONL text, in order, and the lines skipped (pure)."""
    convert: Callable[[Any], T] = ((lambda d: from_dict(decode, d))   # type: ignore[arg-type,return-value]
                                   if dataclasses.is_dataclass(decode) else decode)  # type: ignore[assignment]
    out: list[T] = []
    bad: list[BadLine] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(BadLine(path, n, f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"))
            continue
        try:
            try:   # json.loads without its wrappers (a third of a long history's reading)
                value, end = _DECODER.raw_decode(text)
            except ValueError:
                end = -1
            if end != len(text):   # whitespace around it, or no JSON: as json.loads reads it
                value = json.loads(text)
        except (ValueError, RecursionError):   # RecursionError: nested deeper than the stack
            bad.append(BadLine(path, n, f"not JSON: {text[:80]!r}"))
            continue
        try:
            out.append(convert(value))
        except (ValueError, TypeError, KeyError, AssertionError, OverflowError) as e:   # 1e400 as an int
            bad.append(BadLine(path, n, f"not a {getattr(decode, '__name__', 'record')}: {e}"))
    return out, bad


_reported: set[tuple[str, int, str]] = set()


def report(bad: list[BadLine]) -> None:
    """Logs each skipped line once per process (readers poll; the log must not fill up)."""
    for b in bad:
        key = (str(b.path), b.line, b.why)
        if key not in _reported:
            _reported.add(key)
            log.warning("skipped a damaged record in %s (the rest is read)", b.describe())


def read(path: Path, decode: type[T] | Callable[[Any], T]) -> list[T]:
    """Every readable record in ``path``, in file order; ``[]`` when it does not exist.

    Never raises on content: damaged lines and unreadable files are skipped and reported
    (:func:`report`).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        report([BadLine(path, 0, f"unreadable ({e.strerror or e})")])
        return []
    records, bad = parse(data, decode, path)
    report(bad)
    return records


# --------------------------------------------------------------------------- writing


def encode(record: Any, *, compact: bool = False) -> bytes:
    """One record (a dataclass or a dict) as one JSON line."""
    data = asdict(record) if dataclasses.is_dataclass(record) else dict(record)
    if compact:
        return (json.dumps(data, separators=(",", ":")) + "\n").encode()
    return (json.dumps(data, sort_keys=True) + "\n").encode()


def append(path: Path, record: Any, *, durable: bool = False, job_dir: Path | None = None) -> None:
    """Appends one record to ``path`` in a single write (private to the user, 0600).

    A record whose ``time`` is 0 is stamped with the current time.

    Args:
        path: The JSONL file.
        record: A dataclass record or a dict.
        durable: fsync the file before returning.
        job_dir: On a full disk, give back this job directory's reserve and try again.

    Raises:
        OSError: the write failed (callers that must never fail catch it).
    """
    data = asdict(record) if dataclasses.is_dataclass(record) else dict(record)
    if data.get("time") == 0:
        data["time"] = time.time()
    line = encode(data)
    fd = os.open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        written = 0
        try:
            written = os.write(fd, line)
            if written < len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            if (job_dir is None or e.errno not in diskspace.DISK_FULL_ERRNOS
                    or not diskspace.give_back_reserve(job_dir)):
                raise
            os.write(fd, (b"\n" if written else b"") + line)   # a torn line stays a line of its own
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
