"""Bad nodes stay out: the job's excluded nodes, and leaving them out of its next allocation.

A node that stalled (the suspect of a hang), that Slurm dropped from the job (a crash, a cut
link), or that failed its pre-join health check (:mod:`runtime.launch.health`) is written to
``exclusions.jsonl`` in the job directory (one line per event, ``O_APPEND``: any node may add).

Why not Slurm's ``ExcNodeList``: Slurm 22.05 refuses to change it on a running job ("Job is no
longer pending execution", measured), and once the job is pending again no process of ours is
alive to change it (``scontrol requeue`` ends every process of the job first). So the list is
enforced where the next allocation begins: its batch script runs ``python -m
runtime.exclusions`` before ``srun``, which gives the excluded nodes back to Slurm by shrinking
the running allocation (``scontrol update JobId=J NodeList=KEPT``, accepted for a running job:
measured) and prints the shell lines that make ``srun`` use the kept nodes only.

The cap (pure, :func:`effective` and :func:`plan_release`), so a job never excludes itself out
of its partition:

* at most ``partition nodes - MIN`` nodes are excluded; when more went bad, the oldest
  exclusions lapse first (a node that failed long ago may have been repaired);
* an allocation is never shrunk below MIN: excluded nodes it holds are kept, oldest exclusion
  first, until MIN nodes remain;
* the batch host (the allocation's first node, where the batch script runs) cannot leave a
  running allocation (Slurm refuses: measured); it stays and is named in the log.

Every backend's batch script runs this step or refuses the job that needs it (the
``exclusions`` step of :data:`hpc.backends.BATCH_STEPS`): the sbatch template and submitit's
setup lines run it; TorchX runs only fixed-size jobs, which never shrink. In a container the
batch shell has no Python of the image and the image no Slurm commands, so the step is split:
one task in the container decides (``--plan``: the partition's size comes from the batch shell
in ``HPC_PARTITION_NODES``; it prints ``HPC_KEPT``, ``HPC_RELEASED`` and the shell lines) and
the batch shell shrinks the allocation itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.contract import jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.jobspec import JobSpec
from hpc.contract.records import EXCLUSION_KINDS, Exclusion
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.slurm_parse import expand_hostlist

EXCLUSIONS = jobpaths.EXCLUSIONS
KINDS = EXCLUSION_KINDS
PARTITION_NODES = "HPC_PARTITION_NODES"   # the partition's size, from a container job's batch shell

log = logging.getLogger("hpc.exclusions")


def add(job_dir: Path, node: str, kind: str, reason: str, allocation: int) -> Exclusion | None:
    """Appends one exclusion (never raises: bookkeeping must not take a launcher down)."""
    assert kind in KINDS, kind
    if not node or node == "?":
        return None
    ex = Exclusion(node=node, kind=kind, reason=reason[:300], allocation=allocation, time=time.time())
    try:
        records.append(JobPaths(job_dir).exclusions, ex)
    except OSError as e:
        log.warning("cannot record excluding %s: %s", node, e)
        return None
    log.warning("excluding node %s from the job's next allocations: %s", node, ex.describe())
    return ex


def read(job_dir: Path) -> list[Exclusion]:
    """Every recorded exclusion, oldest first (damaged lines skipped and reported)."""
    return sorted(records.read(JobPaths(job_dir).exclusions, Exclusion), key=lambda e: e.time)


def effective(records: Sequence[Exclusion], *, min_nodes: int,
              partition_nodes: int | None) -> list[Exclusion]:
    """The exclusions in force, oldest first: one per node (its latest), capped (pure).

    Args:
        records: From :func:`read`.
        min_nodes: The job's MIN nodes.
        partition_nodes: Nodes in the job's partition (None: unknown; then no partition cap).
    """
    latest: dict[str, Exclusion] = {}
    for ex in sorted(records, key=lambda e: e.time):
        latest.pop(ex.node, None)
        latest[ex.node] = ex
    ordered = list(latest.values())
    if partition_nodes is not None:
        room = max(0, partition_nodes - min_nodes)
        ordered = ordered[len(ordered) - room:] if room else []
    return ordered


@dataclass(frozen=True)
class Release:
    """What to do with one allocation's nodes (pure result of :func:`plan_release`)."""

    kept: tuple[str, ...]
    released: tuple[str, ...]
    notes: tuple[str, ...]


def plan_release(allocated: Sequence[str], excluded: Sequence[Exclusion], *, min_nodes: int,
                 batch_host: str) -> Release:
    """Which of ``allocated`` to give back, never below ``min_nodes`` nor the batch host (pure)."""
    bad = {ex.node: ex for ex in excluded}
    notes = []
    candidates = [ex for ex in excluded if ex.node in allocated]
    if batch_host in bad and batch_host in allocated:
        notes.append(f"{batch_host} is excluded ({bad[batch_host].reason}) but is the batch host, "
                     "which cannot leave a running allocation: it stays")
        candidates = [ex for ex in candidates if ex.node != batch_host]
    while candidates and len(allocated) - len(candidates) < min_nodes:
        ex = candidates.pop(0)     # the oldest exclusion lapses first
        notes.append(f"{ex.node} is excluded but kept: the job needs at least {min_nodes} nodes")
    released = {ex.node for ex in candidates}
    return Release(tuple(n for n in allocated if n not in released),
                   tuple(n for n in allocated if n in released), tuple(notes))


