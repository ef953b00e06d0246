"""The ``sbatch`` backend: the rendered template, submitted with one sbatch call.

Plan, then act. :func:`plan` turns a :class:`~hpc.contract.jobspec.JobSpec` into an :class:`SbatchPlan`
(the exact script text, the exact sbatch argv and the submission tag) without touching the
filesystem or Slurm; ``hpc render`` / ``--dry-run`` print it. :func:`execute` is the only
function that submits: it writes ``job.sbatch`` into the (already created) job directory and
hands it to :class:`hpc.contract.slurm.SlurmClient`, which retries transient controller errors and never
submits twice (the tag goes into ``--comment``).
"""

from __future__ import annotations

import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc import render
from hpc.contract import jobdir
from hpc.contract.jobspec import JobSpec

from hpc.contract.slurm import TAG_PREFIX

if TYPE_CHECKING:
    from hpc.contract.slurm import SlurmClient

# The template's batch shell gives excluded nodes back before srun and, for a container, does
# the deadlines and the requeue outside it (hpc.backends.BATCH_STEPS).
ENFORCES = frozenset({"exclusions", "container"})

# sbatch's default is --export=ALL, but a site's SBATCH_EXPORT would silently change it; the
# submitter's environment (secrets included) must reach the job, so the argv says it.
SBATCH_OPTIONS = ("--export=ALL",)


@dataclass(frozen=True)
class SbatchPlan:
    """Everything ``hpc submit`` will do for one job, decided before anything runs.

    Attributes:
        spec: The job.
        script: The batch script text (written to ``JOB_DIR/job.sbatch``).
        script_path: Where the script is written.
        options: sbatch options besides the ones the Slurm client adds (``--parsable``, the tag).
        tag: The submission tag (``--comment=hpc-tag:<tag>``).
    """

    spec: JobSpec
    script: str
    script_path: Path
    options: tuple[str, ...]
    tag: str

    @property
    def argv(self) -> list[str]:
        """The exact sbatch command that :func:`execute` runs."""
        return ["sbatch", "--parsable", f"--comment={TAG_PREFIX}{self.tag}", *self.options,
                str(self.script_path)]

    def describe(self) -> str:
        """The dry run: the command, then the script, exactly."""
        return (f"# would create {self.spec.job_dir} (0700) with {jobdir.JOBSPEC} and "
                f"{jobdir.SBATCH}, then run:\n{shlex.join(self.argv)}\n"
                f"# ----- {self.script_path} -----\n{self.script}")


def plan(spec: JobSpec, tag: str | None = None) -> SbatchPlan:
    """Plans the submission of ``spec`` (pure apart from a random tag when none is given).

    Raises:
        SpecError: for values no batch script can carry (see :func:`hpc.render.check_renderable`).
    """
    return SbatchPlan(spec=spec, script=render.render_sbatch(spec),
                      script_path=Path(spec.job_dir) / jobdir.SBATCH, options=SBATCH_OPTIONS,
                      tag=tag or uuid.uuid4().hex)


def execute(p: SbatchPlan, client: SlurmClient) -> str:
    """Writes the script and submits it; returns the Slurm job id.

    Args:
        p: The plan (its job directory must exist already).
        client: The Slurm client (:class:`hpc.contract.slurm.SlurmClient`).
    """
    jobdir.write_atomic(p.script_path, p.script, mode=0o700)
    return client.submit(p.script_path, list(p.options), tag=p.tag)

