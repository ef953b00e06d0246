"""The batch script's steps are part of the backend contract (issue 25, point 5).

Some of a job happens in its batch shell, not in the per-node launcher: giving the nodes it
found bad back to Slurm before ``srun`` (``exclusions``), and a container's deadlines and
requeue from outside the container (``container``). Every registered backend either carries
each step in the script it submits, or refuses a JobSpec that needs it with an error naming
the backend and the option; nothing is silently skipped. A new backend that forgets fails here.
"""

from __future__ import annotations

import itertools
import sys
import types
from dataclasses import dataclass

import pytest

from hpc import backends
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

pytestmark = pytest.mark.unit

BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1",
            python="/opt/venv/bin/python", nproc_per_node=2)

# What each step looks like in a submitted script (a new step must add its mark here).
MARKS = {"exclusions": "-m runtime.exclusions --job-dir", "container": "scontrol requeue"}
# A JobSpec that needs the step, per step.
NEEDS = {"exclusions": dict(nodes=(2, 3)), "container": dict(container_image="/i/pytorch.sif")}


def violations(name: str) -> list[str]:
    """How backend ``name`` breaks the contract: a step a JobSpec needs that is neither in the
    script nor refused with an error naming the backend or the option asking for it."""
    out = []
    module = backends._module(name)
    if not isinstance(getattr(module, "ENFORCES", None), frozenset):
        return [f"{name}: no ENFORCES frozenset"]
    steps = {s.name: s for s in backends.BATCH_STEPS}
    for k in range(1, len(steps) + 1):
        for combo in itertools.combinations(sorted(steps), k):
            spec = JobSpec(**BASE, **{key: v for step in combo for key, v in NEEDS[step].items()})
            assert all(steps[s].needed(spec) for s in combo)
            try:
                text = backends.get(name).plan(spec).describe()
            except SpecError as e:
                asked = [steps[s].asked_by(spec).split()[0] for s in combo]
                if not (f"--backend {name}" in str(e) or any(a in str(e) for a in asked)):
                    out.append(f"{name} {combo}: refused without naming the backend or option: {e}")
                continue
            for step in combo:
                if MARKS[step] not in text:
                    out.append(f"{name} {combo}: accepted, but its script has no {step} step")
                if step not in module.ENFORCES:
                    out.append(f"{name} {combo}: accepted {step} without declaring it in ENFORCES")
    return out


@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_every_backend_carries_each_batch_step_or_refuses_the_job(name: str) -> None:
    assert set(MARKS) == {s.name for s in backends.BATCH_STEPS}, "a new step needs its mark here"
    assert violations(name) == []


@dataclass(frozen=True)
class _Plan:
    spec: JobSpec

    def describe(self) -> str:
        return "srun python -m runtime.launch\n"


def _fake_backend(monkeypatch: pytest.MonkeyPatch, enforces: frozenset[str]) -> str:
    """A new backend whose script runs the launcher and nothing else, declaring ``enforces``."""
    module = types.ModuleType("tests_fake_backend")
    module.ENFORCES = enforces  # type: ignore[attr-defined]
    module.plan = _Plan  # type: ignore[attr-defined]
    module.execute = lambda plan, client: "1"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(backends.REGISTRY, "fake", module.__name__)
    return "fake"


def test_a_backend_claiming_a_step_its_script_lacks_is_caught(monkeypatch) -> None:
    name = _fake_backend(monkeypatch, frozenset({"exclusions", "container"}))
    found = violations(name)
    assert any("no exclusions step" in v for v in found) and any("no container step" in v for v in found)


def test_a_backend_declaring_no_step_refuses_jobs_that_need_one(monkeypatch) -> None:
    name = _fake_backend(monkeypatch, frozenset())
    assert violations(name) == []
    with pytest.raises(SpecError) as e:
        backends.get(name).plan(JobSpec(**BASE, nodes=(2, 3)))
    message = str(e.value)
    assert e.value.flag == "--backend fake" and e.value.value == "--nodes 2:3"
    assert "back to Slurm" in message and "backends that can: sbatch, submitit" in message
    assert "hpc submit --backend sbatch --nodes 2:3" in message
    assert backends.get(name).plan(JobSpec(**BASE, nodes=(2, 2)))   # fixed size: nothing to give back


def test_submitit_refuses_a_container_naming_the_alternative() -> None:
    with pytest.raises(SpecError) as e:
        backends.get("submitit").plan(JobSpec(**BASE, container_image="/i/pytorch.sif"))
    assert e.value.flag == "--backend submitit" and "--container-image /i/pytorch.sif" in str(e.value)
    assert "backends that can: sbatch" in str(e.value)


def test_sbatch_refuses_an_elastic_job_in_a_container() -> None:
    """The template's exclusions step runs the job's Python in the batch shell, on the host:
    in a container it cannot, so an elastic container job would reuse its bad nodes."""
    with pytest.raises(SpecError) as e:
        backends.get("sbatch").plan(JobSpec(**BASE, nodes=(2, 3), container_image="/i/p.sif"))
    assert e.value.flag == "--nodes" and "--nodes 3" in str(e.value) and "--container-image" in str(e.value)
    assert backends.get("sbatch").plan(JobSpec(**BASE, nodes=(3, 3), container_image="/i/p.sif"))


def test_submitit_gives_excluded_nodes_back_before_srun_on_every_node_of_a_range() -> None:
    text = backends.get("submitit").plan(JobSpec(**BASE, nodes=(2, 3), setup=("module load x",))).describe()
    script = text.split("-> sbatch of:\n", 1)[1]
    exclusions = script.index("eval \"$(/opt/venv/bin/python -m runtime.exclusions --job-dir "
                              "/scratch/me/jobs/gpt-1 || true)\"")
    assert script.index("module load x") < exclusions < script.index("\nsrun ")
    # One task per node on srun only: on the allocation it would make Slurm grant MIN nodes.
    assert "#SBATCH --ntasks-per-node" not in script and "--ntasks-per-node=1" in script
    assert "#SBATCH --nodes=2-3" in script
    one_node = backends.get("submitit").plan(JobSpec(**BASE, nodes=(1, 1))).describe()
    assert "runtime.exclusions" not in one_node
