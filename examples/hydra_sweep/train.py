"""A Hydra app whose multirun runs as ONE hpc-elastic job array (``hydra/launcher=hpc``).

    python examples/hydra_sweep/train.py -m hydra/launcher=hpc lr=1e-3,3e-4
    python examples/hydra_sweep/train.py -m hydra/launcher=hpc hydra.launcher.nodes=2 \\
        hydra.launcher.nproc_per_node=4 hydra.launcher.partition=gpu lr=1e-3,3e-4

Nothing here knows about hpc: it is an ordinary ``@hydra.main`` app whose task function is a
torchrun DDP script (it joins the process group when torchrun's variables are set). The
launcher options are hpc.toml's keys under ``hydra.launcher`` (docs/hydra.md). Each task's
return value (the final loss here) comes back to Hydra, and the launcher logs it.
"""

from __future__ import annotations

import os

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def train(cfg: DictConfig) -> dict[str, float]:
    """Fits a linear model with DDP; returns the final loss (the same on every rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(cfg.seed)
    model = torch.nn.Linear(8, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.SGD(ddp.parameters(), lr=float(cfg.lr))
    data = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    target = torch.arange(8, dtype=torch.float32)
    loss = torch.zeros(())
    for _ in range(cfg.steps):
        x = torch.randn(cfg.batch, 8, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.is_initialized():
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        dist.destroy_process_group()
    if rank == 0:
        print(f"hydra_sweep: lr {cfg.lr}: loss {loss.item():.4f} after {cfg.steps} steps", flush=True)
    return {"lr": float(cfg.lr), "loss": float(loss.item()), "world": world}


if __name__ == "__main__":
    train()
