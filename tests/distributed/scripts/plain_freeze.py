"""A plain torchrun script (no hpc Session, no heartbeats) whose rank 1 freezes once.

Each step all-reduces a tensor and prints a line. In the first run (restart 0), rank 1 stops
in ``stuck_in_own_code`` after step 3: no process dies, rank 0 waits in the all-reduce. After
the launcher's restart it runs to the end and rank 0 writes ``done.json``.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def stuck_in_own_code() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    total = torch.zeros(1)
    for step in range(1, args.steps + 1):
        if rank == 1 and restart == 0 and step == 4:
            stuck_in_own_code()
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.2)
    if rank == 0:
        with open(os.path.join(args.out, "done.json"), "w") as f:
            json.dump({"steps": args.steps, "total": total.item(), "restart": restart}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
