"""The launcher's stall watchdog: a thread beside torch's elastic agent on every node.

Twice a second it reads the local workers' heartbeats (:mod:`.heartbeat`), judges them
against their phase's deadline (:mod:`.verdict`), and publishes a one-line summary of its node
into the job directory (``liveness/alloc-A/node-N.json``): the latest progress of its ranks
(a step, or a phase entered or left, e.g. a rank-0 evaluation) and its busy ranks. While any
node progresses or has a busy rank, ranks elsewhere that wait for it in a collective are not
stuck.

Whatever the deadlines, local ranks whose main threads have used no CPU for
:data:`.verdict.DESYNC_S` while none progressed (and no other node progressed or reported a
busy rank) are looked at once (again every :data:`LOOK_EVERY_S`): waiting in *different*
collectives is a deadlock (:func:`.verdict.desync`), acted on at once, however long the first
steps' budget. The idleness is the kernel's: each worker's main thread's own CPU time, from
``/proc/PID/task/PID/stat`` (:data:`WAITING_SHARE`), and its whole process's (a process still
receiving a broadcast is not idle, only its main thread is: :data:`MOVING_SHARE`).

When every local rank is past its deadline without a hard fault (a frozen process, a lost
peer), it takes the ranks' stacks (again every :data:`LOOK_EVERY_S` while the ranks make no
progress) and weighs them (:func:`.verdict.weigh`): a rank alive and working outside any
collective is *running long*: logged once with its stack (and every :data:`BUSY_LOG_EVERY_S`
after), left alone until ``--busy-timeout``.

On a stall it:

1. asks every local worker for its Python stacks (:mod:`.stacks`) and writes them, with the
   verdict and a table of the ranks, to ``logs/alloc-A/hang-<host>-<n>.txt``;
2. names the suspect (a stopped process, a rank outside the collective its peers wait in, or
   "a peer on another node" when all local ranks wait in one);
3. appends a :class:`.hang_log.HangEvent` to ``hangs.jsonl``, and excludes the node from the
   job's next allocations only for a hardware-like fault (:data:`.verdict.HARDWARE_KINDS`),
   never under ``hpc run``;
4. SIGKILLs the node's workers. torch's agent sees a failed worker group and restarts it
   through the rendezvous; the other nodes' agents follow (their workers' sockets to the
   killed ones close). A node that cannot reach the rendezvous store any more (a cut link)
   cannot join, so the survivors form a smaller world when ``--nodes MIN:MAX`` allows, and
   resume from the last checkpoint. SIGKILL, not SIGTERM: a worker blocked in a collective
   with the Session's SIGTERM handler (which only records) would otherwise sit out the
   agent's 30-s grace period.

The same stall twice (same step, suspect and evidence: :func:`.hang_log.repeated`) is a
pattern, not a fault that goes away: :meth:`Watchdog.repeated` names it, and the launcher
then restarts no workers (the allocation ends as ``hang`` with what to do about it).

The launcher touches it through four calls: :meth:`Watchdog.start` before the agent,
:meth:`Watchdog.stop` after it, :meth:`Watchdog.repeated` when workers failed,
:meth:`Watchdog.amend` when it classifies the outcome.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hpc.contract import environment as job_env
from hpc.contract.components import LivenessConfig
from hpc.contract.jobpaths import JobPaths
from runtime import exclusions
from runtime.liveness import hang_log, nccl_watch, proc, stacks
from runtime.liveness.deadline import OUTPUT, StallPolicy, policy_for, step_deadline_s
from runtime.liveness.heartbeat import Heartbeat, read_all
from runtime.liveness.nodes import NodeBoard
from runtime.liveness.beacon import LOST_AFTER_S, PeerBeacon
from runtime.liveness.verdict import (DESYNC_S, HARDWARE_KINDS, RankState, Verdict, assess, blame,
                                      desync, judge, weigh)

log = logging.getLogger("hpc.liveness")
POLL_S = 0.5
GAP_S = 2.5   # a look or a store contact this late: this launcher itself was frozen or cut off
NCCL_DUMP_WAIT_S = 2.0       # torch writes the flight recorder from its own thread
LOOK_EVERY_S = 5.0           # stacks of ranks past their deadline without a hard fault, this often
BUSY_LOG_EVERY_S = 300.0     # a rank still running long is logged again this often
WAITING_SHARE = 0.02         # a main thread using more of a CPU than this is not waiting
MOVING_SHARE = 0.05          # a process using more of a CPU than this is still working (moving data)


def heartbeat_root() -> Path:
    """Node-local and memory-backed when possible: heartbeats must never wait on a disk."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


