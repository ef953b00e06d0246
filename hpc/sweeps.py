"""Sweeps: a grid of script arguments submitted as ONE Slurm job array.

``hpc sweep train.py --nodes 2 --grid lr=1e-3,3e-4 --grid batch=32,64 -- --preset small``
makes 4 argument sets (the product of the grid, in order) and submits one ``sbatch --array``
job. Each array task is a full hpc-elastic job: its own job directory (``SWEEP_DIR/task-<i>/``
with its own ``jobspec.json``, logs, checkpoints and outcomes), elastic, requeued on its own
(Slurm requeues array tasks one by one: ``scontrol requeue ARRAY_TASK``), its own W&B run,
all runs in one W&B group (``WANDB_RUN_GROUP`` = the sweep's name).

``SWEEP_DIR/sweep.json`` lists the tasks and their arguments; ``hpc status SWEEP`` shows the
array compactly (counts per state, then one row per task), ``hpc cancel`` takes the array or
one task (``1234_3``).

Argument sets come from ``--grid KEY=V1,V2`` (the script gets ``--KEY V``) or a TOML file::

    # sweep.toml: either a grid ...
    [grid]
    lr = ["1e-3", "3e-4"]
    # ... or explicit runs
    [[runs]]
    args = ["--lr", "1e-3", "--warmup", "10"]

Planning is pure (:func:`expand_grid`, :func:`plan`); :func:`submit` is the one place that
creates directories and calls sbatch.
"""

from __future__ import annotations

import itertools
import json
import shlex
import time
import tomllib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc import render
from hpc.backends.sbatch import SBATCH_OPTIONS
from hpc.contract import jobdir, joblock, jobpaths
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import TAG_PREFIX, SlurmClient
from hpc.contract.index import JobRecord, current_cluster, record_job

SWEEP_FILE = jobpaths.SWEEP
MAX_TASKS = 10_000   # Slurm's default MaxArraySize is 1001; sites raise it, rarely this far


def parse_grid(items: Sequence[str], flag: str = "--grid") -> list[tuple[str, list[str]]]:
    """``["lr=1e-3,3e-4", "batch=32"]`` -> ``[("lr", ["1e-3", "3e-4"]), ("batch", ["32"])]``.

    Raises:
        SpecError: for an item without ``=``, an empty key or value list, a repeated key.
    """
    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, rest = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in rest.split(",")]
        if not sep or not key or key.lstrip("-") == "" or any(v == "" for v in vals) \
                or any(c.isspace() for c in key):
            raise SpecError(flag, item, "KEY=V1,V2,... (the script gets --KEY V for each V)",
                            f"{flag} lr=1e-3,3e-4")
        if any(k == key for k, _ in out):
            raise SpecError(flag, item, f"each key once ({key!r} is repeated)", f"{flag} lr=1e-3,3e-4")
        out.append((key, vals))
    return out


def expand_grid(grid: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, ...]]:
    """The product of the grid as script arguments, first key slowest (pure)::

        [("lr", ["1", "2"]), ("bs", ["8"])] -> [("--lr", "1", "--bs", "8"), ("--lr", "2", "--bs", "8")]
    """
    flags = [k if k.startswith("-") else f"--{k}" for k, _ in grid]
    return [tuple(itertools.chain.from_iterable(zip(flags, combo)))
            for combo in itertools.product(*(vals for _, vals in grid))]


def load_file(path: Path) -> list[tuple[str, ...]]:
    """Argument sets from a TOML file with a ``[grid]`` table or ``[[runs]]`` with ``args``.

    Raises:
        SpecError: for an unreadable file or one with neither (or both) forms.
    """
    flag = "--grid-file"
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SpecError(flag, str(path), "a readable TOML file", f"{flag} sweep.toml", str(e)) from None
    grid, runs = data.get("grid"), data.get("runs")
    if (grid is None) == (runs is None):
        raise SpecError(flag, str(path), "a [grid] table or a list of [[runs]] (one of the two)",
                        f"{flag} sweep.toml")
    if grid is not None:
        if not isinstance(grid, Mapping) or not all(isinstance(v, list) and v for v in grid.values()):
            raise SpecError(flag, str(path), "[grid] keys with non-empty lists of values",
                            'lr = ["1e-3", "3e-4"]')
        return expand_grid([(str(k), [str(x) for x in v]) for k, v in grid.items()])
    if not isinstance(runs, list) or not all(isinstance(r, Mapping) and isinstance(r.get("args"), list)
                                             for r in runs):
        raise SpecError(flag, str(path), "[[runs]] entries each with an args list",
                        'args = ["--lr", "1e-3"]')
    return [tuple(str(a) for a in r["args"]) for r in runs]


