"""The Python API on the real cluster: submit the example from a Python process, wait, collect.

A user's notebook does exactly this; the process imports ``hpc`` with torch made unimportable
(a login node may not have it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.support import BLOCK_HEAVY

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]

NOTEBOOK = textwrap.dedent("""
    import json, sys
    import hpc

    spec = hpc.JobSpec(script=sys.argv[1], script_args=("--preset", "tiny", "--max-steps", "12"),
                       job_name="api-gpt", job_dir=sys.argv[2], nodes=(2, 2), nproc_per_node=1,
                       time_limit_s=600, python=sys.argv[3])
    job = hpc.submit(spec)
    view = job.wait(timeout=300, max_interval_s=2)
    again = hpc.Job.attach(job.job_id)      # the index finds it by id, as a later process would
    print(json.dumps({
        "job_id": job.job_id, "state": view.state, "attached_dir": str(again.job_dir),
        "outcomes": [o.kind for o in again.outcomes()], "result": again.result(),
        "has_logs": "train_gpt" in again.logs(),
        "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "wandb", "torchx")),
    }))
""")


def test_submit_wait_collect_from_python(slurm_cluster, tmp_path: Path) -> None:
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    job_dir = tmp_path / "api job"
    r = subprocess.run([sys.executable, "-c", BLOCK_HEAVY + NOTEBOOK, str(REPO / "examples" / "train_gpt.py"),
                        str(job_dir), sys.executable], env=env, capture_output=True, text=True,
                       timeout=420, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["state"] == "COMPLETED"
    assert got["attached_dir"] == str(job_dir)
    assert got["outcomes"] == ["finished"]
    assert got["result"]["final_step"] == 12 and got["result"]["world_size"] == 2
    assert got["has_logs"]
    assert got["heavy"] == []


def test_a_refused_submission_is_an_exception_in_python_terms(slurm_cluster, tmp_path: Path) -> None:
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home")}
    code = BLOCK_HEAVY + textwrap.dedent("""
        import sys, hpc
        spec = hpc.JobSpec(script=sys.argv[1], job_dir=sys.argv[2], nodes=(50, 50))
        try:
            hpc.submit(spec)
        except hpc.SpecError as e:
            print("refused:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "examples" / "train_gpt.py"),
                        str(tmp_path / "j")], env=env, capture_output=True, text=True, timeout=60)
    assert "refused: nodes (50, 50) is invalid: at most" in r.stdout, r.stdout + r.stderr
    assert "Example: nodes=" in r.stdout and "--nodes" not in r.stdout   # the field, not the flag
    assert not (tmp_path / "j").exists()      # nothing was created