def shell_lines(kept: Sequence[str]) -> str:
    """The batch shell's view of the shrunk allocation (what Slurm's resize script sets)."""
    nodes = ",".join(kept)
    return "\n".join([
        f"export SLURM_JOB_NODELIST={shlex.quote(nodes)}", f"export SLURM_NODELIST={shlex.quote(nodes)}",
        f"export SLURM_JOB_NUM_NODES={len(kept)}", f"export SLURM_NNODES={len(kept)}",
        "unset SLURM_JOB_CPUS_PER_NODE SLURM_NPROCS SLURM_NTASKS SLURM_TASKS_PER_NODE"]) + "\n"


def partition_size(partition: str) -> int | None:
    """Nodes in ``partition`` (one ``scontrol`` call), or None when it cannot be read."""
    try:
        return SlurmClient(retry_total_s=10).show_partition(partition).total_nodes or None
    except SlurmError:
        return None


def given_partition_size(env: Mapping[str, str]) -> int | None:
    """The partition's size as a container job's batch shell passed it (``HPC_PARTITION_NODES``)."""
    raw = env.get(PARTITION_NODES, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def in_force(job_dir: Path, *, min_nodes: int, partition: str, ask_slurm: bool = True,
             env: Mapping[str, str] = os.environ) -> list[Exclusion]:
    """The job's exclusions in force now. The partition's size comes from ``env`` (in a
    container, from the batch shell), else from Slurm unless ``ask_slurm`` is False."""
    records = read(job_dir)
    if not records:
        return []
    size = given_partition_size(env)
    if size is None and partition and ask_slurm:
        size = partition_size(partition)
    return effective(records, min_nodes=min_nodes, partition_nodes=size)


def decide(job_dir: Path, env: dict[str, str],
           partition_nodes: Callable[[], int | None]) -> tuple[Release, str] | None:
    """Which of the allocation's nodes to give back, and why (None: none); notes to stderr.

    Args:
        job_dir: The job directory (``exclusions.jsonl``, ``jobspec.json``).
        env: The batch shell's (or its one task's) environment: the job id, node list, host.
        partition_nodes: The partition's size, asked only when the job has exclusions.
    """
    allocated = expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))
    if not env.get("SLURM_JOB_ID") or not allocated or not read(job_dir):
        return None
    spec = JobSpec.load(job_dir)
    excluded = effective(read(job_dir), min_nodes=spec.nodes[0], partition_nodes=partition_nodes())
    plan = plan_release(allocated, excluded, min_nodes=spec.nodes[0],
                        batch_host=env.get("SLURMD_NODENAME") or allocated[0])
    for note in plan.notes:
        print(f"hpc: {note}", file=sys.stderr)
    if not plan.released:
        return None
    return plan, "; ".join(ex.describe() for ex in excluded if ex.node in plan.released)


def plan_only(job_dir: Path, env: dict[str, str]) -> str:
    """In a container (no Slurm commands): the decision as lines for the batch shell, which
    shrinks the allocation to ``HPC_KEPT`` and, if Slurm accepts, evaluates them all."""
    decided = decide(job_dir, env, lambda: given_partition_size(env))
    if decided is None:
        return ""
    plan, reasons = decided
    print(f"hpc: excluded node(s) {','.join(plan.released)} to give back ({reasons})", file=sys.stderr)
    return f"HPC_KEPT={','.join(plan.kept)}\nHPC_RELEASED={','.join(plan.released)}\n" + shell_lines(plan.kept)


def enforce(job_dir: Path, env: dict[str, str]) -> str:
    """In the batch shell before srun: shrinks the allocation; returns the shell lines to eval."""
    job_id = env.get("SLURM_JOB_ID", "")
    partition = env.get("SLURM_JOB_PARTITION", "")
    decided = decide(job_dir, env, lambda: partition_size(partition) if partition else None)
    if decided is None:
        return ""
    plan, reasons = decided
    logs = JobPaths(job_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    os.chdir(logs)   # scontrol writes its slurm_job_J_resize.sh into the working directory
    try:
        SlurmClient(retry_total_s=20).resize(job_id, plan.kept)
    except SlurmError as e:
        print(f"hpc: could not give back excluded nodes {','.join(plan.released)}: {e}", file=sys.stderr)
        return ""
    print(f"hpc: gave back excluded node(s) {','.join(plan.released)}; running on "
          f"{','.join(plan.kept)} ({reasons})", file=sys.stderr)
    return shell_lines(plan.kept)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.exclusions", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--job-dir", required=True)
    p.add_argument("--plan", action="store_true",
                   help="decide only, without Slurm commands (in a container): print HPC_KEPT, "
                        "HPC_RELEASED and the shell lines for the batch shell")
    args = p.parse_args(argv)
    try:
        run = plan_only if args.plan else enforce
        sys.stdout.write(run(Path(args.job_dir), dict(os.environ)))
    except Exception as e:  # noqa: BLE001 - never stop the job for its exclusions
        print(f"hpc: exclusions not applied: {type(e).__name__}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
