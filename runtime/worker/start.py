"""The first code each worker process runs: bind its life to the agent, then run the script.

torch's elastic agent starts workers in their own session, so when an agent dies (killed,
OOM, node teardown) its workers would otherwise live on, holding GPUs and ports. Before the
user's script runs, each worker asks the kernel to SIGKILL it when its parent (the agent)
dies (``PR_SET_PDEATHSIG``), and exits at once if the agent is already gone. Then it runs
the script exactly as ``python script.py args`` would, so existing scripts need no change.

Usage (the launcher builds this command): ``python -m runtime.worker SCRIPT [ARGS...]``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import runpy
import signal
import sys
from collections.abc import Mapping

from hpc.contract.environment import JobEnvironment
from runtime.stopping import exit_if_stopping
from runtime.liveness import stacks
from runtime.worker import pg_release
from runtime.wandb_env import finish_run_on_sigterm

PR_SET_PDEATHSIG = 1


def bind_to_parent(expected_parent: int | None) -> None:
    """Dies with SIGKILL when the parent dies; exits now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            print(f"[hpc worker] prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}",
                  file=sys.stderr)
    except OSError as e:  # not Linux
        print(f"[hpc worker] cannot bind to the agent's life: {e}", file=sys.stderr)
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        # The agent died between fork and prctl: nobody will reap or stop us.
        sys.exit(f"[hpc worker] agent {expected_parent} is gone; exiting")


def record_early_warning() -> None:
    """Until the script installs its own handler, a warning signal is recorded, not fatal.

    The launcher forwards the job's warning signal (SIGUSR2 by default) to every worker; one
    that arrives while a worker is still importing torch would otherwise kill it. The record
    goes into ``HPC_PENDING_WARNING``, which the Session's preemption watcher reads.
    """
    name = JobEnvironment.from_env(os.environ).warning_signal
    if name in ("", "SIGTERM", "SIGINT") or not hasattr(signal, name):
        return

    def record(signum: int, frame: object) -> None:
        import time
        JobEnvironment(pending_warning=f"{signal.Signals(signum).name}@{time.time():.3f}").export(
            os.environ, keep_set=True)

    signal.signal(getattr(signal, name), record)


def ignore_late_warning() -> None:
    """Once the script is over, a warning signal is ignored: the work is done, nothing to save.

    At interpreter shutdown CPython resets every signal with a Python handler to SIG_DFL
    (``_PySignal_Fini``), and torch's libraries take a while to unload after that: a warning
    arriving then killed a worker that had finished (exit status -12 for SIGUSR2), and the
    launcher took the finished allocation for a stopped one and requeued it. SIG_IGN is left
    in place by the shutdown, so a late warning is harmless in every phase after this call.
    """
    name = JobEnvironment.from_env(os.environ).warning_signal
    if name in ("", "SIGTERM", "SIGINT") or not hasattr(signal, name):
        return
    try:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    except (ValueError, OSError):   # not the main thread, or an interpreter already going
        pass


def script_contract(job: JobEnvironment, env: Mapping[str, str]) -> dict[str, str]:
    """The per-process part of the contract for users' scripts (docs/own-script.md).

    The launcher sets what holds for the whole allocation; only the worker knows its elastic
    restart count, and a restarted worker resumes whatever the allocation says.
    """
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    resumed = bool(job.resumed or restart) if job.resumed is not None or restart else None
    return JobEnvironment(restart_count=restart, resumed=resumed).to_env()


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m runtime.worker SCRIPT [ARGS...]")
    job = JobEnvironment.from_env(os.environ)
    bind_to_parent(job.agent_pid)
    record_early_warning()
    try:
        _run(job, argv)
    finally:
        pg_release.release()    # the groups the script destroyed, now that its DDP models are gone
        ignore_late_warning()   # before the interpreter's shutdown resets the handler
        # The shutdown's garbage collections walk every object torch and the script made
        # (~0.5-1 s of a worker's exit, several under load, while the allocation's deadline
        # runs): frozen, they are freed by reference counting alone. Atexit handlers still
        # run; as always at exit, objects kept alive by cycles are not finalized.
        gc.freeze()


def _run(job: JobEnvironment, argv: list[str]) -> None:
    """Everything after the warning is recorded: the per-process contract, then the script."""
    if job.heartbeat_dir:   # the launcher's stall watchdog can ask for this process's stacks
        stacks.install(job.heartbeat_dir)
    if job.merge_stderr:
        sys.stderr.flush()
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    exit_if_stopping(job, os.environ.get("RANK"))   # never start again in a stopping allocation
    os.environ.update(script_contract(job, os.environ))
    finish_run_on_sigterm()   # a script without a SIGTERM handler keeps its offline W&B data
    pg_release.install()      # destroy_process_group() before the DDP model goes: no hang at the end
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except Exception as e:
        # The agent reads this file to say *why* a rank failed (outcomes.jsonl, hpc status).
        record_failure(e)
        print_once(e)
        sys.exit(1)     # as an uncaught exception would, without the exception hooks
    except BaseException as e:
        record_failure(e)
        raise


def print_once(e: BaseException) -> None:
    """Prints the script's traceback once, as Python would (from the script's frame on).

    An uncaught exception goes through ``sys.excepthook``, and hooks chain: wandb's prints the
    traceback and then calls torch's, which prints it again with a ``[rankN]:`` prefix, so a
    Session script's failure was shown twice, once per restart.
    """
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and _outside_script(tb):
        tb = tb.tb_next
    try:
        sys.stdout.flush()
        traceback.print_exception(type(e), e, tb, file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _outside_script(tb: object) -> bool:
    """Whether a traceback entry is this wrapper's (``__main__`` or here) or runpy's (skipped)."""
    name = tb.tb_frame.f_code.co_filename   # type: ignore[attr-defined]
    return os.path.dirname(name) == os.path.dirname(__file__) or name.startswith("<frozen runpy>") or name.endswith("runpy.py")


def record_failure(e: BaseException) -> None:
    """Writes the error file the agent reads; never leaves a torn one behind.

    On a full disk the write fails half way and leaves an empty file, and torch's agent dies
    parsing it (no outcome, no word of the disk). Without a file, the agent still sees the
    exit status, and the launcher names the full disk.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    try:
        get_error_handler().record_exception(e)
    except (OSError, ValueError) as err:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            print(f"[hpc worker] cannot write the error file {path}: {err}", file=sys.stderr)
        except OSError:
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
