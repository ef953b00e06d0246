"""The ``torchx`` backend: a TorchX component that runs our per-node launcher on every node.

Usable two ways::

    torchx run -s slurm -cfg partition=debug,time=10 \\
        hpc/backends/torchx_component.py:elastic --script train.py --job_dir /abs/job --nodes 2
    hpc submit --backend torchx train.py --nodes 2 ...

TorchX's Slurm scheduler (0.7) makes a heterogeneous job with one component per replica, so
one replica is one node: ``num_replicas`` is the node count, the replica id is the node rank
(``SLURM_NODEID`` is 0 in every component) and the rendezvous host is the first component's
node (``SLURM_JOB_NODELIST_HET_GROUP_0``). Its ``-cfg`` carries only partition, time,
constraint, comment and mail options, and it silently ignores keys it does not know; it always
adds ``--requeue`` and ``srun --kill-on-bad-exit=1``. So our layer never hands it an option it
would drop: :func:`check_carried` refuses (exit 2, naming them) ``--account``, ``--qos``,
``--exclude``, ``--mem``, ``--requeue never`` and elastic ``MIN:MAX`` (a heterogeneous job
cannot shrink), and the warning signal, which TorchX has no option for, goes through the
``SBATCH_SIGNAL`` environment variable that sbatch reads.

``hpc submit --backend torchx`` runs TorchX's runner with TorchX's Slurm scheduler, except that
the ``sbatch`` goes through :class:`hpc.contract.slurm.SlurmClient` (retries, a unique tag, no double
submission), like the other backends. ``torchx run`` from a shell uses TorchX's own sbatch.

Heavy imports (torchx) stay inside functions.
"""

# No `from __future__ import annotations`: TorchX reads the component's annotations as types.
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc import render
from hpc.backends import slurm_options
from hpc.contract import jobdir
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmClient

if TYPE_CHECKING:
    from torchx.specs import AppDef, Role

# No batch step (hpc.backends.BATCH_STEPS): TorchX writes its own batch script, with no place
# before srun. Both are refused anyway by check_carried: exclusions matter only to an elastic
# job (a heterogeneous job has a fixed size) and containers are not run.
ENFORCES: frozenset[str] = frozenset()


def check_carried(spec: JobSpec) -> None:
    """Refuses every option TorchX's Slurm scheduler cannot carry (pure).

    Raises:
        SpecError: naming all such options at once, and what to do instead.
    """
    lost = [flag for flag, bad in (
        ("--account", bool(spec.account)), ("--qos", bool(spec.qos)),
        ("--exclude", bool(spec.exclude)), ("--mem", bool(spec.mem)),
        ("--requeue never", spec.requeue == "never"),
        ("--nodes MIN:MAX", spec.min_nodes != spec.max_nodes),
        ("--spare-nodes", bool(spec.spare_nodes)),
        ("--gpu-type", bool(spec.gpu_type)), ("--exclusive", spec.exclusive),
        ("--reservation", bool(spec.reservation)), ("--nodelist", bool(spec.nodelist)),
        *((f"--sbatch {k}", True) for k, _ in spec.sbatch),
        ("--container-image", bool(spec.container_image)), ("--after", bool(spec.after))) if bad]
    if lost:
        raise SpecError("--backend torchx", ", ".join(lost),
                        "options TorchX's Slurm scheduler can carry (it has no account, qos, "
                        "exclude, memory, typed-GPU, exclusive, reservation, nodelist or "
                        "dependency option "
                        "and no way to pass other sbatch options, always requeues, runs "
                        "fixed-size heterogeneous jobs, so no hot spares, and runs no containers)",
                        "hpc submit --backend sbatch ...",
                        "Use --backend sbatch, which carries every option (submitit carries all "
                        "but containers)")


def elastic(script: str, *script_args: str, job_dir: str, nodes: int = 1,
            nproc_per_node: int = 1, python: str = sys.executable, job_name: str = "",
            max_restarts: int = 3, rdzv_port: int = 0) -> "AppDef":
    """A TorchX component: ``script`` on ``nodes`` nodes x ``nproc_per_node`` processes.

    Writes ``jobspec.json`` into ``job_dir`` (created private, 0700) if it is not there yet,
    because the per-node launcher reads the job from it.

    Args:
        script: The training script (a torchrun-style Python script).
        script_args: Its arguments.
        job_dir: Absolute job directory on the shared filesystem.
        nodes: Number of nodes (one TorchX replica per node).
        nproc_per_node: Worker processes per node.
        python: Python interpreter on the compute nodes.
        job_name: Name of the job (default: the script's stem).
        max_restarts: Elastic restarts of the workers within one allocation.
        rdzv_port: Port of the c10d rendezvous on the first node.
    """
    from torchx import specs

    path = Path(job_dir).expanduser().absolute()
    if not (path / jobdir.JOBSPEC).exists():
        spec = JobSpec(script=str(Path(script).absolute()), script_args=tuple(script_args),
                       job_name=job_name or Path(script).stem, job_dir=str(path), python=python,
                       nodes=(nodes, nodes), nproc_per_node=nproc_per_node,
                       max_restarts=max_restarts, rdzv_port=rdzv_port)
        jobdir.create(path)
        jobdir.write_atomic(path / jobdir.JOBSPEC, spec.to_json())
    spec = JobSpec.load(path)
    return specs.AppDef(name=spec.job_name, roles=[elastic_role(spec)])


