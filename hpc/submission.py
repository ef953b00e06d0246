"""``hpc submit`` and ``hpc render``: one JobSpec, checked against the cluster, then submitted.

The order matters and is the point of this module:

1. plan (pure): the backend turns the spec into the exact command and script;
   ``hpc render`` / ``--dry-run`` print that plan and stop: no job directory, no Slurm call;
   the nodes that faulted in the user's recent jobs are excluded (:mod:`hpc.node_history`,
   ``--no-avoid-bad-nodes`` keeps them), and one line says which and why;
2. check (reads Slurm, changes nothing; :mod:`hpc.prechecks`): the partition exists and is up,
   the node count and the time limit fit it; a problem exits with status 2 and a message that
   names it;
3. act (:func:`hpc.api.submit`): create the private job directory, lock it, write
   ``jobspec.json``, submit, record the job id in ``JOB_DIR/slurm_job_id`` and in the user's
   job index (:mod:`hpc.contract.index`) so that ``hpc status`` lists recent jobs and ``hpc logs
   JOBID`` finds the job.

sbatch's own rejections (the controller knows limits we cannot see, e.g. QOS or account) are
mapped to the same kind of clear message and status 2 (:func:`hpc.prechecks.explain_rejection`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hpc import backends, node_history
from hpc.contract.jobspec import JobSpec
from hpc.prechecks import check_partition, explain_rejection, node_limit, notes  # noqa: F401 - re-exported


# --------------------------------------------------------------------------- plan


def dry_run(spec: JobSpec, backend: str = backends.DEFAULT) -> int:
    """Prints exactly what :func:`submit` would run; contacts nothing, creates nothing.

    The nodes the user's recent jobs found bad are excluded as :func:`submit` would, but
    without the partition and the cluster (Slurm is not asked): the jobs of every cluster of
    the job index count, and no cap keeps the job room in its partition.
    """
    plan, avoiding = node_history.plan_avoiding(backends.get(backend), spec)
    print(plan.describe(), end="")
    _print_notes(notes(spec) + ([avoiding] if avoiding else []))
    return 0


def _print_notes(lines: Sequence[str]) -> None:
    for line in lines:
        print(f"hpc: note: {line}", file=sys.stderr)


# --------------------------------------------------------------------------- act


def submit(spec: JobSpec, backend: str = backends.DEFAULT) -> int:
    """``hpc submit``: :func:`hpc.api.submit`, then the job id, directory and how to follow it.

    Returns:
        0 when submitted (refusals raise :class:`SpecError` / :class:`UsageError`, which the
        CLI prints with exit status 2).
    """
    from hpc import api   # here: `hpc render` needs none of what submitting loads

    job = api.submit(spec, backend, on_notes=_print_notes)
    print(f"Submitted job {job.job_id} ({backend}): {spec.job_name}, {spec.nodes_text} node(s) x "
          f"{spec.nproc_per_node} process(es)")
    print(f"Job directory: {job.job_dir}")
    print(f"Follow it with: hpc logs -f {job.job_id}")
    return 0


__all__ = ["dry_run", "submit", "check_partition", "explain_rejection", "notes", "node_limit"]
