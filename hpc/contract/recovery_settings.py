"""How a job recovers from a lost worker: the settings both sides read (torch-free).

``--recovery`` (``restart``: every worker again from the last checkpoint; ``inprocess``: the
survivors keep their processes, :mod:`runtime.inprocess`) and ``--replacement`` (``wait`` or
``shrink``), the ``HPC_INPROC_*`` variables the launcher sets for each worker or a job may tune,
their parsers (the workers parse them so, and :func:`check_env` refuses a bad value at
submission, naming it and the range), and NCCL's settings for in-process recovery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hpc.contract.errors import SpecError


STORE_ENV = "HPC_INPROC_STORE"      # host:port of the store that outlives the workers
RECOVERY_ENV = "HPC_RECOVERY"       # "inprocess" or "restart" (the job's --recovery)
TIMEOUT_ENV = "HPC_INPROC_TIMEOUT_S"  # bound of one training collective (else the stall deadline)
WINDOW_ENV = "HPC_INPROC_WINDOW_S"  # how long a leader waits for silent members of the old group
FAULT_ENV = "HPC_TEST_INPROC_FAULT"  # tests: "RANK:STEP:kill|fail|save|repeat", "RANK:GEN:transfer|group|late", comma separated
JOIN_ENV = "HPC_INPROC_JOIN"        # "1": this worker joins a running generation (no rank of its own)
MAX_WORLD_ENV = "HPC_INPROC_MAX_WORLD"  # the largest world joiners may fill (else the starting one)
MAX_REFORMS_ENV = "HPC_INPROC_MAX_REFORMS"  # re-forms in a row at one step before the restart path
CHANNEL_ENV = "HPC_INPROC_CHANNEL"  # node-local file where the launcher names a new epoch's store (Rebind)
WARM_ENV = "HPC_INPROC_WARM"        # "0": a dead worker's joiner starts cold (no warm standby; the launcher reads it)
DEFAULT_MAX_REFORMS = 3
# NCCL's settings for in-process recovery: name -> (value, why, values of the user's that leave
# the recovery working). The launcher sets them before torch's elastic agent starts the workers
# (the agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless its own environment
# has a value: seen on an H200, the recovery then took torch's 1 for the user's and warned);
# the worker (runtime.inprocess.worker.nccl) sets them again where it was started otherwise.
NCCL_ENV: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "0", "torch's watchdog must not end the process on a lost peer's error: the recovery aborts",
        ("0", "2")),   # 2 (CleanUpOnly) aborts the communicators without ending the process
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": (
        "0", "the watchdog must not rethrow an aborted communicator's CUDA error (ends the process)",
        ("0",)),
    "NCCL_NVLS_ENABLE": (
        "0", "NVLink SHARP communicators are not safely aborted (NVIDIA resiliency extension)",
        ("0",)),
}
RESTART = "restart"
INPROCESS = "inprocess"
RECOVERY_MODES = (RESTART, INPROCESS)
# --replacement: when a restarted worker takes a dead one's place (validated by JobSpec.replacement)
WAIT = "wait"        # the survivors' re-form waits for it: world kept, bit-equal numerics
SHRINK = "shrink"    # the survivors go on at world-1 at once; it joins at a later step boundary
REPLACEMENT_MODES = (WAIT, SHRINK)
DEFAULT_WINDOW_S = 3.0


def parse_recovery(value: object, flag: str = "--recovery") -> str:
    """Validates a recovery mode.

    Raises:
        SpecError: Anything but ``restart`` or ``inprocess``.
    """
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in RECOVERY_MODES:
        raise SpecError(flag, value, " or ".join(RECOVERY_MODES), f"{flag} {INPROCESS}",
                        "inprocess keeps the surviving workers and takes the state from a peer; "
                        "restart restarts every worker from the last checkpoint")
    return str(text)


COPY_EVERY_ENV = "HPC_INPROC_COPY_EVERY"    # FSDP2: copy the shards to the peer every N steps
COPY_MAX_MB_ENV = "HPC_INPROC_COPY_MAX_MB"  # FSDP2: bound of the peer copies' host memory per rank
DEFAULT_COPY_EVERY = 1
DEFAULT_COPY_MAX_MB = 4096.0


def parse_max_reforms(raw: str) -> int:
    """``HPC_INPROC_MAX_REFORMS``: re-forms in a row at one step before in-process recovery
    gives up (the restart path takes over); empty: :data:`DEFAULT_MAX_REFORMS`.

    Raises:
        ValueError: Not an integer >= 1 (names the value).
    """
    if not raw.strip():
        return DEFAULT_MAX_REFORMS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{MAX_REFORMS_ENV}={raw!r}: expected an integer >= 1 (re-forms in a row at "
                         f"one step before the restart path; default {DEFAULT_MAX_REFORMS})")
    return n


def _number(name: str, raw: str, default: float, low: float, high: float, *, whole: bool = False,
            unit: str = "") -> float:
    """``raw`` as a finite number in [low, high] (the default when empty), else ValueError
    naming the variable, the value and the range (pure)."""
    if not raw.strip():
        return default
    try:
        x = float(int(raw)) if whole else float(raw)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and low <= x <= high):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{name}={raw!r}: expected {kind} from {low:g} to {high:g}{unit} "
                         f"(default {default:g})")
    return x


def parse_window_s(raw: str) -> float:
    """``HPC_INPROC_WINDOW_S``: how long a leader waits for silent members (0.1-600 s)."""
    return _number(WINDOW_ENV, raw, DEFAULT_WINDOW_S, 0.1, 600.0, unit=" seconds")


def parse_timeout_s(raw: str) -> float | None:
    """``HPC_INPROC_TIMEOUT_S``: a training collective's fixed bound (1 s to a day); None:
    the stall deadline's."""
    return _number(TIMEOUT_ENV, raw, math.nan, 1.0, 86400.0, unit=" seconds") if raw.strip() else None


