"""Barrier-guarded, verified, sharded checkpoints on torch.distributed.checkpoint (DCP).

A save is a transaction. Every rank writes its shards (DCP) plus one small rank-local file (RNG
states) into a fresh ``step-000123.tmp/``; each file's CRC-32 is computed while it is written and
travels to rank 0 inside DCP's own gather of write results. When DCP's coordinator has finished
(so every rank's files are written and fsynced), rank 0 writes ``manifest.json``, fsyncs,
renames the directory to ``step-000123/``, moves the ``latest`` pointer atomically and prunes
old steps. A crash at any point before the rename leaves only a ``.tmp`` directory, which the
next resume deletes; a directory whose files no longer match the manifest is quarantined.

Every filesystem decision is made by rank 0 and broadcast (ranks disagree on NFS/Lustre), and
every failure is broadcast too, so no rank waits at a collective that another rank skipped.
How the bytes are written (checksums, retries, staging) is :mod:`runtime.checkpoint.storage`;
the manifest, its verification and the retention rules are :mod:`runtime.checkpoint.manifest`.

Async saves run DCP's thread-mode ``async_save`` on a dedicated gloo group; at most one is in
flight. Rank 0 commits from the future's completion callback, so a finished async checkpoint is
durable without any further collective; :meth:`Checkpointer.wait` (called by the next save, a
load and :meth:`Checkpointer.close`) tells every rank the outcome. What an async save blocks
for is the copy of the local state into staging buffers that were made in the background
beforehand (:mod:`runtime.checkpoint.staging`) plus one small all-gather that tells every rank
whether every rank is ready; DCP's planning (cached while the structure holds) and the writes
run on the writer thread.

Usage::

    ckpt = Checkpointer("ckpts", keep_last=3, every_steps=100)
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler}
    manifest = ckpt.load_latest(state)          # None on a fresh start
    for step in range(manifest.step if manifest else 0, steps):
        ...
        if ckpt.should_save(step + 1):
            ckpt.save(step + 1, state, metadata={"wandb_run_id": run_id})
    ckpt.close()
"""

from __future__ import annotations

import dataclasses
import errno
import io
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

from hpc.contract.components import CHECKPOINT, CheckpointConfig
from runtime import succession
from runtime.liveness import posted
from runtime.worker import rng
from runtime.console import NOTE
from runtime.checkpoint.manifest import (
    LATEST_NAME, MANIFEST_NAME, Manifest, SaveSchedule, fsync_dir, is_tmp_dir, parse_step,
    quarantine_name, quarantined_to_prune, read_latest, retry_transient, step_dirname, steps_to_prune,
    verify, write_atomic)
from runtime.checkpoint.storage import (
    ChecksummedWriter, RetryingReader, SafeLoadPlanner, kill_point, load_pickled, local_name, unpickling_problem)
from runtime.checkpoint.staging import Staging

log = logging.getLogger("hpc.checkpoint")

#: Write rate assumed before the first measured save (conservative for shared filesystems).
ASSUMED_WRITE_BYTES_S = 100e6
_RNG_KEY = "_rng"
_FAILED = (Exception, CheckpointException)
SETTLE_MIN_S = 15.0    # the least a crashed rank waits for its save in flight (Checkpointer.settle)
SETTLE_MAX_S = 120.0   # the most
_write_atomic = retry_transient(write_atomic)
_PLAN_KEYS = itertools.count()  # one plan-cache key per checkpointer, never reused


class CheckpointError(RuntimeError):
    """A save or load failed on some rank; raised on every rank with the same message."""


class _ModuleState:
    """Stateful view of a module through DCP's state_dict API (plain, DDP and FSDP2 alike)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class _OptimizerState:
    """Stateful view of an optimizer, keyed by parameter names (reshardable).

    Flattened (``param_groups.<name>.lr``, ``state.<name>.exp_avg``): every entry belongs to
    one parameter. Unflattened, a group's settings are one entry per group index
    (``param_groups.0.params`` lists its parameters), which DCP saves once, from rank 0: a
    pipeline stage, whose group holds other parameters than stage 0's, then loaded stage 0's
    group and lost its own settings (AdamW's ``betas``: the first step after the resume failed).
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=self.OPTIONS)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state, options=self.OPTIONS)


