"""What a worker start costs, forked from the launcher's warm fork server (the default) against
started cold (``HPC_WARM_START=0``), on the same job.

Each round is one ``hpc run`` of the example (``examples/train_gpt.py --preset tiny``, a Session
script, DDP on gloo) on ``--nproc-per-node N`` workers; rank 0 fails at step 10 of the first
start (``--fail-at-step 10 --fail-once``), torch's agent restarts the workers once, they resume
from the checkpoint of step 10 and finish at step 20. Two figures per round:

- the CPU seconds of the whole run (``hpc run``, its launcher, the fork server, every worker:
  ``RUSAGE_CHILDREN`` of this process, which waits for ``hpc run``, which waits for the rest);
- the restart's start-up: from the agent's second ``workers_started`` to the restarted
  workers' first step (``events.jsonl``): the workers' python, imports, process group, DDP and
  restore.

Rounds alternate; each ``warm`` round is divided by the ``cold`` rounds on either side of it
(:mod:`benchmarks.pairstats`), so drift slower than a round cancels.

    .venv/bin/python benchmarks/warm_start.py [--rounds 5] [--nproc 2] [--json benchmarks/warm_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pairstats import sandwich_ratios, summarize  # noqa: E402

SCRIPT = REPO / "examples" / "train_gpt.py"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(kind: str, tmp: Path, i: int, nproc: int) -> dict:
    job = tmp / f"job-{i}"
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_WARM_START="1" if kind == "warm" else "0")
    cpu0, t0 = _cpu(), time.time()
    run = subprocess.run([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", str(nproc),
                          "--max-restarts", "1", "--checkpoint-every-steps", "10", "--job-dir", str(job), "--",
                          "--preset", "tiny", "--max-steps", "20", "--fail-at-step", "10", "--fail-once"],
                         env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    cpu, wall = _cpu() - cpu0, time.time() - t0
    if run.returncode != 0:
        raise RuntimeError(f"round {i} ({kind}) failed: {(run.stdout + run.stderr)[-3000:]}")
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    started = [e["t"] for e in events if e["ev"] == "workers_started"]
    first = [e["t"] for e in events if e["ev"] == "first_step" and e.get("restart") == 1]
    if len(started) != 2 or not first:
        raise RuntimeError(f"round {i} ({kind}): not one restart: {len(started)} starts, {len(first)} first steps")
    node_log = "".join(p.read_text() for p in (job / "logs").glob("alloc-0/node-*.log"))
    if kind == "warm" and "warm start" in node_log:
        raise RuntimeError(f"round {i}: a worker started cold: {node_log[-2000:]}")
    return {"kind": kind, "cpu_s": cpu, "wall_s": wall, "restart_s": first[0] - started[1],
            "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=5, help="warm rounds (cold rounds: one more)")
    p.add_argument("--nproc", type=int, default=2, help="workers")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * args.rounds + 1):
            kind = "cold" if i % 2 == 0 else "warm"
            r = one(kind, Path(tmp), i, args.nproc)
            records.append(r)
            print(f"round {i + 1}/{2 * args.rounds + 1}: {kind}: {r['cpu_s']:.1f} CPU-s, {r['wall_s']:.1f} s, "
                  f"restart {r['restart_s']:.2f} s (load {r['load']:.2f})", flush=True)
    load1 = os.getloadavg()[0]
    figures = {}
    for name in ("cpu_s", "restart_s", "wall_s"):
        rounds = [(r["kind"], r[name]) for r in records]
        s = summarize(sandwich_ratios(rounds, baseline="cold").get("warm", []), resolution_pct=10)
        meds = {k: sorted(v for kk, v in rounds if kk == k)[len([1 for kk, _ in rounds if kk == k]) // 2]
                for k in ("cold", "warm")}
        figures[name] = {"median": meds, "ratio_warm_over_cold": s.to_dict()}
        interval = f"[{s.lo:.3f}, {s.hi:.3f}] ({s.coverage:.0%})" if s.lo is not None else "(too few rounds)"
        print(f"{name}: cold {meds['cold']:.2f}, warm {meds['warm']:.2f} (medians); warm / cold {s.median:.3f} {interval}")
    print(f"1-min load {load0:.2f} -> {load1:.2f}, {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps({
            "what": f"one hpc run of the tiny example on {args.nproc} workers with one failure and restart",
            "rounds": records, "figures": figures, "nproc": args.nproc, "load_1min": [load0, load1],
            "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
