"""A worker whose save on SIGTERM takes long: a plain script (no Session), one rank.

On SIGTERM it writes ``--ckpt``/``step-1.tmp/model.bin`` 256 KiB at a time, one write every
0.5 s, for ``--save-s`` seconds (a big model on a slow file system), renames it to ``step-1/``
and exits 0. With ``--stall`` it stops writing half-way and hangs (a save that no longer
progresses). It writes ``ready`` (its pid) into ``--out`` once it waits for the signal.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--ckpt", type=Path, required=True)
parser.add_argument("--save-s", type=float, default=20.0)
parser.add_argument("--stall", action="store_true")
args = parser.parse_args()

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.time()))
(args.out / "ready.tmp").write_text(str(os.getpid()))   # whole or absent: the test reads it at once
os.replace(args.out / "ready.tmp", args.out / "ready")
while not stop:
    time.sleep(0.1)
print(f"SIGTERM: saving for {args.save_s:.0f} s", flush=True)
tmp = args.ckpt / "step-1.tmp"
tmp.mkdir(parents=True, exist_ok=True)
started = time.monotonic()
with open(tmp / "model.bin", "wb") as f:
    while time.monotonic() - started < args.save_s:
        if args.stall and time.monotonic() - started > args.save_s / 2:
            print("save stalls", flush=True)
            while True:
                time.sleep(1)
        f.write(os.urandom(256 * 1024))
        f.flush()
        time.sleep(0.5)
os.rename(tmp, args.ckpt / "step-1")
print(f"saved in {time.monotonic() - started:.0f} s", flush=True)
