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
from pathlib import Path

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


# scontrol stand-in: the batch host's name, a 3-node partition, and updates recorded (or refused).
SCONTROL = """echo "$@" >> "$RECORD/scontrol"
[ "$1" = show ] && [ "$2" = hostnames ] && echo node1
[ "$1" = show ] && [ "$2" = partition ] && echo "PartitionName=low TotalNodes=3 GraceTime=10 State=UP"
[ "$1" = update ] && [ -n "$REFUSE_UPDATE" ] && { echo "scontrol: error: refused" >&2; exit 1; }
true
"""


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
@pytest.mark.parametrize("refused", [False, True], ids=["resized", "slurm-refuses"])
def test_an_elastic_container_job_gives_excluded_nodes_back_from_outside(tmp_path: Path, runtime: str,
                                                                          refused: bool) -> None:
    """The batch shell has Slurm's commands but not the image's Python; the container the
    reverse. One task in the container decides (runtime.exclusions --plan, the real code), the
    batch shell shrinks the allocation and srun starts on the kept nodes only."""
    from hpc.render import render_sbatch
    from runtime.exclusions import add
    from tests.unit.support import SRUN, _run_script

    job = tmp_path / "job dir"
    (job / "logs").mkdir(parents=True)
    spec = JobSpec(**{**BASE, "job_dir": str(job)}, nodes=(2, 3), container_image="img",
                   container_runtime=runtime)
    (job / "jobspec.json").write_text(spec.to_json())
    assert add(job, "node3", "stall", "no progress for 300 s", 0)
    python = tmp_path / "python"   # the image's Python: the real one for the exclusions step
    python.write_text(f'#!/bin/bash\nif [ "$2" = runtime.exclusions ]; then exec {sys.executable} "$@"; fi\n'
                      'echo "launcher on $SLURM_JOB_NODELIST ($SLURM_JOB_NUM_NODES nodes)" >> "$RECORD/launcher"\n')
    python.chmod(0o755)
    text = render_sbatch(spec).replace("PYTHON=/opt/venv/bin/python", f"PYTHON='{python}'")
    apptainer = 'while [ "$1" != img ]; do shift; done; shift\n"$@"\n'
    proc = _run_script(text, tmp_path, extra={
        "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "3", "SLURMD_NODENAME": "node1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **({"REFUSE_UPDATE": "1"} if refused else {})},
        stubs={"scontrol": SCONTROL, "apptainer": apptainer, "srun": SRUN.replace(
            '> "$RECORD/srun.argv"', '>> "$RECORD/srun.argv"')})
    assert proc.returncode == 0, proc.stderr
    record = tmp_path / "record"
    assert "update JobId=7 NodeList=node1,node2" in (record / "scontrol").read_text()
    assert "node3 (stall in allocation 0: no progress for 300 s)" in proc.stderr
    if refused:
        assert (record / "launcher").read_text() == "launcher on node[1-3] (3 nodes)\n"
        assert "could not give back excluded nodes; running on node[1-3]" in proc.stderr
    else:
        assert (record / "launcher").read_text() == "launcher on node1,node2 (2 nodes)\n"
        assert "hpc: gave back excluded node(s) node3; running on node1,node2" in proc.stderr
    srun = (record / "srun.argv").read_text()
    assert srun.count("--nodelist=node1") == 1 and ("--container-image=img" in srun) == (runtime == "pyxis")


def test_a_fixed_size_container_job_has_no_exclusions_step() -> None:
    """A fixed-size job never shrinks: no container start for a step that could not act."""
    text = backends.get("sbatch").plan(JobSpec(**BASE, nodes=(3, 3), container_image="/i/p.sif")).describe()
    assert "runtime.exclusions" not in text


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
