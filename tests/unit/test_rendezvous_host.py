"""One rule for the rendezvous host (:func:`runtime.env.rendezvous_host`), used by every process.

The c10d store lives on one node; every launcher of an allocation must name the same one, or
the job splits into groups that never meet. The batch shell names it once (its
``HPC_RDZV_HOST`` line, which its own ``srun --nodelist`` and echo reuse), the launcher and
``hpc doctor --multi-node`` take it through :func:`~runtime.env.rendezvous_host`, and a job
started without our batch script (submitit, TorchX) falls back to the same first node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpc.contract import environment
from runtime.env import SlurmEnv, rendezvous_host

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_LINE = 'HPC_RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"'


def test_the_rule_in_order() -> None:
    slurm = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[3-4]"}
    assert rendezvous_host({}) == "127.0.0.1"
    assert rendezvous_host({}, default="") == ""
    assert rendezvous_host(slurm) == "node3"                          # submitit: Slurm's first node
    assert rendezvous_host({**slurm, "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu7",
                            "SLURM_JOB_NODELIST": "gpu7,gpu9"}) == "gpu7"  # TorchX: first component
    assert rendezvous_host({**slurm, environment.RDZV_HOST: "node4"}) == "node4"   # the batch shell's
    assert rendezvous_host({**slurm, environment.RDZV_HOST: "node4"}, "10.0.0.1") == "10.0.0.1"


def test_the_batch_shell_names_it_once_by_the_same_rule() -> None:
    """The template's one assignment is the rule :attr:`SlurmEnv.first_node` mirrors (change
    both together)."""
    template = (ROOT / "slurm_templates" / "sbatch_elastic.sh.j2").read_text()
    assigned = [line.strip() for line in template.splitlines() if line.strip().startswith("HPC_RDZV_HOST=")]
    assert assigned == [TEMPLATE_LINE]
    assert "scontrol show hostnames $SLURM_JOB_NODELIST | head -n1" in SlurmEnv.first_node.__doc__


def test_no_other_code_picks_the_host() -> None:
    """Outside runtime/env.py nothing reads the first node or ``HPC_RDZV_HOST`` itself."""
    found = []
    for package in ("hpc", "runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in (ROOT / "runtime" / "env.py", ROOT / "hpc" / "contract" / "environment.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("first_node", "RDZV_HOST", "rdzv_host") \
                        and not ast.unparse(node.value).startswith(("args", "plan", "self")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
                elif isinstance(node, ast.Constant) and node.value in ("HPC_RDZV_HOST", "SLURM_JOB_NODELIST_HET_GROUP_0"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert found == [], "take the host from runtime.env.rendezvous_host"
