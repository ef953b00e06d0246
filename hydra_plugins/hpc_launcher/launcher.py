"""The launcher: a Hydra multirun as one hpc job array, each task's return value collected.

What happens on ``python train.py -m hydra/launcher=hpc lr=1e-3,3e-4``:

1. Hydra hands :meth:`HpcLauncher.launch` one override list per job.
2. The launcher pickles (cloudpickle, as hydra-submitit-launcher does) what a job needs to run
   the task function: Hydra's context, the task function, the multirun's config and Hydra's
   global state, beside ``sys.path`` and the working directory, into
   ``SWEEP_DIR/.hpc-hydra/launch-<first job>.pkl``.
3. It builds the JobSpec from the launcher's options (parsed and checked like their flags,
   over the user's hpc.toml) with :mod:`._task` as the script, and submits the overrides as the
   argument sets of :func:`hpc.api.sweep`: one ``sbatch --array``, each task a full hpc job in
   ``<job_dir>/task-<i>/`` (``job_dir`` is ``SWEEP_DIR/.hpc`` unless set).
4. In every worker of every task, :mod:`._task` runs Hydra's ``run_job`` for its overrides, as
   a multirun job (``hydra.sweep.dir``/``hydra.sweep.subdir``); rank 0 pickles the
   ``JobReturn`` into the task's job directory. A requeued task runs the function again, and a
   script that keeps checkpoints in ``HPC_CHECKPOINT_DIR`` resumes from them.
5. The launcher waits for the array (one squeue/sacct per poll, with backoff) and returns the
   ``JobReturn`` of each task in order; a task that left none (it failed, was cancelled, or its
   requeues ran out) returns a failed one whose error names the task, its outcome and the
   command that shows its log, which Hydra raises.

``hpc_local`` does the same with ``hpc run`` for each task, one after another (no Slurm).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hpc.config import Where, find_config, parse_value
from hpc.contract.errors import HpcError, SpecError
from hpc.contract.jobspec import CONFIG_KEYS, JobSpec

from .config import LAUNCHER_FIELDS

log = logging.getLogger(__name__)

TASK_SCRIPT = Path(__file__).with_name("_task.py")
RETURN_FILE = "hydra_return.pkl"       # in each task's job directory, written by its rank 0
STATE_DIR = ".hpc-hydra"               # in the sweep directory: what the tasks unpickle
WHERE = "hydra/launcher=hpc"


def job_options(params: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The launcher's hpc options as JobSpec field values, over ``base`` (the hpc.toml profile).

    Each set value (not None) is parsed and checked as its hpc.toml key is
    (:func:`hpc.config.parse_value`), so a bad one is refused naming ``hydra.launcher.KEY``.

    Raises:
        SpecError: a value its key does not take.
    """
    out = dict(base)
    for key, value in params.items():
        if key in LAUNCHER_FIELDS or key == "_target_" or value is None:
            continue
        if key not in CONFIG_KEYS:   # added with +hydra.launcher.KEY=...: Hydra lets it through
            from hpc.parser import close_matches

            near = close_matches(key, [*CONFIG_KEYS, *LAUNCHER_FIELDS])
            raise SpecError(f"hydra.launcher.{key}", value, "one of the hpc.toml keys ("
                            + ", ".join(sorted(CONFIG_KEYS)) + ") or " + ", ".join(LAUNCHER_FIELDS),
                            "hydra.launcher.nproc_per_node=2",
                            f"did you mean {' or '.join(near)}?" if near else "")
        field = CONFIG_KEYS[key]
        out[field] = parse_value(field, value, Where(WHERE, "hydra.launcher", key))
    out.pop("profile", None)
    for name in ("job_dir", "checkpoint_dir"):
        if out.get(name):
            out[name] = str(Path(out[name]).expanduser().absolute())
    return out


def task_args(job_overrides: Sequence[Sequence[str]], first: int) -> list[tuple[str, ...]]:
    """One argument tuple per job: its Hydra job number, then its overrides (pure)."""
    return [(f"--hydra-job-num={first + i}", *overrides) for i, overrides in enumerate(job_overrides)]


def app_notes(lines: Sequence[str], app: Path | None) -> list[str]:
    """hpc's advice about the job, told about the Hydra app instead of ``_task.py`` (pure but
    for reading the app's source).

    hpc reads the job's script to say whether it saves checkpoints through the Session; that
    script is ``_task.py`` here, while the training code is the app's task function.
    """
    from hpc.contract.interval import uses_session

    about_task = f"{TASK_SCRIPT.name} does not import runtime.session"
    out = []
    for line in lines:
        if about_task in line:
            try:
                source = app.read_text(errors="replace") if app is not None else None
            except OSError:
                source = None
            if source is None or uses_session(source):
                continue      # unknown, or the app uses the Session: nothing to warn about
            line = line.replace(TASK_SCRIPT.name, app.name)   # type: ignore[union-attr]
        out.append(line)
    return out


def failed_return(overrides: Sequence[str], error: BaseException) -> JobReturn:
    """A ``JobReturn`` for a task that left none: Hydra raises ``error`` when it reads it."""
    ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
    ret._return_value = error
    return ret


