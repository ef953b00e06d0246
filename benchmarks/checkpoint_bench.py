"""Checkpoint benchmark: our transactional save against what people usually do, on 2 ranks.

Builds an FSDP2-sharded model whose model + AdamW state is about ``--size-mb`` (default 1024),
then measures, in one run and as medians of ``--repeats``:

* ``sync_save``: :class:`runtime.checkpoint.Checkpointer` blocking save (shards + CRC-32 +
  manifest + fsyncs + rename + ``latest``), the whole transaction;
* ``async_block``: how long an async save blocks the training loop (staging copy);
* ``load``: resume, including rank 0's verification of every checksum;
* ``rank0_torch_save``: gather the full state to rank 0 and ``torch.save`` it (what tutorials
  teach), with an fsync so that both sides are durable;
* ``plain_dcp_save``: ``dcp.save`` into a fresh directory with no manifest or checksums;
* ``disk_write``: the raw rate: each rank writes its share of the same bytes with fdatasync;
* ``staging_copy``: each rank copies its local state into preallocated CPU buffers, the floor
  of an async save's blocking part (which is that copy plus DCP's planning).

Every contender writes the way a training job with retention does: a new location each round,
and the previous round's copy deleted after the save (outside the timing). This matters: on
the VM these results come from, where a save's blocks land (blocks freed a while ago, or
freed just now and not reusable yet) changes the same write by up to 3x, so comparing a
contender that writes over just-deleted files with one whose old copy was pruned earlier
measures the disk's allocator, not the code (see RESULTS-checkpoint.md, run 4).

Usage: ``python benchmarks/checkpoint_bench.py [--size-mb 1024] [--dir /tmp/x] [--json out.json]``.
Run it on a real disk, not tmpfs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], Any], barrier: Callable[[], None]) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from runtime.checkpoint import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    root = Path(args.dir)
    # model + AdamW (2 moments) = 3 x params; layers of 1024 x 1024 fp32 = 4 MiB each
    n_layers = max(1, round(args.size_mb / 3 / 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(n_layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    local_bytes = sum(t.to_local().nbytes for t in model.parameters()) * 3
    barrier = dist.barrier
    times: dict[str, list[float]] = {k: [] for k in
                                     ("sync_save_s", "async_block_s", "async_total_s", "load_s",
                                      "rank0_torch_save_s", "plain_dcp_save_s", "disk_write_s",
                                      "staging_copy_s")}
    ckpt = Checkpointer(root / "ours", keep_last=1, save_rng=True)
    step = 0
    for _ in range(args.repeats):
        step += 1
        times["sync_save_s"].append(_timed(lambda: ckpt.save(step, state, blocking=True), barrier))
        ckpt.close()  # joins the background prune of the previous step: it must not overlap the next timing
        barrier()     # (rank 0 alone prunes: without this, rank 1 would time its wait for rank 0)
        step += 1
        t0 = time.perf_counter()
        ckpt.save(step, state, blocking=False)
        block = time.perf_counter() - t0
        ckpt.wait()
        barrier()
        times["async_total_s"].append(time.perf_counter() - t0)
        blocks = [0.0] * world
        dist.all_gather_object(blocks, block)
        times["async_block_s"].append(max(blocks))
        ckpt.close()
        barrier()
        times["load_s"].append(_timed(lambda: Checkpointer(root / "ours").load_latest(state), barrier))

        def local_tensors() -> list[Any]:
            msd, osd = get_state_dict(model, optim)
            out = []
            for v in [*msd.values(), *(x for st in osd["state"].values() for x in st.values())]:
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out.append(v.to_local() if hasattr(v, "to_local") else v)
            return out
        sources = local_tensors()
        buffers = [torch.empty_like(t) for t in sources]
        for b, t in zip(buffers, sources):  # touch once: the staging buffers are reused between saves
            b.copy_(t)

        def staging_copy() -> None:
            for b, t in zip(buffers, sources):
                b.copy_(t)
        times["staging_copy_s"].append(_timed(staging_copy, barrier))
        del buffers

        here = step  # a new location per round; the previous round's is deleted after timing

        def rank0_save() -> None:
            msd, osd = get_state_dict(model, optim,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                with open(root / f"full-{here}.pt", "wb") as f:
                    torch.save({"model": msd, "optim": osd}, f)
                    f.flush()
                    os.fsync(f.fileno())
        times["rank0_torch_save_s"].append(_timed(rank0_save, barrier))

        def plain_dcp() -> None:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"plain-{here}"))
        times["plain_dcp_save_s"].append(_timed(plain_dcp, barrier))

        def raw_write() -> None:
            block = bytearray(os.urandom(1 << 20)) * 16
            left = local_bytes
            with open(root / f"raw{rank}-{here}", "wb") as f:
                while left > 0:
                    left -= f.write(memoryview(block)[:min(left, len(block))])
                f.flush()
                os.fdatasync(f.fileno())
        times["disk_write_s"].append(_timed(raw_write, barrier))
        if rank == 0:  # what retention does: drop the previous round's copies after the save
            for old in root.glob("*"):
                if old.name.startswith(("full-", "plain-", "raw")) and not old.name.endswith(f"-{here}") \
                        and not old.name.endswith(f"-{here}.pt"):
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
        barrier()
    total = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
        out["state_bytes"] = int(total.item())
        out["all"] = times
        for k, v in times.items():
            print(f"per round {k:20} " + " ".join(f"{x:.3f}" for x in v), flush=True)
    ckpt.close()
    dist.destroy_process_group()


def _spawn_entry(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    out: dict[str, Any] = {}
    worker(rank, world, port, args, out)
    if rank == 0:
        Path(path).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024.0, help="model + optimizer state, MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dir", default="/tmp/hpc-ckpt-bench", help="scratch directory on a real disk")
    p.add_argument("--json", default=None, help="write the medians as JSON here")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    result_path = root / "result.json"
    mp.spawn(_spawn_entry, args=(args.world_size, _free_port(), args, str(result_path)), nprocs=args.world_size)
    r = json.loads(result_path.read_text())
    shutil.rmtree(root, ignore_errors=True)
    gb = r["state_bytes"] / 1e9
    sync = r["sync_save_s"]
    rows = [("sync save (ours)", sync), ("async save, blocking part", r["async_block_s"]),
            ("async save, total", r["async_total_s"]), ("load (verify + reshard)", r["load_s"]),
            ("(a) rank-0 torch.save of gathered state", r["rank0_torch_save_s"]),
            ("(b) plain dcp.save", r["plain_dcp_save_s"]), ("(c) raw write + fdatasync", r["disk_write_s"]),
            ("(d) memory copy of the local state", r["staging_copy_s"])]
    print(f"state {gb:.3f} GB on {args.world_size} ranks, medians of {args.repeats}")
    print(f"{'what':44} {'seconds':>9} {'GB/s':>7} {'x sync':>8}")
    for name, s in rows:
        print(f"{name:44} {s:9.3f} {gb / s:7.2f} {s / sync:8.3f}")
    print("targets:")
    print(f"  async blocking / sync save = 1/{sync / r['async_block_s']:.1f} (target <= 1/25; "
          f"its floor here, the copy (d), is 1/{sync / r['staging_copy_s']:.1f})")
    print(f"  sync save throughput / raw write = {r['disk_write_s'] / sync:.0%} (target >= 80%)")
    print(f"  sync save vs rank-0 torch.save = {r['rank0_torch_save_s'] / sync:.2f}x faster (target > 1)")
    if args.json:
        keys = ("state_bytes", "sync_save_s", "async_block_s", "load_s", "rank0_torch_save_s",
                "plain_dcp_save_s", "disk_write_s")
        extra = {"async_total_s": r["async_total_s"], "staging_copy_s": r["staging_copy_s"]}
        Path(args.json).write_text(json.dumps({k: r[k] for k in keys} | extra,
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
