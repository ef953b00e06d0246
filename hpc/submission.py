"""``hpc submit`` and ``hpc render``: one JobSpec, checked against the cluster, then submitted.

The order matters and is the point of this module:

1. plan (pure): the backend turns the spec into the exact command and script;
   ``hpc render`` / ``--dry-run`` print that plan and stop: no job directory, no Slurm call;
2. check (reads Slurm, changes nothing): the partition exists and is up, the node count and the
   time limit fit it; a problem exits with status 2 and a message that names it;
3. act (:func:`hpc.api.submit`): create the private job directory, lock it, write
   ``jobspec.json``, submit, record the job id in ``JOB_DIR/slurm_job_id`` and in the user's
   job index (:mod:`hpc.index`) so that ``hpc status`` lists recent jobs and ``hpc logs
   JOBID`` finds the job.

sbatch's own rejections (the controller knows limits we cannot see, e.g. QOS or account) are
mapped to the same kind of clear message and status 2.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpc import backends
from hpc.contract import values
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

if TYPE_CHECKING:
    from hpc.contract.slurm_parse import PartitionInfo


# sbatch's words for a rejection -> (what was wrong, what to do). Recorded from Slurm 22.05.
_SBATCH_REJECTIONS = (
    (r"invalid partition", "the partition does not exist",
     "pick one from `sinfo -s` with --partition"),
    (r"node count specification invalid|more processors requested than permitted",
     "more nodes than the partition allows", "lower --nodes"),
    (r"requested time limit is invalid", "the time limit is over the partition's limit",
     "lower --time (see MaxTime in `scontrol show partition`)"),
    (r"invalid account", "the account is not valid for you", "check --account with `sacctmgr show assoc user=$USER`"),
    (r"invalid qos", "the QOS is not valid", "check --qos with `sacctmgr show qos`"),
    (r"requested node configuration is not available", "no node has the requested resources",
     "lower --mem/--cpus-per-task/--gpus-per-node or change --constraint"),
)


# --------------------------------------------------------------------------- plan


def dry_run(spec: JobSpec, backend: str = backends.DEFAULT) -> int:
    """Prints exactly what :func:`submit` would run; contacts nothing, creates nothing."""
    print(backends.get(backend).plan(spec).describe(), end="")
    _print_notes(notes(spec))
    return 0


def notes(spec: JobSpec, partition: PartitionInfo | None = None) -> list[str]:
    """Advice on a valid request that is probably not what the user meant (pure)."""
    out = []
    if not spec.cpus_per_task and spec.nproc_per_node > 1:
        out.append(f"--cpus-per-task is not set: each node's task (the launcher and its "
                   f"{spec.nproc_per_node} workers) gets Slurm's default CPUs, often 1; e.g. "
                   f"--cpus-per-task {8 * spec.nproc_per_node}")
    if partition is not None:
        most = node_limit(partition)
        if spec.max_nodes > most:
            out.append(f"--nodes {spec.nodes_text}: partition {partition.name!r} has at most {most} "
                       f"nodes, so the job will never grow beyond {most}")
    return out


def node_limit(partition: PartitionInfo) -> int:
    """The most nodes one job can have in ``partition`` (its nodes, or MaxNodes if lower)."""
    return min(partition.total_nodes, partition.max_nodes or partition.total_nodes)


def _print_notes(lines: Sequence[str]) -> None:
    for line in lines:
        print(f"hpc: note: {line}", file=sys.stderr)


# --------------------------------------------------------------------------- check


def check_partition(spec: JobSpec, partitions: Sequence[PartitionInfo]) -> PartitionInfo | None:
    """Checks the request against the partition it will run in (pure).

    Args:
        spec: The job.
        partitions: ``scontrol show partition`` records.

    Returns:
        The partition the job goes to (None if the cluster has no default and none was asked).

    Raises:
        SpecError: unknown or down partition, more nodes than it has or allows, a time limit
            over its MaxTime.
    """
    names = ", ".join(p.name for p in partitions) or "(none)"
    if spec.partition:
        found = [p for p in partitions if p.name == spec.partition]
        if not found:
            raise SpecError("--partition", spec.partition, f"a partition of this cluster: {names}",
                            f"--partition {partitions[0].name if partitions else 'gpu'}")
        part = found[0]
        flag = f"partition {part.name!r}"
    else:
        defaults = [p for p in partitions if p.default]
        if not defaults:
            return None
        part, flag = defaults[0], f"default partition {defaults[0].name!r}"
    if part.state.upper() not in ("UP", ""):
        raise SpecError("--partition", part.name, f"a partition that is UP (it is {part.state})",
                        f"--partition {names.split(', ')[0]}")
    most = node_limit(part)
    if spec.min_nodes > most:
        raise SpecError("--nodes", spec.nodes_text,
                        f"at most {most} nodes: the {flag} has {part.total_nodes} nodes"
                        + (f" and MaxNodes={part.max_nodes}" if part.max_nodes else ""),
                        f"--nodes {most}" if most > 1 else "--nodes 1")
    if spec.time_limit_s and part.max_time_s and spec.time_limit_s > part.max_time_s:
        limit = values.format_time(part.max_time_s)
        raise SpecError("--time", spec.time_text, f"at most {limit}, the MaxTime of the {flag}",
                        f"--time {limit}")
    return part


def explain_rejection(stderr: str) -> str | None:
    """A clear message for an sbatch rejection we recognise, else None (pure)."""
    for pattern, what, todo in _SBATCH_REJECTIONS:
        if re.search(pattern, stderr, re.IGNORECASE):
            detail = stderr.strip().splitlines()[-1].split("error: ", 1)[-1]
            return f"Slurm refused the job: {what} ({detail}); {todo}"
    return None


# --------------------------------------------------------------------------- act


def submit(spec: JobSpec, backend: str = backends.DEFAULT) -> int:
    """``hpc submit``: :func:`hpc.api.submit`, then the job id, directory and how to follow it.

    Returns:
        0 when submitted (refusals raise :class:`SpecError` / :class:`UsageError`, which the
        CLI prints with exit status 2).
    """
    from hpc import api

    job = api.submit(spec, backend, on_notes=_print_notes)
    print(f"Submitted job {job.job_id} ({backend}): {spec.job_name}, {spec.nodes_text} node(s) x "
          f"{spec.nproc_per_node} process(es)")
    print(f"Job directory: {job.job_dir}")
    print(f"Follow it with: hpc logs -f {job.job_id}")
    return 0


__all__ = ["dry_run", "submit", "check_partition", "explain_rejection", "notes", "node_limit"]