HEARTBEAT_DIR_PREFIX = "hpc-liveness-"
HEARTBEAT_DIR_QUIET_S = 120.0   # a left-behind heartbeat directory unchanged this long is stale


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for entry in path.iterdir():
        try:
            newest = max(newest, entry.stat().st_mtime)
        except OSError:
            pass
    return newest


def heartbeat_dir(agent_pid: int) -> Path:
    """The node-local directory of one launcher's workers' heartbeats (and NCCL pipes)."""
    return heartbeat_root() / f"{HEARTBEAT_DIR_PREFIX}{os.getuid()}-{agent_pid}"


def clean_stale_heartbeat_dirs(root: Path | None = None) -> list[Path]:
    """Removes the heartbeat directories of this user's launchers that are gone; returns them.

    A launcher removes its own directory when it stops; one killed with SIGKILL (or with its
    node) cannot, and each left one in memory (``/dev/shm``) until the node reboots. Only
    directories named for this user's uid, owned by it, whose launcher pid no longer runs and
    in which nothing changed for :data:`HEARTBEAT_DIR_QUIET_S` are removed: another user's, and
    a running launcher's (its workers beat every second), are never touched.
    """
    root = heartbeat_root() if root is None else Path(root)
    mine = f"{HEARTBEAT_DIR_PREFIX}{os.getuid()}-"
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for path in entries:
        pid_text = path.name[len(mine):] if path.name.startswith(mine) else ""
        if not (pid_text.isascii() and pid_text.isdigit()) or int(pid_text) == os.getpid():
            continue
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
            continue                                  # its launcher still runs
        except ProcessLookupError:
            pass
        except OSError:
            continue                                  # gone meanwhile, or not ours to judge
        if time.time() - _newest_mtime(path) < HEARTBEAT_DIR_QUIET_S:
            continue    # a live launcher in another pid namespace sharing this /dev/shm beats here
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d heartbeat director%s of launchers that were killed: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(p.name for p in removed))
    return removed


def output_beats(pids: set[int]) -> list[Heartbeat]:
    """Stand-in heartbeats of workers that publish none (scripts without the Session, or a
    Session script still importing): their progress is their output (the rank log the agent
    gave them as stdout and stderr). Judged in phase :data:`~.deadline.OUTPUT` once they wrote
    something; before that they are starting up (imports, process-group init: phase
    ``startup``, its own budget), where a loaded machine may keep them quiet for long."""
    out = []
    for pid in sorted(pids):
        env = proc.environ(pid)
        start = proc.started_at(pid)
        if start is None or "RANK" not in env:   # gone, or not a worker of ours
            continue
        last = max(start, proc.last_output(pid) or 0.0)
        phase = OUTPUT if proc.wrote_output(pid) is not False else "startup"
        out.append(Heartbeat(pid=pid, rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                             restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), phase=phase,
                             step=0, steps_done=0, time=last, p99_s=None, samples=0))
    return out


