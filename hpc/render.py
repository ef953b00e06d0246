"""Rendering a :class:`~hpc.contract.jobspec.JobSpec` into the exact batch script and sbatch command.

Pure functions, no Slurm contact: ``hpc render`` and ``hpc submit --dry-run`` print what
these return, and ``hpc submit`` submits exactly that. Templates live in ``slurm_templates/``
as data files and are rendered with jinja2's ``StrictUndefined`` (a misspelt variable is an
error, never an empty string).

Two quoting rules, because two different parsers read the script:

* the shell body: every value goes through ``shell_quote`` (:func:`shlex.quote`);
* ``#SBATCH`` lines are read by sbatch's own option parser, not by a shell. It splits on
  blanks, treats ``#`` as a comment start, and strips quotes and backslashes with rules that
  changed across Slurm versions (old versions know only double quotes, and a blank ends an
  argument even after a backslash). ``sbatch_quote`` wraps a value in double quotes and puts
  a backslash before every character outside a small safe set, which every version reads
  back as the literal character.

Secrets never go into a rendered script, ``jobspec.json`` or a log: :func:`check_renderable`
applies the policy of :mod:`hpc.secrets` (export them instead: sbatch's ``--export=ALL``
carries the submitter's environment to the job).
"""

from __future__ import annotations

import re
import shlex
from importlib import resources

import jinja2

from hpc.backends import slurm_options
from hpc.contract import jobdir, jobpaths, values
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.secrets import check_no_secrets

TEMPLATE = "sbatch_elastic.sh.j2"
# After a SIGTERM whose allocation nobody recorded (the launchers died of it while starting),
# the batch shell waits this long at most for Slurm to end the stop itself.
STOP_WAIT_S = 900
OUTPUT_PATTERN = "slurm-%j.out"
ARRAY_TASK_DIR = "task-%a"                 # a sweep's task directory, as a Slurm file pattern
ARRAY_OUTPUT_PATTERN = "slurm-%A_%a.out"   # the task's Slurm job id is ARRAYID_TASKID

_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_./=:@,+%-]")


def shell_quote(value: object) -> str:
    """Quotes a value for a POSIX shell (``shlex.quote`` of its text)."""
    return shlex.quote(str(value))


def sbatch_quote(value: object) -> str:
    """Escapes a value for an ``#SBATCH`` line (sbatch's parser, every Slurm version).

    Raises:
        SpecError: for a newline, which cannot appear on an ``#SBATCH`` line at all.
    """
    text = str(value)
    if "\n" in text or "\r" in text:
        raise SpecError("#SBATCH value", text, "a value without line breaks", "--job-name gpt")
    if all(_SBATCH_SAFE.fullmatch(c) for c in text):
        return text
    # Blanks end an argument even after a backslash, so the value goes in double quotes too.
    return '"' + "".join(c if _SBATCH_SAFE.fullmatch(c) else "\\" + c for c in text) + '"'


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_template), undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["shell_quote"] = shell_quote
    env.filters["sbatch_quote"] = sbatch_quote
    return env


def _load_template(name: str) -> str:
    return resources.files("slurm_templates").joinpath(name).read_text()


def output_path(spec: JobSpec) -> str:
    """Where Slurm writes the batch script's own output: ``JOB_DIR/logs/slurm-%j.out``."""
    return f"{spec.job_dir.rstrip('/')}/logs/{OUTPUT_PATTERN}"


def check_renderable(spec: JobSpec) -> None:
    """Refuses values that no quoting can carry into an sbatch script.

    Raises:
        SpecError: for a job directory with ``%`` (Slurm would expand it in the output file
            name) or a line break, or a secret in ``spec.env``.
    """
    if not spec.job_dir:
        raise SpecError("--job-dir", spec.job_dir, "an absolute directory", "--job-dir runs/gpt")
    if "%" in spec.job_dir or "\n" in spec.job_dir:
        raise SpecError("--job-dir", spec.job_dir, "a path without '%' or line breaks (Slurm "
                        "expands % patterns in its output file name)", "--job-dir runs/gpt")
    check_no_secrets(spec)


def render_sbatch(spec: JobSpec, template: str = TEMPLATE, *, array: str = "") -> str:
    """Renders the batch script for ``spec`` (pure).

    Args:
        spec: The validated job (``job_dir`` already absolute).
        template: Template file name in ``slurm_templates/``.
        array: For a sweep, sbatch's ``--array`` value (``0-5%2``); ``spec.job_dir`` is then
            the sweep's directory and each array task runs in its ``task-<i>/`` (see
            :mod:`hpc.sweeps`).

    Returns:
        The script text, exactly as ``hpc submit`` writes it to ``JOB_DIR/job.sbatch``.
    """
    check_renderable(spec)
    root = spec.job_dir.rstrip("/")
    container = spec.container_runtime if spec.container_image else ""
    return _environment().get_template(template).render(
        spec=spec,
        nodes_range=slurm_options.nodes_range(spec),
        output=f"{root}/{ARRAY_TASK_DIR}/logs/{ARRAY_OUTPUT_PATTERN}" if array else output_path(spec),
        warning_signal=slurm_options.warning_signal(spec),
        requeue_flag=slurm_options.requeue_flag(spec),
        gres=slurm_options.gres(spec),
        batch_setup=slurm_options.batch_setup_lines(spec),
        node_setup=slurm_options.node_setup_script(spec),
        setup_eof=values.SETUP_EOF, setup_argv0=slurm_options.SETUP_ARGV0,
        container=container,
        mounts=slurm_options.container_mounts(spec) if container else [],
        apptainer=slurm_options.apptainer_argv(spec, []) if container == "apptainer" else [],
        requeue_request_prefix=jobdir.REQUEUE_REQUEST_PREFIX,
        exclusions_file=jobpaths.EXCLUSIONS,
        outcomes_file=jobpaths.OUTCOMES,
        stop_wait_s=STOP_WAIT_S,
        array=array,
        job_dir_expr=shell_quote(root) + '"/task-${SLURM_ARRAY_TASK_ID}"' if array
        else shell_quote(spec.job_dir),
    )
