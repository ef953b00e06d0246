"""What a JobSpec asks of Slurm and of each node, decided once for every backend (pure).

The sbatch template, the submitit executor and the TorchX component carry the same job in
three syntaxes. The decisions themselves live here, so that an option cannot mean one thing
in one backend and another elsewhere (``--signal-lead 0`` used to: no signal in the template,
``USR2@0`` with submitit, always a signal with TorchX):

* :func:`warning_signal`: Slurm's ``--signal`` value, or None for no warning signal;
* :func:`nodes_range`: Slurm's ``--nodes`` value (``MIN-MAX`` for an elastic job);
* :func:`requeue_flag`: ``requeue`` or ``no-requeue``;
* :func:`launcher_argv`: the per-node launcher command every backend runs on each node.
"""

from __future__ import annotations

from hpc.contract.jobspec import JobSpec

LAUNCHER_MODULE = "runtime.launch"


def warning_signal(spec: JobSpec) -> str | None:
    """``SIG@LEAD`` for sbatch's ``--signal``; None when ``--signal-lead 0`` (no warning signal:
    a preemption then sends only SIGTERM, which the runtime handles as a warning too)."""
    return f"{spec.signal}@{spec.signal_lead_s}" if spec.signal_lead_s else None


def nodes_range(spec: JobSpec) -> str:
    """sbatch's ``--nodes``: ``N``, or ``MIN-MAX`` for an elastic job."""
    lo, hi = spec.nodes
    return str(lo) if lo == hi else f"{lo}-{hi}"


def requeue_flag(spec: JobSpec) -> str:
    """``requeue`` (preemption and time limit bring the job back) or ``no-requeue``."""
    return "no-requeue" if spec.requeue == "never" else "requeue"


def launcher_argv(spec: JobSpec, *extra: str) -> list[str]:
    """The per-node launcher command (``python -m runtime.launch --job-dir DIR ...``).

    The launcher finds the rendezvous host itself (the allocation's first node, see
    ``runtime.launch``), so backends only pass ``extra`` where they know better.
    """
    return [spec.python, "-m", LAUNCHER_MODULE, "--job-dir", spec.job_dir, *extra]
