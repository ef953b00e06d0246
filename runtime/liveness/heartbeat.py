"""Per-rank heartbeats: what each worker last did, and when, for its node's launcher to read.

A worker's Session notes every completed step and every phase change (start-up, restore,
save, eval, a user's own); at most about once a second (and at once on a phase change) it
writes one small JSON record, ``hb-<pid>.json``, into the node-local directory the launcher
names in ``HPC_HEARTBEAT_DIR`` (``/dev/shm`` when the node has it). The write is a temp file
and a rename, without fsync: a reader sees the old or the new record, never a torn one, and
the training loop never waits on a disk or a peer. The record's ``time`` is when the worker
last made progress; the launcher compares it with the deadline of the record's phase.

Progress is not the only evidence: a background thread of the writer (:class:`AliveBeat`)
touches the record's modification time every :data:`ALIVE_EVERY_S` seconds, whatever the
main thread does. A fresh touch says "the process runs and its interpreter schedules
threads", apart from "it finished a step": a rank in a long evaluation keeps touching, a
process frozen by SIGSTOP (or wedged with the interpreter's lock held) does not. The record
says it has such a thread (``alive_every_s``); the reader turns the touch into
:attr:`Heartbeat.alive` (None for records without the thread).

Without ``HPC_HEARTBEAT_DIR`` (a plain ``torchrun``), :class:`NullHeartbeat` stands in.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.liveness.deadline import STEP, p99
from runtime.liveness.stragglers import WINDOW as PACE_WINDOW

WRITE_EVERY_S = 1.0
WINDOW = 200  # step times kept for the p99
ALIVE_EVERY_S = 1.0   # the alive beat's period (a touch of the record)


@dataclass(frozen=True)
class Heartbeat:
    """One worker's last known progress."""

    pid: int
    rank: int
    local_rank: int
    restart: int
    phase: str
    step: int
    steps_done: int       # steps completed since this worker started
    time: float           # wall time of the last progress (a step or a phase change)
    p99_s: float | None   # recent p99 step time
    samples: int          # step times the p99 is over
    budget_s: float | None = None   # the phase's own budget, when its opener gave one
    measured_s: float | None = None  # the longest earlier run of this phase in this process
    compute_s: float | None = None   # median work before DDP's reduction waits (stragglers)
    alive_every_s: float | None = None   # period of the writer's alive beat; None: it has none
    alive: float | None = None       # when the alive beat last touched the record (the reader's)

    def alive_age_s(self, now: float) -> float | None:
        """Seconds since the alive beat last touched the record; None without an alive beat."""
        if self.alive_every_s is None or self.alive is None:
            return None
        return max(0.0, now - self.alive)


def path_for(directory: Path, pid: int) -> Path:
    return Path(directory) / f"hb-{pid}.json"


def stacks_path(directory: Path, pid: int) -> Path:
    """Where worker ``pid``'s faulthandler writes its stacks (see :mod:`.stacks`)."""
    return Path(directory) / f"stacks-{pid}.txt"


def read_all(directory: Path) -> list[Heartbeat]:
    """Every readable record in ``directory`` (a record being replaced is skipped)."""
    out = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not (entry.name.startswith("hb-") and entry.name.endswith(".json")):
            continue
        try:
            mtime = entry.stat().st_mtime
            data = json.loads(Path(entry.path).read_text())
            if data.get("alive_every_s"):   # the record has an alive beat: its touch is evidence
                data["alive"] = mtime
            out.append(Heartbeat(**{k: data[k] for k in Heartbeat.__dataclass_fields__ if k in data}))
        except (OSError, ValueError, TypeError):
            continue
    return out


class AliveBeat:
    """A daemon thread that touches ``path`` every ``every_s`` seconds (the alive beat).

    One ``utime`` a second (after ``on_beat``, the writer's flush of a throttled record). It
    runs while the interpreter schedules threads (blocking calls in torch, gloo and
    ``time.sleep`` release the interpreter's lock); a stopped process stops it.
    """

    def __init__(self, path: Path, every_s: float = ALIVE_EVERY_S,
                 on_beat: Callable[[], None] | None = None) -> None:
        self.path, self.every_s, self.on_beat = path, every_s, on_beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc-alive-beat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.on_beat is not None:
                self.on_beat()
            try:
                os.utime(self.path)
            except OSError:   # not written yet, or being replaced: the next touch will do
                pass


