"""Per-step overhead of the Session against a bare DDP loop doing the same work.

Two ranks (gloo, CPU). Each step does the same fixed work: a small DDP forward/backward/
optimizer step plus a fixed sleep that stands in for the rest of a real step, sized so a
bare step takes about 10 ms or 100 ms. The Session loop adds what a user gets from it: the
sampler, ``s.log(loss=...)`` with metric reduction and a W&B offline log every ``--log-every``
steps, the overlapped preemption agreement (every step for the first 20, then about every
100 ms), progress. To tell where an overhead comes from, the bare loop is also run with one
piece added at a time: the sampler, the metric reduction (every ``--log-every`` steps), the
preemption agreement (every step, the worst case). All loops run in the same processes,
interleaved in rounds; the table shows median seconds per step and the ratio to bare.

    python benchmarks/step_overhead.py [--steps 200] [--wandb-mode offline|disabled] [--json PATH]"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _work(model, opt, x, sleep_s: float) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(sleep_s)
    return loss


def bare(model, opt, steps: int, sleep_s: float) -> list[float]:
    x = torch.randn(32, 64)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _work(model, opt, x, sleep_s)
        times.append(time.perf_counter() - t0)
    return times


def session_loop(s, model, opt, sampler, steps: int, sleep_s: float) -> list[float]:
    from runtime.sampler import rank_slice

    x = torch.randn(32, 64)
    times = []
    t0 = time.perf_counter()
    for _step in s.steps(0, steps):
        rank_slice(sampler.next_global_batch(), s.rank, s.world_size)
        loss = _work(model, opt, x, sleep_s)
        s.log(loss=loss.item())
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times[1:]          # the first interval includes generator start-up


def component_loop(part: str, *, model, opt, sampler, group, watcher, log_every: int,
                   rank: int, world: int, steps: int, sleep_s: float) -> list[float]:
    """The bare loop plus one piece of what the Session does at a step boundary, alone."""
    from runtime.metrics import reduce_metrics
    from runtime.sampler import rank_slice

    x = torch.randn(32, 64)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if part == "sampler":
            rank_slice(sampler.next_global_batch(), rank, world)
        loss = _work(model, opt, x, sleep_s)
        if part == "metrics" and step % log_every == 0:
            reduce_metrics({"loss": loss.item()}, {}, group=group)
        if part == "agreement":
            watcher.poll()
        times.append(time.perf_counter() - t0)
    if part == "agreement":
        watcher.drain()
    return times


PARTS = ("sampler", "metrics", "agreement")


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), WANDB_MODE=args.wandb_mode)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from runtime.preemption import PreemptionWatcher
    from runtime.sampler import ResumableSampler
    from runtime.session import Session

    job = Path(out).parent / "job"
    with Session(seed=0, job_dir=job, log_every=args.log_every) as s:
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        sampler = ResumableSampler(10**7, global_batch=64, seed=0)
        # The agreement alone: the same overlapped all-reduce on its own gloo group, every step.
        watcher = PreemptionWatcher(("SIGUSR2",), dist.new_group(backend="gloo"))
        # Calibrate the sleep so a bare step is ~target long.
        results: dict[str, float] = {}
        for target in (0.010, 0.100):
            probe = statistics.median(bare(model, opt, 20, 0.0))
            sleep_s = max(0.0, target - probe)
            steps = args.steps if target < 0.05 else max(20, args.steps // 5)
            times: dict[str, list[float]] = {"bare": [], "session": [], **{p: [] for p in PARTS}}
            for _ in range(args.rounds):            # interleave to cancel drift
                dist.barrier()
                times["bare"] += bare(model, opt, steps, sleep_s)
                dist.barrier()
                times["session"] += session_loop(s, model, opt, sampler, steps, sleep_s)
                for part in PARTS:
                    dist.barrier()
                    times[part] += component_loop(part, model=model, opt=opt, sampler=sampler,
                                                  group=s.cpu_group, watcher=watcher,
                                                  log_every=args.log_every, rank=rank, world=world,
                                                  steps=steps, sleep_s=sleep_s)
            key = f"{int(target * 1000)}ms"
            for name, values in times.items():
                results[f"{name}_{key}_s"] = statistics.median(values)
        if rank == 0:
            Path(out).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per round at 10 ms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--wandb-mode", default="offline", choices=("offline", "disabled"),
                   help="the Session's W&B mode (offline: rank 0 writes a real offline run)")
    p.add_argument("--json", default="", help="write the medians here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    print(f"{'step':>6} | {'loop':<23} | {'s/step':>9} | {'x bare':>6} | overhead | target")
    for key, target in (("10ms", 3.0), ("100ms", 1.0)):
        b = res[f"bare_{key}_s"]
        rows = [("bare DDP loop", "bare"), ("Session (all of it)", "session"),
                *((f"  bare + {p} only", p) for p in PARTS)]
        for label, name in rows:
            v = res[f"{name}_{key}_s"]
            goal = f"<= {target:.0f}%" if name == "session" else ""
            print(f"{key:>6} | {label:<23} | {v:9.5f} | {v / b:6.3f} | {(v / b - 1) * 100:+7.2f}% | {goal}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
