"""The launcher-to-worker environment: the ``HPC_*`` variables, one writer and one reader.

``jobspec.json`` says what the user asked for; these variables say what the per-node launcher
learned at run time and hands to the workers it starts (and to their restarts): which
allocation this is, when the hard kill comes, a warning that arrived before a worker could
handle it. :class:`JobEnvironment` is the only place that names them; the launcher writes
:meth:`JobEnvironment.to_env` (the only writer of ``HPC_*`` in Python, directly or through
:meth:`JobEnvironment.export`; tests/unit/test_environment_writers.py keeps it so), workers read
:meth:`JobEnvironment.from_env` (tests pass dicts). torch-free: the login node's templates
export two of them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# Variable names (the wire format), each with what it carries.
JOB_DIR = "HPC_JOB_DIR"                  # the job directory (absolute)
ALLOCATION = "HPC_ALLOCATION"            # the Slurm requeue count (0 locally)
RDZV_HOST = "HPC_RDZV_HOST"              # host of the c10d rendezvous (batch script -> launcher)
WARNING_SIGNAL = "HPC_WARNING_SIGNAL"    # the job's warning signal, e.g. SIGUSR2
PENDING_WARNING = "HPC_PENDING_WARNING"  # NAME@time: a warning that arrived before the handler
AGENT_PID = "HPC_AGENT_PID"              # the launcher's pid: workers die with it
MERGE_STDERR = "HPC_MERGE_STDERR"        # "1": workers write stderr into their stdout log
JOB_END_TIME = "HPC_JOB_END_TIME"        # wall time of the job's time limit (from Slurm)
GRACE_S = "HPC_GRACE_S"                  # the partition's preemption GraceTime
PROGRESS_EVERY_S = "HPC_PROGRESS_EVERY_S"  # how often rank 0 writes progress.json (tests)
HEARTBEAT_DIR = "HPC_HEARTBEAT_DIR"      # node-local directory of the workers' heartbeats
RDZV_EPOCH = "HPC_RDZV_EPOCH"            # the rendezvous epoch (a new one after a lost host)
VERBOSE = "HPC_VERBOSE"                  # "1": the console shows every log line (hpc run -v)
# The contract for users' own scripts (docs/own-script.md): read these, change nothing else.
CHECKPOINT_DIR = "HPC_CHECKPOINT_DIR"    # a directory that survives requeues (JOB_DIR/checkpoints)
RESUMED = "HPC_RESUMED"                  # "1": an earlier allocation or worker generation ran
REQUEUE_COUNT = "HPC_REQUEUE_COUNT"      # how many times the job was requeued (0 the first time)
RESTART_COUNT = "HPC_RESTART_COUNT"      # elastic restarts of the workers in this allocation
WARNING_LEAD_S = "HPC_WARNING_LEAD_S"    # seconds from the time-limit warning to the time limit
WARM_START = "HPC_WARM_START"            # job's own: "0": each worker starts cold (runtime.launch.warm_start)
WARM_START_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off")
STOP_FILE = "HPC_STOP_FILE"              # JSON written when a stop begins: kind, signal, deadline
# A script that saved on the warning and stopped before its work was done exits with this status
# (EX_TEMPFAIL): the allocation is recorded as the stop and the job requeued. 0 means done.
STOPPED_EXIT = 75


# Fields written even when 0/False: a user's script reads "not resumed" from HPC_RESUMED=0;
# allocation 0 and rendezvous epoch 0 are values too.
_SET_WHEN_ZERO = frozenset({"resumed", "requeue_count", "restart_count", "allocation", "rdzv_epoch"})


def _float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else None
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = _float(env, name)
    return int(value) if value is not None else None


@dataclass(frozen=True)
class JobEnvironment:
    """What the per-node launcher tells its workers; every field optional (a plain torchrun)."""

    job_dir: str = ""
    allocation: int | None = None
    rdzv_host: str = ""
    warning_signal: str = ""
    pending_warning: str = ""
    agent_pid: int | None = None
    merge_stderr: bool = False
    job_end_time: float | None = None
    grace_s: float | None = None
    progress_every_s: float | None = None
    heartbeat_dir: str = ""
    rdzv_epoch: int | None = None
    checkpoint_dir: str = ""
    resumed: bool | None = None
    requeue_count: int | None = None
    restart_count: int | None = None
    warning_lead_s: float | None = None
    stop_file: str = ""
    verbose: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobEnvironment:
        """Reads the record from an environment mapping (``os.environ`` or a test's dict).

        Raises:
            ValueError: a numeric variable that is not a number, naming it.
        """
        return cls(
            job_dir=env.get(JOB_DIR, ""), allocation=_int(env, ALLOCATION),
            rdzv_host=env.get(RDZV_HOST, ""), warning_signal=env.get(WARNING_SIGNAL, ""),
            pending_warning=env.get(PENDING_WARNING, ""), agent_pid=_int(env, AGENT_PID),
            merge_stderr=env.get(MERGE_STDERR, "") == "1", job_end_time=_float(env, JOB_END_TIME),
            grace_s=_float(env, GRACE_S), progress_every_s=_float(env, PROGRESS_EVERY_S),
            heartbeat_dir=env.get(HEARTBEAT_DIR, ""), rdzv_epoch=_int(env, RDZV_EPOCH),
            checkpoint_dir=env.get(CHECKPOINT_DIR, ""),
            resumed={"1": True, "0": False}.get(env.get(RESUMED, "")),
            requeue_count=_int(env, REQUEUE_COUNT), restart_count=_int(env, RESTART_COUNT),
            warning_lead_s=_float(env, WARNING_LEAD_S), stop_file=env.get(STOP_FILE, ""),
            verbose=env.get(VERBOSE, "") == "1")

    def to_env(self) -> dict[str, str]:
        """The variables to set (fields left empty are not set)."""
        names = {"job_dir": JOB_DIR, "allocation": ALLOCATION, "rdzv_host": RDZV_HOST,
                 "warning_signal": WARNING_SIGNAL, "pending_warning": PENDING_WARNING,
                 "agent_pid": AGENT_PID, "merge_stderr": MERGE_STDERR,
                 "job_end_time": JOB_END_TIME, "grace_s": GRACE_S,
                 "progress_every_s": PROGRESS_EVERY_S, "heartbeat_dir": HEARTBEAT_DIR,
                 "rdzv_epoch": RDZV_EPOCH,
                 "checkpoint_dir": CHECKPOINT_DIR, "resumed": RESUMED,
                 "requeue_count": REQUEUE_COUNT, "restart_count": RESTART_COUNT,
                 "warning_lead_s": WARNING_LEAD_S, "stop_file": STOP_FILE, "verbose": VERBOSE}
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SET_WHEN_ZERO and value is not None:   # "0" tells a script something
                out[names[f.name]] = str(int(value))
                continue
            if value in (None, "", False):
                continue
            if value is True:
                value = "1"
            elif isinstance(value, float):
                value = f"{value:.3f}".rstrip("0").rstrip(".")
            out[names[f.name]] = str(value)
        return out

    def export(self, environ: MutableMapping[str, str], *, keep_set: bool = False) -> None:
        """Writes :meth:`to_env` into ``environ`` (``os.environ``, a child's env dict).

        Args:
            environ: Where to write.
            keep_set: Leave a variable that is already set as it is (the first warning stays
                the first).
        """
        for name, value in self.to_env().items():
            if not keep_set or name not in environ:
                environ[name] = value
