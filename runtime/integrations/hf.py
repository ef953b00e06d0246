"""Hugging Face ``Trainer`` under hpc-elastic: save on the warning, exit 75, resume whole.

What the Trainer does by itself under hpc (transformers 5.x, read from its source and run):

* it has no signal handler: the job's warning (``SIGUSR2``) is recorded by hpc's worker and
  ignored, so the Trainer trains on until the launcher's SIGTERM kills it, and everything since
  its last ``save_steps`` checkpoint is lost;
* it writes ``OUTPUT_DIR/checkpoint-N/`` in place (model, optimizer, scheduler, each rank's
  RNG state, then ``trainer_state.json`` last), with no temporary name: a save cut by the
  SIGTERM leaves a ``checkpoint-N`` without ``trainer_state.json``, and transformers'
  ``get_last_checkpoint`` (the one HF's example scripts resume from) picks it anyway, so the
  next allocation fails to load it;
* ``report_to="wandb"`` calls ``wandb.init`` without an id, so hpc's ``WANDB_RUN_ID`` /
  ``WANDB_RESUME=allow`` already make every allocation continue the job's one run.

So two lines make a Trainer script preemption-safe::

    trainer = Trainer(..., callbacks=[HPCCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

:class:`HPCCallback` records the warning in a handler that only records, agrees on it across
ranks at every step end (one overlapped MAX all-reduce on its own gloo group, the Session's
:class:`~runtime.preemption.PreemptionWatcher`), then asks the Trainer to save
``checkpoint-N`` and stop, and exits with status 75 once the Trainer is done ("not done,
requeue me"; exit 0 would read as finished). :func:`last_checkpoint` is the newest complete
``checkpoint-N`` (with ``trainer_state.json``); rank 0 renames a cut one out of the way so
that the Trainer never saves over it again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hpc.contract import jobdir
from hpc.contract.environment import JobEnvironment
from runtime.preemption import DEFAULT_GRACE_S, PreemptionWatcher, StopRequest

log = logging.getLogger(__name__)

STOPPED_EXIT = 75           # EX_TEMPFAIL: stopped for the warning, the job must go on
COMPLETE_MARK = "trainer_state.json"   # the Trainer writes it last in each checkpoint-N
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[hpc] {message}", file=sys.stderr, flush=True)


def last_checkpoint(output_dir: str | os.PathLike[str] | None) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir``, for ``resume_from_checkpoint``.

    A ``checkpoint-N`` without ``trainer_state.json`` was cut short (the Trainer writes that
    file last). Rank 0 renames it to ``checkpoint-N.incomplete-<time>`` (kept, not deleted,
    and no longer matched by the Trainer's own ``checkpoint-N`` pattern, so it is never
    resumed from, rotated as a real one, or saved over); every rank skips it either way, so all
    ranks return the same answer.

    Args:
        output_dir: The Trainer's ``output_dir`` (None or missing: no checkpoint).

    Returns:
        The checkpoint's path, or None when there is none (a fresh start).
    """
    if not output_dir or not Path(output_dir).is_dir():
        return None
    found = sorted((int(m[1]), p) for p in Path(output_dir).iterdir()
                   if (m := CHECKPOINT_RE.fullmatch(p.name)) and p.is_dir())
    for step, path in reversed(found):
        if (path / COMPLETE_MARK).is_file():
            _say(f"resuming from {path} (step {step})")
            return str(path)
        _say(f"{path} has no {COMPLETE_MARK}: a save cut short, not resumed from")
        if os.environ.get("RANK", "0") == "0":
            try:
                path.rename(path.with_name(f"{path.name}.incomplete-{time.time():.0f}"))
            except OSError as e:  # another rank of a shared FS view, or read-only: skipping is enough
                log.warning("could not set %s aside: %s", path, e)
    return None


class HPCCallback(TrainerCallback):
    """Saves a checkpoint on hpc's warning signal, stops the Trainer, and exits with 75.

    Args:
        exit_on_stop: Exit the process with status 75 at the end of ``train()`` after a stop
            (default). With False the script goes on after ``train()`` returns and must exit
            75 itself when :attr:`stopped` is set (anything after a stop runs on an
            unfinished model).
        environ: The worker's environment (tests pass a dict; default ``os.environ``).
    """

    def __init__(self, *, exit_on_stop: bool = True, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        job = JobEnvironment.from_env(env)
        name = job.warning_signal
        signals = (name,) if name not in ("", "SIGTERM", "SIGINT") and hasattr(signal, name) else ()
        self.exit_on_stop = exit_on_stop
        self.stop: StopRequest | None = None
        self._job = job
        self._watcher = PreemptionWatcher(
            signals, None, job_end_time=job.job_end_time,
            lead_s=job.warning_lead_s if job.warning_lead_s is not None else 120.0,
            grace_s=job.grace_s if job.grace_s is not None else DEFAULT_GRACE_S,
            under_slurm=bool(env.get("SLURM_JOB_ID")))
        # Installed now, before the Trainer's first step; a warning that reached this worker
        # earlier (while it imported torch) comes from HPC_PENDING_WARNING.
        self._watcher.install(env)

    def _record_intent(self, step: int) -> None:
        """Rank 0 records that it saved ``step`` for the stop, before the slow interpreter exit.

        The launcher's outcome then names the stop even if torch's teardown outlives the
        grace and its SIGTERM ends the worker first (:func:`runtime.stopping.amend_outcome`).
        """
        if os.environ.get("RANK", "0") != "0" or not self._job.job_dir or self.stop is None:
            return
        reason = (f"{self.stop.signal_name} ({self.stop.kind}); the Trainer saved "
                  f"checkpoint-{step}; saved step {step}")
        try:
            jobdir.write_atomic(Path(self._job.job_dir) / jobdir.EXIT_INTENT, json.dumps({
                "allocation": self._job.allocation, "kind": self.stop.kind, "step": step,
                "reason": reason, "time": time.time()}))
        except OSError as e:   # the outcome then says less; the save itself is done
            log.warning("cannot record the stop's exit intent: %s", e)

    @property
    def stopped(self) -> bool:
        """Whether the Trainer was stopped for the warning (it saved first)."""
        return self.stop is not None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
                and self._watcher.group is None:
            # Its own gloo group (every rank calls on_train_begin): the agreement runs on the
            # CPU beside the Trainer's own collectives, NCCL or gloo, without waiting on them.
            self._watcher.group = dist.new_group(backend="gloo")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        request = self._watcher.poll()   # overlapped: a warning acts one step later, on every rank
        if request is None or self.stop is not None:
            return
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            return   # this was the last step: the work is done, the script ends as finished
        self.stop = request
        control.should_save = True           # the Trainer saves checkpoint-N right after this
        control.should_training_stop = True
        _say(f"{request.signal_name} ({request.kind}) at step {state.global_step}: saving "
             f"checkpoint-{state.global_step} and stopping")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._watcher.drain()
        self._watcher.uninstall()
        if self.stop is not None:
            self._record_intent(state.global_step)
            _say(f"saved at step {state.global_step}; exiting {STOPPED_EXIT} so that the job "
                 "goes on from it")
            if self.exit_on_stop:
                sys.exit(STOPPED_EXIT)
