"""How long in-process recovery takes from a worker's SIGKILL to the state transferred to its
joiner: the joiner made from the node's warm standby (the default) against one started cold
(``HPC_INPROC_WARM=0``), on the same job.

Under ``--recovery inprocess`` (``--replacement wait``) the survivors wait for the dead worker's
joiner, so its start-up is node-time lost per fault on every node of the job. Each round is one
``hpc run`` of the in-process test script (3 workers on this machine, gloo, DDP); rank 2 is
SIGKILLed at its step ``--kill-step`` (in ``warm`` rounds also once the standby is warm: its
process name says so). The figure is the time from the kill to the survivors' ``t_transfer``
(``events.jsonl``: the joiner holds the state, training goes on). Rounds alternate; each
``warm`` round is divided by the ``cold`` rounds on either side of it
(:mod:`benchmarks.pairstats`), so drift slower than a round cancels.

    .venv/bin/python benchmarks/warm_joiner.py [--rounds 6] [--json benchmarks/warm_joiner.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.pairstats import sandwich_ratios, summarize  # noqa: E402
from hpc.contract import recovery_settings  # noqa: E402
from runtime import node_files  # noqa: E402
from runtime.liveness import proc  # noqa: E402
from runtime.inprocess.worker.standby import READY_NAME  # noqa: E402

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"


def _steps(out: Path) -> dict[int, list[dict]]:
    return {int(f.stem.split("-")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            for f in out.glob("steps-*.jsonl")}


def _warm_standby(job: Path) -> int | None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if node_files.STANDBY_MODULE in proc.cmdline(pid) and proc.environ(pid).get("HPC_JOB_DIR") == str(job):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == READY_NAME:
                    return pid
            except OSError:
                pass
    return None


def one(kind: str, tmp: Path, i: int, kill_step: int) -> dict:
    """One job: rank 2 killed at ``kill_step``; returns the round's record."""
    out, job = tmp / f"out-{i}", tmp / f"job-{i}"
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60",
               **{recovery_settings.WARM_ENV: "1" if kind == "warm" else "0"})
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                            "--recovery", "inprocess", "--max-restarts", "1", "--job-dir", str(job), "--",
                            "--out", str(out), "--steps", str(kill_step + 30), "--step-sleep", "0.1"],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        victim = None
        while victim is None:
            if time.time() > deadline or run.poll() is not None:
                raise RuntimeError(f"round {i} ({kind}): no kill point: {run.stdout.read()[-3000:] if run.stdout else ''}")
            ran = _steps(out)
            rank2 = [p for p, lines in ran.items() if lines and lines[0]["rank"] == 2 and len(lines) >= kill_step]
            if rank2 and (kind == "cold" or _warm_standby(job) is not None):
                victim = rank2[0]
            else:
                time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        text, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    if run.returncode != 0:
        raise RuntimeError(f"round {i} ({kind}) failed: {text[-3000:]}")
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    rec = next(e for e in events if e["ev"] == "inproc_recovery")
    join = next(e for e in events if e["ev"] == "inproc_join")
    replace = next(e for e in events if e["ev"] == "inproc_replace")
    if replace.get("warm") != (kind == "warm"):
        raise RuntimeError(f"round {i} ({kind}): the joiner was {'warm' if replace.get('warm') else 'cold'}")
    return {"kind": kind, "recovery_s": rec["t_transfer"] - killed, "asked_s": join["t_asked"] - killed,
            "group_s": rec["t_group"] - rec["t_reform"], "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=6, help="warm rounds (cold rounds: one more)")
    p.add_argument("--kill-step", type=int, default=100, help="rank 2's step at which it is killed")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * args.rounds + 1):
            kind = "cold" if i % 2 == 0 else "warm"
            records.append(one(kind, Path(tmp), i, args.kill_step))
            r = records[-1]
            print(f"round {i + 1}/{2 * args.rounds + 1}: {kind}: kill -> state transferred {r['recovery_s']:.2f} s "
                  f"(joiner asked after {r['asked_s']:.2f} s, group {r['group_s']:.2f} s; load {r['load']:.2f})",
                  flush=True)
    load1 = os.getloadavg()[0]
    rounds = [(r["kind"], r["recovery_s"]) for r in records]
    summary = summarize(sandwich_ratios(rounds, baseline="cold").get("warm", []), resolution_pct=20)
    med = {k: sorted(v for kk, v in rounds if kk == k)[len([1 for kk, _ in rounds if kk == k]) // 2]
           for k in ("cold", "warm")}
    interval = (f"[{summary.lo:.3f}, {summary.hi:.3f}] ({summary.coverage:.0%})"
                if summary.lo is not None else "(too few rounds for an interval)")
    print(f"kill -> state transferred: cold {med['cold']:.2f} s, warm {med['warm']:.2f} s (medians)")
    print(f"ratio warm / cold: {summary.median:.3f} {interval}; 1-min load {load0:.2f} -> {load1:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "what": "seconds from a worker's SIGKILL to the state transferred to its joiner (3 workers, gloo)",
            "rounds": records, "ratio_warm_over_cold": summary.to_dict(), "median_s": med,
            "kill_step": args.kill_step, "load_1min": [load0, load1], "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
