"""A plain torchrun script (no hpc-elastic import) that handles the warning signal as
docs/own-script.md teaches: its handler only records SIGUSR2; at a step boundary the ranks
agree (all-reduce MAX), rank 0 saves its snapshot in $HPC_CHECKPOINT_DIR and every rank exits
with status 75. It does not handle SIGTERM. It writes ``done`` into ``--out`` when it finishes
its ``--steps``."""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=400)
args = p.parse_args()
warned = []
signal.signal(signal.SIGUSR2, lambda s, f: warned.append(time.time()))
dist.init_process_group("gloo")
rank = dist.get_rank()
snap = Path(os.environ["HPC_CHECKPOINT_DIR"]) / "snapshot.json"
step = json.loads(snap.read_text())["step"] if snap.exists() else 0
print(f"usr2_saver: start step {step}", flush=True)
while step < args.steps:
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    time.sleep(0.05)
    flag = torch.tensor([1.0 if warned else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        if rank == 0:
            snap.parent.mkdir(parents=True, exist_ok=True)
            snap.write_text(json.dumps({"step": step}))
        print(f"usr2_saver: saved step {step} on the warning", flush=True)
        dist.destroy_process_group()
        sys.exit(75)
if rank == 0:
    (Path(args.out) / "done").write_text(str(step))
dist.destroy_process_group()
