"""One rank of a checkpoint test scenario (started by tests/distributed/test_checkpoint.py).

Usage: ``python _ckpt_worker.py SCENARIO CKPT_DIR OUT_DIR [ARG]`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Each rank writes ``OUT_DIR/<scenario>-rank<r>.json``; rank 0
also writes the full (gathered) model and optimizer state where a scenario compares tensors.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from runtime.checkpoint import CheckpointError, Checkpointer
from runtime.checkpoint.storage import KILL_AT_ENV
from runtime.sampler import ResumableSampler


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i * 7 + dist.get_rank())
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state, unsharded, on every rank (for bit-exact comparison)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return _unshard({"model": msd, "optim": osd})


def _unshard(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _unshard(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unshard(v) for v in obj]
    if isinstance(obj, torch.Tensor):  # a copy: the state dict holds the live parameters
        return (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).detach().clone()
    return obj


class Blob:
    """A big tensor in the checkpoint (to fill a small disk)."""

    def __init__(self, mb: float) -> None:
        self.t = torch.ones(int(mb * 2**20 / 4))

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"]


class _Lines(logging.Handler):
    """Keeps the checkpoint log lines, so tests can read what a user would be told."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main() -> None:
    scenario, ckpt_dir, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    lines = _Lines()
    logging.getLogger("hpc.checkpoint").addHandler(lines)
    logging.getLogger("hpc.checkpoint").setLevel(logging.INFO)
    arg = sys.argv[4] if len(sys.argv) > 4 else ""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    kind = arg.split(":")[0] if arg else "ddp"
    sampler = ResumableSampler(100, global_batch=4, seed=1)

    if scenario == "save":  # arg: kind -- train, save step 2, record the full state
        model, optim = build(kind, seed=1)
        train(model, optim, 2)
        sampler.next_global_batch()
        ckpt = Checkpointer(ckpt_dir)
        ckpt.save(2, {"model": model, "optim": optim, "sampler": sampler}, metadata={"wandb_run_id": "r1"},
                  blocking=True)
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, out_dir / "ref.pt")
        ckpt.close()
    elif scenario == "load":  # arg: kind -- load into a fresh model, compare with ref.pt
        model, optim = build(kind, seed=2)
        ckpt = Checkpointer(ckpt_dir)
        manifest = ckpt.load_latest({"model": model, "optim": optim, "sampler": sampler})
        result["step"] = manifest.step if manifest else None
        result["cursor"] = sampler.cursor
        if manifest is not None and (out_dir / "ref.pt").exists():
            got, ref = full_state(model, optim), torch.load(out_dir / "ref.pt", weights_only=False)
            result["mismatch"] = compare(ref, got)
        ckpt.close()
    elif scenario == "crash":  # arg: kind:point[@rank]:mode -- commit step 1, die during step 2
        _, point, mode = arg.split(":")
        model, optim = build(kind, seed=1)
        train(model, optim, 1)
        ckpt = Checkpointer(ckpt_dir)
        ckpt.save(1, {"model": model, "optim": optim, "sampler": sampler}, blocking=True)
        if rank == 0:
            torch.save(full_state(model, optim), out_dir / "ref.pt")
        else:
            full_state(model, optim)
        train(model, optim, 1)
        dist.barrier()
        os.environ[KILL_AT_ENV] = point
        ckpt.save(2, {"model": model, "optim": optim, "sampler": sampler}, blocking=mode == "sync")
        ckpt.wait()
        result["survived"] = True
    elif scenario == "settle":  # arg: kind:dead|silent -- a crash with a save in flight, a bad peer
        import time
        from runtime.checkpoint.storage import WRITE_DELAY_ENV
        _, peer = arg.split(":")
        model, optim = build(kind, seed=1)
        train(model, optim, 1)
        ckpt = Checkpointer(ckpt_dir)
        ckpt.save(1, {"model": model, "optim": optim, "sampler": sampler}, blocking=True)
        dist.barrier()
        if rank == 1:   # dead: killed while it writes; silent: alive, its write never ends
            os.environ.update({KILL_AT_ENV: "before_shards@1"} if peer == "dead" else {WRITE_DELAY_ENV: "600"})
        ckpt.save(2, {"model": model, "optim": optim, "sampler": sampler}, blocking=False)
        if rank == 1:
            time.sleep(600)
        started = time.monotonic()
        result["note"] = ckpt.settle(timeout_s=8.0)   # rank 0 "crashed" with the save in flight
        result["settle_s"] = time.monotonic() - started
        result["latest"] = (ckpt_dir / "latest").read_text().strip()
        (out_dir / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))
        os._exit(0)   # a silent peer's writer thread is still in DCP's collective
    elif scenario == "diskfull":  # commit a small step 1, then a step 2 bigger than the disk
        model, optim = build(kind, seed=1)
        ckpt = Checkpointer(ckpt_dir, async_save=True)
        ckpt.save(1, {"model": model, "optim": optim, "sampler": sampler}, blocking=True)
        torch.save(full_state(model, optim), out_dir / f"ref{rank}.pt")
        try:
            ckpt.save(2, {"model": model, "optim": optim, "blob": Blob(3.0), "sampler": sampler}, blocking=arg.endswith("sync"))
            ckpt.wait()
            result["error"] = None
        except CheckpointError as e:
            result["error"] = str(e)
        result["latest"] = ckpt.latest_step()
    elif scenario == "async":  # async state equals the state at save(), not after
        model, optim = build(kind, seed=1)
        train(model, optim, 1)
        ckpt = Checkpointer(ckpt_dir)
        ref = full_state(model, optim)
        ckpt.save(1, {"model": model, "optim": optim}, blocking=False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1000.0)
        train(model, optim, 2)
        ckpt.wait()
        fresh, fresh_opt = build(kind, seed=5)
        ckpt.load_latest({"model": fresh, "optim": fresh_opt})
        result["mismatch"] = compare(ref, full_state(fresh, fresh_opt))
        result["block_s"] = ckpt.last_block_s
    elif scenario == "staging":  # arg: kind -- buffers made ahead, reused, remade on a structure change
        model, optim = build(kind, seed=1)
        extra = Blob(0.01)
        ckpt = Checkpointer(ckpt_dir, keep_last=10)
        state: dict[str, Any] = {"model": model, "optim": optim}
        ckpt.load_latest(state)  # fresh start: the optimizer has no state yet, so no warm-up either
        train(model, optim, 1)
        result["adam_step"] = [float(st["step"]) for st in optim.state.values()]
        ckpt.should_save(1)  # the state is complete now: the warm-up starts
        train(model, optim, 1)
        checks = []
        for step, size in ((2, None), (3, None), (4, 0.02), (5, 0.03)):
            if size is not None:  # a structure change: a new entry, then a new shape
                extra.t = torch.full((int(size * 2**20 / 4),), float(step))
                state["extra"] = extra
            ref = full_state(model, optim)
            before = len(lines.lines)
            ckpt.save(step, state, blocking=False)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1000.0)  # after save() returns, the saved copy must not see this
            ckpt.wait()
            fresh, fresh_opt = build(kind, seed=5)
            fresh_state: dict[str, Any] = {"model": fresh, "optim": fresh_opt}
            if "extra" in state:
                fresh_state["extra"] = Blob(0.0)
                fresh_state["extra"].t = torch.zeros_like(extra.t)
            Checkpointer(ckpt_dir, async_save=False).load_latest(fresh_state)
            got_extra = fresh_state["extra"].t if "extra" in state else None
            checks.append({"step": step, "mismatch": compare(ref, full_state(fresh, fresh_opt)),
                           "extra_ok": got_extra is None or torch.equal(got_extra, extra.t),
                           "log": lines.lines[before:]})
            train(model, optim, 1)
        result["checks"] = checks
        ckpt.close()
    elif scenario == "prepfail":  # a step saved twice, and a rank whose state cannot be prepared
        model, optim = build(kind, seed=1)
        train(model, optim, 1)
        ckpt = Checkpointer(ckpt_dir)
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
        try:
            ckpt.save(1, {"model": model, "optim": optim})
            result["again"] = None
        except ValueError as e:
            result["again"] = str(e)

        class Picky:
            rank_local = True

            def state_dict(self) -> dict[str, Any]:
                if rank == 1:
                    raise RuntimeError("cannot snapshot on rank 1")
                return {}

            def load_state_dict(self, state: dict[str, Any]) -> None:
                pass
        try:
            ckpt.save(2, {"model": model, "optim": optim, "picky": Picky()})
            ckpt.wait()
            result["picky"] = None
        except CheckpointError as e:
            result["picky"] = str(e)
        result["dirs_after_failure"] = sorted(d.name for d in ckpt_dir.iterdir()) if rank == 0 else None
        ckpt.save(2, {"model": model, "optim": optim})  # and the group is not stuck
        ckpt.close()
        result["latest"] = ckpt.latest_step()
    elif scenario == "retention":  # arg: kind -- async saves 1..9, keep_last=2, keep_every=4
        model, optim = build(kind, seed=1)
        ckpt = Checkpointer(ckpt_dir, keep_last=2, keep_every=4)
        for step in range(1, 10):
            train(model, optim, 1)
            ckpt.save(step, {"model": model, "optim": optim}, blocking=False)
        ckpt.close()
        result["latest"] = ckpt.latest_step()
    elif scenario == "rng":  # per-rank RNG states survive; new ranks are re-seeded
        import random

        model, optim = build(kind, seed=1)
        ckpt = Checkpointer(ckpt_dir, seed=7)
        manifest = ckpt.load_latest({"model": model, "optim": optim})
        if manifest is None:
            random.seed(1000 + rank)
            torch.manual_seed(2000 + rank)
            ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
        result["draw"] = [random.random(), torch.rand(1).item()]
        ckpt.close()
    elif scenario == "ctor":  # the checkpoint directory is unusable: every rank must hear it
        try:
            Checkpointer(ckpt_dir)
            result["error"] = None
        except CheckpointError as e:
            result["error"] = str(e)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    result["log"] = lines.lines
    (out_dir / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def compare(ref: Any, got: Any, path: str = "") -> list[str]:
    """Paths where two nested states differ (tensors compared bit-exact)."""
    if isinstance(ref, dict):
        if set(ref) != set(got):
            return [f"{path}: keys {sorted(map(str, ref))} != {sorted(map(str, got))}"]
        return [m for k in ref for m in compare(ref[k], got[k], f"{path}/{k}")]
    if isinstance(ref, list | tuple):
        return [m for i, (a, b) in enumerate(zip(ref, got, strict=True)) for m in compare(a, b, f"{path}[{i}]")]
    if isinstance(ref, torch.Tensor):
        return [] if isinstance(got, torch.Tensor) and torch.equal(ref, got) else [path]
    return [] if ref == got else [f"{path}: {ref!r} != {got!r}"]


if __name__ == "__main__":
    main()
