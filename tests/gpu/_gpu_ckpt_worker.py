"""One rank of a gpu-tier checkpoint scenario (started by tests/gpu/test_gpu_fsdp_resume.py).

Usage: ``python _gpu_ckpt_worker.py SCENARIO CKPT_DIR OUT_DIR`` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. FSDP2 with a bf16 ``MixedPrecisionPolicy`` on
CUDA, NCCL for the model and gloo for the checkpointer's control groups.

* ``train``: restore (nothing), 3 steps, async save at step 3 (the pinned staging path), 2
  more steps; rank 0 writes the full state at the save and at the end.
* ``resume``: a model built from another seed restores step 3 and trains the same 2 steps;
  rank 0 writes the restored state and the final one.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from runtime.checkpoint import Checkpointer


def build(seed: int, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model[2], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(1000 + 17 * i + dist.get_rank())
    x = torch.randn(8, 64, generator=g).cuda()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    scenario, ckpt_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    lines = _Lines()
    logging.getLogger("hpc.checkpoint").addHandler(lines)
    logging.getLogger("hpc.checkpoint").setLevel(logging.INFO)
    torch.use_deterministic_algorithms(True)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model, optim = build(1 if scenario == "train" else 2, mesh)
    state = {"model": model, "optim": optim}
    ckpt = Checkpointer(ckpt_dir, keep_last=2)
    manifest = ckpt.load_latest(state)
    result: dict[str, Any] = {"rank": rank, "resumed_step": manifest.step if manifest else None}
    if scenario == "train":
        for i in range(3):
            step(model, optim, i)
            ckpt.should_save(i + 1)
        at_save = full_state(model, optim)
        ckpt.save(3, state, blocking=False)
        ckpt.wait()
    else:
        at_save = full_state(model, optim)
    for i in range(3, 5):
        step(model, optim, i)
    final = full_state(model, optim)
    ckpt.close()
    if rank == 0:
        torch.save({"at_save": at_save, "final": final}, out / f"{scenario}.pt")
    result["log"] = lines.lines
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
