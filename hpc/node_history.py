"""Each node's history, read from the job directories of the user's job index; the nodes to avoid.

No new record: a job directory already says which nodes ran it (its launchers' logs,
``logs/alloc-A/node-HOST.log``), which of them faulted (``exclusions.jsonl``), and how each
allocation ended (``outcomes.jsonl``, and ``logs/alloc-A/stop.json`` for when its stop began).
Reading them is linear in the jobs: per job directory ``exclusions.jsonl`` and the names in its
log folders; only for a job with faults its ``outcomes.jsonl``, and a stop notice only for an
allocation that has faults and was stopped. The weighing is :mod:`hpc.bad_nodes`.

Which jobs: every job directory of ``$HPC_HOME/jobs.jsonl`` once (a requeued or resubmitted job
is one job), a sweep's tasks each as a job, and only jobs of the cluster the submission goes to
when it is known (node names of another cluster mean nothing here, and Slurm refuses to exclude
a node it does not know). ``hpc run`` jobs (one machine, no Slurm nodes) are left out.

Nothing here asks Slurm or imports the Slurm client: ``hpc render`` and ``hpc nodes`` stay fast.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc import bad_nodes
from hpc.bad_nodes import Allocation, Avoidance, Fault, JobNodes, NodeRecord, Policy
from hpc.contract import jobdir, jobpaths, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.records import Exclusion, JobRecord
from hpc.contract.slurm_parse import PartitionInfo, expand_hostlist

if TYPE_CHECKING:
    from hpc.backends import Backend, Plan

MAX_SWEEP_TASKS = 100_000
# A node's name as Slurm takes it in --exclude: anything else in a record (a damaged line, a
# stranger's file) is no node and must never reach the batch script.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def job_dirs(home: Path | None = None, cluster: str = "") -> Iterator[tuple[JobRecord, Path]]:
    """Each Slurm job directory of the index once (its first record), oldest first; a sweep's
    tasks each on their own. With ``cluster``, jobs recorded on another cluster are left out."""
    seen: set[str] = set()
    for rec in records.read((home or jobpaths.hpc_home()) / jobpaths.JOBS, JobRecord):
        if not rec.job_dir or rec.backend == "local" or rec.job_dir in seen or rec.elsewhere(cluster):
            continue
        seen.add(rec.job_dir)
        root = Path(rec.job_dir)
        if JobPaths(root).sweep.is_file():
            for i in range(MAX_SWEEP_TASKS):
                task = jobdir.sweep_task_dir(root, i)
                if not task.is_dir():
                    break
                yield rec, task
        else:
            yield rec, root


def read_job(job_dir: Path, key: str, submitted: float) -> JobNodes:
    """What one job directory says about its nodes (a missing or damaged file reads as empty)."""
    paths = JobPaths(job_dir)
    faults: dict[int, list[Fault]] = {}
    for ex in records.read(paths.exclusions, Exclusion):
        if NODE_NAME.fullmatch(ex.node):
            faults.setdefault(ex.allocation, []).append(Fault(ex.node, ex.kind, ex.time, ex.reason))
    endings = {o.allocation: o for o in jobdir.read_outcomes(job_dir)} if faults else {}
    allocations = []
    for a in sorted({*paths.allocations(), *faults, *endings}):
        ending = endings[a].kind if a in endings else ""
        since = None
        if a in faults and ending in bad_nodes.STOP_ENDINGS:
            notice = jobdir.read_json(paths.stop_notice(a)) or {}
            at = notice.get("received_at")
            since = float(at) if isinstance(at, (int, float)) else endings[a].time or None
        nodes = [n for n in paths.node_hosts(a) if NODE_NAME.fullmatch(n)]
        if a in endings and NODE_NAME.fullmatch(endings[a].node) and endings[a].node not in nodes:
            nodes.append(endings[a].node)
        allocations.append(Allocation(tuple(nodes), tuple(faults.get(a, ())), ending, since))
    return JobNodes(key, submitted, tuple(allocations))


def read_history(home: Path | None = None, cluster: str = "") -> list[JobNodes]:
    """Every job of the index as :class:`~hpc.bad_nodes.JobNodes`, oldest first."""
    return [read_job(d, rec.key if d == Path(rec.job_dir) else str(d), rec.submitted)
            for rec, d in job_dirs(home, cluster)]


def policy_of(spec: JobSpec) -> Policy:
    return Policy(faults=spec.bad_node_faults, jobs=spec.bad_node_jobs)


@dataclass(frozen=True)
class Avoided:
    """A submission's spec with the avoided nodes merged into its ``exclude``, and what to say."""

    spec: JobSpec
    avoidance: Avoidance
    line: str          # the one line about the nodes avoided ('' when none)


def avoid(spec: JobSpec, *, partition: PartitionInfo | None = None, cluster: str = "",
          home: Path | None = None) -> Avoided:
    """``spec`` with the nodes its history avoids added to ``--exclude`` (unchanged when
    ``--no-avoid-bad-nodes`` or when no node is avoided).

    Args:
        spec: The job to submit.
        partition: Its partition, when read from Slurm: only its nodes are avoided, capped so
            the job can still start there.
        cluster: The cluster the job goes to ('' unknown: every job of the index counts).
        home: ``$HPC_HOME`` (default: the environment's).
    """
    if not spec.avoid_bad_nodes:
        return Avoided(spec, Avoidance(), "")
    policy = policy_of(spec)
    history = bad_nodes.node_records(read_history(home, cluster), policy, time.time())
    given = expand_hostlist(spec.exclude) if spec.exclude else ()
    avoidance = bad_nodes.to_avoid(history, partition_nodes=partition_nodes(partition),
                                   needed=spec.min_nodes + spec.spare_nodes, excluded=given)
    if not avoidance.avoided:
        return Avoided(spec, avoidance, "; ".join(avoidance.notes))
    merged = ",".join(x for x in (spec.exclude, *avoidance.nodes) if x)
    line = "; ".join((bad_nodes.describe(avoidance, policy), *avoidance.notes))
    return Avoided(spec.replace(exclude=merged), avoidance, line)


def plan_avoiding(chosen: Backend, spec: JobSpec, *, partition: PartitionInfo | None = None,
                  cluster: str = "", home: Path | None = None) -> tuple[Plan, str]:
    """The backend's plan of ``spec`` with its history's bad nodes excluded, and the line to
    print about them ('' when none). ``spec`` is planned as given first, so its own errors are
    its own; a backend that cannot exclude nodes (TorchX) gets ``spec`` unchanged and the line
    says so.

    Raises:
        SpecError: ``spec`` itself is refused by the backend.
    """
    plan = chosen.plan(spec)
    avoided = avoid(spec, partition=partition, cluster=cluster, home=home)
    if avoided.spec is spec:
        return plan, avoided.line
    try:
        return chosen.plan(avoided.spec), avoided.line
    except SpecError as e:
        return plan, (f"not avoiding {','.join(avoided.avoidance.nodes)}, which faulted in recent "
                      f"jobs (hpc nodes): this backend cannot exclude nodes ({e.value})")


def partition_nodes(partition: PartitionInfo | None) -> Sequence[str] | None:
    """The partition's node names (None: unknown, or Slurm did not list them)."""
    if partition is None or not partition.nodes:
        return None
    return partition.nodes


def records_for(home: Path | None = None, cluster: str = "",
                policy: Policy = Policy()) -> list[NodeRecord]:
    """Each node's record (``hpc nodes``)."""
    return bad_nodes.node_records(read_history(home, cluster), policy, time.time())
