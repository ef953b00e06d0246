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

from hpc.contract import values
from hpc.contract.errors import SpecError

SCHEMA_VERSION = 1
REQUEUE_POLICIES = ("auto", "never")
WANDB_MODES = ("offline", "online", "disabled")


def _opt(default: Any, help: str, parse: Callable[[Any, str], Any] | None = None, *,
         example: str = "", metavar: str | None = None, cli: bool = True, repeat: bool = False) -> Any:
    """Declares one option: its default, help, parser and example, in one place."""
    meta = {"help": help, "parse": parse, "example": example, "metavar": metavar, "cli": cli,
            "repeat": repeat}
    if isinstance(default, (list, dict)):
        raise AssertionError("use tuples for frozen defaults")
    return field(default=default, metadata=meta)


def _str(v: Any, flag: str) -> str:
    if not isinstance(v, (str, int)) or str(v).strip() == "":
        raise SpecError(flag, v, "a non-empty string", f"{flag} NAME")
    return str(v).strip()


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(v: Any, flag: str) -> str:
        s = str(v).strip().lower()
        if s not in choices:
            raise SpecError(flag, v, "one of " + ", ".join(choices), f"{flag} {choices[0]}")
        return s
    return parse


def _int(minimum: int) -> Callable[[Any, str], int]:
    return lambda v, flag: values.parse_int(v, flag, minimum=minimum)


def _env(v: Any, flag: str) -> tuple[tuple[str, str], ...]:
    if isinstance(v, Mapping):
        items = [(str(k), str(x)) for k, x in v.items()]
        for k, _ in items:
            values.parse_env_pair(f"{k}=", flag)
        return tuple(sorted(items))
    if isinstance(v, str):
        v = [v]
    return tuple(sorted(dict(values.parse_env_pair(x, flag) for x in v).items()))


