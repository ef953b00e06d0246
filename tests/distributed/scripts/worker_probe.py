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
# Written whole, then renamed: the tests poll for the name and read it at once.
(out / f".pid-{rank}-{restart}").write_text(str(os.getpid()))
os.replace(out / f".pid-{rank}-{restart}", out / f"pid-{rank}-{restart}")
got: list[str] = []
for sig in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
dist.init_process_group("gloo")
if args.fail and rank == 1:
    raise ValueError("boom: injected failure in rank 1")
end = time.time() + args.seconds
n = 0
while True:
    # The ranks leave the loop together: each one's clock votes, and the all-reduce carries
    # the votes. A rank that left on its own clock would leave the other in an all-reduce
    # with a peer that had gone (under load the ranks' `end`s differ by more than a step).
    t = torch.tensor([1.0, float(time.time() >= end)])
    dist.all_reduce(t)
    n += 1
    if t[1] > 0:
        break
    time.sleep(0.05)
if got:
    (out / f"signals-{rank}").write_text(",".join(got))
print(f"probe rank {rank} restart {restart} did {n} all-reduces", flush=True)
dist.destroy_process_group()
