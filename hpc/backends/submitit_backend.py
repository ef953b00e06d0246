"""The ``submitit`` backend: the same JobSpec and the same per-node launcher, submitted by submitit.

submitit pickles a callable and runs it in every Slurm task. We ask for one task per node and
our callable, :func:`run_node`, does what the sbatch template's body does: it takes the first
node of the allocation as the rendezvous host and runs ``runtime.launch.main.main`` (the torch
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
  launcher asks Slurm for the requeue itself (``runtime.ending.requeue``), as under the template.
* The nodes the job found bad before (``exclusions.jsonl``) go back to Slurm in the batch
  shell before ``srun``, as under the template (:func:`slurm_options.exclusion_lines` in
  submitit's ``setup``); ``srun`` then runs on the kept nodes. There is no
  ``--ntasks-per-node`` on the allocation (with it, Slurm 22.05 grants the minimum of a
  ``MIN-MAX`` node range), only on ``srun``.

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
from typing import Any

from hpc import render
from hpc.backends import slurm_options
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmClient, SlurmError

# Exclusions in submitit's setup lines; no containers (see plan) (hpc.backends.BATCH_STEPS).
ENFORCES = frozenset({"exclusions"})


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """The ``SlurmExecutor.update_parameters`` arguments for ``spec`` (pure).

    Every user option is carried; none is dropped. Elastic ``MIN:MAX`` nodes become Slurm's
    ``--nodes=MIN-MAX`` (submitit's ``nodes`` is an int, so it goes in additional parameters).
    ``time`` is None without ``--time`` (the partition's default; submitit's own default would
    be 5 minutes). The warning signal is ours; without one (``--signal-lead 0``) submitit's
    ``--signal`` line is removed from the script (:func:`submission_text`).
    """
    extra: dict[str, Any] = {"no-kill": True, "export": "ALL", slurm_options.requeue_flag(spec): True}
    signal = slurm_options.warning_signal(spec)
    if signal:
        extra["signal"] = signal
    params: dict[str, Any] = {
        "job_name": spec.job_name, "stderr_to_stdout": True,
        # One task per node on srun, not on the allocation (which would then get MIN nodes of a
        # range); srun does not inherit --cpus-per-task from the allocation (Slurm >= 22.05).
        "srun_args": ["--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1",
                      *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else [])],
        "time": math.ceil(spec.time_limit_s / 60) if spec.time_limit_s else None,
    }
    if spec.min_nodes == spec.max_nodes and not spec.spare_nodes:
        params["nodes"] = spec.min_nodes
    else:
        extra["nodes"] = slurm_options.nodes_range(spec)
    for name in ("partition", "account", "qos", "constraint", "exclude", "mem"):
        if getattr(spec, name):
            params[name] = getattr(spec, name)
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.gpu_type:   # typed GPUs: submitit's gpus_per_node cannot name a type
        params["gres"] = slurm_options.gres(spec)
    elif spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    for name in ("nodelist", "mail_type", "mail_user"):
        if getattr(spec, name):
            params[name] = getattr(spec, name)
    if spec.exclusive:
        params["exclusive"] = True
    if spec.after:
        params["dependency"] = ",".join(spec.after)
    if spec.reservation:
        extra["reservation"] = spec.reservation
    # --sbatch: written as #SBATCH --KEY=VALUE (submitit shell-quotes the value), or --KEY.
    extra.update({key: value or True for key, value in spec.sbatch})
    # --setup's batch-shell part (run_node runs the per-node part), then the exclusions step.
    setup = slurm_options.batch_setup_lines(spec, nounset=False) + slurm_options.exclusion_lines(spec)
    if setup:
        params["setup"] = setup
    params["additional_parameters"] = extra
    return params


def submission_text(text: str, spec: JobSpec) -> str:
    """submitit's batch script, with its ``--signal`` line removed when the job has no
    warning signal (submitit always writes one)."""
    if slurm_options.warning_signal(spec):
        return text
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("#SBATCH --signal="))


@dataclass(frozen=True)
class SubmititPlan:
    """What the submitit backend will submit: the executor folder, parameters and callable."""

    spec: JobSpec
    folder: Path
    parameters: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """The dry run: the executor settings and the sbatch script submitit will write."""
        from submitit.slurm.slurm import _make_sbatch_string

        params = self.parameters
        command = shlex.join([self.spec.python, "-u", "-m", "submitit.core._submit",
                              str(self.folder)])
        script = submission_text(
            _make_sbatch_string(command=command, folder=str(self.folder), **params), self.spec)
        return (f"# submitit SlurmExecutor(folder={str(self.folder)!r}, "
                f"python={self.spec.python!r})\n# update_parameters("
                f"{json.dumps(params, sort_keys=True)})\n# submit(run_node, "
                f"{self.spec.job_dir!r}) -> sbatch of:\n{script}")


def plan(spec: JobSpec) -> SubmititPlan:
    """Plans the submission (pure). Secrets in ``spec.env`` are refused, as for sbatch.
    ``--container-image`` is refused by the backend contract (``container`` is not in
    :data:`ENFORCES`: submitit's own process would have to run in the image, and its batch
    script does not do the deadlines and the requeue outside it): use the sbatch backend."""
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

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return submission_text(super()._make_submission_file_text(command, uid), p.spec)

    # One folder for every job (files named JOBID_...), made before sbatch: with submitit's
    # per-job folder (``%j``) Slurm could start the batch step before submitit had made the
    # folder, and the step failed at once with no output (its --output could not be opened).
    executor = Executor(folder=str(p.folder), python=p.spec.python)
    executor.update_parameters(**p.parameters)
    try:
        job = executor.submit(run_node, p.spec.job_dir)
    except submitit.core.utils.FailedJobError as e:
        raise SlurmError("sbatch (for submitit) failed", ["sbatch", str(p.folder)], 1, str(e)) from e
    return str(job.job_id)


def run_node(job_dir: str) -> int:
    """The callable submitit runs on every node: it becomes our per-node launcher.

    The process is replaced (``exec``) by ``python -m runtime.launch``, which finds the
    rendezvous host itself: no submitit signal handler stays behind to act on the warning
    signal (submitit would requeue from global rank 0 on SIGUSR2), and the launcher's exit
    status (0, 75 to be requeued, ...) is the Slurm task's. submitit records no result for the
    job; ``hpc status`` reads outcomes from the job directory instead.
    """
    spec = JobSpec.load(job_dir)
    # --setup's per-node part (bash -c '...; exec "$@"') runs first, then the launcher.
    argv = slurm_options.with_node_setup(spec, slurm_options.launcher_argv(spec))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)
    raise AssertionError("unreachable")


def _submit_file(argv: list[str]) -> int:
    """``python -m hpc.backends.submitit_backend SCRIPT``: sbatch SCRIPT through the client."""
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