def _args(v: Any, flag: str) -> tuple[str, ...]:
    if isinstance(v, str):
        raise SpecError(flag, v, "a list of arguments", f'{flag} = ["--lr", "3e-4"]')
    return tuple(str(x) for x in v)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to run, where, for how long, and how to keep it alive."""

    # --- what to run -------------------------------------------------------------------
    script: str = _opt("", "Training script to run on every worker (a torchrun-style script).",
                       cli=False)
    script_args: tuple[str, ...] = _opt((), "Arguments passed to the script (after --).",
                                        _args, cli=False)
    job_name: str = _opt("", "Slurm job name (default: the script's stem).", _str,
                         example="--job-name gpt-small")
    job_dir: str = _opt("", "Job directory: jobspec, logs, checkpoints, outcomes "
                        "(default: ./jobs/<name>-<time>).", _str, example="--job-dir runs/gpt")
    python: str = _opt(sys.executable, "Python interpreter on the compute nodes.", _str,
                       example="--python /shared/venv/bin/python")
    # --- resources ---------------------------------------------------------------------
    nodes: tuple[int, int] = _opt((1, 1), "Nodes: N, or MIN:MAX for an elastic job.",
                                  values.parse_nodes, example="--nodes 2:4", metavar="N|MIN:MAX")
    nproc_per_node: int = _opt(0, "Worker processes per node (default: GPUs per node, else 1).",
                               _int(1), example="--nproc-per-node 8")
    gpus_per_node: int = _opt(0, "GPUs per node.", _int(0), example="--gpus-per-node 8")
    cpus_per_task: int = _opt(0, "CPUs for each node's task (0: Slurm's default).", _int(0),
                              example="--cpus-per-task 8")
    mem: str = _opt("", "Memory per node, Slurm syntax.", values.parse_mem, example="--mem 64G")
    time_limit_s: int = _opt(0, "Time limit (Slurm formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                             "D-HH:MM:SS); 0: the partition's default.", values.parse_time,
                             example="--time 4:00:00", metavar="TIME")
    partition: str = _opt("", "Slurm partition.", _str, example="--partition gpu")
    account: str = _opt("", "Slurm account.", _str, example="--account proj123")
    qos: str = _opt("", "Slurm QOS.", _str, example="--qos normal")
    constraint: str = _opt("", "Slurm node features constraint.", _str, example="--constraint a100")
    exclude: str = _opt("", "Nodes to exclude (Slurm hostlist).", _str, example="--exclude node[3-4]")
    # --- keeping it alive ----------------------------------------------------------------
    signal: str = _opt("USR2", "Warning signal Slurm sends before the time limit.",
                       values.parse_signal, example="--signal USR2")
    signal_lead_s: int = _opt(120, "Seconds before the time limit that the warning arrives (0: no warning "
                              "signal; a preemption then sends only SIGTERM).",
                              _int(0), example="--signal-lead 120")
    max_restarts: int = _opt(3, "Elastic restarts of the workers within one allocation.",
                             _int(0), example="--max-restarts 3")
    requeue: str = _opt("auto", "Requeue policy: auto (on preemption and time limit) or never.",
                        _choice(REQUEUE_POLICIES), example="--requeue auto")
    max_requeues: int = _opt(20, "Most requeues the job may do before it gives up.", _int(0),
                             example="--max-requeues 20")
    rdzv_port: int = _opt(0, "TCP port of the c10d rendezvous on the first node (0: "
                          "29400 + the Slurm job id mod 1000, so jobs sharing a node differ; "
                          "a free port locally).", _int(0),
                          example="--rdzv-port 29400")
    # --- checkpoints -----------------------------------------------------------------------
    checkpoint_dir: str = _opt("", "Checkpoint directory (default: JOB_DIR/checkpoints).", _str,
                               example="--checkpoint-dir /scratch/me/ckpt")
    checkpoint_every_steps: int = _opt(0, "Save every N steps (0: off).", _int(0),
                                       example="--checkpoint-every-steps 500")
    checkpoint_every_min: float = _opt(
        0.0, "Save every M minutes (0: off).",
        lambda v, f: values.parse_float(v, f, minimum=0.0), example="--checkpoint-every-min 30")
    keep_last: int = _opt(3, "Checkpoints to keep (the newest k).", _int(1), example="--keep-last 3")
    keep_every: int = _opt(0, "Also keep every n-th step forever (0: off).", _int(0),
                           example="--keep-every 10000")
    # --- logging ---------------------------------------------------------------------------
    wandb_project: str = _opt("", "W&B project (empty: the job name).", _str,
                              example="--wandb-project gpt")
    wandb_entity: str = _opt("", "W&B entity.", _str, example="--wandb-entity my-team")
    wandb_mode: str = _opt("offline", "W&B mode: offline (default), online or disabled.",
                           _choice(WANDB_MODES), example="--wandb-mode online")
    env: tuple[tuple[str, str], ...] = _opt((), "Extra environment for the workers, NAME=VALUE "
                                            "(repeatable).", _env, example="--env NCCL_DEBUG=INFO",
                                            metavar="NAME=VALUE", repeat=True)
    profile: str = _opt("", "Cluster profile from hpc.toml.", _str, example="--profile mycluster")

    def __post_init__(self) -> None:
        lo, hi = self.nodes
        if self.gpus_per_node and self.nproc_per_node and self.nproc_per_node != self.gpus_per_node:
            raise SpecError(
                "--nproc-per-node", self.nproc_per_node,
                f"equal to --gpus-per-node ({self.gpus_per_node}): one worker per GPU",
                f"--gpus-per-node {self.gpus_per_node} --nproc-per-node {self.gpus_per_node}")
        if not self.nproc_per_node:
            object.__setattr__(self, "nproc_per_node", self.gpus_per_node or 1)
        if self.time_limit_s and self.signal_lead_s >= self.time_limit_s:
            raise SpecError("--signal-lead", self.signal_lead_s,
                            f"shorter than the time limit ({self.time_limit_s} s)",
                            "--time 4:00:00 --signal-lead 120")
        assert 1 <= lo <= hi

    # --- derived values ------------------------------------------------------------------
    @property
    def min_nodes(self) -> int:
        return self.nodes[0]

    @property
    def max_nodes(self) -> int:
        return self.nodes[1]

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
        return self.checkpoint_dir or str(Path(self.job_dir) / "checkpoints")

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    # --- serialization -------------------------------------------------------------------
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        version = data.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise ValueError(f"jobspec.json has schema_version {version!r}; this hpc-elastic "
                             f"reads version {SCHEMA_VERSION}")
        data["nodes"] = tuple(data["nodes"])
        data["script_args"] = tuple(data["script_args"])
        data["env"] = tuple(tuple(p) for p in data["env"])
        return cls(**data)

    @classmethod
    def load(cls, job_dir: str | Path) -> JobSpec:
        return cls.from_json((Path(job_dir) / "jobspec.json").read_text())


def option_fields() -> list[dataclasses.Field]:
    """The user-settable options (CLI flags and config keys), in declaration order."""
    return [f for f in fields(JobSpec) if f.name not in ("script", "script_args")]


def flag_name(name: str) -> str:
    """The CLI flag for a field name: ``time_limit_s`` -> ``--time``."""
    return "--" + FLAG_ALIASES.get(name, name.replace("_", "-"))


# Flags whose name is not simply the field name (units live in field names, not flags).
FLAG_ALIASES = {"time_limit_s": "time", "signal_lead_s": "signal-lead"}
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
