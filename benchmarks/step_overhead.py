"""Per-step overhead of the Session against a bare DDP loop doing the same work.

Two ranks (gloo, CPU). Each step does the same fixed work: a small DDP forward/backward/
optimizer step plus a fixed sleep that stands in for the rest of a real step, sized so a
bare step takes about 10 ms or 100 ms. The Session loop adds what a user gets from it: the
sampler, ``s.log(loss=...)`` with metric reduction every ``--log-every`` steps, the
overlapped preemption agreement every step, and progress. Both loops run in the same
processes, interleaved in rounds, and the table shows median seconds per step and the ratio.

    python benchmarks/step_overhead.py [--steps 200] [--json PATH]
"""

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


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), WANDB_MODE="disabled")
    from torch.nn.parallel import DistributedDataParallel as DDP

    from runtime.sampler import ResumableSampler
    from runtime.session import Session

    job = Path(out).parent / "job"
    with Session(seed=0, job_dir=job, log_every=args.log_every) as s:
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        sampler = ResumableSampler(10**7, global_batch=64, seed=0)
        # Calibrate the sleep so a bare step is ~target long.
        results: dict[str, list[float]] = {}
        for target in (0.010, 0.100):
            probe = statistics.median(bare(model, opt, 20, 0.0))
            sleep_s = max(0.0, target - probe)
            steps = args.steps if target < 0.05 else max(20, args.steps // 5)
            b, ss = [], []
            for _ in range(args.rounds):            # interleave to cancel drift
                dist.barrier()
                b += bare(model, opt, steps, sleep_s)
                dist.barrier()
                ss += session_loop(s, model, opt, sampler, steps, sleep_s)
            key = f"{int(target * 1000)}ms"
            results[f"bare_{key}_s"] = [statistics.median(b)]
            results[f"session_{key}_s"] = [statistics.median(ss)]
        if rank == 0:
            Path(out).write_text(json.dumps({k: v[0] for k, v in results.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per round at 10 ms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", default="", help="write the medians here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    print(f"{'step':>6} | {'bare s/step':>12} | {'session s/step':>14} | {'ratio':>6} | overhead | target")
    for key, target in (("10ms", 3.0), ("100ms", 1.0)):
        b, s = res[f"bare_{key}_s"], res[f"session_{key}_s"]
        over = (s / b - 1) * 100
        print(f"{key:>6} | {b:12.5f} | {s:14.5f} | {s / b:6.3f} | {over:+7.2f}% | <= {target:.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
