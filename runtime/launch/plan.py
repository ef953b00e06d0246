"""The per-node launcher's plan: what the agent will run and with which environment (pure).

:func:`plan_launch` decides, before anything runs, the agent's configuration (nodes, rendezvous
endpoint, allocation number) and the workers' environment (our ``HPC_*`` contract, the torch
2.13 rendezvous fix, NCCL and W&B defaults, the user's ``--env``), never overriding a value the
user set. The result, a frozen :class:`LaunchPlan`, is handed to :mod:`runtime.launch` (which
runs it) and :mod:`runtime.ending.outcome` (which records how it ended); it lives apart from both so
neither imports the other's process code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc.contract import jobdir, resubmissions
from hpc.contract.environment import JobEnvironment
from hpc.contract.jobspec import JobSpec
from runtime import stopping, wandb_env
from runtime.launch.cpus import job_cpus, omp_threads
from runtime.env import SlurmEnv
from runtime.liveness.deadline import policy_for
from runtime.liveness.nccl_watch import nccl_defaults
from runtime.liveness.watchdog import heartbeat_dir
from runtime.launch.network import EnvChange

# Variables that only make sense in the process that set them, never in a job's workers.
INHERITED_ONLY = {
    # wandb writes its service's socket here in any process that used wandb (a notebook, a
    # wrapper script, the submitting process): rank 0 would log through that process's service,
    # on another host or gone, instead of its own, and a crash would lose the run's history.
    "WANDB_SERVICE": "points at the W&B service of the process that started this job; rank 0 "
                     "starts its own",
}

def env_defaults(current: Mapping[str, str], wanted: Mapping[str, tuple[str, str]]) -> list[EnvChange]:
    """Plans setting ``wanted`` (name -> (value, reason)) without overriding user values."""
    changes = []
    for name, (value, reason) in wanted.items():
        old = current.get(name)
        changes.append(EnvChange(name, value, old, reason, kept_user_value=old is not None and old != value))
    return changes


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the agent needs, decided before anything runs."""

    spec: JobSpec
    job_dir: Path
    allocation: int
    node_rank: int
    nnodes: tuple[int, int]
    rdzv_endpoint: str
    is_rdzv_host: bool
    run_id: str
    env_changes: tuple[EnvChange, ...]
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_unset: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    epoch: int = 0                  # the rendezvous epoch (runtime.succession)
    local: bool = False             # hpc run: one machine, no node is ever excluded
    rdzv_listen_fd: int | None = None   # hpc run: the store's listening socket, bound by hpc run

    @property
    def launchers(self) -> int:
        """The most launchers (nodes) of the allocation: MAX nodes and the hot spares."""
        return self.nnodes[1] + self.spec.spare_nodes

    @property
    def log_dir(self) -> Path:
        return jobdir.alloc_log_dir(self.job_dir, self.allocation)


def rdzv_port(spec: JobSpec, slurm: SlurmEnv) -> int:
    """The rendezvous port: the spec's, else one derived from the job id (pure).

    Slurm may place several jobs on one node; a fixed port would make the second job's store
    fail to bind. Every node of a job derives the same port from the same job id.
    """
    if spec.rdzv_port:
        return spec.rdzv_port
    digits = "".join(ch for ch in slurm.job_id if ch.isdigit())
    return 29400 + int(digits) % 1000 if digits else 29400


def plan_launch(spec: JobSpec, job_dir: Path, env: Mapping[str, str], *, rdzv_host: str,
                node_rank: int, run_id: str, extra_changes: tuple[EnvChange, ...] = ()) -> LaunchPlan:
    """Decides the agent's configuration and the workers' environment (pure).

    Args:
        spec: The job.
        job_dir: Its directory.
        env: The launcher's environment (``os.environ``).
        rdzv_host: Host (name or address) of the c10d rendezvous, the first node.
        node_rank: This node's index in the allocation (0 hosts the rendezvous).
        run_id: Rendezvous run id, the same on every node of one allocation.
        extra_changes: Planned changes from elsewhere (network interface detection).
    """
    slurm = SlurmEnv.from_env(env)
    inherited = JobEnvironment.from_env(env).allocation
    allocation = inherited if inherited is not None else slurm.restart_count + \
        resubmissions.allocation_base(resubmissions.read(job_dir), slurm.job_id)   # a continuation
    wanted = {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": (
            "1", "torch 2.13 elastic restarts fail against a dead worker's store without it"),
        "PYTHONUNBUFFERED": ("1", "worker logs appear as they are written"),
        "WANDB_SILENT": ("true", "keep rank-0 output readable; W&B runs are in "
                         f"{env.get('WANDB_DIR') or job_dir}/wandb unless the script passes dir="),
        "OMP_NUM_THREADS": (str(omp_threads(job_cpus(), spec.nproc_per_node)),
                            "one share of the job's CPUs (affinity, cgroup quota) per worker"),
        **wandb_env.defaults(job_dir, spec.wandb_mode),   # one W&B run per job, own wandb.init too
        # GPU jobs: NCCL's watchdog and flight recorder, coherent with the stall watch.
        **nccl_defaults(gpus_per_node=spec.gpus_per_node, policy=policy_for(spec.liveness),
                        log_dir=jobdir.alloc_log_dir(job_dir, allocation), heartbeat_dir=heartbeat_dir(os.getpid()),
                        recovery=spec.recovery),
    }
    changes = list(extra_changes) + env_defaults(env, wanted)
    for name, reason in INHERITED_ONLY.items():
        if name in env:
            changes.append(EnvChange(name, None, env[name], reason))
    # The user's --env is an explicit request for this job: it wins over the inherited env.
    for name, value in spec.env:
        changes.append(EnvChange(name, value, env.get(name), "--env"))
    ours = JobEnvironment(job_dir=str(job_dir), allocation=allocation,
                          warning_signal=f"SIG{spec.signal}", agent_pid=os.getpid(),
                          merge_stderr=True, checkpoint_dir=spec.resolved_checkpoint_dir,
                          resumed=stopping.is_resumed(job_dir, allocation), requeue_count=allocation,
                          warning_lead_s=float(spec.signal_lead_s),
                          stop_file=str(stopping.notice_path(job_dir, allocation))).to_env()
    worker_env = {c.name: c.new for c in changes
                  if c.new is not None and not c.kept_user_value} | ours
    return LaunchPlan(
        spec=spec, job_dir=job_dir, allocation=allocation, node_rank=node_rank,
        nnodes=spec.nodes, rdzv_endpoint=f"{rdzv_host}:{rdzv_port(spec, slurm)}",
        is_rdzv_host=node_rank == 0, run_id=run_id, env_changes=tuple(changes),
        worker_env=worker_env, worker_unset=tuple(c.name for c in changes if c.new is None),
        argv=("-m", "runtime.worker", spec.script, *spec.script_args),
    )
