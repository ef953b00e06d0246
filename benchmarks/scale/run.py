"""Runs the simulated control plane for N nodes and records the figures (issue 29).

    python -m benchmarks.scale.run --nodes 16 64 256 1024 [--out benchmarks/scale.json]

For each N: a real libuv ``TCPStore`` server in its own process (its CPU is measured), the
node agents in ``--procs`` processes (:mod:`.nodes`) plus one process holding only the victim
node (the last), then, in order:

1. **join**: every agent joins torch's c10d rendezvous (``MIN = MAX = N``); ``join_s`` is from
   the common start to the last agent's return.
2. **load**: beacons and rendezvous keep-alives run; over ``--window`` seconds we count the
   store requests the agents make (``store_req_per_s``) and the server's CPU share.
3. **detect**: the victim's process is suspended (SIGSTOP, its keepalive stops as a frozen
   node's does); ``detect_s`` is when the sampled observers' trackers (node 0, the host, among
   them) name it lost (the median; the watch acts on it at its next poll, <= 0.5 s later).
4. **records**: the stall watch's node records on the job directory for ``--ticks`` polls;
   ``fs_ops_per_node_per_s`` is the audited operations of one node's poll, over its period
   (:data:`runtime.liveness.watchdog.POLL_S`): what the code asks of the file server.
5. **elect**: node 0 is declared lost; the others run the succession election on the job
   directory; ``elect_s`` is from the common start to the last survivor's decision.
6. **report**: :mod:`.history` writes N nodes x 20 allocations of events and times
   ``hpc status`` and ``hpc report`` on it, ``--report-runs`` fresh processes each
   (``report_s``, ``status_s``: the medians; their ranges, CPU seconds and peak memory).
   ``python -m benchmarks.scale.history`` times them again alone.

A figure that could not be measured is null with its reason in ``notes``; nothing is
estimated in its place.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.scale import history
from benchmarks.scale.fit import exponent
from benchmarks.scale.meter import cpu_s, load
from runtime.launch.main import rdzv_conf
from runtime.liveness import groups
from runtime.liveness.beacon import BEAT_S, LOST_AFTER_S
from runtime.liveness.watchdog import POLL_S

ROOT = Path(__file__).resolve().parents[2]
RESOLVER = "timeout:1 attempts:1"   # glibc resolver options for the store's peers (see simulate)
FIGURES = ("join_s", "detect_s", "elect_s", "store_req_per_s", "fs_ops_per_node_per_s", "report_s")

SERVER = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
             timeout=timedelta(seconds=600))
print(s.port, flush=True)
time.sleep(1e6)
"""


def _collect(ctl: Path, name: str, pids: list[int], timeout_s: float) -> list[dict] | None:
    end = time.time() + timeout_s
    while time.time() < end:
        paths = [ctl / f"{name}-{pid}.json" for pid in pids]
        if all(p.exists() for p in paths):
            return [json.loads(p.read_text()) for p in paths]
        time.sleep(0.1)
    return None


def _go(ctl: Path, name: str, **data: object) -> None:
    tmp = ctl / f".go-{name}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, ctl / f"go-{name}.json")


