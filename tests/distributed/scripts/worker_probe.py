"""A test worker: records its pid and signals, then all-reduces in a loop for --seconds."""
import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--seconds", type=float, default=6.0)
p.add_argument("--fail", action="store_true")
args = p.parse_args()
out = Path(args.out)
rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
(out / f"pid-{rank}-{restart}").write_text(str(os.getpid()))
got: list[str] = []
for sig in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
dist.init_process_group("gloo")
if args.fail and rank == 1:
    raise ValueError("boom: injected failure in rank 1")
end = time.time() + args.seconds
n = 0
while time.time() < end:
    t = torch.ones(1)
    dist.all_reduce(t)
    n += 1
    time.sleep(0.05)
if got:
    (out / f"signals-{rank}").write_text(",".join(got))
print(f"probe rank {rank} restart {restart} did {n} all-reduces", flush=True)
dist.destroy_process_group()
