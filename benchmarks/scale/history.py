"""A synthetic job history of N nodes and many allocations, and what reading it costs.

    python -m benchmarks.scale.history --nodes 1024 [--allocations 20] [--runs 5] [--work DIR]

re-times ``hpc status`` and ``hpc report`` alone (the last phase of :mod:`.run`) and records
the figures in ``benchmarks/scale.json``: in the table's rows for N x 20 allocations, under
``report_histories`` for any other number of allocations.

The records are written by the real writers, as a real job writes them: every node's
launcher its allocation frame into ``events.jsonl`` (:class:`runtime.events.EventLog`:
``alloc_start``, ``agent_rendezvous``, ``workers_started``, ``alloc_end``), rank 0 its
Session's events (a ``steps`` summary every :data:`runtime.events.SUMMARY_EVERY_S` seconds of
an hour-long allocation, a checkpoint every 10 minutes), and node 0 one outcome per
allocation (:func:`hpc.contract.jobdir.append_outcome`). Then ``hpc status DIR`` and
``hpc report DIR`` run as the user runs them (a fresh process each), timed, with their peak
memory (``ru_maxrss`` of the child).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.scale.meter import load
from hpc.contract import jobdir
from hpc.contract.records import Outcome
from runtime.events import SUMMARY_EVERY_S, EventLog

ROOT = Path(__file__).resolve().parents[2]
ALLOCATIONS = 20          # the table's histories (docs/scale.md)

ALLOC_S = 3600.0          # each allocation trains an hour
CKPT_EVERY_S = 600.0
STEP_S = 0.5


def write(job_dir: Path, nodes: int, allocations: int = 20) -> int:
    """Writes the history into ``job_dir``; returns the number of event lines."""
    job_dir.mkdir(parents=True, exist_ok=True)
    lines = 0
    t = time.time() - allocations * (ALLOC_S + 120)
    step = 0
    for a in range(allocations):
        start = t
        for r in range(nodes):
            log = EventLog(job_dir, allocation=a, sync_every_s=0, node=f"node{r:05d}", node_rank=r)
            log.emit("alloc_start", t=start + 0.01 * r, slurm_job_id="")
            log.emit("agent_rendezvous", t=start + 20, t0=start + 5, agent_restarts=0)
            log.emit("workers_started", t=start + 21, agent_restarts=0, nodes=nodes)
            log.close()
            lines += 3
        r0 = EventLog(job_dir, allocation=a, sync_every_s=0, node="node00000", rank=0, restart=0)
        r0.emit("session_start", t=start + 22, t_proc=start + 21, world_size=nodes * 8)
        r0.emit("rendezvous", t=start + 30, world_size=nodes * 8)
        r0.emit("restore_begin", t=start + 30)
        r0.emit("restore_end", t=start + 40, step=step, from_checkpoint=a > 0)
        r0.emit("loop_start", t=start + 40, step=step)
        r0.emit("first_step", t=start + 41, step=step + 1)
        lines += 6
        now, first = start + 41, step + 1
        while now < start + ALLOC_S:
            count = int(SUMMARY_EVERY_S / STEP_S)
            r0.emit("steps", t=now + SUMMARY_EVERY_S, t0=now, first=first, last=first + count - 1,
                    count=count)
            now += SUMMARY_EVERY_S
            first += count
            lines += 1
            if int((now - start) // CKPT_EVERY_S) != int((now - SUMMARY_EVERY_S - start) // CKPT_EVERY_S):
                r0.emit("ckpt_save", t=now, step=first - 1, block_s=0.2)
                r0.emit("ckpt_commit", t=now + 3, step=first - 1, save_s=3.0)
                lines += 2
        step = first - 1
        r0.emit("stop_begin", t=now, kind="time_limit", signal="SIGUSR2")
        r0.emit("stop_end", t=now + 5, saved_step=step)
        r0.emit("session_end", t=now + 6, ok=True)
        r0.close()
        lines += 3
        for r in range(nodes):
            log = EventLog(job_dir, allocation=a, sync_every_s=0, node=f"node{r:05d}", node_rank=r)
            log.emit("alloc_end", t=now + 8, kind="time_limit", exit_code=75)
            log.close()
            lines += 1
        jobdir.append_outcome(job_dir, Outcome(
            allocation=a, kind="time_limit", exit_code=75, step=step, reason="time limit",
            node="node00000", time=now + 8, world_size=nodes * 8, start_step=step - int(ALLOC_S / STEP_S),
            last_step=step))
        t = now + 120
    return lines


def _timed(argv: list[str], env: dict) -> tuple[float, float, int, str, float]:
    """(seconds, peak RSS in MB, exit status, last line of stderr, CPU seconds) of one command.
    The CPU seconds do not grow with the machine's load; the wall time does (at load 10 on
    2 cores a process gets about a fifth of a core)."""
    started = time.perf_counter()
    with open(os.devnull, "w") as out, subprocess.Popen(argv, env=env, stdout=out,
                                                         stderr=subprocess.PIPE, text=True) as p:
        _, status, usage = os.wait4(p.pid, 0)      # this child's own rusage
        took = time.perf_counter() - started
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read() if p.stderr else ""
    return (took, usage.ru_maxrss / 1024, p.returncode, (err.strip().splitlines() or [""])[-1],
            usage.ru_utime + usage.ru_stime)


def measure(nodes: int, *, allocations: int = ALLOCATIONS, work: Path, runs: int = 1) -> dict:
    """Writes the history for ``nodes`` nodes (unless ``work`` holds it already), times
    ``hpc status`` and ``hpc report`` on it ``runs`` times."""
    job_dir = Path(work) / "history"
    row: dict = {}
    if len(jobdir.read_outcomes(job_dir)) != allocations:   # none, or cut short: written again
        started = time.perf_counter()
        write(job_dir, nodes, allocations)
        row["history_write_s"] = round(time.perf_counter() - started, 2)
    events = job_dir / "events.jsonl"
    with open(events, "rb") as f:
        lines = sum(1 for _ in f)
    return {"events_lines": lines, "events_mb": round(events.stat().st_size / 2**20, 2), **row,
            **time_runs(job_dir, Path(work) / "hpc-home", runs)}


def time_runs(job_dir: Path, hpc_home: Path, runs: int) -> dict:
    """:func:`time_commands` ``runs`` times: the median of each figure, the range of the wall
    and CPU seconds, the largest peak memory, and the 1-minute load before each run."""
    each, before_all = [], load()
    for _ in range(runs):
        before = load()["load1"]
        each.append({**time_commands(job_dir, hpc_home), "load1": before})
    row: dict = {"timed_runs": runs, "report_load1_each": [r["load1"] for r in each]}
    for k in ("status_s", "status_cpu_s", "report_s", "report_cpu_s"):
        got = [r[k] for r in each if r[k] is not None]
        row[k] = round(statistics.median(got), 3) if len(got) == runs else None
        if got:
            row[k.removesuffix("_s") + "_range_s"] = [min(got), max(got)]
    for k in ("status_rss_mb", "report_rss_mb"):
        row[k] = max(r[k] for r in each)
    notes = {k: v for r in each for k, v in r.get("history_notes", {}).items()}
    if notes:
        row["history_notes"] = notes
    row["report_load"] = before_all
    return row


def time_commands(job_dir: Path, hpc_home: Path) -> dict:
    """``hpc status`` and ``hpc report`` on ``job_dir``: wall and CPU seconds, peak memory."""
    env = {**os.environ, "HPC_HOME": str(hpc_home)}
    hpc = [sys.executable, "-m", "hpc"]
    status_s, status_mb, status_rc, status_err, status_cpu = _timed([*hpc, "status", str(job_dir)], env)
    report_s, report_mb, report_rc, report_err, report_cpu = _timed([*hpc, "report", str(job_dir)], env)
    row = {"status_s": round(status_s, 3) if status_rc == 0 else None,
           "status_cpu_s": round(status_cpu, 2),
           "status_rss_mb": round(status_mb, 1),
           "report_s": round(report_s, 3) if report_rc == 0 else None,
           "report_cpu_s": round(report_cpu, 2),
           "report_rss_mb": round(report_mb, 1)}
    notes = {}
    if status_rc != 0:
        notes["status_s"] = f"hpc status exited {status_rc}: {status_err}"
    if report_rc != 0:
        notes["report_s"] = f"hpc report exited {report_rc}: {report_err}"
    if notes:
        row["history_notes"] = notes
    return row


TIMED = ("events_lines", "events_mb", "history_write_s", "timed_runs", "report_load1_each",
         "status_s", "status_range_s", "status_cpu_s", "status_cpu_range_s", "status_rss_mb",
         "report_s", "report_range_s", "report_cpu_s", "report_cpu_range_s", "report_rss_mb",
         "report_load", "history_notes", "report_first_run", "report_timed")


def record(out: Path, nodes: int, allocations: int, row: dict) -> None:
    """Puts ``row`` (:func:`measure`) into ``out``: the table's row for ``nodes`` (its other
    figures kept; the exponents fitted again) when the history has the table's allocations,
    else ``report_histories["NxA"]``."""
    from benchmarks.scale import run   # its summary (the exponents), only here

    summary = json.loads(out.read_text()) if out.exists() else {"figures": {}}
    if allocations != ALLOCATIONS:
        summary.setdefault("report_histories", {})[f"{nodes}x{allocations}"] = {
            "nodes": nodes, "allocations": allocations, **row}
        out.write_text(json.dumps(summary, indent=1) + "\n")
        return
    rows = {int(k): r for k, r in summary["figures"].items()}
    old = rows.setdefault(nodes, {"nodes": nodes, "ranks": nodes * 8, "notes": {}})
    for k in TIMED:
        old.pop(k, None)
    for k in ("status_s", "report_s"):
        old.setdefault("notes", {}).pop(k, None)
    old.update({k: v for k, v in row.items() if k != "history_notes"})
    old["notes"].update(row.get("history_notes", {}))
    run.write(out, [rows[n] for n in sorted(rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, nargs="+", required=True)
    p.add_argument("--allocations", type=int, default=ALLOCATIONS)
    p.add_argument("--runs", type=int, default=5, help="fresh processes of each command")
    p.add_argument("--work", default="", help="where the histories are (kept; one written there "
                                              "before is timed again, not written again)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "scale.json"))
    a = p.parse_args(argv)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="hpc-history-"))
    command = "python -m benchmarks.scale.history " + " ".join(
        argv if argv is not None else sys.argv[1:])
    for n in a.nodes:
        row = measure(n, allocations=a.allocations, work=work / f"{n}x{a.allocations}", runs=a.runs)
        row["report_timed"] = {"command": command, "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                               "bytecode_cached": not os.environ.get("PYTHONDONTWRITEBYTECODE")}
        print(json.dumps({"nodes": n, **{k: row.get(k) for k in (
            "events_lines", "report_s", "report_range_s", "report_cpu_s", "status_s", "report_load1_each")}}),
            flush=True)
        record(Path(a.out), n, a.allocations, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
