"""What the goodput event recording costs per training step, measured directly.

The step-overhead benchmark (``step_overhead.py``) compares whole loops, and on a busy
machine its noise (several percent) hides anything this small. Here the recorder's own calls
are timed in a tight loop, in one process, against a real ``events.jsonl`` in a temporary
directory: ``step_done`` (the only per-step call: a clock read, a counter, one ``steps`` event
per 5 s), and one ``emit`` (a save, a stop: a JSON line and one ``os.write``), minus the same
loop calling a no-op (the harness). ``HPC_EVENTS=0`` (the recorder writes nothing, still counts)
is shown beside.

    python benchmarks/events_overhead.py [--calls 1000000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.events import EVENTS_ENV, SessionRecorder  # noqa: E402


def per_call_ns(fn, calls: int, rounds: int = 5) -> float:
    """Median over rounds of the mean ns per call."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        out.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--json", default="")
    args = p.parse_args()
    def noop(i: int) -> None:
        pass

    res = {"noop_ns": per_call_ns(noop, args.calls)}
    with tempfile.TemporaryDirectory() as tmp:
        for label, flag in (("off", "0"), ("on", "1")):
            os.environ[EVENTS_ENV] = flag
            rec = SessionRecorder(Path(tmp) / label, rank=0, allocation=0, restart=0, world_size=1)
            rec.loop_start(0)
            res[f"step_done_{label}_ns"] = per_call_ns(lambda i: rec.step_done(i + 1), args.calls)
            res[f"emit_{label}_ns"] = per_call_ns(lambda i: rec.emit("ckpt_save", step=i, block_s=0.01),
                                                  max(1, args.calls // 20))
            rec.close(None, None, 0)
        res["events_written"] = sum(1 for _ in open(Path(tmp) / "on" / "events.jsonl"))
    floor = res["noop_ns"]
    res["step_done_cost_ns"] = res["step_done_on_ns"] - floor
    res["emit_cost_ns"] = res["emit_on_ns"] - floor
    print(f"no-op call (harness): {floor:.0f} ns")
    print(f"{'call':<10} | {'HPC_EVENTS=0':>12} | {'on':>8} | {'cost ns':>8} | share of a 10 ms step")
    for call in ("step_done", "emit"):
        off, on = res[f"{call}_off_ns"], res[f"{call}_on_ns"]
        print(f"{call:<10} | {off - floor:12.0f} | {on - floor:8.0f} | {on - floor:8.0f} | "
              f"{(on - floor) / 1e7 * 100:.5f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