WARM_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off")
LAUNCHER_SET_ENV = (STORE_ENV, JOIN_ENV, MAX_WORLD_ENV, CHANNEL_ENV, RECOVERY_ENV)


def check_env(name: str, value: str) -> None:
    """Refuses a job's own value of an in-process variable it may not set or set so (pure).

    The tunables (window, timeout, re-forms, the FSDP2 copy's interval and memory bound, the
    warm standby) are parsed as the workers parse them; the variables the launcher sets for
    each worker (its store, a joiner's mark, the largest world, the channel, the recovery mode)
    are not the job's to set: a stray ``HPC_INPROC_JOIN=1`` made every worker a joiner.

    Raises:
        ValueError: naming the variable, its value and what it takes.
    """
    if name in LAUNCHER_SET_ENV:
        raise ValueError(f"{name}={value!r}: set by the launcher for each worker, not by the job"
                         + (" (use --recovery)" if name == RECOVERY_ENV else ""))
    if name == WINDOW_ENV:
        parse_window_s(value)
    elif name == TIMEOUT_ENV:
        parse_timeout_s(value)
    elif name == MAX_REFORMS_ENV:
        parse_max_reforms(value)
    elif name == COPY_EVERY_ENV:
        _number(name, value, DEFAULT_COPY_EVERY, 1, 1e9, whole=True, unit=" steps")
    elif name == COPY_MAX_MB_ENV:
        _number(name, value, DEFAULT_COPY_MAX_MB, 1e-3, 1e9, unit=" MB")
    elif name == WARM_ENV and value.strip().lower() not in WARM_VALUES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(WARM_VALUES)}")


