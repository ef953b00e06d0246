"""The ``submitit`` backend: the same JobSpec and the same per-node launcher, submitted by submitit.

submitit pickles a callable and runs it in every Slurm task. We ask for one task per node and
our callable, :func:`run_node`, does what the sbatch template's body does: it takes the first
node of the allocation as the rendezvous host and runs ``runtime.launch.main`` (the torch
elastic agent and our signal handling) on that node.

How submitit's own preemption handling is reconciled with ours (docs/backends.md has more):

* submitit installs handlers in the task process: SIGUSR2 -> checkpoint-and-requeue on global
  rank 0 only (and only for ``Checkpointable`` callables), SIGTERM -> ignored ("bypass"). Our
  launcher installs its own handlers for SIGTERM and the warning signal when it starts, after
  submitit's, so the signal is forwarded to the workers, which agree and save. We do not use
  ``Checkpointable``: the save happens inside the workers, on every rank, collectively.
* ``--signal`` is ours (``spec.signal@spec.signal_lead_s``), set through
  ``additional_parameters`` because submitit would otherwise write ``USR2@90``.
* ``--requeue``/``--no-requeue`` follow ``spec.requeue``; near the time limit node 0's
  launcher asks Slurm for the requeue itself (``runtime.requeue``), as under the template.

submitit writes the batch script; the ``sbatch`` call goes through :class:`hpc.contract.slurm.SlurmClient`
like every other backend's (retries while the controller is unreachable, a unique tag looked up
before a retry so a lost answer never submits twice): the executor's submission command is
``python -m hpc.backends.submitit_backend SCRIPT``, which submits with the client and prints
sbatch's usual line for submitit to parse. submitit is imported only inside functions so the
login node stays light.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc import render
from hpc.contract.jobspec import JobSpec

if TYPE_CHECKING:
    from hpc.contract.slurm import SlurmClient



def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """The ``SlurmExecutor.update_parameters`` arguments for ``spec`` (pure).

    Every user option is carried; none is dropped. Elastic ``MIN:MAX`` nodes become Slurm's
    ``--nodes=MIN-MAX`` (submitit's ``nodes`` is an int, so it goes in additional parameters).
    """
    lo, hi = spec.nodes
    extra: dict[str, Any] = {
        "signal": f"{spec.signal}@{spec.signal_lead_s}",
        "no-kill": True,
        "export": "ALL",
        ("no-requeue" if spec.requeue == "never" else "requeue"): True,
    }
    params: dict[str, Any] = {
        "job_name": spec.job_name, "ntasks_per_node": 1, "stderr_to_stdout": True,
        # srun does not inherit --cpus-per-task from the allocation (Slurm >= 22.05)
        "srun_args": ["--no-kill", "--kill-on-bad-exit=0",
                      *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else [])],
        "time": math.ceil(spec.time_limit_s / 60) if spec.time_limit_s else None,
    }
    if lo == hi:
        params["nodes"] = lo
    else:
        extra["nodes"] = f"{lo}-{hi}"
    for name in ("partition", "account", "qos", "constraint", "exclude", "mem"):
        if getattr(spec, name):
            params[name] = getattr(spec, name)
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    params["additional_parameters"] = extra
    return params


@dataclass(frozen=True)
class SubmititPlan:
    """What the submitit backend will submit: the executor folder, parameters and callable."""

    spec: JobSpec
    folder: Path
    parameters: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """The dry run: the executor settings and the sbatch script submitit will write."""
        from submitit.slurm.slurm import _make_sbatch_string

        params = {k: v for k, v in self.parameters.items() if v is not None}
        command = shlex.join([self.spec.python, "-u", "-m", "submitit.core._submit",
                              str(self.folder)])
        script = _make_sbatch_string(command=command, folder=str(self.folder / "%j"), **params)
        return (f"# submitit SlurmExecutor(folder={str(self.folder)!r}, "
                f"python={self.spec.python!r})\n# update_parameters("
                f"{json.dumps(params, sort_keys=True)})\n# submit(run_node, "
                f"{self.spec.job_dir!r}) -> sbatch of:\n{script}")


def plan(spec: JobSpec) -> SubmititPlan:
    """Plans the submission (pure). Secrets in ``spec.env`` are refused, as for sbatch."""
    render.check_renderable(spec)
    return SubmititPlan(spec=spec, folder=Path(spec.job_dir) / "submitit",
                        parameters=executor_parameters(spec))


def execute(p: SubmititPlan, client: SlurmClient | None = None) -> str:
    """Submits through submitit; returns the Slurm job id. The ``sbatch`` runs in a child
    process through a fresh :class:`SlurmClient` (``client`` is accepted so every backend has
    the same signature; the child reads the same environment)."""
    import submitit

    class Executor(submitit.SlurmExecutor):
        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            return [sys.executable, "-m", "hpc.backends.submitit_backend", str(submission_file_path)]

    executor = Executor(folder=str(p.folder / "%j"), python=p.spec.python)
    executor.update_parameters(**{k: v for k, v in p.parameters.items() if v is not None})
    try:
        job = executor.submit(run_node, p.spec.job_dir)
    except submitit.core.utils.FailedJobError as e:
        from hpc.contract.slurm import SlurmError

        raise SlurmError("sbatch (for submitit) failed", ["sbatch", str(p.folder)], 1, str(e)) from e
    return str(job.job_id)


def rendezvous_host(env: dict[str, str] | os._Environ[str]) -> str:
    """The first node of the allocation (what ``scontrol show hostnames | head -n1`` prints)."""
    from hpc.contract.slurm_parse import expand_hostlist

    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    if not hosts:
        raise RuntimeError("SLURM_JOB_NODELIST is not set: run_node runs inside a Slurm job")
    return hosts[0]


def run_node(job_dir: str) -> int:
    """The callable submitit runs on every node: our per-node launcher.

    Raises:
        RuntimeError: when the launcher fails, so submitit records the job as failed.
    """
    from runtime import launch

    host = rendezvous_host(os.environ)
    os.environ["HPC_RDZV_HOST"] = host
    code = launch.main(["--job-dir", job_dir, "--rdzv-host", host])
    if code != 0:
        raise RuntimeError(f"runtime.launch exited with {code}; see {job_dir}/logs")
    print(f"hpc: node {os.environ.get('SLURM_NODEID', '?')} done", file=sys.stderr, flush=True)
    return code


def _submit_file(argv: list[str]) -> int:
    """``python -m hpc.backends.submitit_backend SCRIPT``: sbatch SCRIPT through the client."""
    from hpc.contract.slurm import SlurmClient, SlurmError

    if len(argv) != 1:
        print("usage: python -m hpc.backends.submitit_backend SUBMISSION_SCRIPT", file=sys.stderr)
        return 2
    try:
        job_id = SlurmClient().submit(Path(argv[0]))
    except SlurmError as e:
        print(e.stderr or str(e), file=sys.stderr)  # sbatch's own words, for explain_rejection
        return 1
    print(f"Submitted batch job {job_id}")  # the line submitit parses
    return 0


if __name__ == "__main__":
    raise SystemExit(_submit_file(sys.argv[1:]))