class Watchdog:
    """Watches one node's workers; see the module docstring.

    Args:
        job_dir: The job directory (shared between nodes under Slurm).
        allocation: The allocation index.
        node_rank: This node's index.
        policy: The stall policy; None disables the watch (``--stall-timeout off``).
        agent_pid: The process whose children are the workers (the launcher: the agent
            runs in it).
        poll_s: Seconds between two looks.
        beacon: The peer beacon (multi-node jobs).
        exclude_nodes: Record bad nodes for the next allocations (False under ``hpc run``:
            one machine, nothing to exclude).
    """

    def __init__(self, job_dir: Path, *, allocation: int, node_rank: int, policy: StallPolicy | None,
                 agent_pid: int | None = None, poll_s: float = POLL_S,
                 beacon: PeerBeacon | None = None, exclude_nodes: bool = True) -> None:
        self.job_dir = Path(job_dir)
        self.allocation, self.node_rank = allocation, node_rank
        self.policy = policy
        self.agent_pid = agent_pid or os.getpid()
        self.poll_s = poll_s
        self.host = socket.gethostname()
        self.directory = heartbeat_dir(self.agent_pid)
        self.hangs: list[hang_log.HangEvent] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acted_on: set[int] = set()
        self._group: set[int] = set()      # the current worker group's pids
        self._beating: set[int] = set()   # workers seen with a heartbeat of their own
        self._cpu: dict[int, tuple[int, float]] = {}   # pid -> (CPU ticks, last time it worked)
        self._watching_from = 0.0   # (wall) no progress is missed before this watch began
        # pid -> (its main thread's ticks, its process's ticks, since when both were quiet)
        self._quiet: dict[int, tuple[int, int, float]] = {}
        self._next_desync_look = 0.0
        self.beacon = beacon
        self.exclude_nodes = exclude_nodes
        # --recovery inprocess: a lost peer node is announced (host -> seconds silent) so the
        # survivors re-form without it, instead of every waiting node's workers being killed.
        self.on_lost: Any = None
        self.on_lost_after_s = LOST_AFTER_S
        self._last_look = time.monotonic()
        self._watching_since = time.monotonic()
        # The current episode: the ranks' progress, unchanged since the ranks went overdue.
        self._episode: tuple = ()
        self._next_look = 0.0
        self._busy_seen_at: float | None = None
        self._weighed: Verdict | None = None
        self._busy_logged: dict[int, float] = {}   # rank -> when it was last logged as busy
        self.busy: tuple[str, ...] = ()           # this node's busy ranks, as published
        self.board = NodeBoard(self.job_dir, allocation=allocation, node_rank=node_rank, host=self.host)

    @classmethod
    def for_job(cls, job_dir: Path, liveness: LivenessConfig, *, allocation: int, node_rank: int,
                rdzv_endpoint: str = "", run_id: str = "", max_nodes: int = 1,
                local: bool = False) -> Watchdog:
        """The watchdog of one launcher (``liveness``: the job's ``JobSpec.liveness``); with a
        rendezvous endpoint, a peer beacon too."""
        policy = policy_for(liveness)
        beacon = PeerBeacon(rdzv_endpoint, run_id, node_rank=node_rank, host=socket.gethostname(),
                            max_nodes=max_nodes) if rdzv_endpoint and max_nodes > 1 and policy else None
        return cls(job_dir, allocation=allocation, node_rank=node_rank, policy=policy, beacon=beacon,
                   exclude_nodes=not local)

    # --- the launcher's calls ---------------------------------------------------
    def start(self) -> None:
        """Creates the heartbeat directory, names it to the workers, starts the thread."""
        clean_stale_heartbeat_dirs(self.directory.parent)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._watching_from = time.time()
        old = os.environ.get(job_env.HEARTBEAT_DIR)
        job_env.JobEnvironment(heartbeat_dir=str(self.directory)).export(os.environ)
        log.info("env %s: %s -> %r (node-local worker heartbeats for the stall watch)",
                 job_env.HEARTBEAT_DIR, repr(old) if old is not None else "(unset)", str(self.directory))
        if self.policy is None:
            log.info("stall watch: off (--stall-timeout off): a stalled job waits for the "
                     "collective timeout")
            return
        p = self.policy
        step = f"{p.fixed_s:g}s" if p.fixed_s else f"max({p.floor_s:g}s, {p.k:g} x p99 step time)"
        log.info("stall watch: an ordinary step may take %s; the first %d steps %gs; phases (%s, "
                 "others %gs) their budget the first time, then %g x their longest run; a peer "
                 "node silent in the rendezvous store for %gs with no local progress: at once",
                 step, p.first_steps, p.first_steps_s,
                 ", ".join(f"{k} {v:g}s" for k, v in p.phase_budgets_s.items()), p.longest_s,
                 p.k if p.fixed_s is None else 2, LOST_AFTER_S)
        log.info("stall watch: a rank past its deadline that is alive (its alive beat fresh, not "
                 "stopped) and works outside any collective is running long, not stalled: it is "
                 "logged and restarted only after %gs without progress (--busy-timeout); a "
                 "frozen process (stopped, or its alive beat silent for %gs) is not given that",
                 p.busy_s, p.alive_s)
        log.info("stall watch of ranks without heartbeats (a script without the Session): %s",
                 f"{p.fixed_s:g}s without output" if p.fixed_s else
                 "stopped processes and lost peers only (--stall-timeout SECONDS watches their output)")
        self._thread = threading.Thread(target=self._run, name="hpc-stall-watchdog", daemon=True)
        self._thread.start()
        if self.beacon is not None:
            self.beacon.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.beacon is not None:
            self.beacon.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def amend(self, kind: str, reason: str) -> tuple[str, str, tuple[str, ...]]:
        """The allocation's outcome with this allocation's stalls (from every node) folded in.

        Returns:
            (kind, reason, one summary line per stall). An allocation whose workers last
            failed by the watchdog's SIGKILL (restarts spent) ends as ``hang``; one that
            finished, or failed otherwise after a recovered stall, keeps its kind.
        """
        hangs = hang_log.read(self.job_dir, self.allocation)
        lines = tuple(h.summary() for h in hangs)
        if hangs and kind == "app_error" and f"exited with -{int(signal.SIGKILL)}" in reason:
            pattern = self.repeated()
            if pattern:
                return "hang", pattern, lines
            return "hang", f"{lines[-1]}; then {reason}" if reason else lines[-1], lines
        return kind, reason, lines

    def repeated(self) -> str | None:
        """Why restarting the workers again is futile: the same stall seen twice in this
        allocation (from any node's record), or None. The message says what was seen and what
        to do."""
        twice = hang_log.repeated(hang_log.read(self.job_dir, self.allocation))
        return twice.advice() if twice is not None else None

    # --- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:   # the watchdog must never take the launcher down
                log.exception("stall watch: check failed")

    def check(self, now: float | None = None) -> Verdict | None:
        """One look at the node; acts on a stall. Returns the verdict (None: no workers)."""
        assert self.policy is not None
        pids = set(proc.workers(self.agent_pid))
        beats = [b for b in read_all(self.directory) if b.pid in pids and b.pid not in self._acted_on]
        self._beating.update(b.pid for b in beats)
        # Stand-ins only for workers that never published a heartbeat: a Session worker's
        # record is gone once it closes (exiting, it must not be judged by its output).
        beats += output_beats(pids - self._beating - self._acted_on)
        # Workers older than this watch (kept through a rendezvous host's loss and adopted by
        # this launcher's new epoch) are judged from when it began: their wait through the
        # succession is none of theirs (CI of 1597460: killed 0.5 s after the adoption, 24 s
        # past their last step).
        beats = [b if b.time >= self._watching_from else dataclasses.replace(b, time=self._watching_from)
                 for b in beats]
        self._forget_dead(pids)
        if pids and not pids & self._group and self.beacon is not None:
            self.beacon.tracker.new_group()   # a new worker group: judge peers from its start
        self._group = pids or self._group
        tracker = self.beacon.tracker if self.beacon is not None else None
        if self.on_lost is not None and tracker is not None:
            self._announce_lost(tracker)
        if not beats:
            return None
        now = time.time() if now is None else now
        ranks = assess(beats, {b.pid: proc.stopped(b.pid) for b in beats}, now, self.policy,
                       ran=self._worked(pids, now))
        idle = self._idle(ranks, now)
        # (in-process: a lost peer was announced above; no worker here is killed for it)
        lost = tracker.lost(time.monotonic()) if tracker is not None and self.on_lost is None else {}
        # The other nodes' progress and busy ranks come folded through the store (the summary
        # of liveness.groups), never from reading their records on the shared filesystem.
        peers_watch = tracker is not None and tracker.store_ok_at is not None
        verdict = judge(ranks, peer_progress_age_s=tracker.peer_progress_age(now) if tracker else None,
                        lost_peers={tracker.name(r): s for r, s in lost.items()} if tracker else None,
                        peer_busy=tracker.peer_busy() if tracker else "")
        dumps = None
        odd = self._desync(ranks, idle, tracker, now) if not verdict.hard else None
        if odd is not None:
            verdict, dumps = odd
        elif verdict.stalled and not verdict.hard:
            verdict, dumps = self._weigh(verdict, sorted(pids), now, peers_watch=peers_watch,
                                         peer_stall=self._peer_stall(verdict))
        else:
            self._new_episode(())
        self._note_busy(verdict, dumps or {}, now)
        self.board.publish(ranks, self.busy, now)
        if self.beacon is not None:
            self.beacon.publish(max(r.beat.time for r in ranks), self.busy,
                                now - min(idle.values()) if idle else None)
        if verdict.stalled:
            verdict = self._act(verdict, sorted(pids), dumps)
            if tracker is not None:
                tracker.done.update(lost)   # acted on: the job re-forms without them
        return verdict

    def _announce_lost(self, tracker: Any) -> None:
        """In-process: hands the peers lost for ``on_lost_after_s`` to ``on_lost``, but only
        after this launcher has itself watched that long without a gap (its own checks and
        store contact regular): back from a freeze or a cut of its own, every peer's counter
        would look still to it."""
        mono = time.monotonic()
        ok_at = tracker.store_ok_at
        gap = mono - self._last_look > GAP_S or ok_at is None or mono - ok_at > GAP_S
        self._last_look = mono
        if gap:
            self._watching_since = mono
        if mono - self._watching_since < self.on_lost_after_s + GAP_S:
            return
        quick = tracker.lost(mono, after_s=self.on_lost_after_s)
        if quick:
            self.on_lost({r: (tracker.hosts.get(r, "?"), s) for r, s in quick.items()})

    # --- ranks deadlocked in different collectives ------------------------------------------------
    def _idle(self, ranks: tuple[RankState, ...], now: float) -> dict[int, float]:
        """rank -> seconds its main thread used no more than :data:`WAITING_SHARE` of a CPU
        (a wait that polls wakes now and then) and was never seen waiting on I/O, and its
        process no more than :data:`MOVING_SHARE` (0 while it works)."""
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for r in ranks:
            pid = r.beat.pid
            thread, total = proc.main_thread(pid), proc.cpu_ticks(pid)
            if thread is None or total is None:
                continue
            main, state = thread
            before = self._quiet.get(pid)
            span = now - before[2] if before is not None else 0.0
            if before is None or state == "D" or (main - before[0]) / tick > WAITING_SHARE * span + 1.0 / tick or \
                    (total - before[1]) / tick > MOVING_SHARE * span + 2.0 / tick:
                self._quiet[pid] = before = (main, total, now)
            out[r.beat.rank] = now - before[2]
        return out

    def _desync(self, ranks: tuple[RankState, ...], idle: dict[int, float], tracker: Any,
                now: float) -> tuple[Verdict, dict[int, str]] | None:
        """A look at the stacks of ranks idle for :data:`DESYNC_S` without progress, here and
        (as far as this node knows) everywhere; the deadlock :func:`.verdict.desync` finds."""
        if len(ranks) < 2 or len(idle) < len(ranks) or min(idle.values()) < DESYNC_S or \
                min(r.age_s for r in ranks) < DESYNC_S:
            return None
        if tracker is not None:   # a rank elsewhere that works may be what these wait for
            ages = (tracker.peer_progress_age(now), tracker.peer_working_age(now))
            if any(a is not None and a < DESYNC_S for a in ages) or tracker.peer_busy():
                return None
            # ... and one gone silent may be (a cut link, a lost node or store host: the
            # ranks here then wait for it in whatever collective each was in; CI of 1597460
            # took that for a deadlock and killed the workers the succession was to keep)
            if not tracker.all_heard(time.monotonic(), GAP_S):
                return None
        if time.monotonic() < self._next_desync_look:
            return None
        self._next_desync_look = time.monotonic() + LOOK_EVERY_S
        if JobPaths(self.job_dir).stop_notice(self.allocation).exists():
            return None   # the allocation is stopping: its stop ends hung workers after its grace
        dumps = stacks.collect(self.directory, {r.beat.pid: r.beat.rank for r in ranks})
        assert self.policy is not None
        ordinary = {r.beat.rank: step_deadline_s(self.policy, r.beat.p99_s, r.beat.samples) for r in ranks}
        found = desync(ranks, dumps, idle, ordinary_s=ordinary)
        return (found, dumps) if found is not None else None

    # --- weighing a candidate stall with the stacks -------------------------------------------
    def _new_episode(self, key: tuple) -> None:
        if key != self._episode:
            self._episode, self._next_look, self._busy_seen_at, self._weighed = key, 0.0, None, None

    def _weigh(self, verdict: Verdict, pids: list[int], now: float, *,
               peers_watch: bool, peer_stall: str = "") -> tuple[Verdict, dict[int, str] | None]:
        """A candidate stall weighed with fresh stacks (every :data:`LOOK_EVERY_S`); between
        looks the last weighing stands, its busy ranks held to their budget."""
        assert self.policy is not None
        self._new_episode(tuple(sorted((r.beat.pid, r.beat.time) for r in verdict.ranks)))
        last = self._weighed
        if last is not None and time.monotonic() < self._next_look and not peer_stall:
            past = [r for r in verdict.ranks if r.beat.rank in last.busy
                    and r.age_s > max(self.policy.busy_s, r.deadline_s)]
            if not past:
                return dataclasses.replace(last, ranks=verdict.ranks), None
        dumps = stacks.collect(self.directory, {r.beat.pid: r.beat.rank for r in verdict.ranks})
        weighed = weigh(verdict, dumps, self.policy, busy_seen_at=self._busy_seen_at, now=now,
                        peers_watch=peers_watch, peer_stall=peer_stall)
        if weighed.busy:
            self._busy_seen_at = now
        self._weighed, self._next_look = weighed, time.monotonic() + LOOK_EVERY_S
        return weighed, dumps

    def _note_busy(self, verdict: Verdict, dumps: dict[int, str], now: float) -> None:
        """Logs ranks running long (with their stack the first time) and keeps them for
        :mod:`.nodes`."""
        busy = [r for r in verdict.ranks if r.beat.rank in verdict.busy] if not verdict.stalled else []
        self.busy = tuple(f"rank {r.beat.rank} on {self.host} (step {r.beat.step}, working outside "
                          f"any collective for {r.age_s:.0f}s)" for r in busy)
        for r in busy:
            last = self._busy_logged.get(r.beat.rank)
            if last is not None and last >= r.beat.time and now - last < BUSY_LOG_EVERY_S:
                continue
            self._busy_logged[r.beat.rank] = now
            stack = dumps.get(r.beat.rank, "")
            if last is None or last < r.beat.time:
                log.warning("stall watch: %s; not a stall: its process is alive and works outside "
                            "any collective (its peers wait for it). Mark long work with "
                            "session.phase(...) to say so; its stack:\n%s", verdict.reason,
                            stacks.head(stack) or "  (no stack)")
            else:
                log.warning("stall watch: %s", verdict.reason)

    def _act(self, verdict: Verdict, pids: list[int], dumps: dict[int, str] | None = None) -> Verdict:
        """Dumps (unless ``dumps`` were just taken), records and kills; returns the verdict
        with its suspect named."""
        log.error("stall detected: %s", verdict.reason)
        if nccl_watch.request_dumps(self.directory):   # NCCL jobs: the flight recorder, into the logs
            time.sleep(NCCL_DUMP_WAIT_S)
        if dumps is None:
            dumps = stacks.collect(self.directory, {r.beat.pid: r.beat.rank for r in verdict.ranks})
        if verdict.hard and verdict.suspect_rank is None:   # from judge: name the suspect
            verdict = blame(verdict, dumps)
        paths = JobPaths(self.job_dir)
        paths.alloc_logs(self.allocation).mkdir(parents=True, exist_ok=True)
        n = len(self.hangs) + 1
        while paths.hang_stacks(self.allocation, self.host, n).exists():   # an earlier watchdog's (epoch)
            n += 1
        path = paths.hang_stacks(self.allocation, self.host, n)
        path.write_text(stacks.report(verdict, dumps, host=self.host, node_rank=self.node_rank))
        event = hang_log.HangEvent(
            allocation=self.allocation, node=self.host, node_rank=self.node_rank,
            reason=verdict.reason, suspect_rank=verdict.suspect_rank,
            stacks=str(path.relative_to(self.job_dir)), step=min(r.beat.step for r in verdict.ranks),
            time=time.time(), ranks=tuple(r.describe() for r in verdict.ranks),
            suspect_node=verdict.lost_node, kind=verdict.kind)
        self.hangs.append(event)
        try:
            hang_log.append(self.job_dir, event)
        except OSError as e:
            log.error("cannot record the stall in %s: %s", hang_log.HANGS, e)
        # The node that stalled stays out of the job's next allocations (runtime.exclusions):
        # a peer that stopped answering, else this node when one of its ranks is the suspect
        # of a hardware-like fault (never a rank that was alive and running the user's code).
        bad = verdict.lost_node.split(" (")[0] if verdict.lost_node else \
            self.host if verdict.suspect_rank is not None and verdict.kind in HARDWARE_KINDS else ""
        if bad and self.exclude_nodes:
            exclusions.add(self.job_dir, bad, "stall", verdict.reason, self.allocation)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._acted_on.update(pids)
        log.error("stall: suspect %s: %s; stacks in %s; killed workers %s so the agents re-form "
                  "and resume from the last checkpoint",
                  f"rank {verdict.suspect_rank}" if verdict.suspect_rank is not None
                  else f"node {verdict.lost_node}" if verdict.lost_node else "off this node",
                  verdict.reason, path, pids)
        return verdict

    def _worked(self, pids: set[int], now: float) -> dict[int, float]:
        """pid -> the last time the kernel saw it work: its CPU time grew since the last
        look, or it is running or in I/O now. Evidence of life that a call holding the
        interpreter's lock (which silences the alive beat thread) cannot hide."""
        out = {}
        for pid in pids:
            ticks = proc.cpu_ticks(pid)
            if ticks is None:
                continue
            before = self._cpu.get(pid)
            if before is None or ticks > before[0] or proc.running(pid):
                self._cpu[pid] = (ticks, now)
            out[pid] = self._cpu[pid][1]
        return out

    def _forget_dead(self, live: set[int]) -> None:
        self._acted_on &= live
        self._beating &= live
        for pid in set(self._cpu) - live:
            del self._cpu[pid]
        for pid in set(self._quiet) - live:
            del self._quiet[pid]
        for p in self.directory.glob("*-*.*"):
            try:
                pid = int(p.stem.split("-", 1)[1])
            except ValueError:
                continue
            if pid not in live and not Path(f"/proc/{pid}").exists():
                p.unlink(missing_ok=True)

    # --- across nodes -----------------------------------------------------------------------
    def _peer_stall(self, verdict: Verdict) -> str:
        """A stall another node's watch acted on since the local ranks last progressed (its
        summary), or "" (``hangs.jsonl``, read only for a candidate stall)."""
        since = max((r.beat.time for r in verdict.ranks), default=0.0)
        theirs = [h for h in hang_log.read(self.job_dir, self.allocation)
                  if h.node_rank != self.node_rank and h.time >= since]
        return theirs[-1].summary() if theirs else ""