def set_aside(hpc_dir: Path, tasks: int) -> list[tuple[Path, Path]]:
    """Moves each task's job directory that an earlier multirun left in ``hpc_dir`` aside.

    A multirun is a new run of its tasks: the same sweep directory again (a fixed
    ``hydra.sweep.dir``, the code changed since) must run them, not find them finished and
    return the earlier results. Only a requeue of the same array continues a task, and that
    never comes here. The earlier directory is renamed (``task-0.earlier-1``), not deleted.

    Returns:
        (earlier, aside) for each directory moved.

    Raises:
        JobDirInUse: a task directory's job is still running or queued (another multirun into
            the same sweep directory): nothing is moved, the message says what holds it.
    """
    from hpc.contract import jobdir, joblock

    held = [d for d in (jobdir.sweep_task_dir(hpc_dir, i) for i in range(tasks))
            if (d / jobdir.JOBSPEC).is_file()]
    for d in held:                       # all or nothing: refuse before moving any
        joblock.acquire(d, "the Hydra launcher (a new multirun)").release()
    moved = []
    for d in held:
        n = 1
        while (aside := d.with_name(f"{d.name}.earlier-{n}")).exists():
            n += 1
        os.rename(d, aside)
        moved.append((d, aside))
    return moved


class HpcLauncher(Launcher):
    """``hydra/launcher=hpc``: one job array on Slurm (see the module docstring)."""

    def __init__(self, **params: Any) -> None:
        self.params = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                       for k, v in params.items()}
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    # -- planning --------------------------------------------------------------------------
    def spec(self, state_file: Path, first: int) -> JobSpec:
        """The JobSpec every task runs: ``_task.py STATE_FILE`` with the launcher's options."""
        profile = self.params.get("profile") or ""
        options = job_options(self.params, find_config().parsed_options(profile))
        if first:   # a later batch of the same multirun: its own array, its own directory
            options["job_dir"] = f"{options['job_dir']}-{first}"
        return JobSpec(script=str(TASK_SCRIPT), script_args=(str(state_file),), **options)

    def write_state(self, sweep_dir: Path, first: int) -> Path:
        """Pickles what a task needs to run the task function (see the module docstring)."""
        import cloudpickle

        assert self.config is not None and self.hydra_context is not None
        folder = sweep_dir / STATE_DIR
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"launch-{first}.pkl"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            # Plain first: the task restores sys.path before it unpickles the user's objects.
            pickle.dump({"sys_path": list(sys.path), "cwd": os.getcwd()}, f)
            cloudpickle.dump({"hydra_context": self.hydra_context, "task_function": self.task_function,
                              "config": self.config, "singletons": Singleton.get_state()}, f)
        os.replace(tmp, path)
        return path

    # -- running ---------------------------------------------------------------------------
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        spec = self.spec(self.write_state(sweep_dir, initial_job_idx), initial_job_idx)
        log.info(f"hpc launcher: sweep output dir {sweep_dir}, hpc jobs in {spec.job_dir}")
        for i, overrides in enumerate(job_overrides):
            log.info(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(overrides))}")
        for earlier, aside in set_aside(Path(spec.job_dir), len(job_overrides)):
            log.warning(f"hpc launcher: {earlier} held a job of an earlier multirun into this sweep "
                        f"directory; it is kept as {aside.name} and the task starts afresh")
        job_dirs = self.run(spec, task_args(job_overrides, initial_job_idx))
        returns = [self.collect(d, o) for d, o in zip(job_dirs, job_overrides)]
        for i, ret in enumerate(returns):
            said = (f"returned {ret._return_value!r}" if ret.status == JobStatus.COMPLETED
                    else f"failed: {ret._return_value}")
            log.info(f"hpc launcher: #{initial_job_idx + i} {' '.join(filter_overrides(ret.overrides or []))}"
                     f" {said[:500]}")
        return returns

    def run(self, spec: JobSpec, arg_sets: list[tuple[str, ...]]) -> list[Path]:
        """Submits the array, waits for it; returns each task's job directory, in order."""
        import hpc

        app = Path(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else None
        sweep = hpc.sweep(spec, arg_sets, throttle=int(self.params.get("throttle") or 0),
                          on_notes=lambda lines: [log.warning(x) for x in app_notes(lines, app)])
        log.info(f"hpc launcher: submitted array {sweep.job_id} ({len(arg_sets)} tasks); "
                 f"`hpc status {sweep.job_id}` shows it, Ctrl-C stops waiting (not the jobs)")
        sweep.wait(self.params.get("timeout_s"),
                   max_interval_s=float(self.params.get("poll_interval_s") or 30.0))
        self._refs = {Path(j.job_dir): j.job_id for j in sweep.jobs}
        return [Path(j.job_dir) for j in sweep.jobs]

    def collect(self, job_dir: Path, overrides: Sequence[str]) -> JobReturn:
        """The task's ``JobReturn``, or a failed one that says why there is none."""
        import cloudpickle

        path = job_dir / RETURN_FILE
        if path.is_file():
            with open(path, "rb") as f:
                ret = cloudpickle.load(f)
            if isinstance(ret, JobReturn):
                return ret
        from hpc.contract import jobdir

        outcomes = jobdir.read_outcomes(job_dir)
        last = outcomes[-1] if outcomes else None
        ended = f"{last.kind}: {last.reason}" if last else "no outcome recorded (it never ran?)"
        ref = getattr(self, "_refs", {}).get(job_dir, str(job_dir))
        return failed_return(overrides, HpcError(
            f"hpc task {ref} ({' '.join(overrides) or 'no overrides'}) returned nothing: {ended}; "
            f"its log: hpc logs {ref}"))


class HpcLocalLauncher(HpcLauncher):
    """``hydra/launcher=hpc_local``: the same tasks, one after another with ``hpc run``."""

    def run(self, spec: JobSpec, arg_sets: list[tuple[str, ...]]) -> list[Path]:
        from hpc import api, sweeps

        plan = sweeps.plan(spec, arg_sets)
        for task in plan.tasks:
            code = api.run(task)
            if code not in (0, 1):   # 1: the task function failed; its JobReturn says how
                log.warning(f"hpc launcher: {task.job_dir} ended with status {code}")
        return [Path(t.job_dir) for t in plan.tasks]


__all__ = ["HpcLauncher", "HpcLocalLauncher", "SpecError"]
