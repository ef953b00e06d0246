"""Per-step cost of the DDP wrapper alone: ``s.wrap(model)`` against plain ``DDP(model)``.

No added work, so the step is only a small DDP step (~3 ms on this VM) and a fixed cost per
step shows in microseconds instead of disappearing in a 10-ms step's noise. Three wrappers of
the same model, in interleaved rounds of 50 steps (the order reversed every other round):
plain ``DDP(model)``, the Session's ``s.wrap(model)``, and the wrap as it was before issue 28
(``find_unused_parameters=True`` and a Python all-reduce comm hook). The figure is the median
of the per-round differences to plain DDP with its 95 % order-statistic interval.

    torchrun --nproc-per-node 2 benchmarks/wrap_overhead.py [--rounds 150]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--steps", type=int, default=50, help="steps per round")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from runtime.session import Session

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    with tempfile.TemporaryDirectory() as job, Session(job_dir=job) as s:
        def model() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))

        old = DDP(model(), find_unused_parameters=True)
        old.register_comm_hook(None, allreduce_hook)
        variants = {"DDP(model)": DDP(model()), "s.wrap(model)": s.wrap(model()), "before issue 28": old}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in variants.items()}
        x = torch.randn(32, 64)

        def round_s(k: str, n: int) -> float:
            m, o = variants[k], opts[k]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                loss = m(x).pow(2).mean()
                o.zero_grad()
                loss.backward()
                o.step()
            return (time.perf_counter() - t0) / n

        for k in variants:
            round_s(k, 20)
        res: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                res[k].append(round_s(k, args.steps))
        if s.rank == 0:
            base = res["DDP(model)"]
            half = max(1, round(1.96 * len(base) ** 0.5 / 2))
            print(f"load average {os.getloadavg()}")
            for k, v in res.items():
                d = sorted(a - b for a, b in zip(v, base))
                mid = len(d) // 2
                lo, hi = d[max(0, mid - half)], d[min(len(d) - 1, mid + half)]
                print(f"{k:16s} median step {statistics.median(v) * 1e6:6.0f} us; vs DDP(model) "
                      f"{statistics.median(d) * 1e6:+5.0f} us (95 % interval {lo * 1e6:+.0f}..{hi * 1e6:+.0f} us, "
                      f"{len(d)} round pairs)")


if __name__ == "__main__":
    main()