def simulate(n: int, *, procs: int = 2, window_s: float = 10.0, ticks: int = 8,
             join_timeout_s: float = 300.0, history_allocs: int = 20,
             work: Path | None = None, skip_liveness: str = "", skip_join: str = "",
             beacons_per_thread: int = 1, join_only: bool = False, keep_alive_s: float = 0.0,
             rdzv: str = "launcher", history_runs: int = 1) -> dict:
    """Measures one N; returns its row (figures, their context, and notes on any null).

    ``skip_liveness``: a reason not to run the join, load and detection phases (then their
    figures are null with that reason).
    """
    tmp = Path(tempfile.mkdtemp(prefix=f"hpc-scale-{n}-", dir=work))
    job_dir, ctl = tmp / "job", tmp / "ctl"
    job_dir.mkdir()
    ctl.mkdir()
    row: dict = {"nodes": n, "ranks": n * 8, "load_before": load(), "notes": {},
                 "beacons_per_thread": beacons_per_thread,
                 "rdzv_keep_alive_s": keep_alive_s or rdzv_conf(n)["keep_alive_interval"]}
    # As the launcher sets it (runtime.launch.plan): torch 2.13's elastic restarts need it.
    # RES_OPTIONS: torch's TCPStore resolves every peer's address (reverse DNS, on the server's
    # loop thread too) when it connects; this sandbox's resolver stalls 5 s on some queries
    # under load (256 connects from 16 threads: 45.6 s with 26 timeouts by default, 1.1 s with
    # a 1-s resolver timeout). See docs/scale.md.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR", "RES_OPTIONS": os.environ.get("RES_OPTIONS", RESOLVER)}
    row["resolver"] = env["RES_OPTIONS"]
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=env)
    port = int(server.stdout.readline())
    endpoint = f"127.0.0.1:{port}"
    victim = n - 1
    per = max(1, -(-(n - 1) // procs))
    spans = [(f, min(per, n - 1 - f)) for f in range(0, n - 1, per)] + [(victim, 1)]
    hosts = [subprocess.Popen([sys.executable, "-m", "benchmarks.scale.nodes", "--first", str(f),
                               "--count", str(c), "--nodes", str(n), "--endpoint", endpoint,
                               "--job-dir", str(job_dir), "--ctl", str(ctl),
                               "--join-timeout", str(join_timeout_s),
                               "--beacons-per-thread", str(beacons_per_thread),
                               *(["--no-join"] if skip_join else []),
                               *(["--no-election"] if join_only else []),
                               *(["--keep-alive", str(keep_alive_s)] if keep_alive_s else []),
                               "--rdzv", rdzv,
                               *(["--skip-liveness"] if skip_liveness else [])], env=env, cwd=ROOT)
             for f, c in spans]
    pids = [h.pid for h in hosts]
    try:
        if _collect(ctl, "ready", pids, 300) is None:
            raise RuntimeError("the node processes did not start in 300 s")
        if skip_liveness:
            _go(ctl, "join", skip=True)
            _collect(ctl, "joined", pids, 60)
            _go(ctl, "load", skip=True)
            _collect(ctl, "load", pids, 60)
            for k in ("join_s", "store_req_per_s", "detect_s"):
                row[k] = None
                row["notes"][k] = f"not run: {skip_liveness}"
        elif join_only:   # the join alone (torch's c10d rendezvous), then every phase skipped
            _join(row, n, ctl, pids, server, join_timeout_s)
            for phase, answer_name, extra in (("load", "load", {"skip": True}),
                                              ("records", "records", {"ticks": 0}),
                                              ("elect", "elect", {"skip": True})):
                _go(ctl, phase, **extra)
                _collect(ctl, answer_name, pids, 120)
        else:
            _liveness(row, n, ctl, pids, hosts, server, window_s, join_timeout_s, skip_join)
        if not join_only:
            _records_and_election(row, n, ctl, pids, ticks)
    finally:
        for h in hosts:
            try:
                os.kill(h.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for h in hosts:
            try:
                h.wait(timeout=30)
            except subprocess.TimeoutExpired:
                h.kill()
                h.wait()
        server.kill()
        server.wait()
    if history_allocs:
        row.update(history.measure(n, allocations=history_allocs, work=tmp, runs=history_runs))
    row["load_after"] = load()
    return row


def _join(row: dict, n: int, ctl: Path, pids: list[int], server: subprocess.Popen,
          join_timeout_s: float) -> None:
    """Phase 1: every agent joins torch's c10d rendezvous from a common start."""
    t_join = time.time() + 1.0
    c0 = cpu_s(server.pid)
    _go(ctl, "join", t=t_join)
    joined = _collect(ctl, "joined", pids, join_timeout_s + 120)
    if joined is None:
        raise RuntimeError(f"the agents neither joined nor gave up in {join_timeout_s + 120:.0f} s")
    done = [t for j in joined for t in j["done"].values()]
    errors = [e for j in joined for e in j["errors"]]
    row["join_s"] = round(max(done) - t_join, 3) if len(done) == n else None
    row["joined"] = len(done)
    if row["join_s"] is None:
        row["notes"]["join_s"] = (f"{n - len(done)} of {n} agents did not join within the "
                                  f"rendezvous join_timeout of {join_timeout_s:.0f} s: {errors[:1]}")
    row["rdzv_backend"] = next((j.get("rdzv_backend") for j in joined if j.get("rdzv_backend")), None)
    row["join_rdzv_requests"] = sum(j["rdzv_requests"] for j in joined)
    row["join_rdzv_mb"] = round(sum(j.get("rdzv_bytes", 0) for j in joined) / 1e6, 1)
    row["join_rdzv_kb"] = round(sum(j.get("rdzv_bytes", 0) for j in joined) / 1e3, 1)
    row["join_rdzv_requests_per_node"] = round(row["join_rdzv_requests"] / n, 2)
    # The agents' processes' CPU over the join (they do nothing else then): the client side.
    row["join_client_cpu_s"] = round(sum(j.get("cpu_s", 0.0) for j in joined), 1)
    row["join_server_cpu_s"] = round(cpu_s(server.pid) - c0, 2)
    row["join_load"] = load()


def _liveness(row: dict, n: int, ctl: Path, pids: list[int], hosts: list, server: subprocess.Popen,
              window_s: float, join_timeout_s: float, skip_join: str = "") -> None:
    """Phases 1-3: join, the load window, the silent node's detection."""
    victim = n - 1
    if skip_join:
        _go(ctl, "join", skip=True)
        _collect(ctl, "joined", pids, 60)
        row["join_s"] = None
        row["notes"]["join_s"] = f"not run: {skip_join}"
    else:
        _join(row, n, ctl, pids, server, join_timeout_s)
    # The beacons start; the window opens once every one of them (the victim's too) has beaten
    # and read its peers: a node that never reached the store is tracked by nobody. Its first
    # connection can take seconds on this loaded machine (seen: 5 s, the victim's only try
    # before its SIGSTOP, which made 0 of 16 observers name it).
    beat_timeout = 60.0 + n / 10
    _go(ctl, "load", t=0, timeout_s=beat_timeout)
    beating = _collect(ctl, "beating", pids, beat_timeout + 60) or []
    row["beating"] = f"{sum(b['beating'] for b in beating)} of {n}"
    row["beacon_connect_errors"] = sum(len(v) for b in beating for v in b["connect_errors"].values())
    t0 = time.time() + 2 * BEAT_S   # every beacon has a counter; two more beats read it
    t1 = t0 + window_s
    detect_timeout = LOST_AFTER_S + 30.0
    _go(ctl, "window", t=0, t0=t0, t1=t1, t_stop=t1, victim=victim, detect_timeout_s=detect_timeout)
    time.sleep(max(0.0, t0 - time.time()))
    s0 = cpu_s(server.pid)
    time.sleep(max(0.0, t1 - time.time()))
    s1 = cpu_s(server.pid)
    row["load_window"] = load()
    os.kill(hosts[-1].pid, signal.SIGSTOP)      # the victim node goes silent
    loaded = _collect(ctl, "load", pids[:-1], detect_timeout + 30)
    os.kill(hosts[-1].pid, signal.SIGCONT)
    loaded = (loaded or []) + (_collect(ctl, "load", pids[-1:], 60) or [])
    req = sum(x["beacon_req"] + x["rdzv_req"] for x in loaded)
    row["store_req_per_s"] = round(req / window_s, 1)
    row["beacon_req_per_s"] = round(sum(x["beacon_req"] for x in loaded) / window_s, 1)
    row["rdzv_keepalive_req_per_s"] = round(sum(x["rdzv_req"] for x in loaded) / window_s, 1)
    row["beacon_demand_req_per_s"] = groups.requests_per_beat(n) / BEAT_S
    row["store_server_cpu"] = round((s1 - s0) / window_s, 3)
    row["false_lost"] = sorted({r for x in loaded for r in x.get("false_lost", [])})[:20]
    seen = [s for x in loaded[:-1] for s in x["detected"].values()]
    watched = sum(x["observers"] for x in loaded[:-1])
    host_seen = [x["detected"].get("0") for x in loaded if "0" in x["detected"]]
    row["detect_observers"] = f"{len(seen)} of {watched}"
    row["detect_s"] = round(statistics.median(seen), 2) if seen and len(seen) == watched else None
    row["detect_max_s"] = round(max(seen), 2) if seen else None
    row["detect_host_s"] = round(host_seen[0], 2) if host_seen else None
    if row["detect_s"] is None:
        missed = [m for x in loaded[:-1] for m in x.get("missed", {}).values()]
        row["notes"]["detect_s"] = (f"only {len(seen)} of {watched} observers named the silent "
                                    f"node within {detect_timeout:.0f} s; missed: {missed[:3]}")


def _records_and_election(row: dict, n: int, ctl: Path, pids: list[int], ticks: int) -> None:
    """Phases 4-5: the stall watch's node records, the succession election."""
    # The stall watch's records on the job directory.
    _go(ctl, "records", t=time.time() + 0.5, ticks=ticks)
    recs = _collect(ctl, "records", pids, 1800)
    if not ticks:
        pass
    elif recs:
        agents = sum(r["agents"] for r in recs)
        per_tick = sum(r["ops_per_node_tick"] * r["agents"] for r in recs) / agents
        row["fs_ops_per_node_tick"] = round(per_tick, 1)
        row["fs_ops_per_node_per_s"] = round(per_tick / POLL_S, 1)
        row["fs_tick_s"] = round(max(r["tick_s"] for r in recs), 3)
    else:
        row["fs_ops_per_node_per_s"] = None
        row["notes"]["fs_ops_per_node_per_s"] = "the record ticks did not finish in 1800 s"
    # Succession: node 0 lost; everyone else elects.
    row["elect_load"] = load()
    t_elect = time.time() + 1.0
    _go(ctl, "elect", t=t_elect)
    elected = _collect(ctl, "elect", pids, 300)
    if elected:
        decided = [v for e in elected for v in e["decided"].values()]
        outcomes = {tuple(v[1:]) for v in decided}
        row["elect_s"] = round(max(v[0] for v in decided) - t_elect, 3)
        row["elect_fs_ops_per_node"] = round(sum(e["fs_ops"] for e in elected) / len(decided), 1)
        row["elect_agree"] = len(outcomes) == 1 and len(decided) == n - 1
        row["elect_members"] = min(v[3] for v in decided)   # of n - 1 survivors
        if not row["elect_agree"]:
            row["notes"]["elect_s"] = f"survivors disagreed or missed: {sorted(outcomes)[:3]}"
    else:
        row["elect_s"] = None
        row["notes"]["elect_s"] = "the election did not finish in 300 s"


def starved(row: dict) -> None:
    """A load window in which the agents made under half the requests the code asks for
    measured this machine's overload, not the design: its rate moves to
    ``store_req_achieved_per_s`` and ``store_req_per_s`` is null with the reason."""
    got, asked = row.get("beacon_req_per_s"), row.get("beacon_demand_req_per_s")
    if got is None or not asked or got >= asked / 2:
        return
    for k in ("store_req_per_s", "beacon_req_per_s", "store_server_cpu"):
        row[k.replace("_per_s", "") + "_achieved" + ("_per_s" if k.endswith("_per_s") else "")] = row.get(k)
        row[k] = None
    row["notes"]["store_req_per_s"] = (
        f"the agents made {got:g} of the {asked:g} beacon requests/s the code asks for "
        f"(store server at {row.get('store_server_cpu_achieved')} cores): the simulating machine was the "
        "bottleneck (2 cores, load "
        f"{(row.get('load_window') or {}).get('load1')}), so this rate says nothing about the design")


def summarize(rows: list[dict]) -> dict:
    """The rows with each figure's growth exponent over N."""
    for r in rows:
        starved(r)
    ns = [r["nodes"] for r in rows]
    extra = ("store_server_cpu", "beacon_req_per_s", "beacon_demand_req_per_s",
             "rdzv_keepalive_req_per_s", "elect_fs_ops_per_node", "status_s", "report_rss_mb",
             "events_lines", "join_rdzv_requests", "join_rdzv_kb", "report_cpu_s", "status_cpu_s")
    return {"figures": {str(r["nodes"]): r for r in rows},
            "exponents": {k: exponent(ns, [r.get(k) for r in rows]) for k in (*FIGURES, *extra)}}


def write(out: Path, rows: list[dict]) -> None:
    """Writes the rows' summary to ``out``, keeping its other records (``join_experiments``)."""
    kept = {}
    if out.exists():
        kept = {k: v for k, v in json.loads(out.read_text()).items() if k not in ("figures", "exponents")}
    out.write_text(json.dumps({**summarize(rows), **kept}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--procs", type=int, default=2, help="processes hosting the agents")
    p.add_argument("--window", type=float, default=10.0, help="seconds of the load window")
    p.add_argument("--join-timeout", type=float, default=300.0,
                   help="the rendezvous join_timeout (s) given to the agents")
    p.add_argument("--skip-liveness-from", type=int, default=1 << 30,
                   help="from this N on, skip join/keepalive/detection (with --skip-liveness)")
    p.add_argument("--skip-liveness", default="", help="the reason recorded for skipping")
    p.add_argument("--skip-join-from", type=int, default=1 << 30,
                   help="from this N on, skip only the c10d join (with --skip-join)")
    p.add_argument("--skip-join", default="", help="the reason recorded for skipping the join")
    p.add_argument("--beacons-per-thread", type=int, default=1,
                   help="nodes whose beacons one driver thread steps (1: a thread each, as launchers)")
    p.add_argument("--rdzv-keep-alive", type=float, default=0.0,
                   help="an experiment: the rendezvous keep-alive interval (s) instead of the launcher's")
    p.add_argument("--join-only", action="store_true",
                   help="measure the join again and update those figures in --out")
    p.add_argument("--rdzv", choices=("launcher", "c10d"), default="launcher",
                   help="the launcher's rendezvous (listed first round) or torch's c10d alone")
    p.add_argument("--elect-only", action="store_true",
                   help="measure the election again and update those figures in --out")
    p.add_argument("--report-runs", type=int, default=5,
                   help="fresh processes of hpc status and hpc report on the history (their median)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "scale.json"))
    p.add_argument("--merge", action="store_true", help="keep the rows of other N in --out")
    a = p.parse_args(argv)
    rows = []
    out = Path(a.out)
    if a.merge and out.exists():
        old = json.loads(out.read_text())["figures"]
        rows = [r for k, r in old.items() if int(k) not in a.nodes]
    if a.join_only:     # the c10d join again, into the rows already recorded
        rows = list(json.loads(out.read_text())["figures"].values())
        for n in a.nodes:
            row = simulate(n, procs=a.procs, ticks=0, history_allocs=0, join_timeout_s=a.join_timeout,
                           join_only=True, keep_alive_s=a.rdzv_keep_alive, rdzv=a.rdzv)
            old = next((r for r in rows if r["nodes"] == n), None)
            if old is None:   # a join-only row (another N than the table's)
                old = {"nodes": n, "ranks": n * 8, "notes": {}}
                rows.append(old)
                rows.sort(key=lambda r: r["nodes"])
            keys = ("join_s", "joined", "join_rdzv_requests", "join_rdzv_mb", "join_client_cpu_s",
                    "join_server_cpu_s", "join_load", "resolver", "rdzv_keep_alive_s")
            if old.get("rdzv_backend", "c10d") == "c10d" and row.get("rdzv_backend") != "c10d" \
                    and "join_c10d" not in old:   # keep torch's c10d figures beside the new ones
                old["join_c10d"] = {k: old.get(k) for k in keys if k in old}
                if "join_s" in old["notes"]:
                    old["join_c10d"]["note"] = old["notes"]["join_s"]
            old["notes"].pop("join_s", None)
            for k in (*keys, "rdzv_backend", "join_rdzv_kb", "join_rdzv_requests_per_node"):
                old[k] = row.get(k)
            if "join_s" in row["notes"]:
                old["notes"]["join_s"] = row["notes"]["join_s"]
            print(json.dumps({k: row.get(k) for k in ("nodes", "rdzv_backend", "join_s", "joined", "join_rdzv_requests",
                                                      "join_rdzv_kb",
                                                      "join_rdzv_mb", "join_client_cpu_s",
                                                      "join_server_cpu_s", "join_load")}), flush=True)
            write(out, rows)
        return 0
    if a.elect_only:    # the election again, into the rows already recorded
        rows = list(json.loads(out.read_text())["figures"].values())
        for n in a.nodes:
            row = simulate(n, procs=a.procs, ticks=0, history_allocs=0, skip_liveness="elect only")
            old = next(r for r in rows if r["nodes"] == n)
            old["notes"].pop("elect_s", None)
            for k in ("elect_s", "elect_fs_ops_per_node", "elect_agree", "elect_members"):
                old[k] = row.get(k)
            old["elect_load"] = row["load_before"]
            if "elect_s" in row["notes"]:
                old["notes"]["elect_s"] = row["notes"]["elect_s"]
        write(out, rows)
        return 0
    for n in a.nodes:
        skip = a.skip_liveness if n >= a.skip_liveness_from else ""
        row = simulate(n, procs=a.procs, window_s=a.window, join_timeout_s=a.join_timeout,
                       skip_liveness=skip, skip_join=a.skip_join if n >= a.skip_join_from else "",
                       beacons_per_thread=a.beacons_per_thread, rdzv=a.rdzv,
                       history_runs=a.report_runs)
        print(json.dumps({k: row.get(k) for k in (*FIGURES, "load_window")}), flush=True)
        rows.append(row)
        rows.sort(key=lambda r: r["nodes"])
        write(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
