"""``hpc doctor``: is this node (or this allocation) ready to train?

On one node it reports the network interfaces NCCL/Gloo would use and why, InfiniBand ports,
GPUs, driver/CUDA/NCCL/torch versions and how the rendezvous host resolves. Across an
allocation (``hpc doctor --nodes N`` inside ``salloc``/``sbatch``, which runs
``srun --ntasks-per-node=1 python -m runtime.launch.doctor --multi-node``), the nodes also meet in a
gloo process group on the first node, check that a file one node writes to the shared job
directory is read back by every other node, and time an all-reduce (latency of a small one,
bandwidth of a large one). A readable report, ``--json`` for machines, and a non-zero exit
with the reason when something is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtime.env import rendezvous_host
from runtime.launch import health, network


@dataclass
class Report:
    """One node's findings; ``problems`` non-empty means the node is not ready."""

    host: str
    checks: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def node_report(rdzv_host: str, *, multi_node: bool) -> Report:
    """Everything one node can check about itself (no collectives)."""
    rep = Report(host=socket.gethostname())
    try:
        addr, loopback = network.resolve_rendezvous(rdzv_host)
        rep.checks["rendezvous"] = {"host": rdzv_host, "address": addr, "loopback": loopback}
    except network.NetworkError as e:
        rep.problems.append(f"rendezvous host {rdzv_host!r} does not resolve: {e}")
    try:
        choice, changes = network.detect(rdzv_host, multi_node=multi_node, env={})
        rep.checks["network"] = {"socket_ifname": choice.socket_ifname, "ib_hcas": list(choice.ib_hcas),
                                 "reasons": list(choice.reasons),
                                 "env": {c.name: c.new for c in changes}}
    except network.NetworkError as e:
        rep.problems.append(f"no usable network interface: {e}")
    ports = network.read_ib_ports()
    rep.checks["infiniband"] = [asdict(p) for p in ports]
    rep.checks["versions"] = versions()
    rep.checks["gpus"] = gpus()
    if shutil.which("nvidia-smi"):   # the launchers' pre-join GPU check (runtime.launch.health)
        finding = health.gpus(0)
        rep.checks["gpu_health"] = finding.detail
        if not finding.ok:
            rep.problems.append(f"GPU health: {finding.detail}")
    return rep