def split_state(app_state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits user state into DCP's sharded part and the rank-local part (``rank_local = True``).

    Modules and optimizers are wrapped in DCP's state_dict API; an optimizer needs exactly one
    module in ``app_state`` to name its parameters.

    Raises:
        ValueError: For a value that is not a module, optimizer or ``state_dict``/``load_state_dict`` object.
    """
    modules = [v for v in app_state.values() if isinstance(v, torch.nn.Module)]
    sharded: dict[str, Any] = {}
    local: dict[str, Any] = {}
    for key, value in app_state.items():
        if isinstance(value, torch.nn.Module):
            sharded[key] = _ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            if len(modules) != 1:
                raise ValueError(f"optimizer {key!r} needs exactly one model in the checkpoint state to "
                                 f"name its parameters, found {len(modules)}")
            sharded[key] = _OptimizerState(modules[0], value)
        elif getattr(value, "rank_local", False):
            local[key] = value
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            sharded[key] = value
        else:
            raise ValueError(f"checkpoint state {key!r} is a {type(value).__name__}; expected a module, an "
                             "optimizer, or an object with state_dict() and load_state_dict()")
    return sharded, local


class _CachingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with torch's plan cache on, keyed to one checkpointer.

    With the cache (``enable_plan_caching``, torch >= 2.6), a rank whose local plan equals the
    last one sends an empty plan and the coordinator reuses the cached global plan and
    metadata; any change of structure on any rank replans. torch keys the cache by class
    name, process-wide; the key here names the checkpointer too, so two checkpointers (or
    process groups) in one process never mix their plans. A key is never reused (a counter,
    not ``id()``): a rank holding a cached local plan for a key whose coordinator has no
    cached global plan would send an empty plan into a fresh global plan, and its shards
    would be missing from the metadata.
    """

    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = f"{type(self).__name__}:{key}"


def _has_errno(exc: BaseException | None, code: int, depth: int = 0) -> bool:
    if exc is None or depth > 8:
        return False
    if isinstance(exc, OSError) and exc.errno == code:
        return True
    if isinstance(exc, CheckpointException):
        return any(_has_errno(e, code, depth + 1) for e, _ in exc.failures.values())
    return _has_errno(exc.__cause__ or exc.__context__, code, depth + 1)


def _summary(exc: BaseException) -> str:
    """One line per failed rank instead of DCP's tracebacks (those go to the log)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {e!r}" for r, (e, _) in sorted(exc.failures.items()))
    return repr(exc)


@dataclass
class _InFlight:
    step: int
    tmp: Path
    writer: ChecksummedWriter
    future: Future[Any]
    started: float
    metadata: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    save_s: float = 0.0


class Checkpointer:
    """Saves and restores training state transactionally; all ranks call every method together.

    Args:
        directory: Where ``step-NNNNNN/`` directories and the ``latest`` pointer live.
        keep_last: Keep the newest ``keep_last`` checkpoints.
        keep_every: Also keep every step divisible by this (None: none).
        every_steps: :meth:`should_save` every N steps (None: no step interval).
        every_min: :meth:`should_save` every M minutes (rank 0's clock decides for everyone).
        async_save: ``save(blocking=False)`` writes in the background (else always blocking).
        verify_checksums: Recompute CRC-32s on resume (sizes are always checked).
        save_rng: Save and restore each rank's RNG states (see ``runtime.worker.rng``).
        seed: Base seed for re-seeding ranks that have no saved RNG state.
        thread_count: DCP writer threads per rank.
        reuse_staging: Keep the async staging buffers between saves and make them ahead of the
            first save, in the background (faster ``save()``, one extra copy of the local
            state in host memory; see :mod:`runtime.checkpoint.staging`).
        safe_globals: Types your own state objects hold besides tensors and plain data (their
            non-tensor values are unpickled with ``torch.load(weights_only=True)``); add only
            types whose unpickling runs no code (see docs/security.md).

    Raises:
        CheckpointError: On every rank, when ``directory`` is not a directory or cannot be created.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = CHECKPOINT.keep_last,
                 keep_every: int | None = None,
                 every_steps: int | None = None, every_min: float | None = None, async_save: bool = True,
                 verify_checksums: bool = True, save_rng: bool = True, seed: int = 0,
                 thread_count: int = 1, reuse_staging: bool = True, safe_globals: Sequence[Any] = ()) -> None:
        steps_to_prune([], keep_last=keep_last, keep_every=keep_every)  # validates
        self.directory = Path(directory).absolute()
        self.keep_last, self.keep_every = keep_last, keep_every
        self.schedule = SaveSchedule(every_steps, every_min)
        self.async_save, self.verify_checksums = async_save, verify_checksums
        self.thread_count = thread_count
        self.safe_globals = tuple(safe_globals)
        self._rng = rng.RNGState(seed) if save_rng else None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._ctl = dist.new_group(backend="gloo") if self.distributed else None
        self._bg = dist.new_group(backend="gloo") if self.distributed and async_save else None
        self._stager = Staging() if async_save and reuse_staging else None
        self._warm_state: Mapping[str, Any] | None = None  # state to make staging buffers for, once ready
        self._plan_key = f"{next(_PLAN_KEYS)}-{self.world_size}"
        self._inflight: _InFlight | None = None
        self._pruner: threading.Thread | None = None
        self._latest: int | None = None
        self._last_save_step: int | None = None
        self._last_save_time = time.time()
        self._estimate_bytes = 0
        self.last_save_s: float | None = None
        """Wall time of the last committed save (rank 0's, the same on every rank)."""
        self.last_block_s: float | None = None
        """How long the last ``save()`` call blocked the caller."""
        self.loaded_manifest: Manifest | None = None
        err = _prepare_directory(self.directory) if self.rank == 0 else None
        if (err := self._broadcast(err)) is not None:
            raise CheckpointError(err)

    wait_work: Any = staticmethod(posted.wait)
    """How the step-boundary decision waits for its collective (in-process recovery sets a
    wait it can leave when a peer is lost)."""

    def release_groups(self) -> list[Any]:
        """In-process recovery: hands over this checkpointer's groups of the failed generation
        and forgets a save in flight on them (it cannot commit: its collectives fail)."""
        groups = [g for g in (self._ctl, self._bg) if g is not None]
        self._ctl = self._bg = None
        self._inflight = None
        return groups

    def rebind(self) -> None:
        """In-process recovery: the groups of the new generation (the default group is new).
        Touches no file: the committed steps on disk are unchanged."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._ctl = dist.new_group(backend="gloo") if self.distributed else None
        self._bg = dist.new_group(backend="gloo") if self.distributed and self.async_save else None
        self._plan_key = f"{next(_PLAN_KEYS)}-{self.world_size}"
        # A joiner's new checkpointer is built now too: meet its constructor's one broadcast.
        self._broadcast(None)

    @classmethod
    def from_config(cls, config: CheckpointConfig, **options: Any) -> Checkpointer:
        """The checkpointer for the job's checkpoint settings (``JobSpec.checkpoint``).

        The config says "off" with 0, as the JobSpec and its flags do; the retention and
        schedule rules below it say None. This is the one place that translates.

        Args:
            config: Directory, save intervals and retention.
            options: The constructor's other arguments (``seed``, ``async_save``...).
        """
        return cls(config.directory, keep_last=config.keep_last, keep_every=config.keep_every or None,
                   every_steps=config.every_steps or None, every_min=config.every_min or None,
                   **options)

    # --- collectives ---------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        if self._ctl is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._ctl, group_src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if self._ctl is None:
            return [obj]
        objs: list[Any] = [None] * self.world_size
        dist.all_gather_object(objs, obj, group=self._ctl)
        return objs

    def _gather_errors(self, err: str | None) -> str | None:
        return next((e for e in self._gather(err) if e), None)

    # --- public API ----------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """Step of the newest committed checkpoint known to this job (None before any)."""
        return self._latest

    def should_save(self, step: int, now: float | None = None, *, timed: bool = True) -> bool:
        """Whether a save is due at ``step``; collective when a minute interval is set.

        Called every step, it also starts the background warm-up of the async staging buffers
        once the state restored (or started fresh) by :meth:`load_latest` is complete.

        Args:
            step: Steps done.
            now: Wall time (default: now).
            timed: Also apply the minute interval (one broadcast: rank 0's clock decides). With
                False only the step rules apply, with no collective: every rank must pass the
                same value at a step (the Session asks the clock at its agreement steps only).
        """
        self._maybe_warm_up()
        timed = timed and self.schedule.every_min is not None
        schedule = self.schedule if timed else dataclasses.replace(self.schedule, every_min=None)
        due = schedule.due(step, time.time() if now is None else now,
                           last_step=self._last_save_step, last_time=self._last_save_time)
        if timed and self._ctl is not None:
            flag = torch.tensor([int(due)])
            work = dist.broadcast(flag, group=self._ctl, group_src=0, async_op=True)  # one clock decides
            self.wait_work(work)
            due = bool(flag.item())
        return due

    def agree_schedule(self) -> None:
        """Rank 0's save schedule and last saved step on every rank (one broadcast).

        The step rules of :meth:`should_save` run on each rank with no collective, and a
        save is one: a rank whose rules differ waits alone in the save's gather while its
        peers go on into the next step's collectives. The rules are tuned from the job's
        event history, which only rank 0 reads (``--checkpoint-interval auto``: after a
        measured save rank 0 plans no probe save where the others would plan one), so the
        Session calls this once the schedule is set, at every restore.
        """
        self.schedule, self._last_save_step = self._broadcast((self.schedule, self._last_save_step))

    def estimated_save_s(self) -> float:
        """Expected duration of a blocking save: last measured, else size / assumed rate."""
        if self.last_save_s is not None:
            return self.last_save_s
        if self.loaded_manifest is not None and self.loaded_manifest.save_s > 0:
            return self.loaded_manifest.save_s
        return self._estimate_bytes / ASSUMED_WRITE_BYTES_S

    def save(self, step: int, app_state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None,
             blocking: bool = False) -> None:
        """Saves ``app_state`` as checkpoint ``step`` (waits for any save in flight first).

        Args:
            step: Training step (steps done); names the directory.
            app_state: Modules, optimizers and Stateful objects, the same keys on every rank.
            metadata: JSON-serializable values for the manifest (W&B run id, cursor, ...).
            blocking: Return only after the checkpoint is committed (always so without async).

        Raises:
            CheckpointError: On every rank, when any rank failed; the previous checkpoint is intact.
            ValueError: When ``step`` is already committed.
        """
        self.wait()
        started = time.monotonic()
        tmp = self.directory / f"{step_dirname(step)}.tmp"
        problem: tuple[str, str] | None = None  # (kind, message): one all-gather settles every rank's
        if self.rank == 0:
            try:
                if (exists := self._prepare(step, tmp)) is not None:
                    problem = ("exists", exists)
            except OSError as e:  # every rank must hear it, or they wait at the gather
                problem = ("failed", f"cannot create {tmp}: {e.strerror or e}")
        meta = dict(metadata or {})
        buf = io.BytesIO()
        try:
            sharded, local = split_state(app_state)
            if self._rng is not None:
                local[_RNG_KEY] = self._rng
            torch.save({k: v.state_dict() for k, v in local.items()}, buf)
            meta.setdefault("samplers", {k: {"epoch": v.epoch, "cursor": v.cursor} for k, v in app_state.items()
                                         if hasattr(v, "cursor") and hasattr(v, "epoch")})
        except _FAILED as e:
            problem = problem or ("failed", f"rank {self.rank}: preparing the checkpoint state failed: {e!r}")
        problems = [p for p in self._gather(problem) if p is not None]
        if problems:
            exists = next((msg for kind, msg in problems if kind == "exists"), None)
            if exists is not None:
                raise ValueError(exists)
            self._cleanup(tmp)
            raise CheckpointError(problems[0][1])
        writer = ChecksummedWriter(tmp, self.rank, {local_name(self.rank): buf.getvalue()}, self.thread_count)
        planner = _CachingSavePlanner(self._plan_key)
        self._last_save_step, self._last_save_time = step, time.time()
        if blocking or not self.async_save:
            err: str | None = None
            try:
                dcp.save(sharded, storage_writer=writer, planner=planner, process_group=self._ctl,
                         no_dist=not self.distributed)
                flight = _InFlight(step, tmp, writer, Future(), started, meta)
                self._commit(flight) if self.rank == 0 else None
            except _FAILED as e:
                err = self._failure(e, tmp)
            err = self._broadcast(err if self.rank == 0 else None)
            self._finish(step, err, time.monotonic() - started)
            self.last_block_s = time.monotonic() - started
            return
        future = dcp.async_save(sharded, storage_writer=writer, planner=planner, process_group=self._bg,
                                async_stager=self._stager, no_dist=not self.distributed)
        self._inflight = _InFlight(step, tmp, writer, future, started, meta)
        if self.rank == 0:
            future.add_done_callback(lambda f, flight=self._inflight: self._commit_async(flight))
        self.last_block_s = time.monotonic() - started
        self._warm_state = None  # the first save made the buffers if no warm-up had

    def wait(self) -> None:
        """Waits for the async save in flight, if any, and tells every rank its outcome.

        Raises:
            CheckpointError: When it failed (on every rank).
        """
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        try:
            flight.future.result()
        except _FAILED:
            pass  # rank 0's view below is authoritative
        if self.rank == 0:
            flight.done.wait()
        outcome = self._broadcast((flight.error, flight.save_s) if self.rank == 0 else None)
        self._finish(flight.step, outcome[0], outcome[1])

    def settle(self, timeout_s: float | None = None) -> str:
        """After a crash: waits, bounded and without any collective, for the save in flight.

        :meth:`wait` needs every rank (it broadcasts the outcome); a crashed rank's peers may be
        gone or may never get there. But an async save runs on its own group, and while the
        peers live their writer threads go on with it although their training is stuck: if the
        crashed rank exits at once, the agent ends them all and the save is lost (the job then
        resumes from the save before). So the crashed rank waits for its own part: its writes
        and DCP's finish (every rank's files written), and on rank 0 the commit. A dead peer
        fails DCP's collective as soon as its sockets close; a silent one is waited for at most
        ``timeout_s`` (then the previous checkpoint stands, as before).

        Args:
            timeout_s: The longest wait (default: three times the expected save time, from
                :data:`SETTLE_MIN_S` to :data:`SETTLE_MAX_S`).

        Returns:
            What became of the save, for the log ("" when none was in flight).
        """
        flight = self._inflight
        if flight is None:
            return ""
        if timeout_s is None:
            timeout_s = min(SETTLE_MAX_S, max(SETTLE_MIN_S, 3 * self.estimated_save_s()))
        deadline = time.monotonic() + timeout_s
        what = f"the async save of step {flight.step}"
        try:
            flight.future.result(timeout=timeout_s)
        except _FAILED as e:
            if not flight.future.done():
                return f"{what} still runs after {timeout_s:.0f} s: given up (the previous checkpoint stands)"
            if self.rank != 0:
                self._inflight = None
                return f"{what} failed: {_summary(e)}"
        if self.rank != 0:
            self._inflight = None
            return f"{what}: this rank's part is written (rank 0 commits it)"
        if not flight.done.wait(max(0.0, deadline - time.monotonic())):
            return f"{what} was not committed within {timeout_s:.0f} s: given up"
        self._inflight = None
        if flight.error is not None:
            return f"{what} failed: {flight.error}"
        self._latest = flight.step
        return f"{what} is committed"

    def load_latest(self, app_state: Mapping[str, Any]) -> Manifest | None:
        """Loads the newest verified checkpoint into ``app_state`` (resharding as needed).

        Rank 0 removes stale ``.tmp`` directories, verifies candidates newest first and quarantines
        the ones that fail; its choice is broadcast. Ranks beyond the saved world size, which have
        no saved RNG state, are re-seeded from ``(seed, step, rank)``.

        Every pickle in the checkpoint is loaded without running code (``weights_only``, an
        allow-list for DCP's metadata); one that would need anything else fails verification
        and is quarantined like a corrupt file (see docs/security.md).

        Returns:
            The loaded checkpoint's manifest, or None when there is none (nothing is changed).

        Raises:
            CheckpointError: On every rank, when the chosen checkpoint cannot be loaded after all.
        """
        self.wait()
        choice, err = None, None
        if self.rank == 0:
            try:
                choice = self._choose()
            except OSError as e:  # every rank must hear it, or they wait at the broadcast
                err = f"cannot pick a checkpoint in {self.directory}: {e}"
        choice, err = self._broadcast((choice, err))
        if err is not None:
            raise CheckpointError(err)
        sharded, local = split_state(app_state)
        self._warm_state = app_state
        if choice is None:
            self._estimate_bytes = self._state_bytes_estimate(sharded)
            self._maybe_warm_up()
            return None
        manifest = Manifest.from_json(choice)
        step_dir = self.directory / step_dirname(manifest.step)
        if self._rng is not None:
            local[_RNG_KEY] = self._rng
        # Rank-local state first: a refused file must fail every rank before any state changes.
        saved: Any = {}
        err = None
        if self.rank < manifest.world_size and local:
            try:
                saved = load_pickled(step_dir / local_name(self.rank), what=local_name(self.rank),
                                     extra_globals=self.safe_globals)
                if not isinstance(saved, dict):
                    err = f"{local_name(self.rank)} holds a {type(saved).__name__}, not a state dict"
            except _FAILED as e:
                err = f"rank {self.rank}: {e}"
        if (err := self._gather_errors(err)) is not None:
            raise CheckpointError(f"cannot resume from {step_dir}: {err}")
        try:
            dcp.load(sharded, storage_reader=RetryingReader(step_dir), planner=SafeLoadPlanner(self.safe_globals),
                     process_group=self._ctl, no_dist=not self.distributed)
        except CheckpointException as e:  # DCP raises it on every rank
            raise CheckpointError(f"cannot resume from {step_dir}: {_summary(e)}") from e
        for key, obj in local.items():
            if key in saved:
                obj.load_state_dict(saved[key])
            elif callable(getattr(obj, "reseed", None)):
                obj.reseed(manifest.step, self.rank)
        self._latest = self._last_save_step = manifest.step
        self.loaded_manifest = manifest
        self._maybe_warm_up()
        if self.rank == 0:
            log.log(NOTE, "checkpoint: resumed from %s (saved at world size %d, now %d)",
                     step_dir, manifest.world_size, self.world_size)
        return manifest

    def close(self) -> None:
        """Flushes the save in flight (call before exit on every rank).

        The staging buffers stay (a later save reuses them); they go with the checkpointer.
        """
        self.wait()
        self._join_pruner()
        if self._stager is not None:
            self._stager.join_warm_up()

    def _maybe_warm_up(self) -> None:
        """Starts making the staging buffers in the background, once, when the state is complete.

        "Complete" means every optimizer has its state: before its first step an optimizer has
        none, and asking DCP for its state dict then runs a zero-lr step to create it, which
        changes the training (Adam's step count). Until then, wait; :meth:`should_save` asks
        again every step. Optimizers that never hold state (plain SGD) get their buffers from
        the first save instead. Purely local: no collective, nothing that can fail a save.
        """
        if self._stager is None or self._warm_state is None:
            return
        if any(isinstance(v, torch.optim.Optimizer) and not v.state for v in self._warm_state.values()):
            return
        app_state, self._warm_state = self._warm_state, None
        try:
            sharded, _ = split_state(app_state)
            self._stager.warm_up({k: v.state_dict() for k, v in sharded.items()})
        except Exception as e:  # an optimization only: the first save makes the buffers then
            log.warning("checkpoint: cannot warm up the staging buffers (%r); the first save makes them", e)

    # --- internals -----------------------------------------------------------------------
    def _prepare(self, step: int, tmp: Path) -> str | None:
        final = self.directory / step_dirname(step)
        if final.exists():
            return f"checkpoint {final} already exists; a step is saved once (never overwritten)"
        if tmp.is_symlink():
            tmp.unlink()
        elif tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(mode=0o700)  # fresh: DCP writes into this one, not into anything planted
        return None

    def _commit_async(self, flight: _InFlight) -> None:
        try:
            flight.future.result()
            self._commit(flight)
        except _FAILED as e:
            flight.error = self._failure(e, flight.tmp)
        finally:
            flight.done.set()

    def _commit(self, flight: _InFlight) -> None:
        """Rank 0: manifest, fsync, rename, ``latest``, prune. The files are all written."""
        flight.save_s = time.monotonic() - flight.started
        kill_point("before_manifest", self.rank)
        manifest = Manifest(step=flight.step, world_size=self.world_size, files=flight.writer.files,
                            metadata=flight.metadata, torch_version=torch.__version__,
                            created_time=time.time(), save_s=round(flight.save_s, 4))
        _write_atomic(flight.tmp / MANIFEST_NAME, manifest.to_json())
        fenced = succession.fence_reason(os.environ)
        if fenced is not None:   # a newer rendezvous epoch owns the job: never commit over it
            raise CheckpointError(f"step {flight.step} not committed: {fenced}")
        kill_point("before_rename", self.rank)
        final = self.directory / step_dirname(flight.step)
        retry_transient(os.rename)(flight.tmp, final)
        fsync_dir(self.directory)
        kill_point("before_latest", self.rank)
        _write_atomic(self.directory / LATEST_NAME, final.name + "\n")
        size = sum(f.size for f in manifest.files)
        log.log(NOTE, "checkpoint: saved %s (%.1f MB, %d files) in %.2fs", final.name, size / 1e6,
                len(manifest.files), flight.save_s)
        self._prune(flight.step)

    def _finish(self, step: int, err: str | None, save_s: float) -> None:
        if err is not None:
            raise CheckpointError(err)
        self._latest, self.last_save_s = step, save_s

    def _failure(self, exc: BaseException, tmp: Path) -> str:
        """Rank 0: removes the torn ``.tmp`` and describes the failure."""
        if _has_errno(exc, errno.ENOSPC):
            free = shutil.disk_usage(self.directory).free
            msg = f"checkpoint save to {tmp} failed: disk full ({free} bytes free)"
        else:
            msg = f"checkpoint save to {tmp} failed: {_summary(exc)}"
        self._cleanup(tmp)
        good = self._latest
        msg += f"; the last good checkpoint {step_dirname(good)} is intact" if good is not None \
            else "; there is no earlier checkpoint"
        log.error("%s", msg)
        return msg

    def _cleanup(self, tmp: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _committed_steps(self) -> list[int]:
        return sorted(s for d in self.directory.iterdir() if (s := parse_step(d.name)) is not None)

    def _prune(self, newest: int) -> None:
        protect = {newest}
        pointed, _ = read_latest(self.directory)
        if pointed is not None and (pointed_step := parse_step(pointed)) is not None:
            protect.add(pointed_step)
        names = [self.directory / step_dirname(step) for step in steps_to_prune(
            self._committed_steps(), keep_last=self.keep_last, keep_every=self.keep_every, protect=protect)]
        self._delete_later(names)

    def _delete_later(self, paths: list[Path]) -> None:
        """Renames ``paths`` (and all but the newest quarantined) aside; deletes them on a thread."""
        paths = paths + [self.directory / n for n in quarantined_to_prune(d.name for d in self.directory.iterdir())]
        doomed = []
        for path in paths:
            trash = path.with_name(f"{path.name}.deleting")
            try:
                os.rename(path, trash)  # never leave a half-deleted step-NNNNNN behind
            except OSError as e:  # retention is housekeeping: the save itself is committed
                log.warning("checkpoint: cannot prune %s: %s", path.name, e.strerror or e)
                continue
            doomed.append(trash)
            log.info("checkpoint: pruned %s", path.name)
        if not doomed:
            return
        # deleting gigabytes takes a while on ext4/Lustre: off the save's critical path
        self._join_pruner()
        self._pruner = threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed],
                                        name="hpc-ckpt-prune", daemon=True)
        self._pruner.start()

    def _join_pruner(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def _choose(self) -> str | None:
        """Rank 0: the newest verified checkpoint's manifest (JSON), quarantining bad ones."""
        if not self.directory.exists():
            return None
        self._join_pruner()
        for d in self.directory.iterdir():
            if is_tmp_dir(d.name) or d.name.endswith(".deleting"):
                log.warning("checkpoint: removing unfinished %s", d.name)
                d.unlink() if d.is_symlink() else shutil.rmtree(d, ignore_errors=True)
        latest, problem = read_latest(self.directory)
        if problem is not None:  # advisory: the newest step that verifies is used either way
            log.warning("checkpoint: ignoring the latest pointer: %s; resuming from the newest step that verifies",
                        problem)
        quarantined: list[str] = []
        chosen: Manifest | None = None
        for step in reversed(self._committed_steps()):
            step_dir = self.directory / step_dirname(step)
            manifest, reason = verify(step_dir, checksums=self.verify_checksums)
            if reason is None and manifest is not None:
                reason = unpickling_problem(step_dir, manifest, self.safe_globals)
            if reason is None and manifest is not None:
                chosen = manifest
                break
            bad = quarantine_name(step_dir, time.time())
            os.rename(step_dir, bad)
            quarantined.append(bad.name)
            log.error("checkpoint: %s failed verification (%s); quarantined as %s", step_dir.name, reason, bad.name)
        if chosen is not None:
            name = step_dirname(chosen.step)
            if quarantined:
                log.warning("checkpoint: resuming from the earlier %s instead", name)
            if latest != name:
                self._point_latest(name)
        else:
            if quarantined:
                log.error("checkpoint: no checkpoint verified (quarantined: %s); starting from step 0",
                          ", ".join(quarantined))
            if latest is not None or problem is not None:
                self._point_latest(None)  # it names nothing that can be resumed
        self._delete_later([])
        return chosen.to_json() if chosen is not None else None

    def _point_latest(self, name: str | None) -> None:
        """Rank 0, on resume: repoints (or removes) the advisory ``latest`` pointer; never fatal."""
        path = self.directory / LATEST_NAME
        try:
            if name is not None:
                _write_atomic(path, name + "\n")
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("checkpoint: cannot update %s: %s", path, e.strerror or e)

    def _state_bytes_estimate(self, sharded: Mapping[str, Any]) -> int:
        local = sum(p.numel() * p.element_size() for v in sharded.values() if isinstance(v, _ModuleState)
                    for p in v.model.parameters())
        local *= 3 if any(isinstance(v, _OptimizerState) for v in sharded.values()) else 1
        if self._ctl is None:
            return local
        total = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(total, group=self._ctl)
        return int(total.item())


def _prepare_directory(directory: Path) -> str | None:
    """Rank 0: makes sure ``directory`` is a directory, creating it and its missing parents private.

    Directories the runtime creates get mode 0700, like the job directory: a checkpoint
    decides what every rank loads, so nobody else may write there. An existing directory keeps
    its mode; a warning says when others can write to it.

    Returns:
        None, or one line saying what is wrong (the caller raises it on every rank).
    """
    try:
        if directory.is_symlink() and not directory.exists():
            return f"checkpoint directory {directory} is a dangling symlink; remove it or choose another directory"
        if directory.exists():
            if not directory.is_dir():
                return (f"checkpoint directory {directory} exists and is not a directory; move it away or "
                        "choose another checkpoint directory")
            mode = directory.stat().st_mode
            if mode & 0o022:
                who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002)) if mode & bit)
                log.warning("checkpoint: %s is writable by %s, who can choose what this job resumes from "
                            "(chmod go-w it; see docs/security.md)", directory, who)
            return None
        missing = []
        parent = directory
        while not parent.exists() and not parent.is_symlink():
            missing.append(parent)
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot create checkpoint directory {directory}: {parent} is not a directory"
        for path in reversed(missing):
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:  # made by someone else meanwhile: checked below
                pass
        if not directory.is_dir():
            return f"cannot create checkpoint directory {directory}: it is not a directory"
    except OSError as e:
        return f"cannot create checkpoint directory {directory}: {e.strerror or e}"
    return None
