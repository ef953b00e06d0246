"""A worker whose save is larger than the room left on its disk (a quota, a shared scratch that
filled up): the write fails with ENOSPC, the partial file is removed (as a checkpoint writer's
cleanup does, so the disk then looks far from full) and the error propagates."""
import argparse
import os
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()
if os.environ.get("RANK") == "0":
    path = Path(args.out) / "big-save.bin"
    try:
        with open(path, "wb") as f:
            for _ in range(64):
                f.write(b"\0" * (1 << 20))
                f.flush()
    finally:
        path.unlink(missing_ok=True)
else:
    time.sleep(60)   # the group ends when rank 0 fails
