"""A worker whose SIGTERM handler runs a collective, as Lightning's does (a broadcast).

Rank 0 waits in Python, so its handler runs at once; rank 1 is blocked in an all-reduce (the
step's collective) that rank 0 never joins, so its handler cannot run. Rank 0's broadcast and
rank 1's all-reduce never match: both wait out the collective timeout (30 minutes), as two
ranks of a Lightning job did when the SIGTERM found one in its step's collective and the
other outside it. Each rank writes ``ready-RANK`` into ``--out`` once it is where it waits.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()


def broadcast_then_die(signum: int, frame: object) -> None:
    """Lightning's handler: a broadcast from rank 0, then death by the signal."""
    print(f"rank {rank}: SIGTERM: broadcasting from the handler", flush=True)
    dist.broadcast(torch.tensor([1]), src=0)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


signal.signal(signal.SIGTERM, broadcast_then_die)
dist.barrier()
(args.out / f".ready-{rank}").write_text(str(os.getpid()))   # whole or absent: the test reads it at once
os.replace(args.out / f".ready-{rank}", args.out / f"ready-{rank}")
if rank == 0:
    while True:
        time.sleep(0.1)
else:
    dist.all_reduce(torch.ones(4))   # rank 0 never comes: blocked here, in gloo
