"""The Session's in-process part (``--recovery inprocess``): what the user's loop does when a
peer is lost, behind the seam the restart path implements as nothing
(:class:`runtime.worker.recovery.Restart`, whose points this class has).

A failed step, or a failed collective at a step boundary, leaves the failed generation and goes
on in a new one (:meth:`runtime.inprocess.worker.stages.InProcess.recover`); a joiner (a
restarted worker, a hot spare's) waits to be taken in, and its state comes from the members'
memory. This part is the Session's own: it reads and sets the Session's loop state (its rank,
groups, metric rows, sink, progress) at those points, as the Session's methods did.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist

from runtime.inprocess.worker.membership import Excluded
from runtime.inprocess.worker.peers import ShardedFallback
from runtime.inprocess.worker.stages import InProcess
from runtime.liveness.deadline import StallPolicy, p99, policy_for, step_deadline_s
from runtime.worker.metrics import LAST_LOSS

Session = Any   # runtime.session.Session (not imported: it imports this module)

log = logging.getLogger("hpc.session")
JOIN_WAIT_S = 30 * 86400.0      # a joiner (a hot spare's worker) may wait the job's whole life
# Every rank holds its last reduced metric rows, so the rank that becomes rank 0 when rank 0 is
# lost logs again the rows rank 0's W&B service had not written yet.
ROWS_HELD = 256


class InProcessSession:
    """The Session's points of in-process recovery (see :mod:`runtime.worker.recovery`)."""

    fixes_buckets = True   # a re-formed world's DDP keeps the bucket layout of the first

    def __init__(self, session: Session, backend: str, fallback: Callable[[], Any]) -> None:
        self.s = session
        self.backend = backend
        self.fallback = fallback               # the restart path's object (sharded(): not carried)
        self.inproc: InProcess | None = None   # set by start()
        self.recent: list[float] = []          # recent step times: the bound of a training all-reduce
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=ROWS_HELD)
        self.joined_at: tuple[float, float] | None = None   # a joiner: (asked, taken in), wall times

    @classmethod
    def start(cls, session: Session, backend: str, fallback: Callable[[], Any]) -> InProcessSession | None:
        """The part for this worker, or None where the launcher started no in-process recovery
        for it. On NCCL its communicators are aborted at a fault (:mod:`runtime.inprocess.worker.nccl`)."""
        part = cls(session, backend, fallback)
        made = InProcess.from_env(os.environ, rank=session.rank, world_size=session.world_size,
                                  timeout=session.timeout, step_bound_s=part._step_bound_s,
                                  backend=backend, device=session.device if backend == "nccl" else None)
        if made is None:
            return None
        made.session_state = part._session_state
        part.inproc = made
        return part

    @property
    def ip(self) -> InProcess:
        assert self.inproc is not None
        return self.inproc

    @property
    def joining(self) -> bool:
        return self.ip.joining

    # --- the seam's points ----------------------------------------------------------------
    def init_group(self, session: Session, backend: str) -> None:
        if self.joining:
            self._join()
        else:
            self.ip.init_group()

    def cpu_group(self, backend: str, timeout: Any) -> Any:
        return self.ip.cpu_group   # its generation's group for CPU tensors (NCCL: made with it)

    def joiner_flag(self) -> Callable[[], bool]:
        return lambda: self.ip.guard.joiners   # rank 0's fault watch saw a joiner: agreed with the signals

    def busy(self, until: float | None) -> None:
        self.ip.membership.set_busy(until)     # a re-form waits for this rank instead of leaving it out

    def sharded(self, *, mesh: bool) -> Any:
        if mesh:
            return self._leave("a mesh (Session(parallel=...))")
        if self.ip.plan.backend != "gloo":
            return self._leave(f"an FSDP2 model on {self.ip.plan.backend}")
        return self

    def ddp_options(self) -> dict[str, Any]:
        # No collective in the forward pass (buffers are not broadcast; a step's only
        # collectives are the guarded gradient all-reduces); a joiner's state comes in restore().
        from runtime.worker import ddp as ddp_build

        return {**ddp_build.no_forward_buffer_sync(), **({"init_sync": False} if self.joining else {})}

    def attach(self, app_state: Mapping[str, Any]) -> None:
        self.ip.attach(app_state)

    def bind(self, checkpointer: Any) -> None:
        checkpointer.wait_work = self._settle_one   # its step-boundary decision: a wait a lost peer ends

    def receive(self) -> int | None:
        return self._receive() if self.joining else None

    def at_save(self, step: int) -> None:
        self.ip.guard.inject_at_save(step)

    def begin(self, step: int) -> None:
        self.ip.guard.begin(step)

    def after_body(self, step: int, step_s: float) -> int | None:
        guard = self.ip.guard
        if guard.failed:
            # A peer was lost. Before the optimizer step: it did not run, the state is the
            # step's start (dirty: the small state goes back). After it: the step is whole.
            return self._recover(step + 1 if guard.stepped else step, guard.error or "",
                                 dirty=not guard.stepped)
        self.recent = (self.recent + [step_s])[-50:]
        return None

    def after_step(self, step: int) -> None:
        self.ip.after_step(step, self.recent[-1] if self.recent else None)   # FSDP2: the peer copy, when due

    def settle(self, works: Iterable[Any]) -> None:
        self.ip.guard.settle(list(works))

    def survives(self, error: BaseException) -> bool:
        return _collective_error(error)

    def recover_at_boundary(self, error: BaseException) -> int:
        return self._recover(self.s.step, f"at the step boundary: {_first_line(error)}", dirty=False)

    def grow(self) -> int:
        """Every member at the same step boundary (the agreement said a joiner waits): opens
        the next generation with the joiner; returns the step to go on from (unchanged)."""
        s = self.s
        if s._watcher is not None:
            s._watcher.drain()
        s._log_row_in_flight()
        if s._checkpointer is not None:
            s._checkpointer.wait()
        return self._recover(s.step, "a joiner waits", dirty=False, planned=True)

    def keep_row(self, step: int, row: Mapping[str, float]) -> None:
        self.rows.append((step, dict(row)))

    def close(self, *, finished: bool) -> None:
        self.ip.close(finished=finished)

    # --- joining --------------------------------------------------------------------------
    def _join(self) -> None:
        """A joiner (a restarted worker, a hot spare's): waits until the running members take
        it in, then forms their group; its rank and world are theirs. A joiner the job did not
        need (it finished first) ends here, cleanly."""
        s = self.s
        # DDP's construction imports torch._dynamo (seconds): here, while nobody waits for this
        # process, not once taken in, when the members wait for its wrap (a hot spare waits long).
        import torch._dynamo  # noqa: F401
        t0 = time.time()
        s._beat.enter("join", JOIN_WAIT_S)
        try:
            members = self.ip.join_group(JOIN_WAIT_S)
        finally:
            s._beat.leave()
        if members is None:
            log.info("session: the job finished while this worker waited to join: not needed")
            s._rec.emit("inproc_join", needed=False, waited_s=round(time.time() - t0, 3))
            s._beat.close()
            raise SystemExit(0)
        rank, world = self.ip.rank, self.ip.world_size
        s.env = dataclasses.replace(s.env, rank=rank, world_size=world)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        s._record_as(rank, world)
        self.joined_at = (t0, time.time())
        log.warning("in-process join: taken in as rank %d of %d in generation %d after %.2f s",
                    rank, world, members.gen, time.time() - t0)

    def _session_state(self) -> dict[str, Any]:
        """What a joiner needs of the loop to run its step-boundary collectives at the same
        steps as the members (sent with the state)."""
        s = self.s
        ckpt = s._checkpointer
        return {"origin": s._origin, "poll_every": s._poll_every,
                "last_save_step": ckpt._last_save_step if ckpt is not None else None,
                "schedule": ckpt.schedule if ckpt is not None else None,
                "metric_names": dict(s._metrics.names)}

    def _receive(self) -> int:
        """A joiner's restore: the state from the members' memory (no file is read)."""
        s = self.s
        assert self.joined_at is not None
        t0 = time.time()
        try:
            s.step, moved = self.ip.receive()
        except ShardedFallback as e:
            log.error("in-process join: %s", e)
            s._rec.emit("inproc_fallback", reason=str(e)[:600])
            raise
        got = self.ip.received_session
        s._origin = got.get("origin")
        s._poll_every = int(got.get("poll_every") or 1)
        s._metrics.names = dict(got.get("metric_names") or {})   # the members' row layout
        if s._checkpointer is not None:   # the same save rules (a timed save is a collective)
            s._checkpointer._last_save_step = got.get("last_save_step")
            if got.get("schedule") is not None:
                s._checkpointer.schedule = got["schedule"]
        s._ensure_sink(resume_step=s.step, run_id=None)
        asked, taken = self.joined_at
        self.ip.record_join(s.job_dir, s.env.allocation, t_asked=asked, t_taken=taken,
                            t_received=time.time(), bytes_moved=moved)
        log.warning("in-process join: received step %d from rank %d (%d bytes, %.3f s); no "
                    "checkpoint read", s.step, self.ip.joined.source, moved, time.time() - t0)
        return s.step

    def _leave(self, what: str) -> Any:
        """Falls back to the restart path for state in-process recovery cannot carry yet
        (a mesh of its own: HSDP, TP, PP), and says so in the log; returns the restart path's
        object."""
        s = self.s
        if self.joining:
            raise RuntimeError(f"this worker joins an in-process job, but the job has {what}, which "
                               "in-process recovery does not carry yet; use --recovery restart")
        why = (f"{what} is not carried in-process yet (its sub-groups are not made again in-process): "
               "a lost worker restarts every worker, as --recovery restart does")
        if s.is_rank0:
            log.warning("in-process recovery: %s", why)
        s._rec.emit("inproc_fallback", reason=why, step=s.step)   # rank 0's record (hpc report says it)
        self.ip.close()
        self.inproc = None
        if s._watcher is not None:
            s._watcher.flag = None   # no joiner is admitted without in-process recovery
        return self.fallback()

    # --- recovery -------------------------------------------------------------------------
    def _settle_one(self, work: Any) -> None:
        self.ip.guard.settle([work])

    def _step_bound_s(self) -> float:
        """The bound of one training all-reduce now: the stall watch's deadline of a step."""
        spec = self.s.spec
        policy = (policy_for(spec.liveness) if spec is not None else None) or StallPolicy()
        if len(self.recent) < policy.first_steps:
            return policy.first_steps_s
        return step_deadline_s(policy, p99(self.recent), len(self.recent))

    def _regroup(self) -> None:
        """The new generation's groups besides the default one, in the order a joiner's
        start, ``wrap`` and ``restore`` form them (the preemption agreement's, DDP's bucket
        layout, the checkpointer's)."""
        s = self.s
        world = self.ip.world_size
        if s._watcher is not None:
            s._watcher.group = dist.new_group(backend="gloo", timeout=s.timeout) if world > 1 else None
            s._watcher._pending = None
        self.ip.rewrap()
        if s._checkpointer is not None:
            s._checkpointer.rebind()
            s._checkpointer.wait_work = self._settle_one

    def _own_groups(self) -> list[Any]:
        """The Session's own groups of the generation being left (the recovery keeps them)."""
        s = self.s
        extra = [s.cpu_group, getattr(s._watcher, "group", None)]
        if s._checkpointer is not None:
            extra += s._checkpointer.release_groups()
        return [g for g in extra if g is not None]

    def _recover(self, held: int, why: str, *, dirty: bool, planned: bool = False) -> int:
        """Leaves the failed generation, goes on in a new one; returns the step to go on from."""
        s = self.s
        if s._pace is not None:
            s._pace.take()
        s._beat.enter("recover", 300.0)
        old_rank, old_world = s.rank, s.world_size
        self._keep_row_in_flight()
        try:
            rec = self.ip.recover(held, why, dirty=dirty, groups=self._own_groups(),
                                  regroup=self._regroup, planned=planned, release=self._own_groups)
        except Excluded as e:   # its peers went on without it (it was cut off, or frozen): done here
            s._beat.leave()
            log.warning("in-process recovery: %s; this worker ends, the job goes on without it", e)
            s._rec.emit("inproc_left_out", reason=str(e)[:300])
            s._beat.close()
            raise SystemExit(0) from None
        except ShardedFallback as e:   # the disk checkpoint is the fallback: the restart path
            s._beat.leave()
            log.error("in-process recovery: %s", e)
            s._rec.emit("inproc_fallback", reason=str(e)[:600], step=held)
            raise
        except BaseException:
            s._beat.leave()
            raise
        s._beat.leave()
        rank, world = rec.rank, rec.members.world_size
        s.env = dataclasses.replace(s.env, rank=rank, world_size=world)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        s.cpu_group = self.ip.cpu_group
        s._pending_metrics.clear()
        s._row_in_flight = None
        self.recent = []
        s.step = rec.members.step
        self._hand_over_sink(old_rank)
        # A new rank 0, or a sharded recovery that went back to its peer copies' step.
        if s.is_rank0 and (s._progress is None or s._progress.step > s.step):
            s._progress = s._meter(s._progress_total, s.step)
        phases = {"detect_t": rec.t_detect, "abort_s": rec.t_abort - rec.t_detect,
                  "reform_s": rec.t_reform - rec.t_abort, "group_s": rec.t_group - rec.t_reform,
                  "transfer_s": rec.t_transfer - rec.t_group}
        self.ip.record(s.job_dir, s.env.allocation, rec, old_rank=old_rank,
                       old_world=old_world, held=held, dirty=dirty)
        log.warning("in-process recovery: generation %d, rank %d -> %d of %d (was %d), going on "
                    "from step %d (this rank held %d); %s", rec.members.gen, old_rank, rank, world,
                    old_world, s.step, held, ", ".join(f"{k} {v:.3f}" for k, v in phases.items()
                                                       if k.endswith("_s")))
        s._write_progress(force=True)
        return s.step

    # --- metric rows across a recovery ----------------------------------------------------
    def _hand_over_sink(self, old_rank: int) -> None:
        """After a re-form the W&B run goes with rank 0: a process that was rank 0 and is no
        longer finishes its run (it logs nothing more); one that became rank 0 (its rank 0 was
        lost) resumes the job's one run (``JOB_DIR/wandb_run_id``, first write wins for steps
        already logged). Its ``wandb.init`` runs on the sink's thread: training goes on
        meanwhile, the rows wait in its queue."""
        s = self.s
        if s._sink is not None and (old_rank == 0) != s.is_rank0:
            old, s._sink = s._sink, None
            old.close()
            s._ensure_sink(resume_step=s.step, background=True, check_written=True)
            s._row_logged = None
        if s.is_rank0:   # rows not logged yet: the kept one, the lost rank 0's unwritten ones
            for step, row in self.rows:
                if (s._row_logged is None or step > s._row_logged) and step <= s.step:
                    s._ensure_sink().log(row, step=step)   # (the heir's sink drops written ones)
                    s._row_logged = step

    def _keep_row_in_flight(self) -> None:
        """At a recovery: the metric row whose reduction finished before the fault is kept (as
        every rank has it); one still posted is lost with the failed generation."""
        s = self.s
        if s._row_in_flight is None:
            return
        step, pending = s._row_in_flight
        s._row_in_flight = None
        try:
            if pending.works and not all(w.is_completed() for w in pending.works):
                return
            row = dict(pending.result(agree_new=False))   # no collective: the group may be gone
        except Exception as e:  # noqa: BLE001 - a failed reduction: the row is lost
            log.info("in-process recovery: the metric row of step %d is lost (%r)", step, e)
            return
        row.pop(LAST_LOSS, None)
        self.rows.append((step, row))


def _collective_error(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective or process group (a peer lost), not a bug."""
    if isinstance(e, dist.DistError) or type(e).__name__ == "PeerLost":
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "connection", "timed out", "broken pipe", "peer"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
