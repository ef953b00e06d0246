"""How long a worker takes to exit once its script is over: ``python -m runtime.worker`` (the
launcher's worker entry, which freezes the garbage collector when the script ends) against
``python script.py`` (the interpreter's usual shutdown), on the same script.

Every restart, preemption and requeue waits for the old workers to exit (torch's agent, and
Slurm's grace time, count it), so their shutdown is node-time lost per fault. The script is a
user's: it imports torch, DCP and the Session, builds a small transformer with its optimizer
and takes one step, then writes the time of its last line. The figure is the time from that
line to the parent seeing the process gone (``wait`` returns), in alternated rounds; each
``worker`` round is divided by the ``plain`` rounds on either side of it
(:mod:`benchmarks.pairstats`), so drift slower than a round cancels.

    .venv/bin/python benchmarks/worker_exit.py [--rounds 15] [--json benchmarks/worker_exit.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pairstats import sandwich_ratios, summarize  # noqa: E402

SCRIPT = '''
import sys, time
import torch
import torch.distributed.checkpoint  # noqa: F401
import runtime.session  # noqa: F401
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
model = torch.nn.TransformerEncoder(layer, 4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(8, 64, 128)).square().mean().backward()
opt.step()
open(sys.argv[1], "w").write(repr(time.time()))
'''


def one(kind: str, script: Path, stamp: Path) -> float:
    """Seconds from the script's last line to its process gone."""
    argv = [sys.executable, *(["-m", "runtime.worker"] if kind == "worker" else []), str(script), str(stamp)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run(argv, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    gone = time.time()
    return gone - float(stamp.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=15, help="worker rounds (plain rounds: one more)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        script, stamp = Path(tmp) / "user_script.py", Path(tmp) / "stamp"
        script.write_text(SCRIPT)
        rounds: list[tuple[str, float]] = []
        for i in range(2 * args.rounds + 1):
            kind = "plain" if i % 2 == 0 else "worker"
            rounds.append((kind, one(kind, script, stamp)))
            print(f"round {i + 1}/{2 * args.rounds + 1}: {kind} {rounds[-1][1]:.3f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    load1 = os.getloadavg()[0]
    ratios = sandwich_ratios(rounds, baseline="plain").get("worker", [])
    summary = summarize(ratios, resolution_pct=20)
    plain = sorted(v for k, v in rounds if k == "plain")
    worker = sorted(v for k, v in rounds if k == "worker")
    print(f"exit after the script's last line: plain {plain[len(plain) // 2]:.3f} s, "
          f"runtime.worker {worker[len(worker) // 2]:.3f} s (medians)")
    interval = (f"[{summary.lo:.3f}, {summary.hi:.3f}] ({summary.coverage:.0%})"
                if summary.lo is not None else "(too few rounds for an interval)")
    print(f"ratio worker / plain: {summary.median:.3f} {interval}; 1-min load {load0:.2f} -> {load1:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "what": "seconds from a user's script's last line to its process gone",
            "rounds": rounds, "ratio_worker_over_plain": summary.to_dict(),
            "median_s": {"plain": plain[len(plain) // 2], "worker": worker[len(worker) // 2]},
            "load_1min": [load0, load1], "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
