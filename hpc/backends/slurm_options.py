"""What a JobSpec asks of Slurm and of each node, decided once for every backend (pure).

The sbatch template, the submitit executor and the TorchX component carry the same job in
three syntaxes. The decisions themselves live here, so that an option cannot mean one thing
in one backend and another elsewhere (``--signal-lead 0`` used to: no signal in the template,
``USR2@0`` with submitit, always a signal with TorchX):

* :func:`warning_signal`: Slurm's ``--signal`` value, or None for no warning signal;
* :func:`nodes_range`: Slurm's ``--nodes`` value (``MIN-MAX`` for an elastic job);
* :func:`requeue_flag`: ``requeue`` or ``no-requeue``;
* :func:`launcher_argv`: the per-node launcher command every backend runs on each node;
* :func:`gres`: the GPU request (typed with ``--gpu-type``);
* :func:`batch_setup_lines` / :func:`node_setup_script`: ``--setup`` in the batch shell and on
  each node before the launcher;
* :func:`exclusion_lines`: the batch shell's step that gives the nodes the job found bad back
  to Slurm before ``srun`` (the ``exclusions`` step of :data:`hpc.backends.BATCH_STEPS`);
* :func:`container_mounts` / :func:`apptainer_argv`: what a container gets mounted and how
  Apptainer is started.

A backend that cannot carry an option refuses it (exit 2, naming it) instead of dropping it.
"""

from __future__ import annotations

import posixpath
import shlex

from hpc.contract import jobdir
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

LAUNCHER_MODULE = "runtime.launch"
EXCLUSIONS_MODULE = "runtime.exclusions"
SETUP_ARGV0 = "hpc-setup"   # $0 of the per-node setup shell (names it in error messages)


def warning_signal(spec: JobSpec) -> str | None:
    """``SIG@LEAD`` for sbatch's ``--signal``; None when ``--signal-lead 0`` (no warning signal:
    a preemption then sends only SIGTERM, which the runtime handles as a warning too)."""
    return f"{spec.signal}@{spec.signal_lead_s}" if spec.signal_lead_s else None


def nodes_range(spec: JobSpec) -> str:
    """sbatch's ``--nodes``: ``N``, or ``MIN-MAX`` for an elastic job; with ``--spare-nodes K``,
    ``MIN-(MAX+K)``: the spares come on top of MAX when Slurm has them, and the job never waits
    for a spare (without one, a lost node shrinks an elastic job as before)."""
    lo, hi = spec.nodes
    hi += spec.spare_nodes
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


def gres(spec: JobSpec) -> str | None:
    """sbatch's ``--gres``: ``gpu:N``, ``gpu:TYPE:N`` with ``--gpu-type``; None without GPUs."""
    if not spec.gpus_per_node:
        return None
    return f"gpu:{spec.gpu_type}:{spec.gpus_per_node}" if spec.gpu_type else f"gpu:{spec.gpus_per_node}"


def _guarded(lines: tuple[str, ...], where: str) -> list[str]:
    """Each ``--setup`` line in a group of its own, so that a failing line ends the job with
    a message naming it (a line may end in ``&`` or ``;`` or a comment: hence the newlines)."""
    out = []
    for i, line in enumerate(lines, 1):
        out += ["{", line, f'}} || {{ echo "hpc: --setup line {i} failed {where}: "'
                f'{shlex.quote(line)} >&2; exit 1; }}']
    return out


def batch_setup_lines(spec: JobSpec, *, nounset: bool = True) -> list[str]:
    """The ``--setup`` lines as the batch shell runs them, before srun (``[]`` without any).

    With ``nounset`` (our template runs under ``set -u``), ``set -u`` is off around them:
    environment scripts (``module``, a venv's or conda's activate) read unset variables.
    """
    if not spec.setup:
        return []
    lines = _guarded(spec.setup, "in the batch shell on $(hostname)")
    return ["set +u", *lines, "set -u"] if nounset else lines


def exclusion_lines(spec: JobSpec) -> list[str]:
    """The batch shell's lines, before ``srun``, that give the nodes this job found bad back to
    Slurm and point ``srun`` at the kept ones (``python -m runtime.exclusions``, whose output
    is evaluated; it never fails the job). ``[]`` for a one-node job, which has none to give
    back, and in a container, whose Python the batch shell does not have."""
    if spec.allocated_nodes <= 1 or spec.container_image:
        return []
    command = shlex.join([spec.python, "-m", EXCLUSIONS_MODULE, "--job-dir", spec.job_dir])
    return [f'eval "$({command} || true)"']


def node_setup_script(spec: JobSpec) -> str:
    """The per-node part of ``--setup``: a ``bash -c`` script that runs the lines on the node
    and then execs its arguments (the launcher), so the launcher inherits what they set.
    Empty without ``--setup``."""
    if not spec.setup:
        return ""
    return "\n".join([*_guarded(spec.setup, "on $(hostname)"), 'exec "$@"'])


def with_node_setup(spec: JobSpec, argv: list[str]) -> list[str]:
    """``argv`` run after the per-node ``--setup`` lines (``argv`` itself without any)."""
    script = node_setup_script(spec)
    return ["bash", "-c", script, SETUP_ARGV0, *argv] if script else list(argv)


def container_mounts(spec: JobSpec) -> list[str]:
    """What the container gets mounted: the job directory, the checkpoint directory and the
    script's directory at the same paths (the launcher and workers use the host's paths),
    then ``--container-mounts``.

    Raises:
        SpecError: for a directory with ``,`` or ``:``, which the mount syntax cannot carry.
    """
    dirs = {"--job-dir": spec.job_dir.rstrip("/") or "/",
            "--checkpoint-dir": spec.resolved_checkpoint_dir.rstrip("/") or "/",
            "SCRIPT": posixpath.dirname(spec.script) or "/"}
    for flag, d in dirs.items():
        if "," in d or ":" in d:
            raise SpecError(flag, d, "a path without ',' or ':' under --container-image (the "
                            "container mount syntax separates with them)", f"{flag} /scratch/run")

    def inside(d: str, m: str) -> bool:
        return d != m and d.startswith(m.rstrip("/") + "/")

    out: list[str] = []
    for d in dirs.values():   # in this order, leaving out what another one already mounts
        if d not in out and not any(inside(d, m) for m in dirs.values()):
            out.append(d)
    return [f"{d}:{d}" for d in out] + list(spec.container_mounts)


def apptainer_argv(spec: JobSpec, argv: list[str]) -> list[str]:
    """``apptainer exec [--nv] --bind MOUNTS IMAGE argv...`` (``--nv`` with GPUs)."""
    return ["apptainer", "exec", *(["--nv"] if spec.gpus_per_node else []),
            "--bind", ",".join(container_mounts(spec)), spec.container_image, *argv]


def requeue_request(job_dir: str) -> str:
    """The file (a pattern with ``${ALLOCATION}``) through which node 0's launcher asks the
    batch shell to requeue the job when it runs in a container (no Slurm commands there)."""
    return f"{job_dir}/{jobdir.REQUEUE_REQUEST_PREFIX}${{ALLOCATION}}"
