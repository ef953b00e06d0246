"""``events.jsonl``: the life of a job as timestamped events, for ``hpc report``.

Each line is one JSON object ``{"t": wall time, "ev": name, "alloc": A, "node": host, ...}``.
The per-node launchers write the allocation's frame (``alloc_start``, the agent's rendezvous
rounds and worker starts, the signals it forwarded, ``alloc_end`` with the same kind as
``outcomes.jsonl``); rank 0's :class:`~runtime.session.Session` writes what the training does
(``session_start``, ``rendezvous``, ``restore_begin/end``, ``loop_start``, ``first_step``, a
``steps`` summary every few seconds, ``ckpt_save``/``ckpt_commit``, ``stop_begin/end``,
``crash``, ``session_end``). :mod:`hpc.contract.ledger` turns them into a goodput ledger.

Why it is cheap and still durable: the file is opened once with ``O_APPEND`` and every event is
a single ``os.write`` of one line (lines from several processes never interleave; a crashed
process loses nothing it wrote, the kernel has it). Nothing here calls ``fsync`` on the training
path: a daemon thread ``fdatasync``s the file every :data:`SYNC_EVERY_S` seconds when something
was written, so a node crash loses at most the last few seconds. Steps are not events: a
:class:`StepSummary` counts them and emits one ``steps`` event per :data:`SUMMARY_EVERY_S`.
Bookkeeping never stops training: write errors are logged once and the log goes quiet.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hpc.contract import jobdir, records
from hpc.contract.events import EVENTS, read_events
from hpc.contract.ledger import build
from runtime.liveness import proc

log = logging.getLogger("hpc.events")
SUMMARY_EVERY_S = 5.0       # one ``steps`` event per this many seconds of training
SYNC_EVERY_S = 3.0          # the background fdatasync period (crash durability)
MAX_SUMMARY_BYTES = 32 << 20  # larger event files are not summarized on the exit path
EVENTS_ENV = "HPC_EVENTS"   # "0": the Session records nothing (for A/B overhead measurements)


class NullEventLog:
    """The recorder on ranks that record nothing (every rank but 0): every call is a no-op."""

    def emit(self, ev: str, t: float | None = None, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


class EventLog(NullEventLog):
    """Appends events for one process to ``JOB_DIR/events.jsonl``.

    Args:
        job_dir: The job directory.
        allocation: The allocation these events belong to.
        base: Fields every event carries (``rank``, ``restart``, ``node_rank``...).
        sync_every_s: fdatasync period in a daemon thread (0: never).
    """

    def __init__(self, job_dir: str | Path, *, allocation: int, sync_every_s: float = SYNC_EVERY_S,
                 **base: Any) -> None:
        self._base = {"alloc": allocation, "node": socket.gethostname(), **base}
        self._fd: int | None = None
        self._dirty = False
        self._stop = threading.Event()
        try:
            Path(job_dir).mkdir(parents=True, exist_ok=True)
            self._fd = os.open(Path(job_dir) / EVENTS,
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("cannot record events in %s: %s", job_dir, e)
            return
        if sync_every_s > 0:
            threading.Thread(target=self._syncer, args=(sync_every_s,), name="hpc-events-sync",
                             daemon=True).start()

    def emit(self, ev: str, t: float | None = None, **fields: Any) -> None:
        """Appends one event (``t`` defaults to now, wall time) in a single write."""
        if self._fd is None:
            return
        record = {"t": round(time.time() if t is None else t, 4), "ev": ev, **self._base, **fields}
        try:
            os.write(self._fd, records.encode(record, compact=True))
            self._dirty = True
        except OSError as e:
            log.warning("cannot record event %s: %s (no more events from this process)", ev, e)
            self.close()

    def _syncer(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._sync()

    def _sync(self) -> None:
        fd = self._fd
        if fd is not None and self._dirty:
            self._dirty = False
            try:
                os.fdatasync(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Flushes to disk and closes (idempotent)."""
        self._stop.set()
        self._sync()
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class StepSummary:
    """Counts finished steps and emits one ``steps`` event per ``every_s`` seconds.

    ``done(step, now)`` is the only call on the training path: a few attribute updates and a
    comparison. The window ``[t0, t]`` covers the steps ``first..last`` (steps done, as the
    checkpoint step counts them) back to back, so productive time is the union of windows.

    Args:
        events: Where to emit.
        start_step: The step the loop starts at (steps done before it).
        t0: Wall time the loop started.
        every_s: Seconds per summary.
    """

    def __init__(self, events: NullEventLog, start_step: int, t0: float,
                 every_s: float = SUMMARY_EVERY_S) -> None:
        self.events, self.every_s = events, every_s
        self._t0, self._first, self._last, self._count = t0, start_step + 1, start_step, 0
        self._t_last = t0

    def done(self, step: int, now: float) -> None:
        """Records that ``step`` steps are done at wall time ``now``."""
        self._last, self._t_last = step, now
        self._count += 1
        if now - self._t0 >= self.every_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Emits the open window (if it holds steps) and starts the next one.

        Without ``now`` the window ends when its last step did (a stop or a crash comes later).
        """
        if self._count:
            now = self._t_last if now is None else now
            self.events.emit("steps", t=now, t0=round(self._t0, 4), first=self._first,
                             last=self._last, count=self._count)
            self._t0, self._first, self._count = now, self._last + 1, 0


def process_start_time() -> float | None:
    """Wall time this process started (Linux /proc), or None: spawn-to-Session is start-up.

    The start is read in ticks since boot and set against ``/proc/uptime`` (the same clock)
    rather than the whole-second ``btime``, so it is right to about 10 ms.
    """
    ticks = proc.start_ticks(os.getpid())
    if ticks is None:
        return None
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class AgentEvents(logging.Handler):
    """Turns torch's elastic-agent events into ours (installed by the launcher on each node).

    The agent records its rendezvous rounds (``RENDEZVOUS`` with ``duration_ms``), each
    worker's start (``START``) and, when it is done, how its last workers ended, on the
    ``torchelastic-events-null`` logger; they mark where a group formed, re-formed and ended,
    which the workers alone can not tell (and a script without the Session tells nothing).
    """

    LOGGER = "torchelastic-events-null"

    def __init__(self, events: NullEventLog) -> None:
        super().__init__(level=logging.INFO)
        self.events = events

    def install(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:  # never raises into the agent
        try:
            meta = json.loads(record.getMessage()).get("metadata") or {}
            inner = json.loads(meta.get("metadata") or "{}")
            state, now = meta.get("state"), time.time()
            if state == "RENDEZVOUS" and meta.get("duration_ms") is not None:
                dur = float(meta["duration_ms"]) / 1e3
                self.events.emit("agent_rendezvous", t=now, t0=round(now - dur, 4),
                                 agent_restarts=meta.get("agent_restarts"))
            elif state == "START" and list(inner.get("local_rank") or [None])[0] == 0:
                self.events.emit("workers_started", t=now, agent_restarts=meta.get("agent_restarts"),
                                 nodes=inner.get("group_world_size"))
            elif state in ("SUCCEEDED", "FAILED", "TERMINATED") and \
                    list(inner.get("local_rank") or [None])[0] == 0:
                self.events.emit("workers_ended", t=now, state=state,
                                 agent_restarts=meta.get("agent_restarts"))
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass



class SessionRecorder:
    """What rank 0's :class:`~runtime.session.Session` records.

    The Session calls one method per moment of a worker's life; on other ranks the events go
    to a :class:`NullEventLog`. (``--checkpoint-interval auto`` is the Session's, decided by
    :class:`~runtime.checkpoint.auto_interval.AutoInterval`; :meth:`saved` tells it of a commit.)
    """

    def __init__(self, job_dir: Path, *, rank: int, allocation: int, restart: int,
                 world_size: int) -> None:
        self.job_dir, self.rank = Path(job_dir), rank
        self.key = (allocation, restart)
        self.events: NullEventLog = NullEventLog()
        if rank == 0 and os.environ.get(EVENTS_ENV, "1") != "0":
            self.events = EventLog(job_dir, allocation=allocation, rank=0, restart=restart)
        self.events.emit("session_start", t_proc=process_start_time(), world_size=world_size)
        self._steps: StepSummary | None = None
        self._committed: int | None = None
        self._first = False
        self._pending: list[int] = []

    def emit(self, ev: str, **fields: Any) -> None:
        self.events.emit(ev, **fields)

    # --- the loop -------------------------------------------------------------------------
    def loop_start(self, step: int) -> None:
        self.events.emit("loop_start", step=step)
        self._steps = StepSummary(self.events, step, time.time())
        self._first = True

    def step_done(self, step: int) -> None:
        """After every step (the only per-step call)."""
        if self._steps is not None:
            now = time.time()
            self._steps.done(step, now)
            if self._first:
                self._first = False
                self.events.emit("first_step", t=now, step=step)

    def flush_steps(self) -> None:
        if self._steps is not None:
            self._steps.flush()

    # --- checkpoints ----------------------------------------------------------------------
    def saved(self, ckpt: Any, step: int) -> bool:
        """After ``Checkpointer.save``: what it blocked, and any commit it completed (True then)."""
        self.events.emit("ckpt_save", step=step, block_s=round(ckpt.last_block_s or 0.0, 4))
        self._pending.append(step)
        return self.check_commit(ckpt)

    def check_commit(self, ckpt: Any) -> bool:
        """Records the saves committed since the last look (the newest with its duration);
        whether there was one."""
        latest = ckpt.latest_step() if ckpt is not None else None
        committed = latest is not None and latest != self._committed
        if committed:
            self._committed = latest
            for step in [s for s in self._pending if s < latest]:   # committed inside a later save
                self.events.emit("ckpt_commit", step=step)
            self._pending = [s for s in self._pending if s > latest]
            self.events.emit("ckpt_commit", step=latest, save_s=round(ckpt.last_save_s or 0.0, 4))
        return committed

    def restored(self, ckpt: Any, step: int, from_checkpoint: bool) -> None:
        """After the restore."""
        self.events.emit("restore_end", step=step, from_checkpoint=from_checkpoint)
        self._committed = ckpt.latest_step() if ckpt is not None else None

    # --- stops and the end ----------------------------------------------------------------
    def stop_begin(self, kind: str, signal: str) -> None:
        self.flush_steps()
        self.events.emit("stop_begin", kind=kind, signal=signal)

    def closing(self, error: BaseException | None, step: int, sink: Any = None) -> None:
        """First thing on every exit path: the last step window, the crash if any, and the
        job's goodput so far into the W&B run's config (rank 0; ``goodput/...`` keys)."""
        self.flush_steps()
        self._steps = None
        if error is not None:
            self.events.emit("crash", step=step, error=f"{type(error).__name__}: {error}"[:300])
        if sink is not None and isinstance(self.events, EventLog):
            self._goodput_to(sink)

    def _goodput_to(self, sink: Any) -> None:
        """The ledger so far (pure, milliseconds) as run config; never fails the exit path."""
        try:
            path = self.job_dir / EVENTS
            if path.stat().st_size > MAX_SUMMARY_BYTES:
                return

            ledger = build(read_events(self.job_dir), current=self.key)
            data: dict[str, Any] = {"goodput/ratio": round(ledger.goodput, 4),
                                    "goodput/allocated_node_s": round(ledger.allocated_node_s, 2),
                                    "goodput/lost_steps": ledger.lost_steps,
                                    "goodput/interruptions": ledger.interruptions}
            data.update({f"goodput/{c}_node_s": round(v, 2) for c, v in ledger.categories.items()})
            sink.config(data)
        except Exception as e:  # noqa: BLE001 - bookkeeping only
            log.warning("goodput summary for W&B skipped: %s", e)

    def close(self, ckpt: Any, error: BaseException | None, step: int) -> None:
        """Last thing: any commit the final wait completed, the end; the file is synced."""
        self.check_commit(ckpt)
        self.events.emit("session_end", ok=error is None, step=step)
        self.events.close()


class _NullRecorder:
    """Before ``Session.start``: every recorder call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


