"""``JobSpec``: the one typed, frozen, validated description of a job.

Every backend (local, sbatch, submitit, torchx) is driven by the same ``JobSpec``. It is
written as ``jobspec.json`` into the job directory, and the runtime on the compute nodes
reads that file instead of re-parsing flags, so the login node and the job can never
disagree about what was asked.

Each field is declared once, with its help text, unit (in the name: ``_s``, ``_min``),
parser and example; the CLI flags and the config-file keys are generated from these
declarations, so an option cannot exist in one place and be missing in another.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hpc.contract import components, interval, jobdir, jobpaths, recovery_settings, spec_terms, stall, values
from hpc.contract import environment as job_env
from hpc.contract import parallel as mesh
from hpc.contract.errors import HpcError, SpecError

SCHEMA_VERSION = 1
REQUEUE_POLICIES = ("auto", "never")
RECOVERY_MODES = recovery_settings.RECOVERY_MODES
REPLACEMENT_MODES = recovery_settings.REPLACEMENT_MODES
WANDB_MODES = ("offline", "online", "disabled")
CONTAINER_RUNTIMES = ("pyxis", "apptainer")


def _opt(default: Any, help: str, parse: Callable[[Any, str], Any] | None = None, *,
         check: Callable[[Any, str], None] | None = None, example: str = "",
         metavar: str | None = None, cli: bool = True, repeat: bool = False,
         short: str = "", flag: bool = False) -> Any:
    """Declares one option: its default, help, parser, check and example, in one place.

    ``parse`` turns a raw value (CLI text or a TOML value) into the field's value and checks it,
    naming where it came from; ``check`` validates a field value wherever the spec was built
    (the constructor runs it for every field, so direct construction and ``jobspec.json`` are
    held to the same rules as flags and profiles). ``short`` is sbatch's one-letter form of the
    flag (``-N``), where it means the same; ``flag`` makes a boolean ``--x``/``--no-x`` pair.
    """
    meta = {"help": help, "parse": parse, "check": check, "example": example, "metavar": metavar,
            "cli": cli, "repeat": repeat, "short": short, "flag": flag}
    if isinstance(default, (list, dict)):
        raise AssertionError("use tuples for frozen defaults")
    return field(default=default, metadata=meta)


def _parsed(check: Callable[[Any, str], None]) -> Callable[[Any, str], str]:
    """A parser for a string option: strips blanks at the ends, refuses empty, then ``check``."""
    def parse(v: Any, flag: str) -> str:
        if isinstance(v, str) and v.strip() == "":
            raise SpecError(flag, v, "a non-empty string", f"{flag} NAME")
        s = v.strip() if isinstance(v, str) else v
        check(s, flag)  # a non-string (partition = true in hpc.toml) is refused here
        return s
    return parse


def _name(example: str, extra: str = "", words: str = "") -> Callable[[Any, str], None]:
    return lambda v, flag: values.check_slurm_name(v, flag, extra=extra, extra_words=words,
                                                   example=example)


def _text(example: str, max_len: int = values.MAX_NAME,
          forbidden: str = "") -> Callable[[Any, str], None]:
    return lambda v, flag: values.check_text(v, flag, example=example, max_len=max_len,
                                             forbidden=forbidden)


def _path(example: str) -> Callable[[Any, str], None]:
    return lambda v, flag: values.check_path(v, flag, example=example)


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(v: Any, flag: str) -> str:
        s = v.strip().lower() if isinstance(v, str) else None
        if s not in choices:
            raise SpecError(flag, v, "one of " + ", ".join(choices), f"{flag} {choices[0]}")
        return s
    return parse


def _in(choices: tuple[str, ...]) -> Callable[[Any, str], None]:
    def check(v: Any, flag: str) -> None:
        if v not in choices:
            raise SpecError(flag, v, "one of " + ", ".join(choices), f"{flag} {choices[0]}")
    return check


def _int(minimum: int, maximum: int, example: str = "") -> Callable[[Any, str], int]:
    return lambda v, flag: values.parse_int(v, flag, minimum=minimum, maximum=maximum,
                                            example=example)


def _int_check(minimum: int, maximum: int) -> Callable[[Any, str], None]:
    return lambda v, flag: values.check_int(v, flag, minimum=minimum, maximum=maximum)


def _cpus(v: Any, flag: str) -> int:
    """``--cpus-per-task``: 0 is the unset default, never a value a user gives (Slurm refuses it)."""
    if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip() == "0":
        raise SpecError(flag, v, f"an integer >= 1 and <= {MAX_CPUS_PER_TASK} (Slurm refuses 0)",
                        f"{flag} 8", "Leave the option out for the partition's default")
    return values.parse_int(v, flag, minimum=1, maximum=MAX_CPUS_PER_TASK)


def _env(v: Any, flag: str) -> tuple[tuple[str, str], ...]:
    """``--env NAME=VALUE`` (repeated), or in hpc.toml a table or a list of ``"NAME=VALUE"``."""
    valid = 'NAME=VALUE pairs: in hpc.toml a table (env = { NCCL_DEBUG = "INFO" }) or a list of strings'
    if isinstance(v, Mapping):
        items = []
        for k, x in v.items():
            if isinstance(x, bool) or not isinstance(x, (str, int, float)):
                raise SpecError(f"{flag} {k}", x, "a string (or a number)", 'NCCL_DEBUG = "INFO"')
            items.append(values.parse_env_pair(f"{k}={x}", flag))
        return tuple(sorted(items))
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise SpecError(flag, v, valid, 'env = { NCCL_DEBUG = "INFO" } in hpc.toml, or '
                        "--env NCCL_DEBUG=INFO")
    return tuple(sorted(dict(values.parse_env_pair(x, flag) for x in v).items()))


def _env_check(v: Any, flag: str) -> None:
    if not isinstance(v, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in v):
        raise SpecError(flag, v, "a tuple of (NAME, VALUE) string pairs", f"{flag} NCCL_DEBUG=INFO")
    for name, value in v:
        if not values.ENV_NAME.fullmatch(name):
            raise SpecError(flag, f"{name}={value}", "NAME=VALUE with a valid variable name",
                            f"{flag} NCCL_DEBUG=INFO")
        values.check_env_value(name, value, flag)
        try:
            recovery_settings.check_env(name, value)
            if name == job_env.WARM_START and value.strip().lower() not in job_env.WARM_START_VALUES:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(job_env.WARM_START_VALUES)}")
        except ValueError as e:
            raise SpecError(flag, f"{name}={value}", str(e).partition(": ")[2],
                            f"{flag} {recovery_settings.WINDOW_ENV}=5") from None


def _args(v: Any, flag: str) -> tuple[str, ...]:
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise SpecError(flag, v, "a list of arguments", f'{flag} = ["--lr", "3e-4"]')
    return tuple(str(x) for x in v)


def _args_check(v: Any, flag: str) -> None:
    if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
        raise SpecError(flag, v, "a tuple of strings", "hpc submit train.py -- --lr 3e-4")
    bad = next((x for x in v if "\x00" in x), None)
    if bad is not None:
        raise SpecError(flag, bad, "arguments without NUL characters (no program can receive "
                        "them)", "hpc submit train.py -- --lr 3e-4")


def _sbatch(v: Any, flag: str) -> tuple[tuple[str, str], ...]:
    """``--sbatch KEY=VALUE`` (repeated), or in hpc.toml a table or a list of ``"KEY=VALUE"``.

    A later value for the same key replaces an earlier one; the order is kept otherwise.
    """
    if isinstance(v, Mapping):
        items = []
        for k, x in v.items():
            if x is True:
                items.append(values.parse_sbatch_pair(str(k), flag))
            elif isinstance(x, bool) or not isinstance(x, (str, int)):
                raise SpecError(f"{flag} {k}", x, "a string, a number, or true for an option "
                                "without a value", 'sbatch = { gres-flags = "enforce-binding" }')
            else:
                items.append(values.parse_sbatch_pair(f"{k}={x}", flag))
    else:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise SpecError(flag, v, "KEY=VALUE strings: in hpc.toml a table or a list of strings",
                            'sbatch = { gres-flags = "enforce-binding" } in hpc.toml, or '
                            "--sbatch gres-flags=enforce-binding")
        items = [values.parse_sbatch_pair(x, flag) for x in v]
    return tuple(dict(items).items())


def _sbatch_check(v: Any, flag: str) -> None:
    if not isinstance(v, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in v):
        raise SpecError(flag, v, "a tuple of (KEY, VALUE) string pairs",
                        f"{flag} gres-flags=enforce-binding")
    for key, value in v:
        values.check_sbatch_pair(key, value or None, flag)


def _lines(check_one: Callable[[Any, str], None], example: str) -> Callable[[Any, str], tuple[str, ...]]:
    """A parser for a repeatable string option (a TOML string or list of strings)."""
    def parse(v: Any, flag: str) -> tuple[str, ...]:
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise SpecError(flag, v, "a string or a list of strings", example)
        for x in v:
            check_one(x, flag)
        return tuple(x.strip() for x in v)
    return parse


def _lines_check(check_one: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    def check(v: Any, flag: str) -> None:
        if not isinstance(v, tuple):
            raise SpecError(flag, v, "a tuple of strings", f"{flag} VALUE")
        for x in v:
            check_one(x, flag)
    return check


def _after(v: Any, flag: str) -> tuple[str, ...]:
    """``--after JOB[:STATE]`` (repeated), or in hpc.toml a string or a list of them."""
    if isinstance(v, (str, int)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise SpecError(flag, v, "JOB[:STATE] strings", f"{flag} 1234:ok")
    return tuple(dict.fromkeys(values.parse_after(x, flag) for x in v))


def _bool_opt(help: str, example: str) -> Any:
    return _opt(False, help, values.parse_bool, check=values.check_bool, example=example, flag=True)


# Upper bounds (in the help text, and docs/security.md).
MAX_NPROC_PER_NODE = 1024
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_TASK = 4096
MAX_SIGNAL_LEAD_S = 65535   # Slurm's --signal takes at most 0xffff seconds
MAX_RESTARTS = 1000
MAX_SPARE_NODES = 1024
MAX_REQUEUES = 10_000
MAX_BAD_NODE_JOBS = 1000
MAX_PORT = 65535
MAX_STEPS = 10**12
MAX_KEEP = 100_000
MAX_EVERY_MIN = values.MAX_TIME_S // 60

_WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in project and entity names
_CONSTRAINT_OPS = "[]()&|,:*!"


def _str_opt(default: str, help: str, check: Callable[[Any, str], None], example: str,
             **kw: Any) -> Any:
    """A string option: the parser strips and refuses empty, then ``check``; so does the spec."""
    return _opt(default, help, _parsed(check), check=check, example=example, **kw)


def _int_opt(default: int, help: str, minimum: int, maximum: int, example: str, *,
             parse: Callable[[Any, str], int] | None = None, unset: int | None = None,
             **kw: Any) -> Any:
    """An integer option in ``[minimum, maximum]``; ``unset`` is a default below ``minimum``
    that the spec accepts but a user cannot give (``--nproc-per-node 0``)."""
    lowest = minimum if unset is None else min(unset, minimum)
    return _opt(default, help, parse or _int(minimum, maximum, example),
                check=_int_check(lowest, maximum), example=example, **kw)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to run, where, for how long, and how to keep it alive.

    Every field is checked by its declaration's ``check`` in ``__post_init__``, however the spec
    is built (flags, profiles, ``jobspec.json``, the constructor): a bad value raises
    :class:`SpecError` naming the flag, the value, the valid form and an example.
    """

    # --- what to run -------------------------------------------------------------------
    script: str = _opt("", "Training script to run on every worker (a torchrun-style script).",
                       check=_path("hpc submit train.py"), cli=False)
    script_args: tuple[str, ...] = _opt((), "Arguments passed to the script (after --).",
                                        _args, check=_args_check, cli=False)
    job_name: str = _str_opt("", "Slurm job name (default: the script's stem; one line of "
                             "printable text).", _text("--job-name gpt-small"),
                             "--job-name gpt-small", short="-J")
    job_dir: str = _str_opt("", "Job directory: jobspec, logs, checkpoints, outcomes "
                            "(default: ./jobs/<name>-<time>).", _path("--job-dir runs/gpt"),
                            "--job-dir runs/gpt")
    python: str = _str_opt(sys.executable, "Python interpreter on the compute nodes.",
                           _path("--python /shared/venv/bin/python"),
                           "--python /shared/venv/bin/python")
    # --- resources ---------------------------------------------------------------------
    nodes: tuple[int, int] = _opt((1, 1), "Nodes: N, or MIN:MAX for an elastic job (at most "
                                  f"{values.MAX_NODES}).", values.parse_nodes,
                                  check=values.check_nodes, example="--nodes 2:4",
                                  metavar="N|MIN:MAX", short="-N")
    spare_nodes: int = _int_opt(0, "Hot spare nodes allocated beyond --nodes (0 to "
                                f"{MAX_SPARE_NODES}): they start, pass the health check and wait "
                                "without a rank; a lost node's place goes to a spare, so the world "
                                "size stays that of --nodes (with none left, an elastic job shrinks).",
                                0, MAX_SPARE_NODES, "--spare-nodes 1", metavar="K")
    nproc_per_node: int = _int_opt(0, "Worker processes per node (default: GPUs per node, else 1; "
                                   f"at most {MAX_NPROC_PER_NODE}).", 1, MAX_NPROC_PER_NODE,
                                   "--nproc-per-node 8", unset=0)
    gpus_per_node: int = _int_opt(0, f"GPUs per node (0 to {MAX_GPUS_PER_NODE}).", 0,
                                  MAX_GPUS_PER_NODE, "--gpus-per-node 8")
    cpus_per_task: int = _int_opt(0, f"CPUs for each node's task, 1 to {MAX_CPUS_PER_TASK} (not "
                                  "given: Slurm's default).", 1, MAX_CPUS_PER_TASK,
                                  "--cpus-per-task 8", parse=_cpus, unset=0)
    mem: str = _opt("", "Memory per node, Slurm syntax.", values.parse_mem, check=values.check_mem,
                    example="--mem 64G")
    time_limit_s: int = _int_opt(0, "Time limit (Slurm formats: MM, MM:SS, HH:MM:SS, D-HH, "
                                 "D-HH:MM, D-HH:MM:SS; at most 365 days); 0: the partition's "
                                 "default.", 1, values.MAX_TIME_S, "--time 4:00:00",
                                 parse=values.parse_time, unset=0, metavar="TIME", short="-t")
    partition: str = _str_opt("", "Slurm partition (or a comma-separated list).",
                              _name("--partition gpu", ",", " and ,"), "--partition gpu",
                              short="-p")
    account: str = _str_opt("", "Slurm account.", _name("--account proj123"), "--account proj123",
                            short="-A")
    qos: str = _str_opt("", "Slurm QOS.", _name("--qos normal"), "--qos normal", short="-q")
    constraint: str = _str_opt("", "Slurm node features constraint.",
                               _name("--constraint 'a100&ib'", _CONSTRAINT_OPS,
                                     " and Slurm's operators " + " ".join(_CONSTRAINT_OPS)),
                               "--constraint a100")
    exclude: str = _str_opt("", "Nodes to exclude (Slurm hostlist).",
                            _name("--exclude node[3-4]", "[],", " and [ ] , of a hostlist"),
                            "--exclude node[3-4]")
    avoid_bad_nodes: bool = _opt(True, "Also exclude the nodes that faulted in --bad-node-faults of "
                                 "the last --bad-node-jobs of your jobs that ran on them (crashed, "
                                 "lost, frozen, failed health checks; see hpc nodes); "
                                 "--no-avoid-bad-nodes keeps them.", values.parse_bool,
                                 check=values.check_bool, example="--avoid-bad-nodes", flag=True)
    bad_node_faults: int = _int_opt(2, f"Faulty jobs (1 to {MAX_BAD_NODE_JOBS}, at most --bad-node-jobs) "
                                    "that make a node avoided.", 1, MAX_BAD_NODE_JOBS,
                                    "--bad-node-faults 2", metavar="N")
    bad_node_jobs: int = _int_opt(5, "Of how many of the latest jobs that ran on a node "
                                  f"--bad-node-faults counts (1 to {MAX_BAD_NODE_JOBS}).", 1,
                                  MAX_BAD_NODE_JOBS, "--bad-node-jobs 5", metavar="M")
    gpu_type: str = _str_opt("", "GPU type for typed GPUs: Slurm's --gres=gpu:TYPE:N with N from "
                             "--gpus-per-node (needs --gpus-per-node).",
                             _name("--gpu-type a100"), "--gpu-type a100", metavar="TYPE")
    exclusive: bool = _bool_opt("Whole nodes for this job (sbatch --exclusive); --no-exclusive "
                                "undoes a profile's.", "--exclusive")
    reservation: str = _str_opt("", "Slurm reservation.", _name("--reservation maint", ","),
                                "--reservation maint")
    nodelist: str = _str_opt("", "Nodes the job must include (Slurm hostlist).",
                             _name("--nodelist node[1-2]", "[],", " and [ ] , of a hostlist"),
                             "--nodelist node[1-2]")
    mail_type: str = _opt("", "When Slurm mails you: a comma-separated list of "
                          + ", ".join(values.MAIL_TYPES) + ".", values.parse_mail_type,
                          check=values.check_mail_type, example="--mail-type END,FAIL",
                          metavar="TYPE[,TYPE]")
    mail_user: str = _str_opt("", "Who Slurm mails (default: you).",
                              _name("--mail-user me@example.org", "@"), "--mail-user me@example.org")
    sbatch: tuple[tuple[str, str], ...] = _opt(
        (), "Any other sbatch option, KEY=VALUE or KEY (repeatable; written as #SBATCH --KEY=VALUE). "
        "Options hpc sets itself are refused with the flag to use instead.", _sbatch,
        check=_sbatch_check, example="--sbatch gres-flags=enforce-binding", metavar="KEY=VALUE",
        repeat=True)
    after: tuple[str, ...] = _opt(
        (), "Start only after job JOB: JOB or JOB:STATE with STATE ok (default: it completed "
        "successfully), any (it ended), notok (it failed) or start (it started); repeatable, "
        "all must hold (sbatch --dependency).",
        _after,
        check=_lines_check(values.check_after), example="--after 1234:ok", metavar="JOB[:STATE]",
        repeat=True)
    setup: tuple[str, ...] = _opt(
        (), "A shell command run on every node before the launcher starts (repeatable, in "
        "order): in the batch script before srun (environment changes reach the job) and in "
        "each node's step. E.g. 'module load cuda/12.4', 'source /shared/venv/bin/activate'.",
        _lines(values.check_setup_line, "--setup 'module load cuda/12.4'"),
        check=_lines_check(values.check_setup_line), example="--setup 'module load cuda/12.4'",
        metavar="CMD", repeat=True)
    container_image: str = _str_opt("", "Container image to run the launcher and workers in "
                                    "(pyxis: a registry reference or .sqsh file; Apptainer: a "
                                    ".sif file or docker:// URI).",
                                    _path("--container-image nvcr.io#nvidia/pytorch:24.05-py3"),
                                    "--container-image nvcr.io#nvidia/pytorch:24.05-py3",
                                    metavar="IMAGE")
    container_mounts: tuple[str, ...] = _opt(
        (), "Extra container mounts SRC[:DST[:FLAGS]] (repeatable); the job, checkpoint and "
        "script directories are always mounted.", _lines(values.check_mount, "--container-mounts "
        "/datasets:/data:ro"), check=_lines_check(values.check_mount),
        example="--container-mounts /datasets:/data:ro", metavar="SRC[:DST[:FLAGS]]", repeat=True)
    container_runtime: str = _opt("pyxis", "How --container-image runs: pyxis (srun "
                                  "--container-image) or apptainer (apptainer exec).",
                                  _choice(CONTAINER_RUNTIMES), check=_in(CONTAINER_RUNTIMES),
                                  example="--container-runtime apptainer",
                                  metavar="pyxis|apptainer")
    # --- parallelism (hpc.contract.parallel) -------------------------------------------
    tp: int = _int_opt(1, "Tensor-parallel degree: ranks that split each layer (within a node: a "
                       f"divisor of --nproc-per-node; at most {mesh.MAX_DEGREE}).", 1,
                       mesh.MAX_DEGREE, "--tp 2", metavar="N")
    pp: int = _int_opt(1, "Pipeline-parallel degree: stages the model is cut into (at most "
                       f"{mesh.MAX_DEGREE}).", 1, mesh.MAX_DEGREE, "--pp 2", metavar="N")
    dp_replicate: int = _int_opt(1, "Data-parallel replicas of the sharded model (HSDP; 1: plain "
                                 f"FSDP; at most {mesh.MAX_DEGREE}).", 1, mesh.MAX_DEGREE,
                                 "--dp-replicate 2", metavar="N")
    dp_shard: int = _int_opt(0, "FSDP shards per replica (0: what the world leaves after tp x pp x "
                             "dp-replicate: the dimension an elastic job grows and shrinks; at most "
                             f"{mesh.MAX_DEGREE}).", 0, mesh.MAX_DEGREE, "--dp-shard 4",
                             metavar="N")
    # --- keeping it alive ----------------------------------------------------------------
    signal: str = _opt(components.PREEMPTION.signal,
                       "Warning signal Slurm sends before the time limit.",
                       values.parse_signal, check=_in(values.SIGNALS), example="--signal USR2")
    signal_lead_s: int = _int_opt(components.PREEMPTION.lead_s,
                                  "Seconds before the time limit that the warning arrives "
                                  "(0: no warning signal; a preemption then sends only SIGTERM; "
                                  f"at most {MAX_SIGNAL_LEAD_S}).", 0, MAX_SIGNAL_LEAD_S,
                                  "--signal-lead 120")
    max_restarts: int = _int_opt(3, "Elastic restarts of the workers within one allocation (at "
                                 f"most {MAX_RESTARTS}).", 0, MAX_RESTARTS, "--max-restarts 3")
    recovery: str = _opt("restart", "How workers recover from a lost peer: restart (every worker "
                         "starts again from the last checkpoint; any script) or inprocess (the "
                         "survivors keep their processes and take the state from a peer, at most "
                         "one step lost; Session scripts with DDP on gloo).",
                         _choice(RECOVERY_MODES), check=_in(RECOVERY_MODES),
                         example="--recovery inprocess")
    replacement: str = _opt(recovery_settings.WAIT, "With --recovery inprocess, when a dead worker's "
                            "replacement (its launcher starts it again) is taken in: wait (the "
                            "survivors' re-form waits for its start-up; the world keeps its size "
                            "and the weights stay bit-equal to an uninterrupted run; the default, "
                            "so that a run is reproducible) or shrink (the survivors go on at once "
                            "with one worker less, same samples and global batch, and the "
                            "replacement joins at a later step boundary: recovery without the "
                            "start-up, which on GPUs takes tens of seconds).",
                            _choice(REPLACEMENT_MODES), check=_in(REPLACEMENT_MODES),
                            example="--replacement shrink")
    requeue: str = _opt("auto", "Requeue policy: auto (on preemption and time limit) or never.",
                        _choice(REQUEUE_POLICIES), check=_in(REQUEUE_POLICIES),
                        example="--requeue auto")
    max_requeues: int = _int_opt(20, "Most requeues the job may do before it gives up (at most "
                                 f"{MAX_REQUEUES}).", 0, MAX_REQUEUES, "--max-requeues 20")
    rdzv_port: int = _int_opt(0, "TCP port (1 to 65535) of the c10d rendezvous on the first node "
                              "(0: 29400 + the Slurm job id mod 1000, so jobs sharing a node "
                              "differ; a free port locally).", 0, MAX_PORT, "--rdzv-port 29400")
    rdzv_timeout_s: int = _int_opt(600, "Seconds the rendezvous waits for MIN nodes to join "
                                   "(each round: the start, and after a node is lost) before it "
                                   "fails (10 to 86400); raise it when nodes start slowly (a "
                                   "container pull, a slow file system).", 10, 86400,
                                   "--rdzv-timeout 1200", metavar="SECONDS")
    stall_timeout: str = _opt("auto", "Stall watch: a rank that makes no progress this long has its "
                              "stacks dumped and its node's workers restarted. auto: max(20 s, "
                              "10 x the recent p99 step time), with own budgets for start-up, "
                              "restore, the first steps, saves and eval; SECONDS: a fixed step "
                              "deadline; off: wait for the collective timeout.",
                              stall.parse_stall_timeout, check=stall.check_stall_timeout,
                              example="--stall-timeout auto", metavar="auto|off|SECONDS")
    busy_timeout_s: int = _int_opt(stall.BUSY_TIMEOUT_S, "Stall watch: seconds a rank may go "
                                   "without progress while its process is alive and it works "
                                   "outside any collective (an evaluation, I/O, its own code not "
                                   "marked with session.phase); it is logged as running long, "
                                   "and restarted only after this long (from "
                                   f"{stall.MIN_BUSY_TIMEOUT_S} to {stall.MAX_BUSY_TIMEOUT_S}).",
                                   stall.MIN_BUSY_TIMEOUT_S, stall.MAX_BUSY_TIMEOUT_S,
                                   "--busy-timeout 3600", metavar="SECONDS")
    # --- checkpoints -----------------------------------------------------------------------
    checkpoint_dir: str = _str_opt("", "Checkpoint directory (default: JOB_DIR/checkpoints).",
                                   _path("--checkpoint-dir /scratch/me/ckpt"),
                                   "--checkpoint-dir /scratch/me/ckpt")
    checkpoint_every_steps: int = _int_opt(components.CHECKPOINT.every_steps,
                                           "Save every N steps (0: off).", 0, MAX_STEPS,
                                           "--checkpoint-every-steps 500", metavar="N")
    checkpoint_every_min: float = _opt(
        components.CHECKPOINT.every_min, "Save every M minutes (0: the --checkpoint-interval "
        "rule; at most 365 days).",
        lambda v, f: values.parse_float(v, f, minimum=0.0, maximum=MAX_EVERY_MIN,
                                        example="--checkpoint-every-min 30"),
        check=lambda v, f: values.check_float(v, f, minimum=0.0, maximum=MAX_EVERY_MIN,
                                              example="--checkpoint-every-min 30"),
        example="--checkpoint-every-min 30")
    checkpoint_interval: str = _opt(
        interval.AUTO, "auto: save every sqrt(2 x save cost x MTBF) (Young/Daly), kept between 5 "
        "and 30 minutes, from the measured save cost and the job's own interruptions, recomputed "
        "at each allocation, with a prior MTBF of 6h for the cluster (auto:2h sets another); the "
        "job's first save comes 20 steps in, to measure it; --checkpoint-every-min wins over it. "
        "fixed: only --checkpoint-every-min/-steps as given (see docs/goodput.md).",
        interval.parse_checkpoint_interval,
        check=interval.check_checkpoint_interval, example="--checkpoint-interval auto",
        metavar="fixed|auto|auto:MTBF")
    keep_last: int = _int_opt(components.CHECKPOINT.keep_last,
                              f"Checkpoints to keep (the newest k, 1 to {MAX_KEEP}).", 1,
                              MAX_KEEP, "--keep-last 3")
    keep_every: int = _int_opt(components.CHECKPOINT.keep_every,
                               "Also keep every n-th step forever (0: off).", 0, MAX_STEPS,
                               "--keep-every 10000")
    # --- logging ---------------------------------------------------------------------------
    wandb_project: str = _str_opt("", "W&B project (empty: the job name).",
                                  _text("--wandb-project gpt", 128, _WANDB_FORBIDDEN),
                                  "--wandb-project gpt")
    wandb_entity: str = _str_opt("", "W&B entity.",
                                 _text("--wandb-entity my-team", 128, _WANDB_FORBIDDEN),
                                 "--wandb-entity my-team")
    wandb_mode: str = _opt(components.WANDB.mode, "W&B mode: offline (default), online or disabled.",
                           _choice(WANDB_MODES), check=_in(WANDB_MODES),
                           example="--wandb-mode online")
    env: tuple[tuple[str, str], ...] = _opt((), "Extra environment for the workers, NAME=VALUE "
                                            "(repeatable; never a secret).", _env, check=_env_check,
                                            example="--env NCCL_DEBUG=INFO",
                                            metavar="NAME=VALUE", repeat=True)
    profile: str = _str_opt("", "Cluster profile from hpc.toml.", _text("--profile mycluster"),
                            "--profile mycluster")

    def __post_init__(self) -> None:
        self._normalize()
        cli = spec_terms.in_cli_terms()
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                flag = _CHECK_FLAGS.get(f.name) or flag_name(f.name)
                try:
                    check(getattr(self, f.name), flag if cli else f.name)
                except SpecError as e:   # from Python: the field, its unit, a Python example
                    raise e if cli else spec_terms.api_error(f, getattr(self, f.name), flag, e) from None
        if isinstance(self.checkpoint_every_min, int):
            object.__setattr__(self, "checkpoint_every_min", float(self.checkpoint_every_min))
        pick, name = spec_terms.pick, _term
        if self.gpus_per_node and self.nproc_per_node and self.nproc_per_node != self.gpus_per_node:
            n = self.gpus_per_node
            raise SpecError(
                name("nproc_per_node"), self.nproc_per_node,
                f"equal to {name('gpus_per_node')} ({n}): one worker per GPU",
                pick(f"--gpus-per-node {n} --nproc-per-node {n}",
                     f"gpus_per_node={n}, nproc_per_node={n}"))
        if not self.nproc_per_node:
            object.__setattr__(self, "nproc_per_node", self.gpus_per_node or 1)
        if self.gpu_type and not self.gpus_per_node:
            raise SpecError(name("gpu_type"), self.gpu_type,
                            f"used with {pick('--gpus-per-node N', 'gpus_per_node=N')} (typed "
                            "GPUs are gres=gpu:TYPE:N)",
                            pick(f"--gpus-per-node 8 --gpu-type {self.gpu_type}",
                                 f"gpus_per_node=8, gpu_type={self.gpu_type!r}"))
        if self.spare_nodes and self.allocated_nodes > values.MAX_NODES:
            raise SpecError(name("spare_nodes"), self.spare_nodes,
                            f"at most {values.MAX_NODES - self.max_nodes} with "
                            f"{name('nodes')} {self.nodes_text} (nodes and spares together at "
                            f"most {values.MAX_NODES})", pick("--spare-nodes 1", "spare_nodes=1"))
        if self.bad_node_faults > self.bad_node_jobs:
            raise SpecError(name("bad_node_faults"), self.bad_node_faults,
                            f"at most {name('bad_node_jobs')} ({self.bad_node_jobs}): a node faults "
                            "in at most every one of the jobs counted",
                            pick(f"--bad-node-faults {self.bad_node_jobs}",
                                 f"bad_node_faults={self.bad_node_jobs}"))
        mesh.check_nodes(self.parallel, nodes=self.nodes, nproc_per_node=self.nproc_per_node,
                         cli=spec_terms.in_cli_terms())
        if self.recovery == recovery_settings.INPROCESS and not self.parallel.trivial:
            dims = ", ".join(f"{name(k)} {getattr(self, k)}" for k in ("tp", "pp", "dp_replicate", "dp_shard")
                             if getattr(self, k) != getattr(JobSpec, k))
            raise SpecError(name("recovery"), self.recovery,
                            f"restart with a device mesh ({dims}): in-process recovery covers plain "
                            "data parallel (DDP) only; a mesh's sharded state has no peer copy yet",
                            pick("--recovery restart", 'recovery="restart"'),
                            "Or drop the mesh flags to keep " + pick("--recovery inprocess",
                                                                     'recovery="inprocess"'))
        if self.replacement != recovery_settings.WAIT and self.recovery != recovery_settings.INPROCESS:
            raise SpecError(name("replacement"), self.replacement,
                            f"{recovery_settings.WAIT} (the default) with {name('recovery')} {self.recovery}: "
                            "a replacement that joins later exists only under in-process recovery",
                            pick(f"--recovery inprocess --replacement {self.replacement}",
                                 f'recovery="inprocess", replacement="{self.replacement}"'))
        if self.time_limit_s and self.signal_lead_s >= self.time_limit_s:
            raise SpecError(name("signal_lead_s"), self.signal_lead_s,
                            f"shorter than the time limit ({name('time_limit_s')}: "
                            f"{self.time_limit_s} s)",
                            pick("--time 4:00:00 --signal-lead 120",
                                 "time_limit_s=4 * 3600, signal_lead_s=120"))

    def _normalize(self) -> None:
        """What Python callers naturally write, in the fields' own types: ``nodes=3`` is
        ``(3, 3)``, and a list where the field holds a tuple (``script_args=["--lr", "1"]``,
        ``env=[("A", "1")]``) is that tuple."""
        if isinstance(self.nodes, int) and not isinstance(self.nodes, bool):
            object.__setattr__(self, "nodes", (self.nodes, self.nodes))
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and isinstance(f.default, tuple):
                object.__setattr__(self, f.name, tuple(
                    tuple(x) if isinstance(x, list) else x for x in value))

    # --- derived values ------------------------------------------------------------------
    @property
    def min_nodes(self) -> int:
        return self.nodes[0]

    @property
    def max_nodes(self) -> int:
        return self.nodes[1]

    @property
    def allocated_nodes(self) -> int:
        """The nodes the job asks Slurm for: the largest world and the hot spares beside it."""
        return self.max_nodes + self.spare_nodes

    @property
    def nodes_text(self) -> str:
        lo, hi = self.nodes
        return str(lo) if lo == hi else f"{lo}:{hi}"

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def time_text(self) -> str:
        return values.format_time(self.time_limit_s) if self.time_limit_s else ""

    @property
    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint_dir or str(Path(self.job_dir) / jobdir.CHECKPOINTS)

    # --- what each component gets, whole ---------------------------------------------------
    @property
    def checkpoint(self) -> components.CheckpointConfig:
        return components.CheckpointConfig(
            directory=self.resolved_checkpoint_dir, every_steps=self.checkpoint_every_steps,
            every_min=self.checkpoint_every_min, keep_last=self.keep_last, keep_every=self.keep_every)

    @property
    def preemption(self) -> components.PreemptionConfig:
        return components.PreemptionConfig(signal=self.signal, lead_s=self.signal_lead_s)

    @property
    def liveness(self) -> components.LivenessConfig:
        return components.LivenessConfig.from_flags(self.stall_timeout, self.busy_timeout_s)

    @property
    def parallel(self) -> mesh.ParallelDims:
        """The degrees of the job's mesh (see :mod:`hpc.contract.parallel`)."""
        return mesh.ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                                 tp=self.tp, pp=self.pp)

    @property
    def wandb(self) -> components.WandbConfig:
        return components.WandbConfig(project=self.wandb_project or self.job_name,
                                      entity=self.wandb_entity, mode=self.wandb_mode)

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    # --- serialization -------------------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = jobpaths.JOBSPEC) -> JobSpec:
        """Reads a spec written by :meth:`to_json`, checked like any other.

        Args:
            text: The file's text.
            source: Where it came from, for errors (the file's path).

        Raises:
            SpecError: for text that is not a jobspec of this schema version (garbled, written by
                another hpc-elastic version, or holding a value no flag would accept), naming
                ``source`` and what to do.
        """
        def refuse(what: str, valid: str = "") -> SpecError:
            return _unreadable(source, what, valid)

        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes
            raise refuse(f"not JSON ({e})") from None
        if not isinstance(data, dict):
            raise refuse(f"a JSON {type(data).__name__}, not an object")
        version = data.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise refuse(f"schema_version {version!r}",
                         f"schema_version {SCHEMA_VERSION}, the one this hpc-elastic reads")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise refuse(f"unknown keys {', '.join(unknown)}")
        try:
            for key in ("nodes", "script_args", "setup", "container_mounts", "after"):
                if key in data:
                    data[key] = tuple(data[key])
            for key in ("env", "sbatch"):
                if key in data:
                    data[key] = tuple(tuple(p) for p in data[key])
        except TypeError as e:
            raise refuse(f"a malformed value ({e})") from None
        try:
            return cls(**data)
        except SpecError as e:
            raise refuse(f"{e.flag} {e.value!r}: {e.valid}") from None

    @classmethod
    def load(cls, job_dir: str | Path) -> JobSpec:
        """Reads ``JOB_DIR/jobspec.json``.

        Raises:
            SpecError: for a file that is not a readable jobspec (see :meth:`from_json`).
            HpcError: for a file that cannot be read at all (missing, no permission).
        """
        path = Path(job_dir) / jobdir.JOBSPEC
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise HpcError(f"cannot read {path}: {e.strerror or e}; is {job_dir} a job "
                           "directory written by hpc submit or hpc run?") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _unreadable(str(path), f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        return cls.from_json(text, str(path))


def _unreadable(source: str, what: str, valid: str = "") -> SpecError:
    """The error for a jobspec.json that this version cannot use, and what to do about it."""
    return SpecError(source, what, valid or f"a jobspec.json of schema_version {SCHEMA_VERSION}, "
                     "as this hpc-elastic writes it", "hpc submit train.py --job-dir runs/new-dir",
                     "Use a new --job-dir, or remove this job directory if nothing in it is needed "
                     "(or use the hpc-elastic version that wrote it)")


def option_fields() -> list[dataclasses.Field]:
    """The user-settable options (CLI flags and config keys), in declaration order."""
    return [f for f in fields(JobSpec) if f.name not in ("script", "script_args")]


def flag_name(name: str) -> str:
    """The CLI flag for a field name: ``time_limit_s`` -> ``--time``."""
    return "--" + FLAG_ALIASES.get(name, name.replace("_", "-"))


# Flags whose name is not simply the field name (units live in field names, not flags).
FLAG_ALIASES = {"time_limit_s": "time", "signal_lead_s": "signal-lead",
                "busy_timeout_s": "busy-timeout", "rdzv_timeout_s": "rdzv-timeout"}
# How the fields that are not flags are named in errors (as the CLI's usage names them).
_CHECK_FLAGS = {"script": "SCRIPT", "script_args": "SCRIPT_ARGS"}


def _term(name: str) -> str:
    """A field as errors name it: its flag inside :func:`spec_terms.cli_terms`, else itself."""
    return (_CHECK_FLAGS.get(name) or flag_name(name)) if spec_terms.in_cli_terms() else name
CONFIG_KEYS = {flag_name(f.name)[2:].replace("-", "_"): f.name for f in option_fields()}
"""Config-file key (``time``, ``signal_lead``, ``partition``...) -> field name."""


def parse_options(raw: Mapping[str, Any], source: Callable[[str], str]) -> dict[str, Any]:
    """Parses raw option values (strings from the CLI, or TOML values) into field values.

    Args:
        raw: Field name -> raw value.
        source: Names where a field's value came from, for error messages (``--time`` or
            ``hpc.toml [profiles.x] time``).
    """
    by_name = {f.name: f for f in fields(JobSpec)}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        f = by_name[name]
        parse = f.metadata.get("parse")
        out[name] = parse(value, source(name)) if parse else value
    return out
