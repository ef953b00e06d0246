"""A Lightning script that survives requeues: ModelCheckpoint-based resume plus a clean stop.

Copy it as a starting point; it runs unchanged under torchrun, `hpc run` and `hpc submit`:

    hpc run    examples/lightning_resume.py --nproc-per-node 2 -- --steps 30
    hpc submit examples/lightning_resume.py --nodes 2 --nproc-per-node 1 --partition debug -- --steps 30

What it takes from hpc-elastic (docs/own-script.md), all through environment variables:

* ``HPC_CHECKPOINT_DIR``: where ModelCheckpoint writes (it survives requeues);
* ``HPC_RESUMED=1``: this allocation continues an earlier one, so ``fit(ckpt_path="last")``;
* ``HPC_WARNING_SIGNAL``: the warning before a stop; the ``StopOnWarning`` callback agrees on it
  across ranks at a step boundary, saves ``last.ckpt`` and stops, and the script then exits with
  status 75 ("not done, requeue me"). Exit 0 means the work is done.

Lightning picks its ``TorchElasticEnvironment`` here (it ranks it above ``SLURMEnvironment``
because torchrun variables are set): do not pass ``plugins=[SLURMEnvironment()]``, whose ranks
would come from our one-task-per-node Slurm step and whose auto-requeue would race the
launcher's. A model and data small enough for CPU and gloo; one batch per rank per epoch, so
that every checkpoint is at an epoch boundary and a resume repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

STOPPED_EXIT = 75   # EX_TEMPFAIL: stopped for the warning, the job must go on


class Regressor(pl.LightningModule):
    """A two-layer MLP fitted to a fixed random target."""

    def __init__(self, width: int = 16, lr: float = 0.02, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)   # stands in for real work (tests preempt it)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class StopOnWarning(Callback):
    """Records the job's warning signal; all ranks agree at a step boundary, save, and stop.

    The handler only records: acting inside it (or on one rank alone) would mismatch the
    collectives of the step in flight.
    """

    def __init__(self, last_path: str) -> None:
        self.last_path = last_path
        self.stopped = False
        # A warning that reached this worker before its handler below existed (hpc recorded it).
        self.received = bool(os.environ.get("HPC_PENDING_WARNING"))
        name = os.environ.get("HPC_WARNING_SIGNAL", "")
        if hasattr(signal, name) and name not in ("SIGTERM", "SIGINT"):
            signal.signal(getattr(signal, name), self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.received = True

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.is_global_zero:   # after a resume: the step the checkpoint restored
            print(f"lightning_resume: training from step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.strategy.reduce_boolean_decision(self.received, all=False):
            trainer.save_checkpoint(self.last_path)   # every rank calls it; rank 0 writes
            trainer.should_stop = True
            self.stopped = True
            if trainer.is_global_zero:
                print(f"lightning_resume: warning at step {trainer.global_step}: saved, stopping", flush=True)


def wandb_logger() -> pl.loggers.Logger:
    """W&B from rank 0; hpc sets WANDB_RUN_ID/WANDB_RESUME, so every allocation continues one run.

    Do not pass ``id=`` or ``version=``. ``save_dir`` must be WANDB_DIR (the job directory):
    WandbLogger's default ``"."`` overrides it, and `hpc sync` would not find the offline runs.
    """
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project="hpc-elastic-examples", save_dir=os.environ.get("WANDB_DIR", "."))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="", help="rank 0 writes the final weights and loss here (JSON)")
    p.add_argument("--wandb", action="store_true", help="log to W&B: one run for the whole job")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ckpt_dir = os.environ.get("HPC_CHECKPOINT_DIR", "checkpoints")
    resumed = os.environ.get("HPC_RESUMED") == "1"

    pl.seed_everything(0, workers=True)
    x = torch.randn(args.batch * world, 8, generator=torch.Generator().manual_seed(1))
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True)  # one batch per rank

    stopper = StopOnWarning(os.path.join(ckpt_dir, "last.ckpt"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=world // devices,
        strategy="ddp" if world > 1 else "auto", max_epochs=args.steps,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=1,
                                   every_n_epochs=1), stopper],
        logger=wandb_logger() if args.wandb else False, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=os.environ.get("HPC_JOB_DIR", "."))
    model = Regressor(step_sleep=args.step_sleep)
    if trainer.is_global_zero:
        cluster = getattr(trainer.strategy, "cluster_environment", None)   # none: one process
        env = type(cluster).__name__ if cluster is not None else "none"
        print(f"lightning_resume: world {world}, cluster environment {env}, "
              f"{'resuming from ' + ckpt_dir if resumed else 'fresh start'}", flush=True)
    trainer.fit(model, data, ckpt_path="last" if resumed else None)

    if stopper.stopped:
        sys.exit(STOPPED_EXIT)
    if trainer.is_global_zero:
        loss = float(trainer.callback_metrics["loss"])
        print(f"lightning_resume: done {trainer.global_step} steps, loss {loss:.6f}", flush=True)
        if args.out:
            weights = [v.flatten().tolist() for v in model.state_dict().values()]
            with open(args.out, "w") as f:
                json.dump({"steps": trainer.global_step, "loss": loss, "weights": weights}, f)


if __name__ == "__main__":
    main()