NULL_RECORDER: Any = _NullRecorder()


class LauncherRecorder:
    """What a node's launcher records: the allocation's frame, the agent's rounds, signals."""

    def __init__(self, job_dir: Path, *, allocation: int, node_rank: int, slurm_job_id: str) -> None:
        self.job_dir, self.allocation = Path(job_dir), allocation
        self.events = EventLog(job_dir, allocation=allocation, node_rank=node_rank, sync_every_s=0)
        # The launcher's own start-up (imports, network checks) is the allocation's too.
        self.events.emit("alloc_start", t=process_start_time(), slurm_job_id=slurm_job_id)
        AgentEvents(self.events).install()

    def ready(self, spare_nodes: int) -> None:
        """The node passed its health check and joins the rendezvous (as a hot spare, when the
        job has them and the group is full: :mod:`hpc.contract.spare_waits` reads it so)."""
        self.events.emit("node_ready", spare_nodes=spare_nodes)

    def end(self, code: int, signals: list[tuple[float, str]]) -> None:
        """After the agent: the signals it forwarded, then ``alloc_end`` with the recorded kind."""
        for t, name in signals:
            self.events.emit("signal", t=t, signal=name)
        mine = [o for o in jobdir.read_outcomes(self.job_dir) if o.allocation == self.allocation]
        kind = mine[-1].kind if mine else ""
        self.events.emit("alloc_end", kind=kind, exit_code=code)
        self.events.close()
