"""A test worker that records how it was started: whether torch was imported before its first
line (a fork of the warm server), its parent, session, generators, streams; rank 1 of the first
start exits 3 once rank 0 has written its record (torch's agent restarts the workers); every worker's atexit handler leaves a file.

The restarted workers then make and destroy 100 process groups, each under a DDP model, as a
torchrun script ends (``destroy_process_group()`` while the model lives): without
runtime.worker.pg_release one of them hangs within the first 50 (gloo's threads joined under
the GIL from DDP's Reducer). ``teardowns-RANK`` records how many ended."""
import sys
import time

WARM = "torch" in sys.modules   # before any import of this script's own
STARTED = time.time()

import argparse  # noqa: E402
import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()
out = Path(args.out)
rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
record = {
    "warm": WARM, "t": STARTED, "pid": os.getpid(), "ppid": os.getppid(), "agent": int(os.environ["HPC_AGENT_PID"]),
    "sid": os.getsid(0), "random": random.random(), "numpy": float(np.random.random()),
    "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
    "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
    "stdin": os.path.realpath(f"/proc/self/fd/0"),
}
import torch.distributed as dist  # noqa: E402

record["keeps_groups"] = bool(getattr(dist.destroy_process_group, "keeps_groups", False))
(out / f".rec-{rank}-{restart}").write_text(json.dumps(record))
(out / f".rec-{rank}-{restart}").rename(out / f"rec-{rank}-{restart}.json")   # whole when it is seen
atexit.register(lambda: (out / f"atexit-{rank}-{restart}").write_text("ran"))
print(f"warm probe rank {rank} restart {restart}", flush=True)
if restart == 0 and rank == 1:
    # rank 0's record first: a cold rank 0 still importing torch when rank 1 ends is stopped before it writes
    deadline = time.time() + 120
    while not (out / "rec-0-0.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    (out / "crashed").write_text(str(time.time()))
    sys.exit(3)
if restart == 1:
    dist.init_process_group("gloo")
    for i in range(100):
        group = dist.new_group()
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1), process_group=group)
        loss = ddp(torch.randn(2, 4)).sum()
        loss.backward()
        dist.all_reduce(loss.detach(), group=group)
        dist.destroy_process_group(group)
        del ddp, loss   # the model goes after its group was destroyed
    dist.destroy_process_group()
    (out / f"teardowns-{rank}").write_text(str(i + 1))
