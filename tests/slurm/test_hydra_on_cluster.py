"""``python train.py -m hydra/launcher=hpc lr=1e-3,3e-4`` on the real cluster (issue 30).

The multirun must be ONE Slurm job array (a task per override set, each a full hpc job with
its own job directory), each task's return value must come back to Hydra (the launcher logs
each), and Hydra's own outputs (multirun.yaml, one subdirectory per job) must be where Hydra
puts them.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slurm
APP = REPO / "examples" / "hydra_sweep" / "train.py"


def test_a_hydra_multirun_is_one_job_array_and_each_result_comes_back(slurm_cluster, tmp_path):
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    sweep = tmp_path / "multi run"
    r = subprocess.run([sys.executable, str(APP), "-m", "hydra/launcher=hpc",
                        "hydra.launcher.partition=debug", "hydra.launcher.nproc_per_node=2",
                        "hydra.launcher.time=10", "hydra.launcher.poll_interval_s=2",
                        "hydra.launcher.timeout_s=300", f"hydra.sweep.dir={sweep}",
                        "lr=1e-3,3e-4"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=400)
    said = r.stdout + r.stderr
    assert r.returncode == 0, said[-4000:]

    array_id = (sweep / ".hpc" / "slurm_job_id").read_text().strip()
    assert f"submitted array {array_id} (2 tasks)" in said, said[-3000:]
    for i in range(2):
        assert (sweep / ".hpc" / f"task-{i}" / "slurm_job_id").read_text().strip() == f"{array_id}_{i}"
    rows = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array_id, "-o", "JobID,State"], env=env,
                          capture_output=True, text=True).stdout.split()
    print(f"sacct of the array: {rows}")

    returned = {}
    for line in said.splitlines():
        if m := re.search(r"hpc launcher: #(\d) (lr=\S+) returned (\{.*\})", line):
            returned[int(m[1])] = (m[2], ast.literal_eval(m[3]))
    assert sorted(returned) == [0, 1], said[-3000:]
    assert returned[0][0] == "lr=0.001" and returned[0][1]["lr"] == 1e-3
    assert returned[1][0] == "lr=0.0003" and returned[1][1]["lr"] == 3e-4
    assert returned[0][1]["world"] == returned[1][1]["world"] == 2      # torchrun ran each task
    assert returned[0][1]["loss"] != returned[1][1]["loss"]             # different models trained

    # Hydra's own outputs, where Hydra puts them.
    assert yaml.safe_load((sweep / "multirun.yaml").read_text())["hydra"]["overrides"]["task"] == \
        ["lr=1e-3,3e-4"]
    for i, lr in enumerate(("0.001", "0.0003")):
        assert yaml.safe_load((sweep / str(i) / ".hydra" / "overrides.yaml").read_text()) == [f"lr={lr}"]
    assert os.access(sweep / ".hpc" / "task-1" / "hydra_return.pkl", os.R_OK)
