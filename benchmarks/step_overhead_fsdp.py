"""Per-step overhead of the Session with FSDP2 under in-process recovery (the peer copies of the
shards) against a bare FSDP2 loop doing the same work, at 100-ms steps, per shard size.

Issue 26 asks that the peer copies of the FSDP2 shards (``runtime/inprocess/worker/shard_copy.py``)
not push the Session's step overhead past its target (<= 1 % at 100-ms steps), and the Session
says once which ``HPC_INPROC_COPY_EVERY`` would meet it when a snapshot costs more. This measures
both, with the method of ``benchmarks/step_overhead.py`` (whose ``Work``, calibration and paired
statistics it reuses; see its docstring and ``benchmarks/pairstats.py``).

Two ranks (gloo, CPU, one torch thread each), each its own "node" (``GROUP_RANK`` = rank, as two
launchers give it), so each rank keeps the other's copy; a TCPStore this benchmark hosts plays
the launcher's (``HPC_INPROC_STORE``), with ``HPC_RECOVERY=inprocess``: the Session forms its
group on that store and runs the in-process machinery a user gets (guarded FSDP2 comms, guarded
optimizer, fault watch, lifeline, the snapshot at the step boundary, the exchange on a side
thread). A model of Linear layers sized so that each rank's shards (parameters + AdamW's two
states, local parts) take ``--shard-mb``; each step is an FSDP2 forward/backward/AdamW step plus
fixed work (``--work sleep`` or ``busy``) sized to a 100-ms bare step.

Loops, each run as rounds of the same number of steps, in blocks ``B X1 B X2 ... B`` (shuffled):

- ``bare``: ``fully_shard`` of the same model (blocks, then root), plain optimizer, no Session
  (between two bare rounds, the A/A control);
- ``wrap``: the bare loop on the Session's model and optimizer (``s.wrap(fsdp=True)`` with the
  in-process guard's comms and optimizer step), outside ``s.steps()``: the guard's share;
- ``nocopy``: the Session's loop with the copies never due (the in-process Session without
  copies: its guarded comms, ``s.steps()``, ``s.log``, the sampler);
- ``copy``: the same with a copy every step (``HPC_INPROC_COPY_EVERY=1``, the default);
- ``every``: a copy every N steps, N being what the Session's own warning recommended during the
  warm-up at 100-ms steps (parsed from its log line; when it has not said it yet, its rule,
  ``shard_copy.advised_every``, on the warm-up's snapshots and steps; absent when neither asks
  for more than 1).

The interval is set between rounds on the live ``PeerCopies`` (the attribute the variable sets).
A round is a multiple of N steps, so each holds the same number of copies. The exchange a round
started is waited for after the round, outside its timing (its wait is reported: it would
otherwise run into the next bare round); an exchange still running at the next copy is waited
for inside the step, as in a job.

    flock /tmp/hpc-bench.lock python benchmarks/step_overhead_fsdp.py --shard-mb 1 4 16
        [--blocks 20] [--work sleep|busy] [--pin] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pairstats import summarize  # noqa: E402
from benchmarks.step_overhead import Loops, Work, _agree, _ratios_by_block, calibrate, timed_bare  # noqa: E402
from runtime.inprocess.worker.shard_copy import advised_every  # noqa: E402

STEP_S, TARGET_PCT = 0.100, 1.0
NEVER = 10**9                      # a copy interval no round reaches
VARIANTS = ("wrap", "nocopy", "copy", "every", "bare")
LABELS = {"wrap": "bare on the s.wrap() model", "nocopy": "Session, copies off", "copy": "Session, copy every step", "every": "Session, copy every N",
          "bare": "bare (A/A control)"}
ADVICE = re.compile(r"set HPC_INPROC_COPY_EVERY=(\d+)")


def hidden_for(shard_mb: float, world: int = 2) -> int:
    """The hidden width H of ``Linear(64,H) ReLU Linear(H,H) ReLU Linear(H,1)`` whose shards per
    rank (parameters and AdamW's two states, fp32, 1/world of each) take ``shard_mb``."""
    params = shard_mb * 2**20 * world / (3 * 4)
    return max(8, round((-66 + math.sqrt(66**2 + 4 * (params - 1))) / 2))


def net(hidden: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


class Advice(logging.Handler):
    """Keeps the interval the Session's copy warning recommends."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.every: int | None = None
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        m = ADVICE.search(record.getMessage())
        if m:
            self.every, self.line = int(m.group(1)), record.getMessage()


class CopyLoops(Loops):
    """The loops of one shard size; ``copy``/``every``/``nocopy`` are the Session's loop with the
    copy interval set before the round."""

    def __init__(self, s: Any, work: Work, sampler: Any, log_every: int, copies: Any) -> None:
        super().__init__(s, work, sampler, None, log_every)
        self.copies = copies
        self.intervals = {"copy": 1, "nocopy": NEVER, "every": 1}
        self.stats: dict[str, dict[str, float]] = {}

    def round(self, name: str, steps: int) -> float:
        dist.barrier()
        if name == "bare":
            return timed_bare(self.work, steps)
        if name == "wrap":
            return timed_bare(self.work.session, steps)
        c = self.copies
        c.every = self.intervals[name]
        before = (c.snapshot_s, c.snapshots, c.copy_s, c.copies_made, c.copy_cpu_s)
        at = len(self.boundary_s)
        took = self._session(steps)
        inside = sum(self.boundary_s[at:])
        t0 = time.perf_counter()
        c.settle()            # outside the round's time: else it runs into the next bare round
        waited = time.perf_counter() - t0
        st = self.stats.setdefault(name, {"snapshot_s": 0.0, "snapshots": 0, "copy_s": 0.0, "copies": 0,
                                          "settle_after_s": 0.0, "inside_s": 0.0, "copy_cpu_s": 0.0, "rounds": 0, "steps": 0})
        st["inside_s"] += inside
        st["snapshot_s"] += c.snapshot_s - before[0]
        st["snapshots"] += c.snapshots - before[1]
        st["copy_s"] += c.copy_s - before[2]
        st["copies"] += c.copies_made - before[3]
        st["copy_cpu_s"] += c.copy_cpu_s - before[4]
        st["settle_after_s"] += waited
        st["rounds"] += 1
        st["steps"] += steps
        return took

    def close(self) -> None:
        self.gen.close()


def run_size(s: Any, work: Work, sampler: Any, copies: Any, advice: Advice, args: argparse.Namespace) -> dict[str, Any]:
    cal = calibrate(work, STEP_S)
    loops = CopyLoops(s, work, sampler, args.log_every, copies)
    # Warm-up at the calibrated step, a copy every step: the Session's interval calibration (20
    # steps), W&B's start, and its copy warning (after 3 snapshots, with the step time it saw).
    loops.round("copy", 3 * args.log_every + 21)
    # The Session says its advice once, when its running mean first crosses 1 % (that may come
    # late when the snapshot sits near 1 %): without it yet, its rule on the warm-up's figures.
    rule = 0
    if copies.snapshots and s._recent:
        snap_s = copies.snapshot_s / copies.snapshots
        rule = advised_every(snap_s, statistics.median(s._recent) - snap_s, 1) or 0
    said = args.every or _agree_max(advice.every or rule)
    source = "--every" if args.every else "log" if advice.every else "rule" if said else "none"
    every = said or 1
    loops.intervals["every"] = every
    variants = [v for v in VARIANTS if (v != "every" or said) and v in args.variants]
    steps = every * max(1, math.ceil(args.round_steps / every))
    rounds: list[tuple[str, float]] = []
    resized = []
    for block in range(-args.warmup_blocks, args.blocks):
        order = list(variants)
        random.Random(args.seed * 1000 + block).shuffle(order)
        if block == 0:
            loops.boundary_s.clear()
            loops.boundary_kind.clear()
            loops.stats.clear()
            saved_before = s._checkpointer.latest_step()
        seq = ["bare"]
        for v in order:
            seq += [v, "bare"]
        block_rounds = [(name, loops.round(name, steps)) for name in seq]
        if block >= 0:
            rounds.append(("block", 0.0))
            rounds += block_rounds
        bare_now = _agree_float_mean(statistics.median(t for n, t in block_rounds if n == "bare"))
        if abs(bare_now - STEP_S) > 0.03 * STEP_S:   # the machine's speed moved: resize the work
            work.units = _agree(max(0, round(work.units + (STEP_S - bare_now) / cal["unit_s"])))
            resized.append({"block": block, "bare_step_s": bare_now, "units": work.units})
    loops.close()
    ratios = _ratios_by_block(rounds)
    by: dict[str, list[float]] = {}
    for n, t in rounds:
        if n != "block":
            by.setdefault(n, []).append(t)
    bare = by["bare"]
    per_snapshot = {k: v["snapshot_s"] / v["snapshots"] for k, v in loops.stats.items() if v["snapshots"]}
    snap = per_snapshot.get("copy")
    return {
        "shard_bytes": copies.bytes_per_copy, "held_bytes": copies.held_bytes(), "hidden": args.hidden,
        "calibration": cal, "resized": resized, "round_steps": steps,
        # The Session's own checkpoint schedule (auto: its first save in the warm-up, then ~5 min).
        "checkpoint_step_before": saved_before, "checkpoint_step_after": s._checkpointer.latest_step(),
        "advice": {"every": said or None, "source": source, "line": advice.line,
                   # The same rule on the measured rounds' snapshots and bare step.
                   "every_from_bare_step": (advised_every(snap, statistics.median(bare), 1) or 1)
                   if snap else None},
        "bare_step_s": {"median": statistics.median(bare), "min": min(bare), "max": max(bare), "rounds": len(bare)},
        "step_s_median": {k: statistics.median(v) for k, v in by.items()},
        # Per variant: the copies' figures, and rank 0's time inside the Session's boundary
        # (``next()`` of ``s.steps()``, where the snapshot runs, plus ``s.log``) per step.
        "copies": {k: v | {"per_snapshot_s": per_snapshot.get(k), "inside_per_step_s": v["inside_s"] / v["steps"],
                           "per_exchange_s": v["copy_s"] / v["copies"] if v["copies"] else None,
                           "per_exchange_cpu_s": v["copy_cpu_s"] / v["copies"] if v["copies"] else None}
                   for k, v in loops.stats.items()},
        "intervals": dict(loops.intervals),
        "ratios": ratios,
        "summary": {k: summarize(r, TARGET_PCT).to_dict() for k, r in ratios.items()},
        "rounds": [[n, round(t, 7)] for n, t in rounds],
    }


def _agree_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _agree_float_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t.item())


def worker(rank: int, world: int, port: int, store_port: int, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GROUP_RANK=str(rank), WANDB_MODE=args.wandb_mode,
                      HPC_HEARTBEAT_DIR=args.heartbeat_dir, HPC_RECOVERY="inprocess",
                      HPC_INPROC_STORE=f"127.0.0.1:{store_port}", HPC_INPROC_COPY_EVERY="1")
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    from runtime.sampler import ResumableSampler
    from runtime.session import Session

    advice = Advice()
    logging.getLogger("hpc.inprocess").addHandler(advice)
    with Session(seed=0, job_dir=Path(tmp) / "job", log_every=args.log_every) as s:
        assert getattr(s._recovery, "inproc", None) is not None, "the Session did not start in-process recovery"
        bare_model = net(args.hidden)
        for i in (0, 2, 4):
            fully_shard(bare_model[i])
        fully_shard(bare_model)
        x = torch.randn(args.batch, 64)
        work = Work(bare_model, torch.optim.AdamW(bare_model.parameters(), lr=1e-6), args.work)
        work.x = x
        model = net(args.hidden)
        model = s.wrap(model, fsdp=True, blocks=[model[0], model[2], model[4]])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        sampler = ResumableSampler(10**7, global_batch=64, seed=0)
        s.restore(model=model, optim=opt, sampler=sampler)   # attaches the in-process recovery
        copies = s._recovery.inproc.copies
        assert copies is not None, "no peer copies: the model was not taken as sharded"
        work.session = Work(model, opt, args.work)
        work.session.x = x
        timed_bare(work, 20)   # warm-up: allocator, AdamW's state
        result = run_size(s, work, sampler, copies, advice, args)
        if rank == 0:
            (Path(tmp) / "result.json").write_text(json.dumps(result))


def table(res: dict[str, Any]) -> list[str]:
    lines = [f"{'shards':>8} | {'loop':<26} | {'s/step':>8} | {'x bare':>6} | {'95% interval':>15} | "
             f"{'+-':>6} | {'n':>3} | verdict (<= {TARGET_PCT:.0f}%)"]
    for key, r in res.items():
        for v in VARIANTS:
            summ = r["summary"].get(v)
            if summ is None:
                continue
            label = LABELS[v] if v != "every" else f"Session, copy every {r['intervals']['every']}"
            ci = f"{summ['lo']:.4f}-{summ['hi']:.4f}" if summ["lo"] is not None else "n/a"
            half = f"{summ['half_width_pct']:.2f}%" if summ["half_width_pct"] is not None else "n/a"
            verdict = ("ok" if summ["trusted"] else "untrusted") if v == "bare" else _verdict(summ)
            lines.append(f"{key:>8} | {label:<26} | {r['step_s_median'][v]:8.5f} | {summ['median']:6.4f} | "
                         f"{ci:>15} | {half:>6} | {summ['n']:>3} | {verdict}")
    return lines


def _verdict(summ: dict[str, Any]) -> str:
    if not summ["trusted"]:
        return "untrusted (interval wider than +-1%)"
    limit = 1 + TARGET_PCT / 100
    return "meets" if summ["hi"] <= limit else "exceeds" if summ["lo"] > limit else "undecided"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--shard-mb", nargs="+", type=float, default=[1.0, 4.0, 16.0],
                   help="shards per rank (parameters + AdamW state), one run each")
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--warmup-blocks", type=int, default=1)
    p.add_argument("--every", type=int, default=0, help="the every-N variant's N (default: the Session's advice)")
    p.add_argument("--round-steps", type=int, default=10, help="steps per round (rounded up to N's multiple)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--work", default="sleep", choices=("busy", "sleep"))
    p.add_argument("--pin", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb-mode", default="offline", choices=("offline", "disabled"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    from runtime.liveness.watchdog import heartbeat_root

    load_before, started = os.getloadavg(), time.time()
    res: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    for mb in args.shard_mb:
        args.hidden = hidden_for(mb)
        key = f"{mb:g}MB"
        l0 = os.getloadavg()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock, \
                tempfile.TemporaryDirectory(prefix="hpc-bench-hb-", dir=heartbeat_root()) as hb:
            args.heartbeat_dir = hb
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            mp.spawn(worker, args=(2, port, store.port, args, tmp), nprocs=2, join=True)
            res[key] = json.loads((Path(tmp) / "result.json").read_text())
        del store
        loads[key] = {"before": l0, "after": os.getloadavg()}
        r = res[key]
        cal, bare, adv = r["calibration"], r["bare_step_s"], r["advice"]
        print(f"{key}: {r['shard_bytes'] / 2**20:.1f} MB of shards per rank (H={r['hidden']}), copies hold "
              f"{r['held_bytes'] / 2**20:.1f} MB; bare step calibrated to {cal['checked_step_s'] * 1e3:.2f} ms "
              f"(FSDP2 step {cal['ddp_step_s'] * 1e3:.2f} ms), rounds: median {bare['median'] * 1e3:.2f} ms "
              f"({bare['min'] * 1e3:.2f}-{bare['max'] * 1e3:.2f}), {r['round_steps']} steps a round, resized "
              f"{len(r['resized'])} times; load {l0[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
        for v, c in r["copies"].items():
            print(f"  {v}: inside the Session's boundary {c['inside_per_step_s'] * 1e3:.2f} ms per step "
                  f"(step {r['step_s_median'][v] * 1e3:.2f} ms, bare {bare['median'] * 1e3:.2f} ms)", flush=True)
            if c["snapshots"]:
                print(f"  {v}: snapshot {c['per_snapshot_s'] * 1e3:.2f} ms x {c['snapshots']}, exchange "
                      f"{(c['per_exchange_s'] or 0) * 1e3:.1f} ms (side thread; its CPU {(c['per_exchange_cpu_s'] or 0) * 1e3:.1f} ms), waited after rounds "
                      f"{c['settle_after_s'] / c['rounds'] * 1e3:.1f} ms per round", flush=True)
        print(f"  the Session's advice: {adv['line'] or 'none (the snapshot is within 1 %)'}; from the bare "
              f"step: every {adv['every_from_bare_step']}", flush=True)
    print("\n".join(table(res)))
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {time.time() - started:.0f} s")
    if args.json:
        meta = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "wall_s": round(time.time() - started, 1), "load_before": load_before, "load_after": load_after,
                "loads": loads, "pinned": args.pin, "work": args.work, "blocks": args.blocks,
                "torch": torch.__version__, "cpus": os.cpu_count()}
        Path(args.json).write_text(json.dumps({"meta": meta, **res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