def elastic_role(spec: JobSpec) -> "Role":
    """The one TorchX role: the per-node launcher, one replica per node (pure)."""
    from torchx import specs

    # The launcher finds the rendezvous host itself (SLURM_JOB_NODELIST_HET_GROUP_0 in
    # TorchX's heterogeneous job); the replica id is the node rank.
    # --setup runs on each node before the launcher (bash -c '...; exec "$@"'); TorchX's batch
    # script has no place for the batch-shell part, and needs none: exec keeps what it set.
    python, *args = slurm_options.with_node_setup(spec, slurm_options.launcher_argv(
        spec, "--node-rank", specs.macros.replica_id, "--run-id", "torchx"))
    resource = specs.Resource(cpu=spec.cpus_per_task or 1, gpu=spec.gpus_per_node, memMB=0)
    role = specs.Role(name="node", image=os.getcwd(), entrypoint=python,
                      args=args, num_replicas=spec.max_nodes, resource=resource,
                      max_retries=spec.max_requeues)
    return role


def scheduler_cfg(spec: JobSpec) -> dict[str, Any]:
    """The ``-cfg`` for TorchX's Slurm scheduler (pure): only keys it really carries."""
    cfg: dict[str, Any] = {}
    if spec.partition:
        cfg["partition"] = spec.partition
    if spec.time_limit_s:
        cfg["time"] = spec.time_text
    if spec.constraint:
        cfg["constraint"] = spec.constraint
    if spec.mail_type:
        cfg["mail-type"] = spec.mail_type
    if spec.mail_user:
        cfg["mail-user"] = spec.mail_user
    return cfg


@dataclass(frozen=True)
class TorchxPlan:
    """What ``hpc submit --backend torchx`` does: the component call, cfg and sbatch env."""

    spec: JobSpec
    cfg: dict[str, Any]
    env: dict[str, str]

    def describe(self) -> str:
        args = [f"--script={self.spec.script}", f"--job_dir={self.spec.job_dir}",
                f"--nodes={self.spec.max_nodes}", f"--nproc_per_node={self.spec.nproc_per_node}"]
        cfg = ",".join(f"{k}={v}" for k, v in self.cfg.items())
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (f"# would create {self.spec.job_dir} (0700) with {jobdir.JOBSPEC}, then run:\n"
                f"{env} torchx run -s slurm" + (f" -cfg {shlex.quote(cfg)}" if cfg else "")
                + f" {Path(__file__).as_posix()}:elastic {shlex.join(args)}"
                + (" -- " + shlex.join(self.spec.script_args) if self.spec.script_args else "")
                + "\n")


def plan(spec: JobSpec) -> TorchxPlan:
    """Plans the submission (pure): refuses what TorchX would drop, maps the rest."""
    render.check_renderable(spec)
    check_carried(spec)
    return TorchxPlan(spec=spec, cfg=scheduler_cfg(spec),
                      env={**({"SBATCH_SIGNAL": signal} if (signal := slurm_options.warning_signal(spec)) else {}),
                           # TorchX puts --cpus-per-task on sbatch only, and srun does not
                           # inherit it (Slurm >= 22.05): the job's srun reads this instead.
                           **({"SRUN_CPUS_PER_TASK": str(spec.cpus_per_task)} if spec.cpus_per_task else {})})


def _slurm_scheduler_factory(client: "SlurmClient") -> Any:
    """A TorchX scheduler factory: TorchX's Slurm scheduler, whose ``sbatch`` goes through
    :class:`SlurmClient` (retries while the controller is unreachable, a unique tag looked up
    before a retry, so a lost answer never submits twice). TorchX still writes the script."""
    from torchx.schedulers import slurm_scheduler

    class HpcSlurmScheduler(slurm_scheduler.SlurmScheduler):
        def schedule(self, dryrun_info: Any) -> str:
            # TorchX 0.7's schedule(), with the subprocess.run(sbatch) replaced by the client.
            req = dryrun_info.request
            with tempfile.TemporaryDirectory() as tmpdir:
                path = os.path.join(req.job_dir or tmpdir, "torchx-sbatch.sh")
                if req.job_dir is not None:
                    req.cmd += [f"--chdir={req.job_dir}"]
                req.cmd += [path]
                with open(path, "w") as f:
                    f.write(req.materialize())
                args = [a for a in req.cmd[1:-1] if a != "--parsable"]  # the client adds these
                job_id = client.submit(Path(path), args)
            if req.job_dir is not None:
                slurm_scheduler._save_job_dir(job_id, req.job_dir)  # what `torchx log` reads
            return job_id

    return lambda session_name, **_: HpcSlurmScheduler(session_name)


def execute(p: TorchxPlan, client: "SlurmClient | None" = None) -> str:
    """Submits through TorchX's runner; returns the Slurm job id (``sbatch`` runs through
    ``client``, see :func:`_slurm_scheduler_factory`)."""
    from torchx.runner import Runner

    # sbatch reads the warning signal from SBATCH_SIGNAL (TorchX has no option for it), and the
    # job's srun SRUN_CPUS_PER_TASK: both go in the environment of the client's sbatch only.
    client = SlurmClient(env={**(client.env if client else os.environ), **p.env})
    app = elastic(p.spec.script, *p.spec.script_args, job_dir=p.spec.job_dir,
                  nodes=p.spec.max_nodes, nproc_per_node=p.spec.nproc_per_node,
                  python=p.spec.python, job_name=p.spec.job_name)
    with Runner("torchx", {"slurm": _slurm_scheduler_factory(client)}) as runner:
        handle = runner.run(app, scheduler="slurm", cfg=p.cfg)
    return handle.rsplit("/", 1)[-1]
