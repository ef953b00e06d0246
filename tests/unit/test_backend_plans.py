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


# --------------------------------------------------------------------------- one meaning everywhere

def _script(backend: str, spec: JobSpec) -> str:
    """What each backend would submit, as text (the dry run)."""
    from hpc import backends

    return backends.get(backend).plan(spec).describe()


@pytest.mark.parametrize("backend", ["sbatch", "submitit", "torchx"])
def test_signal_lead_zero_means_no_warning_signal_in_every_backend(backend: str) -> None:
    text = _script(backend, JobSpec(**BASE, signal_lead_s=0))
    assert "--signal=" not in text and "SBATCH_SIGNAL" not in text
    with_lead = _script(backend, JobSpec(**BASE, signal="USR1", signal_lead_s=90))
    assert ("--signal=USR1@90" in with_lead) or ("SBATCH_SIGNAL=USR1@90" in with_lead)


@pytest.mark.parametrize("backend", ["sbatch", "submitit"])
def test_no_time_limit_means_the_partition_default_in_every_backend(backend: str) -> None:
    text = _script(backend, JobSpec(**BASE))
    assert "--time" not in text   # submitit's own default would be 5 minutes
    assert "--time" in _script(backend, JobSpec(**BASE, time_limit_s=3600))


@pytest.mark.parametrize("backend", ["sbatch", "submitit", "torchx"])
def test_every_backend_runs_the_same_launcher_module(backend: str) -> None:
    spec = JobSpec(**BASE)
    if backend == "torchx":
        role = torchx_component.elastic_role(spec)
        assert [role.entrypoint, *role.args][:5] == [spec.python, "-m", "runtime.launch",
                                                      "--job-dir", spec.job_dir]
    elif backend == "submitit":
        assert "submit(run_node" in _script(backend, spec)   # run_node execs the launcher
    else:
        assert '-m runtime.launch --job-dir "$JOB_DIR"' in _script(backend, spec)


def test_unknown_backend_names_the_valid_ones() -> None:
    from hpc import backends
    from hpc.contract.errors import SpecError

    with pytest.raises(SpecError) as e:
        backends.get("slurmx")
    assert "sbatch, submitit, torchx" in str(e.value)