def versions() -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "nccl": None, "driver": None}
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - report, don't crash the doctor
            v["nccl"] = f"unavailable ({e})"
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        v["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    return v


def gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    return out


def collective_checks(rep: Report, *, rank: int, world: int, rdzv_host: str, port: int,
                      shared_dir: Path) -> list[Report]:
    """Shared filesystem and all-reduce checks across nodes; returns every node's report on rank 0."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(rdzv_host, port, world, is_master=rank == 0, timeout=_td(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_td(60))
    try:
        token = uuid.uuid4().hex
        shared_dir.mkdir(parents=True, exist_ok=True)
        mine = shared_dir / f".doctor-{rank}"
        mine.write_text(token)
        tokens: list[Any] = [None] * world
        dist.all_gather_object(tokens, token)
        seen = {}
        for r in range(world):
            path = shared_dir / f".doctor-{r}"
            try:
                seen[r] = path.read_text() == tokens[r]
            except OSError:
                seen[r] = False
        dist.barrier()
        mine.unlink(missing_ok=True)
        rep.checks["shared_fs"] = {"dir": str(shared_dir), "reads_every_node": all(seen.values())}
        if not all(seen.values()):
            bad = [r for r, ok in seen.items() if not ok]
            rep.problems.append(f"{shared_dir} is not shared: cannot read what node(s) {bad} wrote")
        rep.checks["allreduce"] = _time_allreduce(torch, dist, world)
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, rep)
        return reports
    finally:
        dist.destroy_process_group()


def _time_allreduce(torch: Any, dist: Any, world: int) -> dict[str, float]:
    small = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(small)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(small)
    latency = (time.perf_counter() - t0) / n
    big = torch.ones(8 * 2**20 // 4)                    # 8 MiB of float32
    dist.all_reduce(big)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    per = (time.perf_counter() - t0) / reps
    # Ring all-reduce moves 2 (n-1)/n of the buffer through each link ("bus bandwidth").
    busbw = big.numel() * 4 * 2 * (world - 1) / world / per if world > 1 else float("nan")
    ok = bool(torch.all(big == float(world ** (reps + 1))))
    return {"latency_us": round(latency * 1e6, 1), "busbw_gbps": round(busbw * 8 / 1e9, 3),
            "bytes": big.numel() * 4, "correct": ok}


def _td(s: float) -> Any:
    from datetime import timedelta
    return timedelta(seconds=s)


def format_reports(reports: list[Report]) -> str:
    lines = []
    for rep in reports:
        lines.append(f"== {rep.host}: {'OK' if rep.ok else 'PROBLEMS'}")
        net = rep.checks.get("network")
        if net:
            lines.append(f"  network: {net['socket_ifname']}  IB HCAs: {','.join(net['ib_hcas']) or 'none'}")
            lines += [f"    - {r}" for r in net["reasons"]]
        rz = rep.checks.get("rendezvous")
        if rz:
            lines.append(f"  rendezvous: {rz['host']} -> {rz['address']}" + (" (loopback)" if rz["loopback"] else ""))
        v = rep.checks.get("versions", {})
        lines.append("  versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k]))
        g = rep.checks.get("gpus", [])
        lines.append(f"  gpus: {len(g)}" + "".join(f"\n    - {x['index']}: {x['name']} {x['memory_gib']} GiB" for x in g))
        if "shared_fs" in rep.checks:
            s = rep.checks["shared_fs"]
            lines.append(f"  shared fs {s['dir']}: {'ok' if s['reads_every_node'] else 'NOT SHARED'}")
        if "allreduce" in rep.checks:
            a = rep.checks["allreduce"]
            lines.append(f"  all-reduce: latency {a['latency_us']} us, bus bandwidth {a['busbw_gbps']} Gbit/s"
                         f" ({a['bytes'] // 2**20} MiB), result {'correct' if a['correct'] else 'WRONG'}")
        lines += [f"  PROBLEM: {p}" for p in rep.problems]
    return "\n".join(lines)


def _first_node(env: dict[str, str], given: str) -> str:
    host = rendezvous_host(env, given, default="")
    if not host:
        raise SystemExit("hpc doctor --multi-node must run inside a Slurm step (no SLURM_JOB_NODELIST)")
    return host


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if getattr(args, "multi_node", False):
        rank, world = int(env.get("SLURM_NODEID", "0")), int(env.get("SLURM_NNODES", "1"))
        rdzv = _first_node(env, args.rdzv_host or "")
        rep = node_report(rdzv, multi_node=world > 1)
        reports = collective_checks(rep, rank=rank, world=world, rdzv_host=rdzv, port=args.port,
                                    shared_dir=Path(args.shared_dir).absolute())
        if rank != 0:
            return 0 if rep.ok else 1
        for r in reports:
            a = r.checks.get("allreduce", {})
            if a and not a.get("correct"):
                r.problems.append("all-reduce returned a wrong result")
    else:
        rdzv = args.rdzv_host or socket.gethostname()
        reports = [node_report(rdzv, multi_node=bool(args.rdzv_host))]
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"ok": ok, "nodes": [asdict(r) for r in reports]}, indent=2, default=str))
    else:
        print(format_reports(reports))
        print("doctor: all checks passed" if ok else "doctor: problems found (see PROBLEM lines)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry for ``python -m runtime.launch.doctor`` (``hpc doctor`` runs it, through srun for
    ``--nodes``)."""
    p = argparse.ArgumentParser(prog="python -m runtime.launch.doctor", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rdzv-host", default="")
    p.add_argument("--multi-node", action="store_true", help="run one per node under srun")
    p.add_argument("--port", type=int, default=29431)
    p.add_argument("--shared-dir", default=".", help="directory every node should share")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
