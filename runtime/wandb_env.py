"""One W&B run per job for scripts that call ``wandb.init()`` themselves.

A script that calls ``wandb.init()`` with no id starts a new run every time it starts: after
every requeue and every elastic restart (Lightning #13524/#16639, wandb #4482). wandb reads its
run id, resume mode, directory and mode from its own environment variables when ``init`` is
not given them, so the launcher hands every worker:

* ``WANDB_RUN_ID``: the job's run id, the one in ``JOB_DIR/wandb_run_id`` that our Session's
  sink uses too (:func:`load_or_create_run_id`, here because the launcher and the sink both
  create it: created once, atomically);
* ``WANDB_RESUME=allow``: continue that run if it exists, create it if not (``must`` fails on
  the first start and offline);
* ``WANDB_DIR=JOB_DIR``: the offline runs land in ``JOB_DIR/wandb/offline-run-*`` where
  ``hpc sync`` finds them;
* ``WANDB_MODE``: the job's ``--wandb-mode`` (offline by default: compute nodes often have no
  network).

These are defaults: a value the user set (in the submitting shell) is kept, and every one is
logged with the launcher's other environment changes. Arguments the script passes to
``wandb.init`` win over all of them (wandb's rule).

Steps that are redone after a resume from an older checkpoint: wandb keeps a run's ``_step``
increasing and drops (with a warning) a ``log(step=...)`` lower than the last one, so the redone
steps keep the values of their first attempt; a script that logs without ``step=`` appends them
as new, higher steps. Online, W&B's server-side rewind (``wandb.init(resume_from=f"{id}?_step=N")``)
can instead cut the history back to the checkpoint; it is opt-in in the script and not
available offline. See docs/own-script.md.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

from hpc.contract import jobdir

RUN_ID_FILE = jobdir.WANDB_RUN_ID


def load_or_create_run_id(job_dir: Path, preferred: str | None = None) -> str:
    """The job's W&B run id: read `JOB_DIR/wandb_run_id`, or create it exactly once.

    Args:
        job_dir: the job directory.
        preferred: an id to store if none exists yet (e.g. from a checkpoint manifest).

    Returns:
        The id in the file; if two processes race, both return the one that won.
    """
    path = Path(job_dir) / RUN_ID_FILE
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    alphabet = string.ascii_lowercase + string.digits
    run_id = preferred or "".join(secrets.choice(alphabet) for _ in range(8))
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(run_id + "\n")
    try:
        os.link(tmp, path)  # atomic and exclusive: fails if another process created it first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def defaults(job_dir: Path, mode: str) -> dict[str, tuple[str, str]]:
    """The W&B variables to set for the workers: name -> (value, reason).

    Args:
        job_dir: The job directory (holds, or will hold, ``wandb_run_id``).
        mode: The job's W&B mode (``offline``, ``online``, ``disabled``).
    """
    run_id = load_or_create_run_id(Path(job_dir))
    return {
        "WANDB_RUN_ID": (run_id, "one W&B run for the whole job (JOB_DIR/wandb_run_id), also "
                                 "for a script's own wandb.init()"),
        "WANDB_RESUME": ("allow", "every allocation and restart continues the job's run"),
        "WANDB_DIR": (str(job_dir), "W&B runs go to JOB_DIR/wandb, whatever the script"),
        "WANDB_MODE": (mode, "the job's --wandb-mode (hpc sync uploads offline runs)"),
    }


def finish_run_on_sigterm() -> None:
    """In a worker, before the user's script: on SIGTERM, finish its W&B run, then die of it.

    wandb's service keeps an offline run's records in memory until the run finishes: a
    script killed by the SIGTERM that ends a preempted or timed-out allocation loses everything
    it logged in that allocation (measured: a 7-byte ``.wandb`` file after 10 s of logging). A
    script that handles SIGTERM itself replaces this handler; one that does not gets its run
    finished (about 0.1-1 s offline) and then dies of SIGTERM exactly as it would have.
    """
    import signal
    import sys

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def finish_then_die(signum: int, frame: object) -> None:
        import os

        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            print("[hpc worker] SIGTERM: finishing the W&B run so that its data is kept",
                  file=sys.stderr, flush=True)
            try:
                run.finish(exit_code=128 + signum)
            except Exception as e:  # noqa: BLE001 - dying of the signal matters more
                print(f"[hpc worker] W&B finish failed: {e!r}", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, finish_then_die)
