"""Pre-submit checks: a JobSpec against the cluster it goes to, before anything is created.

:func:`check_partition` refuses a request the partition cannot take (unknown or down, too many
nodes, a time limit over its MaxTime) with a :class:`SpecError` naming the flag (the field, when
called from Python: :mod:`hpc.contract.spec_terms`); :func:`notes`
gives advice on a valid request that is probably not what the user meant; and
:func:`explain_rejection` turns sbatch's own refusals (limits we cannot see, e.g. QOS or
account) into the same kind of message. All pure: the caller reads the partitions
(:meth:`hpc.contract.slurm.SlurmClient.partitions`). Both :mod:`hpc.api` (which submits) and
:mod:`hpc.submission` (the CLI's words around it) use them, so they live apart from both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from hpc.contract import interval, spec_terms, values
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
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


def checkpoint_warning(spec: JobSpec) -> str | None:
    """One line when the job will save no periodic checkpoint (reads the script's source)."""
    source = None
    if spec.script.endswith(".py"):
        try:
            source = Path(spec.script).read_text(errors="replace")
        except OSError:
            pass
    return interval.no_checkpoint_warning(
        spec.checkpoint_interval, spec.checkpoint_every_min, spec.checkpoint_every_steps,
        interval.uses_session(source) if source is not None else None, Path(spec.script).name)


def notes(spec: JobSpec, partition: PartitionInfo | None = None) -> list[str]:
    """Advice on a valid request that is probably not what the user meant (pure, but for
    reading the script's source in :func:`checkpoint_warning`)."""
    out = []
    if (warning := checkpoint_warning(spec)) is not None:
        out.append(warning)
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
    pick = spec_terms.pick   # flags for the CLI, fields for Python (hpc.submit)
    if spec.partition:
        found = [p for p in partitions if p.name == spec.partition]
        if not found:
            first = partitions[0].name if partitions else "gpu"
            raise SpecError(pick("--partition", "partition"), spec.partition,
                            f"a partition of this cluster: {names}",
                            pick(f"--partition {first}", f"partition={first!r}"))
        part = found[0]
        flag = f"partition {part.name!r}"
    else:
        defaults = [p for p in partitions if p.default]
        if not defaults:
            return None
        part, flag = defaults[0], f"default partition {defaults[0].name!r}"
    if part.state.upper() not in ("UP", ""):
        first = names.split(", ")[0]
        raise SpecError(pick("--partition", "partition"), part.name,
                        f"a partition that is UP (it is {part.state})",
                        pick(f"--partition {first}", f"partition={first!r}"))
    most = node_limit(part)
    if spec.min_nodes > most:
        raise SpecError(pick("--nodes", "nodes"), pick(spec.nodes_text, spec.nodes),
                        f"at most {most} nodes: the {flag} has {part.total_nodes} nodes"
                        + (f" and MaxNodes={part.max_nodes}" if part.max_nodes else ""),
                        pick(f"--nodes {max(most, 1)}", f"nodes={max(most, 1)}"))
    if spec.time_limit_s and part.max_time_s and spec.time_limit_s > part.max_time_s:
        limit = values.format_time(part.max_time_s)
        raise SpecError(pick("--time", "time_limit_s"), pick(spec.time_text, spec.time_limit_s),
                        f"at most {limit}, the MaxTime of the {flag}"
                        + pick("", f" ({part.max_time_s} s)"),
                        pick(f"--time {limit}", f"time_limit_s={part.max_time_s}"))
    return part


def explain_rejection(stderr: str) -> str | None:
    """A clear message for an sbatch rejection we recognise, else None (pure)."""
    for pattern, what, todo in _SBATCH_REJECTIONS:
        if re.search(pattern, stderr, re.IGNORECASE):
            detail = stderr.strip().splitlines()[-1].split("error: ", 1)[-1]
            return f"Slurm refused the job: {what} ({detail}); {todo}"
    return None


__all__ = ["check_partition", "explain_rejection", "notes", "node_limit"]
