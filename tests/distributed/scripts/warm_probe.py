"""A test worker that records how it was started: whether torch was imported before its first
line (a fork of the warm server), its parent, session, generators, streams; rank 1 of the first
start exits 3 (torch's agent restarts the workers); every worker's atexit handler leaves a file."""
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
(out / f"rec-{rank}-{restart}.json").write_text(json.dumps(record))
atexit.register(lambda: (out / f"atexit-{rank}-{restart}").write_text("ran"))
print(f"warm probe rank {rank} restart {restart}", flush=True)
if restart == 0 and rank == 1:
    (out / "crashed").write_text(str(time.time()))
    sys.exit(3)