class HeartbeatWriter:
    """The worker side: notes steps and phases, writes the record at most every ``every_s``.

    Args:
        directory: The node-local heartbeat directory.
        rank: Global rank.
        local_rank: Rank on this node.
        restart: The agent's restart count of this worker.
        every_s: Least seconds between two writes of ordinary steps.
        clock: Wall clock (injected for tests).
    """

    def __init__(self, directory: Path, *, rank: int, local_rank: int, restart: int,
                 every_s: float = WRITE_EVERY_S, clock: Callable[[], float] = time.time,
                 alive_every_s: float | None = ALIVE_EVERY_S) -> None:
        self.path = path_for(directory, os.getpid())
        self.rank, self.local_rank, self.restart = rank, local_rank, restart
        self.every_s = every_s
        self.clock = clock
        self.step = 0
        self.steps_done = 0
        self.phases: list[tuple[str, float | None, float]] = [("startup", None, clock())]
        self.longest: dict[str, float] = {}   # phase -> its longest completed run (s)
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.compute: deque[float] = deque(maxlen=PACE_WINDOW)
        self._progress = clock()
        self._written = float("-inf")
        self.written: Heartbeat | None = None   # the record on disk now (what the watchdog reads)
        self.alive_every_s = alive_every_s
        # The alive beat's thread also writes a record the throttle held back, so the one on
        # disk names the step a rank stopped at (the same stall twice is then recognized).
        self._lock = threading.Lock()
        self._held = False
        self._closed = False
        self._alive = AliveBeat(self.path, alive_every_s, self._flush) if alive_every_s else None
        if self._alive is not None:
            self._alive.start()

    @property
    def phase(self) -> str:
        return self.phases[-1][0]

    def record(self) -> Heartbeat:
        name, budget, _ = self.phases[-1]
        return Heartbeat(pid=os.getpid(), rank=self.rank, local_rank=self.local_rank,
                         restart=self.restart, phase=name, step=self.step,
                         steps_done=self.steps_done, time=self._progress,
                         p99_s=p99(self.times), samples=len(self.times), budget_s=budget,
                         measured_s=self.longest.get(name),
                         compute_s=statistics.median(self.compute) if self.compute else None,
                         alive_every_s=self.alive_every_s)

    def step_done(self, step: int, seconds: float | None, compute_s: float | None = None) -> None:
        """Step ``step`` finished after ``seconds`` (None: the first one, not a fair sample),
        of which ``compute_s`` before its first collective."""
        with self._lock:
            self._step_done(step, seconds, compute_s)

    def _flush(self) -> None:
        with self._lock:
            if self._held and not self._closed:
                self._write(force=True)

    def _step_done(self, step: int, seconds: float | None, compute_s: float | None) -> None:
        self.step = step
        self.steps_done += 1
        if seconds is not None and self.phase == STEP:
            self.times.append(seconds)
            if compute_s is not None:
                self.compute.append(compute_s)
        self._progress = self.clock()
        self._write(force=False)

    def enter(self, phase: str, budget_s: float | None = None) -> None:
        """Opens ``phase`` (written at once: a long phase must be known before it runs)."""
        with self._lock:
            self._progress = self.clock()
            self.phases.append((phase, budget_s, self._progress))
            self._write(force=True)

    def leave(self) -> None:
        """Closes the innermost phase."""
        with self._lock:
            self._progress = self.clock()
            if len(self.phases) > 1:
                name, _, since = self.phases.pop()
                self.longest[name] = max(self.longest.get(name, 0.0), self._progress - since)
            self._write(force=True)

    def set_base(self, phase: str) -> None:
        """Replaces the outermost phase (``startup`` -> ``step`` once the loop runs)."""
        with self._lock:
            self._progress = self.clock()
            self.phases[0] = (phase, None, self._progress)
            self._write(force=True)

    def close(self) -> None:
        if self._alive is not None:
            self._alive.stop()
        with self._lock:
            self._closed = True
        try:
            self.path.unlink()
        except OSError:
            pass

    def _write(self, *, force: bool) -> None:
        now = self.clock()
        if not force and now - self._written < self.every_s:
            self._held = True
            return
        self._held = False
        self._written = now
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        record = self.record()
        try:
            tmp.write_text(json.dumps({k: v for k, v in asdict(record).items() if k != "alive"}))
            os.replace(tmp, self.path)
            self.written = record
        except OSError:   # bookkeeping never stops training; the watchdog then sees no progress
            pass


class NullHeartbeat:
    """Stands in where no launcher watches (plain torchrun, tests): every call does nothing."""

    phase = STEP

    def step_done(self, step: int, seconds: float | None, compute_s: float | None = None) -> None: ...
    def enter(self, phase: str, budget_s: float | None = None) -> None: ...
    def leave(self) -> None: ...
    def set_base(self, phase: str) -> None: ...
    def close(self) -> None: ...


def writer_for(directory: str, *, rank: int, local_rank: int,
               restart: int) -> HeartbeatWriter | NullHeartbeat:
    """A writer into ``directory`` (``HPC_HEARTBEAT_DIR``), or the null one without it."""
    if not directory or not Path(directory).is_dir():
        return NullHeartbeat()
    return HeartbeatWriter(Path(directory), rank=rank, local_rank=local_rank, restart=restart)
