"""A plain torchrun DDP script that uses nothing from hpc-elastic.

It shows that `hpc run` / `hpc submit` launch existing scripts unchanged:

    torchrun --nproc-per-node 2 examples/ddp_plain.py --steps 20
    hpc run examples/ddp_plain.py --nproc-per-node 2 -- --steps 20

It fits a linear model to a fixed random target with DDP over gloo (or nccl on GPUs) and
prints the final loss from rank 0.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    target = torch.nn.Linear(32, 1)
    model = DDP(torch.nn.Linear(32, 1).to(device), device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(args.seed + rank)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    t = loss.detach().reshape(1)   # on the device: NCCL takes no CPU tensor
    dist.all_reduce(t)
    if rank == 0:
        print(f"ddp_plain: world {world}, {args.steps} steps, mean final loss {t.item() / world:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
