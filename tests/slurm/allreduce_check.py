"""A tiny torchrun-style script for backend tests: every rank all-reduces and rank 0 writes the result.

Each rank contributes ``rank + 1``; rank 0 writes ``allreduce.json`` into the job directory
(``HPC_JOB_DIR``, else the first argument) with the world size, the reduced sum (which must be
``W * (W + 1) / 2``), the hosts the ranks ran on, and, when ``HPC_TEST_SECRET_TOKEN`` is set,
the SHA-256 of its value: proof that the secret reached the workers without writing it down.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    print(f"rank {rank}/{world} on {socket.gethostname()}: sum {value.item():g}", flush=True)
    if rank == 0:
        out_dir = Path(os.environ.get("HPC_JOB_DIR") or sys.argv[1])
        secret = os.environ.get("HPC_TEST_SECRET_TOKEN")
        result = {"world_size": world, "sum": value.item(), "hosts": hosts,
                  "secret_sha256": hashlib.sha256(secret.encode()).hexdigest() if secret else None}
        (out_dir / "allreduce.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
