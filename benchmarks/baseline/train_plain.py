"""The baseline of the fault campaign: what users run today, without hpc-elastic's runtime.

A plain torchrun DDP script as a careful user writes it: gloo/nccl process group, the same
char-level GPT, data and learning-rate schedule as ``examples/train_gpt.py`` (only those pure
pieces are imported from it: no Session, no checkpointer, no sampler of ours), its own
``torch.save`` of model, optimizer, scheduler and step every ``--save-every`` steps (written to
a temporary file and renamed, so a crash never leaves a torn file), and a resume from that file
on start. It is launched by ``benchmarks/baseline/baseline.sbatch`` (``--requeue``,
``torchrun --nnodes MIN:MAX --max-restarts 3``, c10d rendezvous).

The global batch is fixed whatever the world size (gradient accumulation adapts) and the data
order is a function of the step alone, so a resume at the same world size reproduces the
uninterrupted run bit for bit. Rank 0 appends one JSON line per step to ``OUT/steps.jsonl``
(``t``, ``step``, ``world``, ``job``: Slurm's job id, ``alloc``: Slurm's restart count,
``restart``: torchrun's) and
one line per process start, restore and save: the log a user would print, machine-readable,
which the campaign turns into a goodput ledger. At the end it writes ``OUT/result.json``
(final step, SHA-256 of the weights).

    torchrun --nproc-per-node 2 benchmarks/baseline/train_plain.py --out /tmp/plain --steps 40
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

T_PROC = time.time()   # this worker process's start (before the imports)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _example():
    """examples/train_gpt.py as a module: the model, the data and the LR schedule."""
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="directory for checkpoint, steps.jsonl, result.json")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=20, help="torch.save every N steps")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--pg-timeout-s", type=float, default=120.0,
                   help="process-group timeout (torch's gloo default is 30 minutes)")
    p.add_argument("--fixed-buckets", action="store_true",
                   help="fix DDP's gradient-bucket layout before the first step (off: plain DDP, which "
                        "re-lays its buckets out after the first step of every process, so a resumed "
                        "run at 3+ ranks sums its first step in another order than an uninterrupted one)")
    return p.parse_args(argv)


def batch_indices(step: int, global_batch: int, n: int, seed: int) -> list[int]:
    """The global batch of ``step``: consecutive positions of a per-epoch permutation."""
    out, perms = [], {}
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch = pos // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        out.append(int(perms[epoch][pos % n]))
    return out


def log(out: Path, record: dict) -> None:
    with open(out / "steps.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    ex = _example()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = {"job": os.environ.get("SLURM_JOB_ID", ""), "alloc": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log(out, {"ev": "start", "t": time.time(), "t_proc": T_PROC, "world": world,
                  "node": os.uname().nodename, **ids})
    cfg, _, _, _, lr, data_bytes = ex.PRESETS["tiny"]
    micro = args.micro_batch
    if args.global_batch % (world * micro):
        raise SystemExit(f"global batch {args.global_batch} does not divide over {world} x {micro}")
    accum = args.global_batch // (world * micro)
    torch.manual_seed(args.seed)
    data = ex.Blocks(ex.load_text(data_bytes), cfg.block_size)
    model = DDP(ex.GPT(cfg))
    if args.fixed_buckets:   # what runtime/worker/ddp.py does for the Session's DDP
        model.reducer._push_all_rebuilt_params()
        model._has_rebuilt_buckets = bool(model.reducer._rebuild_buckets())
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, ex.lr_lambda(max(1, args.steps // 10), args.steps))

    ckpt = out / "ckpt.pt"
    start = 0
    t0 = time.time()
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
    if rank == 0:
        log(out, {"ev": "restored", "t0": t0, "t": time.time(), "step": start, **ids})

    for step in range(start, args.steps):
        mine = batch_indices(step, args.global_batch, len(data), args.seed)[rank::world]
        optim.zero_grad(set_to_none=True)
        for i in range(accum):
            x, y = data.batch(mine[i * micro:(i + 1) * micro])
            ctx = model.no_sync() if i < accum - 1 else _null()
            with ctx:
                (model(x, y) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if rank == 0:
            log(out, {"ev": "step", "t": time.time(), "step": done, "world": world, **ids})
            if done % args.save_every == 0 and done < args.steps:
                s0 = time.time()
                tmp = out / "ckpt.pt.tmp"
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                            "sched": sched.state_dict(), "step": done}, tmp)
                os.replace(tmp, ckpt)
                log(out, {"ev": "save", "t0": s0, "t": time.time(), "step": done, **ids})
        dist.barrier()   # nobody runs ahead of a save it may need to resume from

    if rank == 0:
        h = hashlib.sha256()
        sd = model.module.state_dict()
        for name in sorted(sd):
            h.update(name.encode())
            h.update(sd[name].detach().float().contiguous().numpy().tobytes())
        (out / "result.json").write_text(json.dumps(
            {"final_step": args.steps, "weights_sha256": h.hexdigest(), "world_size": world,
             "threads": torch.get_num_threads(), "fixed_buckets": args.fixed_buckets}) + "\n")
        log(out, {"ev": "end", "t": time.time(), "step": args.steps, **ids})
    dist.destroy_process_group()


def _null():
    import contextlib
    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
