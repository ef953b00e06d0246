"""Checkpoint benchmark: our transactional save against its floors and what people usually do.

Builds an FSDP2-sharded model whose model + AdamW state is about ``--size-mb`` (default 1024) on
``--world-size`` ranks and measures two things.

**First save** (``--rounds`` fresh process groups, one sample each: the first save of a process is
once per process). Each builds the model, trains a step and times the process's first async save
the old way (a checkpointer with no restore, hence no warm-up: buffers allocated and first
touched inside the stall); then a second checkpointer restores (starting the warm-up), trains
``--warm-steps`` steps calling ``should_save`` as a training loop does, and its first async
``save()`` is timed; then the floor: a copy of the local state into buffers that already exist.

**Steady state** (one process group, ``--rounds`` rounds; every figure is per round, so ratios
are paired within a round, taken close together in time):

* ``sync_save``: :class:`runtime.checkpoint.Checkpointer` blocking save (shards + CRC-32 +
  manifest + fsyncs + rename + ``latest``), the whole transaction;
* ``async_block``: how long an async save blocks the training loop; ``async_total`` until committed;
* ``load``: resume, including rank 0's verification of every checksum (same world: no reshard),
  with a default checkpointer, which starts the staging warm-up in the background as it returns;
* ``rank0_torch_save``: gather the full state to rank 0 and ``torch.save`` it (what tutorials
  teach), with an fsync so that both sides are durable;
* ``plain_dcp_save``: ``dcp.save`` into a fresh directory with no manifest or checksums;
* ``disk_write``: the raw rate: each rank writes its share of the same bytes with fdatasync;
* ``copy_floor``: each rank copies its local state into buffers that exist (CPU) or, with
  ``--device cuda``, into pinned host buffers on a side stream: the floor of an async save's
  blocking part;
* ``peer_*``: in-process recovery's FSDP2 peer copies (each rank its own "node"):
  ``peer_snapshot_s`` the snapshot on the step's path, ``peer_exchange_s`` until the copy
  reached the peer (side thread), ``peer_host_bytes`` the host memory the copies hold per rank
  (two own snapshots and two copies of a peer's shards), and the copy interval that keeps the
  snapshot under 1 % of a 100-ms step.

Ratios are printed with a 95 % confidence interval (Student t over the per-round ratios) and the
spread (min..max); a line says when a figure cannot be trusted (interval wider than +-20 % of the
ratio, or a machine busier than its cores). Blocking times are the slowest rank's.

Every contender writes the way a training job with retention does: a new location each round,
and the previous round's copy deleted after the save (outside the timing). On the VM these
results come from, where a save's blocks land changes the same write by up to 3x
(RESULTS-checkpoint.md, run 4).

Usage: ``python benchmarks/checkpoint_bench.py [--size-mb 1024] [--rounds 5] [--device cpu|cuda]
[--dir /tmp/x] [--json out.json]``. Run it on a real disk, not tmpfs. With ``--device cuda`` each
rank needs its own GPU (NCCL refuses two ranks on one): the world size is capped at the GPU count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: two-sided 95 % Student t quantiles by degrees of freedom (no scipy here)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}
#: a ratio whose 95 % interval is wider than this fraction of it either way is not trusted
TRUST_HALF_WIDTH = 0.20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def t95(df: int) -> float:
    """Two-sided 95 % t quantile for ``df`` degrees of freedom (the next smaller tabulated df)."""
    return _T95[max(k for k in _T95 if k <= df)] if df >= 1 else math.inf


def ratio_stats(values: Sequence[float]) -> dict[str, float]:
    """Median, mean with a 95 % t interval, and min/max of per-round ratios."""
    n = len(values)
    mean = statistics.fmean(values)
    half = t95(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else math.inf
    return {"n": n, "median": statistics.median(values), "mean": mean, "ci95_low": mean - half,
            "ci95_high": mean + half, "min": min(values), "max": max(values)}


def untrusted(stats: dict[str, float], load_per_core: float) -> str | None:
    """Why a ratio cannot be trusted, or None."""
    why = []
    if stats["n"] < 5:
        why.append(f"only {stats['n']} rounds")
    if stats["ci95_high"] - stats["mean"] > TRUST_HALF_WIDTH * abs(stats["mean"]):
        why.append(f"95% interval wider than +-{TRUST_HALF_WIDTH:.0%}")
    if load_per_core > 1.0:
        why.append(f"machine busy (load {load_per_core:.1f} per core)")
    return "; ".join(why) or None


def _setup(rank: int, world: int, port: int, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """Process group, an FSDP2 model + AdamW (not stepped yet) on the benchmark's device."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    # model + AdamW (2 moments) = 3 x params; layers of 1024 x 1024 fp32 = 4 MiB each
    n_layers = max(1, round(args.size_mb / 3 / 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(n_layers)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch, dist, model, optim


def _train_step(torch: Any, model: Any, optim: Any) -> None:
    device = next(model.parameters()).device
    model(torch.randn(2, 1024, device=device)).sum().backward()
    optim.step()
    optim.zero_grad()


def _local_tensors(torch: Any, model: Any, optim: Any) -> list[Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    out = []
    for v in [*msd.values(), *(x for st in osd["state"].values() for x in st.values())]:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def _copy_floor(torch: Any, sources: list[Any]) -> Callable[[], None]:
    """The floor of the blocking part: one copy of the local state into buffers that exist."""
    cuda = sources[0].is_cuda
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in sources]
    stream = torch.cuda.Stream() if cuda else None

    def copy() -> None:
        if stream is None:
            for b, t in zip(buffers, sources):
                b.copy_(t)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b, t in zip(buffers, sources):
                b.copy_(t, non_blocking=True)
        stream.synchronize()
    copy()  # first touch (and pinning) before any timing
    return copy


def _slowest(dist: Any, world: int, seconds: float) -> float:
    everyone = [0.0] * world
    dist.all_gather_object(everyone, seconds)
    return max(everyone)


def first_save_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """One sample of the first async save: after restore + warm steps, and without a warm-up."""
    torch, dist, model, optim = _setup(rank, world, port, args)
    from runtime.checkpoint import Checkpointer

    root = Path(args.dir) / f"first-{port}"
    state = {"model": model, "optim": optim}
    _train_step(torch, model, optim)
    # the process's first save, the old way: no restore, no warm-up, buffers made in the stall
    cold = Checkpointer(root / "cold", keep_last=1)
    dist.barrier()
    t0 = time.perf_counter()
    cold.save(1, state)
    cold_block = _slowest(dist, world, time.perf_counter() - t0)
    cold.close()  # its buffers stay alive: the next checkpointer cannot reuse their pages
    ckpt = Checkpointer(root / "warm", keep_last=1)
    ckpt.load_latest(state)  # nothing to load here; a restore starts the warm-up as it returns
    t0 = time.perf_counter()
    for step in range(args.warm_steps):
        _train_step(torch, model, optim)
        ckpt.should_save(step + 2)
    steps_s = time.perf_counter() - t0
    warm_before = ckpt._stager is not None and ckpt._stager.warm  # noqa: SLF001 (reported, not used)
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save(args.warm_steps + 1, state)
    block = _slowest(dist, world, time.perf_counter() - t0)
    ckpt.close()
    floor = _copy_floor(torch, _local_tensors(torch, model, optim))
    floors = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        floor()
        floors.append(_slowest(dist, world, time.perf_counter() - t0))
    if rank == 0:
        out.update(first_block_s=block, first_cold_block_s=cold_block, floor_s=statistics.median(floors),
                   warm_before_first_save=bool(warm_before), warm_steps_s=steps_s)
    dist.barrier()
    dist.destroy_process_group()


def steady_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    torch, dist, model, optim = _setup(rank, world, port, args)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from runtime.checkpoint import Checkpointer

    root = Path(args.dir)
    state = {"model": model, "optim": optim}
    barrier = dist.barrier
    keys = ("sync_save_s", "async_block_s", "async_total_s", "load_s", "rank0_torch_save_s", "plain_dcp_save_s",
            "disk_write_s", "copy_floor_s")
    times: dict[str, list[float]] = {k: [] for k in keys}
    ckpt = Checkpointer(root / "ours", keep_last=1, save_rng=True)
    ckpt.load_latest(state)
    _train_step(torch, model, optim)
    ckpt.should_save(1)
    _train_step(torch, model, optim)
    sources = _local_tensors(torch, model, optim)
    local_bytes = sum(t.nbytes for t in sources)
    floor = _copy_floor(torch, sources)
    step = 0
    step += 1
    ckpt.save(step, state)  # the first save is measured by first_save_worker, not here
    ckpt.close()

    def timed(fn: Callable[[], Any]) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    for _ in range(args.rounds):
        step += 1
        times["sync_save_s"].append(timed(lambda: ckpt.save(step, state, blocking=True)))
        ckpt.close()  # joins the background prune of the previous step: it must not overlap the next timing
        barrier()     # (rank 0 alone prunes: without this, rank 1 would time its wait for rank 0)
        barrier()  # the floor right before the async save: the same writeback of the sync save behind both
        t0 = time.perf_counter()
        floor()
        times["copy_floor_s"].append(_slowest(dist, world, time.perf_counter() - t0))
        step += 1
        barrier()
        t0 = time.perf_counter()
        ckpt.save(step, state, blocking=False)
        block = time.perf_counter() - t0
        ckpt.wait()
        barrier()
        times["async_total_s"].append(time.perf_counter() - t0)
        times["async_block_s"].append(_slowest(dist, world, block))
        ckpt.close()
        barrier()
        loader = Checkpointer(root / "ours")  # as a job restores: the load starts the staging warm-up
        times["load_s"].append(timed(lambda: loader.load_latest(state)))
        loader.close()  # joins that warm-up (untimed): it must not overlap the floor's timing
        del loader

        here = step  # a new location per round; the previous round's is deleted after timing

        def rank0_save() -> None:
            msd, osd = get_state_dict(model, optim,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                with open(root / f"full-{here}.pt", "wb") as f:
                    torch.save({"model": msd, "optim": osd}, f)
                    f.flush()
                    os.fsync(f.fileno())
        times["rank0_torch_save_s"].append(timed(rank0_save))

        def plain_dcp() -> None:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"plain-{here}"))
        times["plain_dcp_save_s"].append(timed(plain_dcp))

        def raw_write() -> None:
            block = bytearray(os.urandom(1 << 20)) * 16
            left = local_bytes
            with open(root / f"raw{rank}-{here}", "wb") as f:
                while left > 0:
                    left -= f.write(memoryview(block)[:min(left, len(block))])
                f.flush()
                os.fdatasync(f.fileno())
        times["disk_write_s"].append(timed(raw_write))
        if rank == 0:  # what retention does: drop the previous round's copies after the save
            for old in root.glob("*"):
                if old.name.startswith(("full-", "plain-", "raw")) and not old.name.endswith(f"-{here}") \
                        and not old.name.endswith(f"-{here}.pt"):
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
        barrier()
    times.update(_peer_copy_rounds(torch, dist, world, model, optim, args.rounds))
    total = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(total, group=ckpt._ctl)  # noqa: SLF001 (a CPU group, whatever the device)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
        out["state_bytes"] = int(total.item())
        out["all"] = times
        for k, v in times.items():
            print(f"per round {k:20} " + " ".join(f"{x:.4f}" for x in v), flush=True)
    ckpt.close()
    dist.destroy_process_group()


def _peer_copy_rounds(torch: Any, dist: Any, world: int, model: Any, optim: Any,
                      rounds: int) -> dict[str, list[float]]:
    """In-process recovery's FSDP2 peer copies (:mod:`runtime.inprocess.worker.shard_copy`),
    each rank its own "node" (a ring over ranks): the snapshot on the step's path, the exchange
    with the peer on the side thread, and the host memory the copies hold per rank."""
    from runtime.inprocess.worker.shard_copy import PeerCopies

    rank = dist.get_rank()
    copies = PeerCopies([model], [optim], {}, every=1, max_bytes=1 << 62, node=f"bench-node{rank}")
    out: dict[str, list[float]] = {"peer_snapshot_s": [], "peer_exchange_s": [], "peer_host_bytes": []}
    for i in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        copies.after_step(1000 + i)   # the step path: the snapshot, then the exchange starts
        block = time.perf_counter() - t0
        copies.settle()
        total = time.perf_counter() - t0
        if i == 0:
            continue   # the side group's creation (once per generation) is not a round
        out["peer_snapshot_s"].append(_slowest(dist, world, block))
        out["peer_exchange_s"].append(_slowest(dist, world, total))
        out["peer_host_bytes"].append(float(copies.held_bytes()))
    copies.unbind()
    return out


def _spawn_entry(rank: int, world: int, port: int, args: argparse.Namespace, path: str, which: str) -> None:
    out: dict[str, Any] = {}
    (first_save_worker if which == "first" else steady_worker)(rank, world, port, args, out)
    if rank == 0:
        Path(path).write_text(json.dumps(out))


def _run(which: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    path = Path(args.dir) / f"result-{which}.json"
    path.unlink(missing_ok=True)
    mp.spawn(_spawn_entry, args=(world, _free_port(), args, str(path), which), nprocs=world)
    return json.loads(path.read_text())


def _fmt(stats: dict[str, float]) -> str:
    return (f"{stats['median']:.2f} (95% CI {stats['ci95_low']:.2f}..{stats['ci95_high']:.2f}, "
            f"range {stats['min']:.2f}..{stats['max']:.2f}, n={stats['n']})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--size-mb", type=float, default=1024.0, help="model + optimizer state, MiB (default 1024)")
    p.add_argument("--rounds", "--repeats", type=int, default=5, help="rounds of each measurement (default 5)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model lives (default cpu)")
    p.add_argument("--warm-steps", type=int, default=5,
                   help="training steps between restore and the first save (default 5)")
    p.add_argument("--dir", default="/tmp/hpc-ckpt-bench", help="scratch directory on a real disk")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 5:
        print(f"note: {args.rounds} rounds; the ratios below need >= 5 to be trusted", flush=True)
    world = args.world_size
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is present")
        if torch.cuda.device_count() < world:
            print(f"note: {torch.cuda.device_count()} GPU(s): world size {world} -> {torch.cuda.device_count()} "
                  "(NCCL needs a GPU per rank)", flush=True)
            world = torch.cuda.device_count()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load_before = os.getloadavg()
    started = time.time()
    firsts = []
    for _ in range(args.rounds):
        firsts.append(_run("first", args, world))
        for d in root.glob("first-*"):
            shutil.rmtree(d, ignore_errors=True)
    r = _run("steady", args, world)
    load_after = os.getloadavg()
    shutil.rmtree(root, ignore_errors=True)
    cores = os.cpu_count() or 1
    load_per_core = max(load_before[0], load_after[0]) / cores
    all_ = r["all"]
    ratios = {
        "steady_async_block_over_copy_floor": ratio_stats(
            [b / f for b, f in zip(all_["async_block_s"], all_["copy_floor_s"])]),
        "first_async_block_over_copy_floor": ratio_stats([f["first_block_s"] / f["floor_s"] for f in firsts]),
        "first_save_without_warm_up_over_copy_floor": ratio_stats(
            [f["first_cold_block_s"] / f["floor_s"] for f in firsts]),
        "steady_async_block_over_sync_save": ratio_stats(
            [b / s for b, s in zip(all_["async_block_s"], all_["sync_save_s"])]),
        "sync_save_throughput_over_raw_write": ratio_stats(
            [d / s for d, s in zip(all_["disk_write_s"], all_["sync_save_s"])]),
    }
    gb = r["state_bytes"] / 1e9
    sync = r["sync_save_s"]
    rows = [("sync save (ours)", sync), ("async save, blocking part", r["async_block_s"]),
            ("async save, total", r["async_total_s"]), ("load (verify, same world)", r["load_s"]),
            ("(a) rank-0 torch.save of gathered state", r["rank0_torch_save_s"]),
            ("(b) plain dcp.save", r["plain_dcp_save_s"]), ("(c) raw write + fdatasync", r["disk_write_s"]),
            ("(d) copy floor: local state into existing buffers", r["copy_floor_s"])]
    print(f"state {gb:.3f} GB on {world} ranks ({args.device}), steady state: medians of {args.rounds} rounds")
    print(f"{'what':52} {'seconds':>9} {'GB/s':>7} {'x sync':>8}")
    for name, s in rows:
        print(f"{name:52} {s:9.4f} {gb / s:7.2f} {s / sync:8.3f}")
    first_blocks = [f["first_block_s"] for f in firsts]
    print(f"first save (fresh process, restore + {args.warm_steps} steps), blocking: "
          + " ".join(f"{x:.4f}" for x in first_blocks) + " s; warm-up done before it: "
          + " ".join("yes" if f["warm_before_first_save"] else "no" for f in firsts))
    print("first save without a warm-up (the old path), blocking: "
          + " ".join(f"{f['first_cold_block_s']:.3f}" for f in firsts) + " s")
    snap, exch = r["peer_snapshot_s"], r["peer_exchange_s"]
    every = max(1, math.ceil(snap / (0.01 * 0.1)))   # <= 1 % of a 100-ms step, on average
    print(f"in-process recovery, FSDP2 peer copies: host memory {r['peer_host_bytes'] / 1e6:.1f} MB per rank "
          f"({r['state_bytes'] / world / 1e6:.1f} MB of shards: 2 own snapshots + 2 copies of a peer's); "
          f"snapshot on the step's path {snap:.4f} s, exchange with the peer (side thread) {exch:.4f} s; "
          f"<= 1 % of a 100-ms step needs HPC_INPROC_COPY_EVERY >= {every}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({cores} cores)")
    targets = {"steady_async_block_over_copy_floor": "<= 1.5", "first_async_block_over_copy_floor": "<= 3",
               "sync_save_throughput_over_raw_write": ">= 0.8"}
    print("ratios (per-round, paired):")
    for name, stats in ratios.items():
        target = f"  target {targets[name]}" if name in targets else ""
        print(f"  {name:44} {_fmt(stats)}{target}")
        if (why := untrusted(stats, load_per_core)) is not None:
            print(f"    ^ cannot be trusted: {why}")
    if args.json:
        record = {k: r[k] for k in ("state_bytes", "sync_save_s", "async_block_s", "async_total_s", "load_s",
                                    "rank0_torch_save_s", "plain_dcp_save_s", "disk_write_s", "copy_floor_s",
                                    "peer_snapshot_s", "peer_exchange_s", "peer_host_bytes")}
        record.update(
            command="python " + " ".join(["benchmarks/checkpoint_bench.py", *(argv if argv is not None else sys.argv[1:])]),
            device=args.device, world_size=world, rounds=args.rounds, started_utc=time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), load_average_before=load_before,
            load_average_after=load_after, cpu_count=cores, per_round=all_, first_saves=firsts, ratios=ratios,
            untrusted={k: untrusted(v, load_per_core) for k, v in ratios.items()})
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
