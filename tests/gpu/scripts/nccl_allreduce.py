"""A torchrun-style script for the gpu tier: one NCCL all-reduce per rank, and what the rank saw.

Each rank pins its GPU (``LOCAL_RANK``), joins an NCCL process group, all-reduces ``rank + 1``
over a CUDA tensor, and writes ``OUT/nccl-rank<r>.json``: the sum (must be ``W * (W + 1) / 2``),
the backend, the NCCL version and the network variables the launcher set (NCCL_SOCKET_IFNAME,
GLOO_SOCKET_IFNAME, NCCL_IB_HCA).

Usage: ``hpc run tests/gpu/scripts/nccl_allreduce.py --nproc-per-node N -- OUT``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.full((1 << 20,), float(rank + 1), device="cuda")  # 4 MiB: more than a latency probe
    dist.all_reduce(value)
    torch.cuda.synchronize()
    record = {"rank": rank, "world": world, "sum": value[0].item(), "all_equal": bool((value == value[0]).all()),
              "backend": dist.get_backend(), "device": torch.cuda.get_device_name(local_rank),
              "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
              "env": {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA")}}
    Path(sys.argv[1], f"nccl-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
