"""One reader of the job's environment: torchrun's and Slurm's variables, as typed values.

Everything inside a job that wants to know "who am I" reads it here, from a mapping passed
in (tests pass dicts), instead of scattering ``os.environ[...]`` through the code.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc.contract.environment import JobEnvironment
from hpc.contract.slurm_parse import expand_hostlist


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class SlurmEnv:
    """What Slurm tells a job step about itself (empty when not under Slurm)."""

    job_id: str = ""
    restart_count: int = 0          # SLURM_RESTART_COUNT: how many times it was requeued
    node_id: int = 0                # SLURM_NODEID: this node's index in the allocation
    nnodes: int = 1
    nodelist: str = ""              # SLURM_JOB_NODELIST (compressed hostlist)
    het_group0_nodelist: str = ""   # SLURM_JOB_NODELIST_HET_GROUP_0 (heterogeneous jobs)
    proc_id: int = 0
    submit_host: str = ""
    partition: str = ""

    @property
    def active(self) -> bool:
        return bool(self.job_id)

    @property
    def first_node(self) -> str:
        """The allocation's first node, host of the c10d rendezvous ("" outside Slurm).

        What ``scontrol show hostnames $SLURM_JOB_NODELIST | head -n1`` prints; in a
        heterogeneous job (TorchX: one component per node) the first component's node.
        """
        hosts = expand_hostlist(self.het_group0_nodelist or self.nodelist)
        return hosts[0] if hosts else ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmEnv:
        return cls(
            job_id=env.get("SLURM_ARRAY_JOB_ID") and
            f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}" or env.get("SLURM_JOB_ID", ""),
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            node_id=_int(env, "SLURM_NODEID", 0),
            nnodes=_int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", 1)),
            nodelist=env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")),
            het_group0_nodelist=env.get("SLURM_JOB_NODELIST_HET_GROUP_0", ""),
            proc_id=_int(env, "SLURM_PROCID", 0),
            submit_host=env.get("SLURM_SUBMIT_HOST", ""),
            partition=env.get("SLURM_JOB_PARTITION", ""),
        )



def rendezvous_host(env: Mapping[str, str], given: str = "", *, default: str = "127.0.0.1") -> str:
    """The host of the c10d rendezvous, by the one rule every process uses.

    ``--rdzv-host`` when given, else ``HPC_RDZV_HOST`` (the batch shell's: the allocation's first
    node as ``scontrol show hostnames`` lists it), else the allocation's first node from Slurm's
    variables (:attr:`SlurmEnv.first_node`; a submitit or TorchX job step), else ``default``
    (outside Slurm: this machine).
    """
    return (given or JobEnvironment.from_env(env).rdzv_host or SlurmEnv.from_env(env).first_node
            or default)

@dataclass(frozen=True)
class WorkerEnv:
    """What torchrun's elastic agent tells each worker (RANK, WORLD_SIZE, ...)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0             # the node's rank in this rendezvous round
    restart_count: int = 0          # TORCHELASTIC_RESTART_COUNT: elastic restarts this allocation
    max_restarts: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    run_id: str = ""
    hostname: str = ""
    slurm: SlurmEnv = SlurmEnv()
    job: JobEnvironment = field(default_factory=JobEnvironment)  # what our launcher set

    @property
    def job_dir(self) -> str:
        return self.job.job_dir

    @property
    def allocation(self) -> int:
        """The Slurm requeue count of this allocation (0 locally)."""
        return self.job.allocation if self.job.allocation is not None else self.slurm.restart_count

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if env is None else env
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            group_rank=_int(env, "GROUP_RANK", 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            hostname=env.get("HOSTNAME") or socket.gethostname(),
            slurm=SlurmEnv.from_env(env),
            job=JobEnvironment.from_env(env),
        )
