"""The pre-join health check: a node that cannot train well stays out of the rendezvous.

Each launcher runs it before it joins (about a second): the fast checks of ``hpc doctor``.

* **interfaces**: the network interface NCCL/Gloo would use is found (:mod:`runtime.launch.network`);
* **job_dir**: the shared job directory takes a write and reads it back (a node whose mount is
  gone or read-only would fail at its first checkpoint, or never write its records);
* **gpus** (GPU jobs only): ``nvidia-smi`` answers, shows at least ``--gpus-per-node`` GPUs,
  none with uncorrected volatile ECC errors or pages pending retirement; and the kernel log,
  where readable, has no fatal Xid of the driver (48, 63, 64, 74, 79, 92, 94, 95) since boot.

A failing node is reported in its launcher log and recorded in ``exclusions.jsonl`` (kept
out of the next allocations, :mod:`runtime.exclusions`). It leaves the job when MIN allows:
it claims one of ``nodes - MIN`` leave slots in the job directory (``O_EXCL``, so two failing
nodes can never both leave a job that needs one of them), and exits 0 without joining; the
others form the group without it. Without a free slot, or as the rendezvous host (the store
lives on it), it joins anyway and says so.

The parsers are pure and tested on nvidia-smi's CSV and dmesg's Xid lines; the job-directory
check is tested for real. ``HPC_TEST_HEALTH_FAIL=N`` points node rank N's job-directory probe
at a path that cannot be written, so the real check fails for real (tests only).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.contract.jobpaths import JobPaths

FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95})
GPU_QUERY = "index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
TEST_FAIL = "HPC_TEST_HEALTH_FAIL"
UNWRITABLE = Path("/proc/hpc-health-test")   # no file can be created under /proc


@dataclass(frozen=True)
class Finding:
    """One check's result."""

    check: str
    ok: bool
    detail: str

    def describe(self) -> str:
        return f"{self.check}: {'ok' if self.ok else 'FAILED'}: {self.detail}"


def job_dir_writable(job_dir: Path, host: str, *, probe_root: Path | None = None) -> Finding:
    """Writes a token under ``job_dir/health`` and reads it back."""
    root = probe_root or JobPaths(job_dir).health_root
    probe = root / f".probe-{host}-{os.getpid()}"
    token = uuid.uuid4().hex
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
        back = probe.read_text()
        probe.unlink()
    except OSError as e:
        return Finding("job_dir", False, f"cannot write and read back {probe}: {e}")
    if back != token:
        return Finding("job_dir", False, f"{probe} read back other content than was written")
    return Finding("job_dir", True, f"{root} is writable")


@dataclass(frozen=True)
class GpuState:
    """One GPU as ``nvidia-smi --query-gpu`` reports it (None: [N/A], not supported)."""

    index: int
    bus_id: str
    uncorrected_ecc: int | None
    retirement_pending: bool | None


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if not raw or raw.startswith("[") or raw in ("N/A", "Not Supported") else raw


def parse_gpu_query(text: str) -> list[GpuState]:
    """Parses ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits`` (pure)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        ecc, pending = _value(parts[2]), _value(parts[3])
        out.append(GpuState(int(parts[0]), parts[1], int(ecc) if ecc and ecc.isdigit() else None,
                            None if pending is None else pending.lower() == "yes"))
    return out


XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def parse_xids(dmesg: str) -> list[tuple[str, int]]:
    """``(PCI bus id, Xid)`` of each driver Xid line in kernel-log text (pure)."""
    return [(m.group(1), int(m.group(2))) for m in XID_LINE.finditer(dmesg)]


def gpu_finding(states: Sequence[GpuState], xids: Sequence[tuple[str, int]], *, expected: int) -> Finding:
    """The verdict on a node's GPUs (pure)."""
    problems = []
    if len(states) < expected:
        problems.append(f"{len(states)} GPU(s) visible, the job asks for {expected}")
    for g in states:
        if g.uncorrected_ecc:
            problems.append(f"GPU {g.index} ({g.bus_id}): {g.uncorrected_ecc} uncorrected ECC error(s)")
        if g.retirement_pending:
            problems.append(f"GPU {g.index} ({g.bus_id}): memory pages pending retirement (needs a reset)")
    fatal = sorted({(bus, x) for bus, x in xids if x in FATAL_XIDS})
    problems += [f"Xid {x} on PCI {bus} since boot" for bus, x in fatal]
    if problems:
        return Finding("gpus", False, "; ".join(problems))
    return Finding("gpus", True, f"{len(states)} GPU(s), no uncorrected ECC errors or pending retirements")


def gpus(expected: int) -> Finding:
    """Runs ``nvidia-smi`` (and reads the kernel log where allowed) for :func:`gpu_finding`."""
    if not shutil.which("nvidia-smi"):
        return Finding("gpus", False, f"the job asks for {expected} GPU(s) and nvidia-smi is not installed")
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Finding("gpus", False, f"nvidia-smi did not answer: {e}")
    if r.returncode != 0:
        return Finding("gpus", False, f"nvidia-smi failed ({r.returncode}): {(r.stderr or r.stdout).strip()[:200]}")
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        kernel = ""   # not readable here (dmesg_restrict): nvidia-smi's view only
    return gpu_finding(parse_gpu_query(r.stdout), parse_xids(kernel), expected=expected)


def run_checks(job_dir: Path, *, host: str, node_rank: int, gpus_per_node: int,
               network_problem: str | None, env: Mapping[str, str]) -> list[Finding]:
    """Every check of this node (``network_problem``: why the interface detection failed)."""
    found = [Finding("interfaces", network_problem is None, network_problem or "an interface was chosen")]
    injected = env.get(TEST_FAIL, "")
    probe_root = UNWRITABLE if injected.strip() == str(node_rank) else None
    found.append(job_dir_writable(job_dir, host, probe_root=probe_root))
    if gpus_per_node:
        found.append(gpus(gpus_per_node))
    return found


def claim_leave(job_dir: Path, allocation: int, *, nodes: int, min_nodes: int, host: str) -> bool:
    """Claims one of the ``nodes - min_nodes`` slots a failing node needs to leave (O_EXCL)."""
    root = JobPaths(job_dir).health(allocation)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    for slot in range(max(0, nodes - min_nodes)):
        try:
            fd = os.open(root / f"leave-{slot}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except OSError:
            return False
        os.write(fd, host.encode())
        os.close(fd)
        return True
    return False