@dataclass(frozen=True)
class InProcessEnvironment:
    """The in-process variables as one record: their one reader (:meth:`from_env`, which parses
    each as :func:`check_env` checks it at submission) and the launcher's one writer
    (:meth:`to_env`, the variables it sets for each worker).

    Attributes:
        recovery: ``HPC_RECOVERY``: the job's ``--recovery`` (None: not set, the restart path).
        store: ``HPC_INPROC_STORE``: ``host:port`` of the store that outlives the workers.
        join: ``HPC_INPROC_JOIN``: this worker joins a running generation (no rank of its own).
        max_world: ``HPC_INPROC_MAX_WORLD``: the largest world joiners may fill (None: the
            starting one).
        channel: ``HPC_INPROC_CHANNEL``: the node-local file where the launcher names a new
            epoch's store (it keeps its workers through the host's loss).
        window_s: ``HPC_INPROC_WINDOW_S``: how long a leader waits for silent members.
        timeout_s: ``HPC_INPROC_TIMEOUT_S``: a training collective's fixed bound (None: the
            stall deadline's).
        max_reforms: ``HPC_INPROC_MAX_REFORMS``: re-forms in a row at one step before the
            restart path.
        copy_every: ``HPC_INPROC_COPY_EVERY``: FSDP2's peer copy every N steps.
        copy_max_mb: ``HPC_INPROC_COPY_MAX_MB``: the peer copies' bound of host memory per rank.
        warm: ``HPC_INPROC_WARM``: a dead worker's joiner comes from the warm standby.
        faults: ``HPC_TEST_INPROC_FAULT``: the tests' planted faults (unparsed: the guard's).
    """

    recovery: str | None = None
    store: str | None = None
    join: bool | None = None
    max_world: int | None = None
    channel: str | None = None
    window_s: float = DEFAULT_WINDOW_S
    timeout_s: float | None = None
    max_reforms: int = DEFAULT_MAX_REFORMS
    copy_every: int = DEFAULT_COPY_EVERY
    copy_max_mb: float = DEFAULT_COPY_MAX_MB
    warm: bool = True
    faults: str = ""

    @property
    def inprocess(self) -> bool:
        """Whether the worker was started for in-process recovery."""
        return self.recovery == INPROCESS

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> InProcessEnvironment:
        """The record of ``environ`` (``os.environ``, a child's or a process's environment):
        under the restart path only :attr:`recovery`, the others left at their defaults.

        Raises:
            SpecError: ``HPC_RECOVERY`` that is no recovery mode.
            ValueError: A tunable out of its range, or a launcher's value that is not one,
                naming the variable, the value and what it takes.
        """
        mode = environ.get(RECOVERY_ENV, "")
        recovery = parse_recovery(mode, RECOVERY_ENV) if mode else None
        if recovery != INPROCESS:   # the restart path reads none of the others
            return cls(recovery=recovery)
        return cls.parsed(environ)

    @classmethod
    def parsed(cls, environ: Mapping[str, str]) -> InProcessEnvironment:
        """Every variable of ``environ`` parsed as an in-process worker parses it, whatever
        ``HPC_RECOVERY`` says (the launcher reads the standby's switch before it sets the mode
        for its workers; a test gives the tunables alone).

        Raises:
            SpecError: ``HPC_RECOVERY`` that is no recovery mode.
            ValueError: as :meth:`from_env`.
        """
        mode = environ.get(RECOVERY_ENV, "")
        recovery = parse_recovery(mode, RECOVERY_ENV) if mode else None
        raw = {name: environ.get(name, "") for name in (
            RECOVERY_ENV, STORE_ENV, JOIN_ENV, MAX_WORLD_ENV, CHANNEL_ENV, WINDOW_ENV, TIMEOUT_ENV,
            MAX_REFORMS_ENV, COPY_EVERY_ENV, COPY_MAX_MB_ENV, WARM_ENV, FAULT_ENV)}
        world = raw[MAX_WORLD_ENV].strip()
        if world and not (world.isdigit() and int(world) >= 1):
            raise ValueError(f"{MAX_WORLD_ENV}={world!r}: expected a whole number >= 1 (set by the launcher)")
        warm = raw[WARM_ENV].strip().lower() or "1"
        if warm not in WARM_VALUES:
            raise ValueError(f"{WARM_ENV}={raw[WARM_ENV]!r}: expected one of {', '.join(WARM_VALUES)}")
        return cls(
            recovery=recovery, store=raw[STORE_ENV] or None, join=raw[JOIN_ENV] == "1" if raw[JOIN_ENV] else None,
            max_world=int(world) if world else None, channel=raw[CHANNEL_ENV] or None,
            window_s=parse_window_s(raw[WINDOW_ENV]), timeout_s=parse_timeout_s(raw[TIMEOUT_ENV]),
            max_reforms=parse_max_reforms(raw[MAX_REFORMS_ENV]),
            copy_every=int(_number(COPY_EVERY_ENV, raw[COPY_EVERY_ENV], DEFAULT_COPY_EVERY, 1, 1e9,
                                   whole=True, unit=" steps")),
            copy_max_mb=_number(COPY_MAX_MB_ENV, raw[COPY_MAX_MB_ENV], DEFAULT_COPY_MAX_MB, 1e-3, 1e9,
                                unit=" MB"),
            warm=warm in ("1", "true", "yes", "on"), faults=raw[FAULT_ENV])

    def to_env(self) -> dict[str, str]:
        """The variables the launcher sets for a worker (fields left None are not set; the
        tunables are the job's own, from ``--env``, and never written here)."""
        values = {RECOVERY_ENV: self.recovery, STORE_ENV: self.store,
                  JOIN_ENV: None if self.join is None else "1" if self.join else "0",
                  MAX_WORLD_ENV: None if self.max_world is None else str(self.max_world),
                  CHANNEL_ENV: self.channel}
        return {name: value for name, value in values.items() if value is not None}
