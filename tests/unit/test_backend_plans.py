"""What the submitit and TorchX backends hand to their libraries (pure, no Slurm)."""

from __future__ import annotations

import pytest

from hpc.backends import submitit_backend, torchx_component
from hpc.contract.jobspec import JobSpec

pytestmark = pytest.mark.unit

BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1",
            python="/opt/venv/bin/python", nodes=(2, 2), nproc_per_node=2)


def test_submitit_srun_gets_cpus_per_task_which_it_does_not_inherit() -> None:
    params = submitit_backend.executor_parameters(JobSpec(**BASE, cpus_per_task=8))
    assert params["cpus_per_task"] == 8
    assert "--cpus-per-task=8" in params["srun_args"]
    assert not any(a.startswith("--cpus-per-task") for a in
                   submitit_backend.executor_parameters(JobSpec(**BASE))["srun_args"])


def test_torchx_job_srun_gets_cpus_per_task_through_the_environment() -> None:
    plan = torchx_component.plan(JobSpec(**BASE, cpus_per_task=8))
    assert plan.env["SRUN_CPUS_PER_TASK"] == "8"
    assert plan.env["SBATCH_SIGNAL"] == "USR2@120"
    assert "SRUN_CPUS_PER_TASK" not in torchx_component.plan(JobSpec(**BASE)).env