@dataclass(frozen=True)
class SweepPlan:
    """One array job: the sweep's spec (its ``job_dir`` is the sweep directory), the task
    specs, the array range and the batch script."""

    spec: JobSpec
    tasks: tuple[JobSpec, ...]
    array: str
    script: str
    tag: str

    @property
    def script_path(self) -> Path:
        return Path(self.spec.job_dir) / jobdir.SBATCH

    @property
    def argv(self) -> list[str]:
        return ["sbatch", "--parsable", f"--comment={TAG_PREFIX}{self.tag}", *SBATCH_OPTIONS,
                str(self.script_path)]

    def describe(self) -> str:
        """The dry run: the tasks, the command and the script, exactly."""
        lines = [f"# would create {self.spec.job_dir} (0700) with {SWEEP_FILE}, {jobdir.SBATCH} "
                 f"and {len(self.tasks)} task directories:"]
        lines += [f"#   task-{i}: {shlex.join(t.script_args)}" for i, t in enumerate(self.tasks)]
        return ("\n".join(lines) + f"\n{shlex.join(self.argv)}\n"
                f"# ----- {self.script_path} -----\n{self.script}")


def plan(spec: JobSpec, arg_sets: Sequence[Sequence[str]], *, throttle: int = 0) -> SweepPlan:
    """Plans the sweep (pure apart from the random tag).

    Args:
        spec: The job every task runs; its ``script_args`` come first in every task, its
            ``job_dir`` becomes the sweep directory.
        arg_sets: One argument tuple per task (from :func:`expand_grid` or :func:`load_file`).
        throttle: At most this many tasks run at once (sbatch's ``%N``); 0: no limit.

    Raises:
        SpecError: no tasks, too many, a bad throttle, or anything a single job refuses.
    """
    if not arg_sets:
        raise SpecError("--grid", "(none)", "at least one argument set", "--grid lr=1e-3,3e-4")
    if len(arg_sets) > MAX_TASKS:
        raise SpecError("--grid", f"{len(arg_sets)} tasks", f"at most {MAX_TASKS} tasks",
                        "--grid lr=1e-3,3e-4")
    if (not isinstance(throttle, int) or isinstance(throttle, bool) or throttle < 0
            or throttle > MAX_TASKS):
        raise SpecError("--throttle", throttle, f"an integer >= 0 and <= {MAX_TASKS} (0: no limit)",
                        "--throttle 4")
    group = spec.env_dict.get("WANDB_RUN_GROUP", spec.job_name)
    env = dict(spec.env) | {"WANDB_RUN_GROUP": group}
    tasks = tuple(spec.replace(job_dir=str(jobdir.sweep_task_dir(Path(spec.job_dir), i)),
                               script_args=(*spec.script_args, *args), env=tuple(sorted(env.items())))
                  for i, args in enumerate(arg_sets))
    array = f"0-{len(tasks) - 1}" + (f"%{throttle}" if throttle else "")
    return SweepPlan(spec=spec, tasks=tasks, array=array,
                     script=render.render_sbatch(spec, array=array), tag=uuid.uuid4().hex)


def submit(p: SweepPlan, client: SlurmClient) -> JobRecord:
    """Creates the sweep and task directories, submits the array once, records it.

    Returns:
        The sweep's record in the job index (job id = the array's id).

    Raises:
        SlurmError: sbatch refused the array (the caller explains and cleans up).
    """
    root = jobdir.create(Path(p.spec.job_dir))
    joblock.acquire(root, "hpc sweep")
    for t in p.tasks:
        jobdir.create(Path(t.job_dir))
        jobdir.write_atomic(Path(t.job_dir) / jobdir.JOBSPEC, t.to_json())
    jobdir.write_atomic(root / SWEEP_FILE, json.dumps(
        {"name": p.spec.job_name, "array": p.array,
         "tasks": [{"index": i, "job_dir": t.job_dir, "args": list(t.script_args)}
                   for i, t in enumerate(p.tasks)]}, indent=2) + "\n")
    jobdir.write_atomic(p.script_path, p.script, mode=0o700)
    started = time.time()
    job_id = client.submit(p.script_path, list(SBATCH_OPTIONS), tag=p.tag)
    jobdir.write_atomic(root / jobdir.SLURM_JOB_ID, job_id + "\n")
    for i, t in enumerate(p.tasks):
        jobdir.write_atomic(Path(t.job_dir) / jobdir.SLURM_JOB_ID, f"{job_id}_{i}\n")

    record = JobRecord(job_id, str(root), p.spec.job_name, "sbatch-array", started,
                       current_cluster(client))
    record_job(record)
    return record


def read(sweep_dir: Path | str) -> dict[str, Any] | None:
    """The sweep's ``sweep.json`` (None for a directory that is not a sweep)."""
    return jobdir.read_json(Path(sweep_dir) / SWEEP_FILE)


def task_records(record: JobRecord) -> list[JobRecord]:
    """The array's tasks as job records (``ARRAY_i``, ``SWEEP_DIR/task-i``); [] if not a sweep."""
    info = read(record.job_dir) if record.job_dir else None
    if not info:
        return []
    return [JobRecord(f"{record.job_id}_{t['index']}", t["job_dir"], f"{record.name}[{t['index']}]",
                      record.backend, record.submitted, record.cluster) for t in info["tasks"]]
