"""``Session``: the few lines that make a user's own training loop survive a cluster.

::

    with Session(seed=0) as s:
        model = s.wrap(MyModel(), fsdp=False)
        opt = torch.optim.AdamW(model.parameters())
        start = s.restore(model=model, optim=opt, sampler=sampler)
        for step in s.steps(start, max_steps):
            loss = train_step(...)
            s.log(loss=loss.item())
        s.finish()

The session initializes the process group (nccl on CUDA, gloo otherwise, with a CPU gloo
group for control traffic), picks the CUDA device from LOCAL_RANK, wraps the model (DDP or
FSDP2), restores the latest verified checkpoint, and at every step boundary does what the
job needs: reduce and log metrics (rank 0 to W&B, everyone else to a null sink), save
checkpoints on schedule, and run the preemption protocol (all ranks agree, save, record
the reason, exit cleanly). It tears everything down on every exit path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hpc.contract import components, interval, jobdir
from hpc.contract.components import CheckpointConfig, WandbConfig
from hpc.contract.jobspec import JobSpec
from hpc.contract.parallel import MeshError, ParallelDims, resolve
from runtime.console import NOTE
from runtime.env import WorkerEnv
from runtime.checkpoint.auto_interval import AutoInterval
from runtime.events import NULL_RECORDER, SessionRecorder
from runtime.liveness import hang_log, posted, stragglers
from runtime.liveness.deadline import USER_PHASE_S, collective_timeout_s, policy_for
from runtime.liveness.heartbeat import NullHeartbeat, writer_for
from runtime.liveness.stragglers import StragglerWatch
from runtime.parallel import mesh as device_mesh
from runtime.worker import recovery
from runtime.worker.metric_rows import Row, Schema
from runtime.worker.metrics import LAST_LOSS, BackgroundSink, NullSink
from runtime import stop_deadline
from runtime.preemption import DEFAULT_GRACE_S, Decision, PreemptionWatcher, StopRequest, decide
from runtime.worker.progress import ProgressMeter
from runtime.stopping import STOP_KINDS
from runtime.worker.wandb_sink import make_sink, run_metadata

log = logging.getLogger("hpc.session")
CALIBRATE_AFTER_STEPS = 20      # measure step time over these, then fix the poll interval
POLL_TARGET_S = 0.1             # agree on warnings about this often (in wall time)
MAX_POLL_EVERY = 50
PROGRESS_EVERY_S = 2.0          # rank 0 writes progress.json this often (HPC_PROGRESS_EVERY_S)
LINE_MIN_S = 1.0                # console progress: a line per log step, at most one a second,
LINE_MAX_S = 30.0               # and at least one this often (a slow loop, a large log_every)


def progress_interval(configured: float | None) -> float:
    """Seconds between rank 0's ``progress.json`` writes: ``HPC_PROGRESS_EVERY_S`` where set,
    ``0`` meaning every step (it once fell back to the 2-s default, being falsy), else 2 s."""
    return PROGRESS_EVERY_S if configured is None else max(0.0, float(configured))


class Session:
    """Ties the process group, model wrapping, checkpoints, metrics and preemption together.

    Args:
        seed: Base seed; each rank seeds python/numpy/torch with ``seed`` (same model init
            everywhere; data order comes from the sampler, not from per-rank RNG).
        job_dir: Job directory (default: ``HPC_JOB_DIR`` set by the launcher, else ./job).
        spec: The job's spec (default: ``JOB_DIR/jobspec.json`` when present).
        log_every: Reduce and log metrics every N steps.
        timeout_s: Collective timeout for the process groups.
        env: Environment mapping (tests pass dicts).
        parallel: The mesh degrees (tensor, pipeline, data parallel; default: the job spec's
            ``--tp``/``--pp``/``--dp-replicate``/``--dp-shard``, else plain data parallel). A
            script's own degrees must agree with the spec's where that sets any.
    """

    def __init__(self, *, seed: int = 0, job_dir: str | Path | None = None, spec: JobSpec | None = None,
                 log_every: int = 10, timeout_s: float = 600.0,
                 env: Mapping[str, str] | None = None, parallel: ParallelDims | None = None) -> None:
        self.env = WorkerEnv.from_env(env)
        self.job_dir = Path(job_dir or self.env.job_dir or "job").absolute()
        spec_path = self.job_dir / jobdir.JOBSPEC
        self.spec = spec or (JobSpec.load(self.job_dir) if spec_path.exists() else None)
        self.seed = seed
        self.parallel = _degrees(parallel, self.spec)
        self.mesh: Any = None                # runtime.parallel.mesh.MeshPlace with a mesh
        self.log_every = max(1, log_every)
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cpu")
        self.cpu_group: Any = None
        self.stopped: StopRequest | None = None
        self.step = 0
        self._pending_metrics: dict[str, list[float]] = {}
        self._row_in_flight: tuple[int, Row] | None = None   # (step, its reduction)
        self._metrics = Schema()             # the metric names every rank reduces (agreed)
        self._row_logged: int | None = None  # the last row's step this process gave its sink
        self._metric_ops: dict[str, str] = {}
        self._app_state: dict[str, Any] = {}
        self._watcher: PreemptionWatcher | None = None
        self._checkpointer: Any = None
        self._sink: Any = None
        self._progress: Any = None
        self._started = time.time()
        self._progress_written = 0.0
        self._line_at = 0.0                  # when rank 0 last printed a progress line (monotonic)
        self._poll_every = 1
        self._start_step = 0
        self._owns_group = False
        self._rec: Any = NULL_RECORDER      # events.jsonl (runtime.events), from start() on
        self._interval: AutoInterval | None = None   # --checkpoint-interval auto, with the recorder
        self._beat: Any = NullHeartbeat()
        self._timeout_note = ""
        self._pace: Any = None               # runtime.worker.ddp.PaceProbe of the wrapped DDP model
        self._stragglers: Any = None         # rank 0: runtime.liveness.stragglers.StragglerWatch
        self._slow_s = _test_slowdown(os.environ)
        self._recovery: Any = recovery.Restart()   # how a lost peer is recovered from (runtime.worker.recovery)
        self._origin: int | None = None      # the loop's first step (a joiner takes the members')
        self._grow_due = False               # the agreement said a joiner waits (in-process recovery)
        self._progress_total = 0

    # --- lifecycle -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of the global batch it reads (the
        ranks of one TP group or pipeline read the same)."""
        return self.mesh.dp_rank if self.mesh is not None else self.env.rank

    @property
    def dp_size(self) -> int:
        """The data-parallel width (the world size without a mesh)."""
        return self.mesh.dp_size if self.mesh is not None else self.env.world_size

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def restart_count(self) -> int:
        return self.env.restart_count

    @property
    def slurm_job_id(self) -> str:
        return self.env.slurm.job_id

    def __enter__(self) -> Session:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(error=exc)

    def start(self) -> None:
        """Initializes the process group, device, seeds, preemption watcher and sinks."""
        import random

        import numpy as np

        # The node's stall watchdog reads this from now on (phase start-up, a long budget).
        self._beat = writer_for(self.env.job.heartbeat_dir, rank=self.rank,
                                local_rank=self.env.local_rank, restart=self.restart_count)
        self.timeout = self._collective_timeout()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.env.local_rank)
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        fresh = not dist.is_initialized()   # a script's own group: the restart path
        if fresh:
            if "MASTER_ADDR" not in os.environ:   # plain `python script.py`: a world of one
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            self._recovery = recovery.for_session(self, backend)
        # A joiner holds no rank yet: it records from its join on, as the rank it is given.
        if not self._recovery.joining:
            self._record_as(self.rank, self.world_size)
        if fresh:
            self._recovery.init_group(self, backend)
            self._owns_group = True
        self.cpu_group = self._recovery.cpu_group(backend, self.timeout)
        self._rec.emit("rendezvous", world_size=self.world_size)
        _show_hpc_logs(self.is_rank0)
        self._build_mesh()
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.manual_seed(self.seed)
        end = self.env.job.job_end_time or None
        grace = self.env.job.grace_s or DEFAULT_GRACE_S
        # The agreement runs on its own gloo group: on the training group its all-reduce
        # would queue behind (and delay) the model's gradient all-reduces.
        control = dist.new_group(backend="gloo", timeout=self.timeout) if self.world_size > 1 else None
        self._watcher = PreemptionWatcher.from_config(
            self.spec.preemption if self.spec else components.PREEMPTION, control,
            job_end_time=end, grace_s=grace, under_slurm=self.env.slurm.active)
        self._watcher.install()
        self._watcher.flag = self._recovery.joiner_flag()   # agreed with the signals
        if self.is_rank0:
            log.info("session: rank 0 of %d, backend %s, device %s, restart %d, allocation %d",
                     self.world_size, backend, self.device, self.restart_count, self.env.allocation)
            log.info("session: %s", self._timeout_note or
                     f"collective timeout {self.timeout.total_seconds():.0f}s")

    def _build_mesh(self) -> None:
        """The job's device mesh, when it asks for more than plain data parallel.

        A world that cannot form the mesh (the survivors of a node loss hold a part of a
        pipeline or of a TP group) is no place to train: under hpc's launcher every rank
        ends cleanly and rank 0 records a node failure, which requeues the job for a whole
        allocation; a script run without hpc gets the error.
        """
        if self.parallel.trivial:
            return
        try:
            mesh = resolve(self.parallel, self.world_size, self.env.local_world_size)
        except MeshError as e:
            if self.spec is None:
                raise
            reason = f"no mesh on this allocation: {e}; requeued for a whole allocation"
            if self.is_rank0:
                log.error("session: %s", reason)
                jobdir.write_atomic(self.job_dir / jobdir.EXIT_INTENT, _json({
                    "allocation": self.env.allocation, "kind": "node_failure", "step": None,
                    "reason": reason, "time": time.time()}))
            self.close()
            raise SystemExit(0) from None
        self.mesh = device_mesh.build(mesh, self.rank, self.device.type)
        if self.is_rank0:
            log.info("session: mesh %s (data parallel %d of %d ranks)", mesh.describe(), mesh.dp,
                     self.world_size)

    def close(self, error: BaseException | None = None) -> None:
        """Flushes any save in flight, closes sinks and the process group (every exit path)."""
        self._rec.closing(error, self.step, self._sink)
        if error is not None:
            self._write_progress(force=True)   # the crash's last step, for outcomes.jsonl
        self._beat.enter("exit")
        if error is not None and self._checkpointer is not None:
            self._settle_save_in_flight()
        try:
            if error is None:
                self._log_row_in_flight()   # after an error a peer may be gone: the row is lost
            if self._checkpointer is not None and error is None:
                self._checkpointer.wait()
        finally:
            if self._watcher is not None:
                if error is None:
                    self._watcher.drain()
                self._watcher.uninstall()
            if self._sink is not None:
                self._sink.close(exit_code=0 if error is None else 1)
            if self._owns_group and dist.is_initialized():
                if error is None:
                    dist.barrier(group=self.cpu_group)
                dist.destroy_process_group()
            self._recovery.close(finished=error is None)
            self._rec.close(self._checkpointer, error, self.step)
            self._beat.close()

    def _settle_save_in_flight(self) -> None:
        """After a crash, keeps the async save in flight if it can still finish (bounded, no
        collective: :meth:`Checkpointer.settle`); else the job resumes from the save before."""
        try:
            note = self._checkpointer.settle()
        except Exception as e:  # noqa: BLE001 - the crash is what the user must see
            note = f"waiting for the save in flight failed: {e!r}"
        if note:
            log.warning("session: after the error: %s", note)

    @contextmanager
    def phase(self, name: str, *, budget_s: float | None = None) -> Iterator[None]:
        """Marks a long stretch of the loop (evaluation, a data reload...) for the stall watch.

        Inside it, this rank may go without progress for the phase's budget instead of the
        deadline of an ordinary step: ``eval`` and ``save`` have their own budgets
        (:data:`runtime.liveness.deadline.PHASE_BUDGETS_S`), another name gets 30 minutes
        unless ``budget_s`` says otherwise. Ranks waiting for this one (here or on other
        nodes) are not declared stuck while it lasts. Phases nest; no collective is involved.

        Args:
            name: The phase, e.g. ``"eval"``.
            budget_s: Seconds this phase may take on this rank.
        """
        self._beat.enter(name, budget_s)
        self._recovery.busy(time.time() + (budget_s or USER_PHASE_S))
        try:
            yield
        finally:
            self._beat.leave()
            self._recovery.busy(None)

    def _report_stalls(self) -> None:
        """Rank 0 logs the stalls the node watchdogs acted on (``hangs.jsonl``) as run events."""
        if not self.is_rank0:
            return

        for h in hang_log.take_unreported(self.job_dir):
            fields = {"node": h.node, "suspect_rank": h.suspect_rank, "suspect_node": h.suspect_node,
                      "reason": h.reason, "stacks": h.stacks, "allocation": h.allocation,
                      "stalled_at_step": h.step}
            self.event("hang", step=self.step, **{k: v for k, v in fields.items() if v not in (None, "")})

    def _report_stragglers(self) -> None:
        """Rank 0 names ranks persistently slower than the others (log, W&B, stragglers.jsonl)."""
        for s in self._stragglers.check(self.step):
            log.warning("straggler: %s (reported, not restarted)", s.summary())
            self.event("straggler", step=self.step, rank=s.rank, node=s.node, node_rank=s.node_rank,
                       compute_s=round(s.compute_s, 4), median_s=round(s.median_s, 4))
            try:
                stragglers.append(self.job_dir, s)
            except OSError as e:
                log.warning("cannot record the straggler: %s", e)

    def _collective_timeout(self) -> timedelta:
        """The process groups' timeout, coherent with the stall watch.

        When the launcher's stall watch is on, it notices a stall long before any collective
        timeout, and the timeout is only the backstop: it must then outlast the longest phase
        a peer may legitimately be in while others wait (a rank-0 evaluation), or a healthy
        run would fail in a barrier. Without the watch the given ``timeout_s`` stands.
        """
        policy = policy_for(self.spec.liveness) if self.spec is not None else None
        if isinstance(self._beat, NullHeartbeat) or policy is None:
            return self.timeout

        wanted = timedelta(seconds=collective_timeout_s(policy))
        if wanted > self.timeout:
            self._timeout_note = (f"collective timeout {wanted.total_seconds():.0f}s (asked "
                                  f"{self.timeout.total_seconds():.0f}s): it must outlast the longest "
                                  f"phase budget ({policy.longest_s:.0f}s); the stall watch catches "
                                  "stalls first")
            return wanted
        return self.timeout

    # --- records ----------------------------------------------------------------------
    def _record_as(self, rank: int, world: int) -> None:
        """Records (events.jsonl, rank 0) and decides the auto interval (every rank) as ``rank``."""
        self._rec = SessionRecorder(self.job_dir, rank=rank, allocation=self.env.allocation,
                                    restart=self.restart_count, world_size=world)
        self._interval = AutoInterval(self.job_dir, rank=rank, key=self._rec.key, emit=self._rec.emit)

    # --- model ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, *, fsdp: bool = False, blocks: Any = None,
             mixed_precision: bool | None = None, reproducible_resume: bool = True,
             find_unused_parameters: bool = False, pace_hook: bool = True,
             tp_plan: Mapping[str, Any] | None = None) -> torch.nn.Module:
        """Moves ``model`` to the device and wraps it in DDP, or FSDP2 (``fully_shard``).

        With a mesh (``--tp``, ``--dp-replicate``...; see :mod:`runtime.parallel`) the model is
        split by ``tp_plan`` over the TP ranks and sharded with FSDP2 over the data-parallel
        ranks, whatever ``fsdp`` says.

        Args:
            model: The model.
            fsdp: Shard with FSDP2 instead of replicating with DDP.
            blocks: For FSDP2, the submodules to shard one by one (e.g. transformer blocks).
            mixed_precision: bf16 compute with fp32 reductions under FSDP2 (default: on CUDA).
            reproducible_resume: DDP only: keep one gradient-bucket layout for the whole run,
                so a resumed run is bit-identical to an uninterrupted one at any world size
                (the buckets then follow the parameters' order; see ``runtime.worker.ddp``).
            find_unused_parameters: DDP only: for a model that leaves some parameters out of
                the loss (DDP's option of that name; it costs a graph walk and an all-reduce
                per step). Without it such a model stops at its second step with torch's
                error, which names this option.
            pace_hook: DDP only: time this rank's forward and backward pass on sampled steps
                for the straggler watch (autograd hooks during those steps only; DDP's comm
                hook stays free for yours). False: straggler reports time the whole step
                body, where DDP hides a slow rank.
            tp_plan: With ``--tp``: module names (``fnmatch`` patterns, ``"blocks.*.q"``) to
                ``"colwise"``, ``"rowwise"`` or a torch ``ParallelStyle``.
        """
        from runtime.worker import ddp as ddp_build

        model = model.to(self.device)
        self._pace = None
        if fsdp or self.mesh is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            self._recovery = self._recovery.sharded(mesh=self.mesh is not None)

            mp = mixed_precision if mixed_precision is not None else self.device.type == "cuda"
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if mp else MixedPrecisionPolicy()
            if self.mesh is not None:
                from runtime.parallel import apply

                if self.mesh.mesh.pp > 1:
                    raise ValueError(f"the job runs {self.mesh.mesh.pp} pipeline stages (--pp): build "
                                     "this rank's stage with s.pipeline(model, split=..., loss_fn=...)")
                apply.tensor_parallel(model, self.mesh, tp_plan)
                apply.fully_shard(model, self.mesh, blocks or [], policy)
                return model
            for block in blocks or []:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            return model
        ddp = ddp_build.SessionDDP(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters, **self._recovery.ddp_options())
        if (reproducible_resume or self._recovery.fixes_buckets) and not ddp_build.fix_bucket_layout(ddp) \
                and not find_unused_parameters and self.is_rank0:
            log.warning("DDP: this torch cannot fix the gradient-bucket layout; a resumed run may "
                        "differ from an uninterrupted one in the last bits")
        if self.world_size > 1 and pace_hook:
            self._pace = ddp_build.PaceProbe(list(ddp.parameters()))   # straggler accounting
        return ddp

    def pipeline(self, model: torch.nn.Module, *, split: Any, loss_fn: Any, microbatches: int,
                 schedule: str = "1f1b", blocks: Any = None, tp_plan: Mapping[str, Any] | None = None,
                 mixed_precision: bool | None = None) -> Any:
        """This rank's pipeline stage of ``model`` (``--pp``), split by ``tp_plan`` and sharded
        with FSDP2 over the data-parallel ranks as :meth:`wrap` does.

        Args:
            model: The whole model (built the same on every rank).
            split: ``split(model, stage, num_stages)`` returns the module of that stage: the
                model with the other stages' layers dropped, parameter names kept.
            loss_fn: ``loss_fn(output, target)`` on the last stage, per micro-batch.
            microbatches: Micro-batches per step (they replace gradient accumulation).
            schedule: ``"gpipe"`` or ``"1f1b"``.
            blocks: FSDP2 units, as for :meth:`wrap` (those the stage kept are used).
            tp_plan: As for :meth:`wrap`.
            mixed_precision: As for :meth:`wrap`.

        Returns:
            A :class:`runtime.parallel.pipeline.Pipeline`: ``.module`` (the stage, for the
            optimizer and :meth:`restore`) and ``.step(inputs, targets)`` (the step's loss).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from runtime.parallel import apply
        from runtime.parallel.pipeline import Pipeline

        if self.mesh is None or self.mesh.mesh.pp == 1:
            raise ValueError("s.pipeline() needs pipeline stages: --pp N (or Session(parallel="
                             "ParallelDims(pp=N))) with N >= 2; without, use s.wrap(model)")
        stage = split(model, self.mesh.coords["pp"], self.mesh.mesh.pp).to(self.device)
        kept = {id(m) for m in stage.modules()}
        mp = mixed_precision if mixed_precision is not None else self.device.type == "cuda"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mp else MixedPrecisionPolicy()
        apply.tensor_parallel(stage, self.mesh, tp_plan)
        apply.fully_shard(stage, self.mesh, [b for b in blocks or [] if id(b) in kept], policy)
        return Pipeline(stage, self.mesh, loss_fn=loss_fn, microbatches=microbatches,
                        schedule=schedule, device=self.device)

    # --- checkpoints ---------------------------------------------------------------------
    def restore(self, **state: Any) -> int:
        """Registers the training state and loads the latest verified checkpoint into it.

        Args:
            **state: Named parts of the state: ``model=``, ``optim=``, and any object with
                ``state_dict``/``load_state_dict`` (scheduler, sampler, a counter...).

        Returns:
            The step to start at (0 when there is no checkpoint).
        """
        from runtime.checkpoint import Checkpointer

        spec = self.spec
        self._app_state = _app_state(state)
        self._recovery.attach(self._app_state)
        self._checkpointer = Checkpointer.from_config(
            spec.checkpoint if spec
            else CheckpointConfig(directory=str(self.job_dir / jobdir.CHECKPOINTS)), seed=self.seed)
        self._recovery.bind(self._checkpointer)
        received = self._recovery.receive()   # a joiner: the state from the members' memory
        if received is not None:
            return received
        self._rec.emit("restore_begin")
        with self.phase("restore"):
            manifest = self._checkpointer.load_latest(self._app_state)
        self.step = manifest.step if manifest else 0
        self._rec.restored(self._checkpointer, self.step, manifest is not None)
        if self._interval is not None:   # --checkpoint-interval auto[:MTBF]: decided now (all ranks)
            self._interval.restored(self._checkpointer, self.step,
                                    interval.effective(spec.checkpoint_interval, spec.checkpoint_every_min)
                                    if spec else interval.AUTO)
        self._checkpointer.agree_schedule()   # tuned from rank 0's reading of the history
        meta = dict(manifest.metadata) if manifest else {}
        self._ensure_sink(resume_step=self.step if manifest else None, run_id=meta.get("wandb_run_id"),
                          check_written=manifest is not None)
        if manifest:
            self.event("resumed", step=self.step, world_size=self.world_size,
                       saved_world_size=manifest.world_size, allocation=self.env.allocation,
                       restart=self.restart_count)
        self._report_stalls()
        return self.step

    def save(self, *, blocking: bool = True) -> None:
        """Saves a checkpoint of the registered state at the current step (all ranks)."""
        assert self._checkpointer is not None, "call restore() before save()"
        with self.phase("save"):
            self._recovery.at_save(self.step)
            self._checkpointer.save(self.step, self._app_state, metadata=self._metadata(), blocking=blocking)
        if self._rec.saved(self._checkpointer, self.step) and self._interval is not None:
            self._interval.committed(self._checkpointer)   # the first measured save decides again

    def _metadata(self) -> dict[str, Any]:
        return {"wandb_run_id": getattr(self._sink, "run_id", None), "world_size": self.world_size,
                "mesh": self.mesh.mesh.describe() if self.mesh is not None else None,
                "allocation": self.env.allocation, "slurm_job_id": self.slurm_job_id}

    # --- the loop ------------------------------------------------------------------------
    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Yields step indices ``start .. stop-1``; handles each step's boundary after it.

        After the body of step ``k`` (so ``k + 1`` steps are done): metrics are reduced and
        logged, a checkpoint is saved if due, and the preemption agreement runs. When a stop
        is agreed the generator saves (deadline permitting), records the exit intent and
        ends; :attr:`stopped` then says why.
        """
        self._start_step = start
        if self._origin is None:   # a joiner has the members' (their step-boundary collectives)
            self._origin = start
        origin = self._origin
        self._rec.loop_start(start)
        self._progress_total = stop
        if self.is_rank0:
            self._progress = self._meter(stop, start)
            self._line_at = time.monotonic()
        step_times: list[float] = []
        self._beat.set_base("step")
        if self.is_rank0 and not isinstance(self._beat, NullHeartbeat) and self.world_size > 1:
            self._stragglers = StragglerWatch(self.job_dir, self.env.allocation)
        tick = time.perf_counter()
        step = start
        while step < stop:
            timed = self._pace is not None and self._pace.arm(tick)
            if self._slow_s:
                time.sleep(self._slow_s)   # HPC_TEST_SLOW_NODE: a slow node, for the tests
            self._recovery.begin(step)
            yield step
            now = time.perf_counter()
            recovered = self._recovery.after_body(step, now - tick)   # a peer lost in the step
            if recovered is not None:
                step, tick = recovered, time.perf_counter()
                continue
            self.step = step + 1
            done = self.step - origin
            if done <= CALIBRATE_AFTER_STEPS:    # kept only until the interval is fixed
                step_times.append(now - tick)
            # The first step (compilation, warm-up) is no sample of an ordinary one. Work
            # before DDP's reduction waits on the others (its backward pass, on sampled steps;
            # without DDP the whole body) tells a straggler (runtime.liveness.stragglers).
            compute = None
            if self._pace is None:
                compute = now - tick
            elif timed:
                grads_at = self._pace.take()
                compute = grads_at - tick if grads_at is not None else None
            self._beat.step_done(self.step, now - tick if done > 1 else None, compute)
            tick = now
            try:
                self._recovery.after_step(self.step)
                if self._boundary(start, stop, done, step_times):
                    return
                if self._grow_due and self.step < stop:
                    self._grow_due = False
                    step = self._recovery.grow()
                    tick = time.perf_counter()
                    continue
            except (RuntimeError, CheckpointException) as e:   # DCP's is a BaseException
                if not self._recovery.survives(e):
                    raise
                step = self._recovery.recover_at_boundary(e)
                tick = time.perf_counter()
                continue
            step += 1
        self._rec.flush_steps()
        if self._checkpointer is not None:
            self._checkpointer.wait()
            if self._checkpointer.latest_step() != self.step:
                self.save(blocking=True)

    def _boundary(self, start: int, stop: int, done: int, step_times: list[float]) -> bool:
        """The step boundary's bookkeeping and agreements after ``self.step`` steps; True:
        a stop was agreed (the loop ends)."""
        self._recovery.settle(self._posted_waits())   # waits this rank can leave when a peer is lost
        if self._stragglers is not None and self._stragglers.due():
            self._report_stragglers()
        self._rec.step_done(self.step)
        self._end_of_step(last=self.step == stop)
        if done == CALIBRATE_AFTER_STEPS:
            self._poll_every = self._agree_poll_interval(step_times)
        request = None
        if self._watcher is not None and done % self._poll_every == 0:
            request = self._watcher.poll()
            self._grow_due = self._watcher.flagged   # a joiner waits (only in-process recovery flags)
        if request is not None and self.step < stop:
            self._stop(request)
            return True
        if request is not None and self.is_rank0:   # the work is done: finish, no requeue
            log.log(NOTE, "%s arrived at the last step: finishing instead of stopping",
                    request.signal_name)
        if self._checkpointer is not None and self.step < stop \
                and self._checkpointer.should_save(self.step, timed=done % self._poll_every == 0):
            self.save(blocking=False)
        return False

    def _posted_waits(self) -> list[Any]:
        """The collectives this rank posted and waits for at a step boundary (the metric row's
        reduction, the preemption agreement's)."""
        works = list(self._row_in_flight[1].works) if self._row_in_flight else []
        pending = getattr(self._watcher, "_pending", None)
        return works + ([pending] if pending is not None else [])

    def _meter(self, total: int, start: int) -> ProgressMeter:
        """Rank 0's progress meter from ``start`` to ``total`` steps."""
        return ProgressMeter(total_steps=total, start_step=start, every_s=LINE_MAX_S)

    def _agree_poll_interval(self, step_times: list[float]) -> int:
        """How many steps between preemption agreements, the same on every rank.

        One agreement per step is cheap for long steps but measurable for steps of a few
        milliseconds on busy CPUs; reacting within ~POLL_TARGET_S is all a warning needs (it
        comes tens of seconds before the kill). Rank 0's median step time decides.
        """
        import statistics

        median = statistics.median(step_times[1:] or step_times)
        every = max(1, min(MAX_POLL_EVERY, int(POLL_TARGET_S / max(median, 1e-6))))
        if self.world_size > 1:
            t = torch.tensor([every], dtype=torch.int64)
            work = dist.broadcast(t, src=0, group=self.cpu_group, async_op=True)
            self._recovery.settle([work])
            posted.wait(work)
            every = int(t.item())
        if self.is_rank0 and every > 1:
            log.info("steps take ~%.1f ms: preemption agreement every %d steps", median * 1e3, every)
        return every

    def _stop(self, request: StopRequest) -> None:
        self._log_row_in_flight()   # every rank: the stop comes after that row
        request, decision, note = self._plan_stop(request)
        self.stopped = request
        self._rec.stop_begin(request.kind, request.signal_name)
        if self._checkpointer is not None:
            if decision.save:
                self._checkpointer.wait()
                if self._checkpointer.latest_step() != self.step:
                    self.save(blocking=True)
            else:
                self._checkpointer.wait()
        saved = self._checkpointer.latest_step() if self._checkpointer else None
        self._write_progress(force=True)
        # Without Slurm (hpc run) a warning is a stop someone asked for, not a preemption.
        what = request.kind if self.env.slurm.active else "a stop was asked for"
        reason = f"{request.signal_name} ({what}); {decision.reason} ({note}); saved step {saved}"
        self._rec.emit("stop_end", kind=request.kind, saved_step=saved, save=decision.save)
        self.event(request.kind, step=self.step, signal=request.signal_name, saved_step=saved)
        if self.is_rank0:
            log.warning("stopping at step %d: %s", self.step, reason)
            jobdir.write_atomic(self.job_dir / jobdir.EXIT_INTENT, _json({
                "allocation": self.env.allocation, "kind": request.kind, "step": saved,
                "reason": reason, "time": time.time()}))

    def _plan_stop(self, request: StopRequest) -> tuple[StopRequest, Decision, str]:
        """Rank 0 decides the stop's deadline, kind and whether to save; every rank gets it.

        The agreed request carries the workers' own estimate of the deadline; the launcher's
        stop notice (``HPC_STOP_FILE``) may carry Slurm's real one, which can be earlier (a
        late warning) or name another kind (:mod:`runtime.stop_deadline`). Rank 0 reads it
        (waiting briefly while node 0's launcher still asks Slurm) and broadcasts the plan:
        ranks that read the clock or the notice apart would otherwise decide apart, and a
        save is a collective.
        """
        est = self._checkpointer.estimated_save_s() if self._checkpointer else 0.0
        plan = torch.zeros(3, dtype=torch.float64)
        note = ""
        decision = Decision(False, "")
        if self.is_rank0:
            path = self.env.job.stop_file
            notice = stop_deadline.await_answer(lambda: stop_deadline.read_notice(path),
                                                request.received_at) if path else None
            kind, deadline, note = stop_deadline.plan(request.kind, request.deadline, notice,
                                                      allocation=self.env.allocation)
            decision = decide(time.time(), deadline, est)
            plan = torch.tensor([deadline, STOP_KINDS.index(kind), float(decision.save)],
                                dtype=torch.float64)
        if self.world_size > 1:
            dist.broadcast(plan, src=0, group=self.cpu_group)
        deadline, kind_index, save = plan.tolist()
        if not self.is_rank0:
            decision = Decision(bool(save), "as rank 0 decided")
        return (dataclasses.replace(request, kind=STOP_KINDS[int(kind_index)], deadline=deadline),
                decision, note)

    # --- metrics -------------------------------------------------------------------------
    def log(self, ops: Mapping[str, str] | None = None, **metrics: float) -> None:
        """Records metrics for the current step; reduced across ranks at log steps.

        Ranks may log different metrics (rank 0's evaluation, a metric of some steps): each is
        reduced over the ranks that logged it in that row (:mod:`runtime.worker.metric_rows`).

        Args:
            ops: Reduction per metric (``mean`` default, ``sum``, ``max``, ``min``).
            **metrics: Values (floats or 0-d tensors).
        """
        for k, v in metrics.items():
            self._pending_metrics.setdefault(k, []).append(float(v))
            self._metric_ops[k] = (ops or {}).get(k, self._metric_ops.get(k, "mean"))

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Records a named event (preempted, resumed, node lost...) in the run (rank 0)."""
        self._ensure_sink().event(name, step=step, **fields)

    def _write_progress(self, force: bool = False) -> None:
        """Rank 0 notes its step every few seconds, so a crash's lost work can be told."""
        now = time.time()
        every = progress_interval(self.env.job.progress_every_s)
        if not self.is_rank0 or (not force and now - self._progress_written < every):
            return
        self._progress_written = now
        try:
            self.job_dir.mkdir(parents=True, exist_ok=True)
            jobdir.write_atomic(self.job_dir / jobdir.PROGRESS, _json({
                "allocation": self.env.allocation, "restart": self.restart_count, "step": self.step,
                "start_step": self._start_step, "world_size": self.world_size, "time": now}),
                durable=force)  # no fsync on the training loop's path, except at the end/stop
        except OSError as e:  # bookkeeping must never stop training
            log.warning("cannot write %s: %s", self.job_dir / jobdir.PROGRESS, e)

    def _end_of_step(self, *, last: bool) -> None:
        self._write_progress(force=last)
        if self._progress is not None:
            self._progress.update(self.step)          # the speed; lines are printed below
        self._log_row_in_flight()   # the previous log step's row: its reduction is done by now
        if not (self.step % self.log_every == 0 or last) or not self._pending_metrics:
            if last or time.monotonic() - self._line_at >= LINE_MAX_S:
                self._print_progress(self.step)       # no row to wait for
            return
        local = {k: sum(v) / len(v) for k, v in self._pending_metrics.items()}
        ops = dict(self._metric_ops)
        if "loss" in self._pending_metrics:           # the progress line's: the step's, not the mean
            local[LAST_LOSS], ops[LAST_LOSS] = self._pending_metrics["loss"][-1], "mean"
        # Posted, not waited for: the row is logged at the next step (or below, at the last),
        # so no step waits for a metric all-reduce (~2 ms on gloo every log_every steps).
        self._row_in_flight = (self.step, self._metrics.post(local, ops, group=self.cpu_group))
        self._pending_metrics.clear()
        if last:
            self._log_row_in_flight()

    def _log_row_in_flight(self) -> None:
        """Logs the metric row whose reduction :meth:`_end_of_step` posted, if any, and prints
        rank 0's progress line for its step."""
        if self._row_in_flight is not None:
            step, pending = self._row_in_flight
            self._row_in_flight = None
            row = dict(pending.result())
            loss = row.pop(LAST_LOSS, None)
            self._recovery.keep_row(step, row)
            self._ensure_sink().log(row, step=step)
            self._row_logged = step
            if self._progress is not None:
                if loss is not None:
                    self._progress.loss = loss
                if step >= self._progress.total_steps or time.monotonic() - self._line_at >= LINE_MIN_S:
                    self._print_progress(step)

    def _print_progress(self, step: int) -> None:
        """Rank 0's console line for ``step`` (speed, the latest logged loss over all ranks, ETA)."""
        if self._progress is not None:
            self._line_at = time.monotonic()
            print(self._progress.line(step), flush=True)

    def _ensure_sink(self, resume_step: int | None = None, run_id: str | None = None, *,
                     background: bool = False, check_written: bool = False) -> Any:
        """The metrics sink: W&B on rank 0, a null sink elsewhere (created once, lazily;
        ``background``: rank 0's ``wandb.init`` runs on the sink's thread)."""
        if self._sink is None:
            config = self.spec.wandb if self.spec else WandbConfig(mode=wandb_mode(None, os.environ))

            def make() -> Any:
                return make_sink(
                    0, job_dir=self.job_dir, config=config, metadata=run_metadata(self.env),
                    resume_step=resume_step, run_id=run_id, check_written=check_written,
                    # Offline init touches no network: a long bound only guards a starved node.
                    init_timeout_s=30.0 if config.mode == "online" else 120.0)
            # Rank 0's W&B calls (and the exactly-once mark) run off the training loop's path.
            self._sink = NullSink() if not self.is_rank0 else \
                BackgroundSink(make) if background else BackgroundSink(make())
        return self._sink

    def finish(self) -> None:
        """Records that the job is done (rank 0); checkpoints are flushed in :meth:`close`."""
        if self.stopped is None:
            self.event("finished", step=self.step)


