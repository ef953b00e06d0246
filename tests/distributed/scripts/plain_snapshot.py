"""A plain torchrun DDP script with its own snapshot, like the PyTorch multinode example.

It uses nothing from hpc-elastic and installs no signal handler: the shape of
pytorch/examples' distributed/ddp-tutorial-series/multinode.py (a Trainer that loads
``snapshot.pt`` if it exists and saves it every ``--save-every`` steps from rank 0), trained
on CPU with gloo. With ``--wandb`` rank 0 calls ``wandb.init()`` itself, with no id, as
nanoGPT does. For the tests it writes ``started-<alloc>-<restart>-<rank>`` (with the HPC_*
variables it saw) into ``--out``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model: torch.nn.Module, snapshot_path: str, save_every: int) -> None:
        self.rank = dist.get_rank()
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
        self.steps_run = 0
        self.snapshot_path = snapshot_path
        self.save_every = save_every
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        snap = torch.load(path, map_location="cpu")
        self.model.load_state_dict(snap["MODEL_STATE"])
        self.steps_run = snap["STEPS_RUN"]
        print(f"Resuming training from snapshot at step {self.steps_run}", flush=True)

    def _save_snapshot(self, step: int) -> None:
        snap = {"MODEL_STATE": self.model.module.state_dict(), "STEPS_RUN": step}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snap, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Step {step} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, steps: int, step_sleep: float, run, fail_at: int = 0) -> None:
        gen = torch.Generator().manual_seed(1234)
        target = torch.nn.Linear(16, 1)
        for step in range(self.steps_run + 1, steps + 1):
            gen.manual_seed(step * 97 + self.rank)
            x = torch.randn(32, 16, generator=gen)
            with torch.no_grad():
                y = target(x)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if run is not None:
                run.log({"loss": loss.item()}, step=step)
            if self.rank == 0:
                print(f"step {step} loss {loss.item():.5f}", flush=True)
            if self.rank == 0 and step % self.save_every == 0:
                self._save_snapshot(step)
            time.sleep(step_sleep)
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if step == fail_at and self.rank == 1 and restart < 2:
                raise RuntimeError(f"injected failure at step {step}, restart {restart}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--snapshot", default="snapshot.pt")
    p.add_argument("--out", default=".")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--fail-at", type=int, default=0, help="rank 1 raises at this step in its first two starts (0: never)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    alloc, restart = os.environ.get("HPC_REQUEUE_COUNT", "?"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    seen = {k: v for k, v in os.environ.items() if k.startswith(("HPC_", "WANDB_"))}
    Path(args.out, f"started-{alloc}-{restart}-{rank}").write_text(json.dumps(seen))
    run = None
    if args.wandb and rank == 0:
        import wandb

        run = wandb.init(project="plain-snapshot", config={"steps": args.steps})
        Path(args.out, f"wandb-id-{alloc}-{restart}").write_text(run.id)
    torch.manual_seed(0)
    trainer = Trainer(torch.nn.Linear(16, 1), args.snapshot, args.save_every)
    trainer.train(args.steps, args.step_sleep, run, args.fail_at)
    if run is not None:
        run.finish()
    dist.barrier()
    if rank == 0:
        print(f"plain_snapshot: done {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
