"""One Hydra job inside an hpc job: the script every worker of an array task runs.

``python _task.py STATE_FILE --hydra-job-num=N OVERRIDE...`` (the launcher builds it). It
restores ``sys.path`` and the working directory of the ``python train.py -m`` that launched the
sweep, unpickles Hydra's context, the task function and config (see :mod:`.launcher`), and runs
the job exactly as Hydra's own launchers do (``run_job`` over ``hydra.sweep.dir`` /
``hydra.sweep.subdir``). Every rank runs the task function (a torchrun script's ranks all run
it); rank 0 writes the ``JobReturn`` to ``$HPC_JOB_DIR/hydra_return.pkl`` for the launcher.

Exit status: the task function's ``sys.exit`` passes through (75 from a stop on the warning
requeues the task); a task function that raised exits 1 (an application error: not requeued),
after printing the error.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

RETURN_FILE = "hydra_return.pkl"


def load_state(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        plain = pickle.load(f)
        sys.path[:0] = [p for p in plain["sys_path"] if p not in sys.path]
        if os.path.isdir(plain["cwd"]):
            os.chdir(plain["cwd"])
        import cloudpickle  # noqa: F401 - registers what the objects below need

        return pickle.load(f)


def job_id(env: dict[str, str], num: int) -> str:
    """Slurm's id of this task (``ARRAY_TASK``), else the job's, else ``local-N`` (pure)."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or f"local-{num}"


def save_return(ret: Any, job_dir: str) -> None:
    import cloudpickle

    path = Path(job_dir) / RETURN_FILE
    tmp = path.with_name(f".{RETURN_FILE}.{os.getpid()}.tmp")
    try:
        data = cloudpickle.dumps(ret)
    except Exception as e:  # noqa: BLE001 - a return value that does not pickle
        ret._return_value = RuntimeError(f"the task's return value could not be pickled: {e!r} "
                                         f"(it was {type(ret._return_value).__name__})")
        data = cloudpickle.dumps(ret)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    state_file, num_flag, *overrides = argv
    num = int(num_flag.partition("=")[2])
    state = load_state(state_file)
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals
    from omegaconf import open_dict

    Singleton.set_state(state["singletons"])
    setup_globals()
    context = state["hydra_context"]
    config = context.config_loader.load_sweep_config(state["config"], list(overrides))
    with open_dict(config.hydra.job) as job:
        job.id = job_id(dict(os.environ), num)
        job.num = num
    ret = run_job(hydra_context=context, task_function=state["task_function"], config=config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    if os.environ.get("RANK", "0") == "0" and os.environ.get("HPC_JOB_DIR"):
        save_return(ret, os.environ["HPC_JOB_DIR"])
    if ret.status == JobStatus.FAILED:
        error = ret._return_value
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