def _degrees(given: ParallelDims | None, spec: JobSpec | None) -> ParallelDims:
    """The run's mesh degrees: the script's and the spec's, which must agree where both say.

    Raises:
        ValueError: When the script asks for other degrees than the job was submitted with.
    """
    from_spec = spec.parallel if spec is not None else ParallelDims()
    if given is None or given == from_spec or from_spec.trivial:
        return given or from_spec
    raise ValueError(f"the script asks for {given} but the job was submitted with {from_spec} "
                     "(--tp/--pp/--dp-replicate/--dp-shard): give the degrees in one place")


def wandb_mode(spec: JobSpec | None, environ: Mapping[str, str]) -> str:
    """The W&B mode of this run: the job spec's, else ``WANDB_MODE``, else offline.

    Without a job spec (a plain ``torchrun``/``python`` start) the user's ``WANDB_MODE`` is
    honoured, including wandb's legacy spellings (``dryrun`` = offline, ``run`` = online).
    """
    if spec is not None:
        return spec.wandb_mode
    mode = environ.get("WANDB_MODE", "").strip().lower()
    return {"": "offline", "dryrun": "offline", "run": "online"}.get(mode, mode)


def _test_slowdown(environ: Mapping[str, str]) -> float:
    """``HPC_TEST_SLOW_NODE=N:SECONDS``: every step of the workers of node rank N sleeps (tests)."""
    raw = environ.get("HPC_TEST_SLOW_NODE", "")
    node, _, seconds = raw.partition(":")
    try:
        return float(seconds) if raw and int(node) == int(environ.get("GROUP_RANK", "-1")) else 0.0
    except ValueError:
        return 0.0


def _show_hpc_logs(rank0: bool) -> None:
    """Makes the runtime's own messages (resumed from, saved, stopping...) visible on stderr:
    INFO on rank 0, warnings elsewhere. Left alone when the script configured logging itself."""
    logger = logging.getLogger("hpc")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(name)s] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank0 else logging.WARNING)


def _app_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return dict(state)


def _json(data: Mapping[str, Any]) -> str:
    import json
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
