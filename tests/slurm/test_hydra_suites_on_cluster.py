"""Hydra's own launcher test suites against ``hydra/launcher=hpc`` on the test cluster, as every
Hydra launcher plugin runs them: each launch is a real Slurm job array (one task per override
set, each a whole hpc job: sbatch, the per-node launcher, torchrun, the pickled task function,
rank 0's ``JobReturn`` read back by the login side).

Opt-in (``HPC_TEST_HYDRA_CLUSTER=1``): every one of its 20 cases is at least one job array on
the cluster (20 passed in 268 s at load ~6, the slurm lane already the suite's longest, over
the 30-minute budget: docs/testing.md). The same
suites run against ``hpc_local`` in every suite run (tests/distributed/test_hydra_suites.py),
and ``test_hydra_on_cluster.py`` holds the array, the returns and Hydra's outputs on the
cluster in every run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("hydra_restore_singletons", "cluster_env")]

LAUNCHER = ["hydra.launcher.partition=debug", "hydra.launcher.time=10",
            "hydra.launcher.poll_interval_s=2", "hydra.launcher.timeout_s=300"]


@pytest.fixture
def cluster_env(slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher runs in this process: the cluster's Slurm, W&B offline, an index of its own."""
    from tests.wandb_offline import offline_env

    for key, value in {**slurm_cluster.env, **offline_env(tmp_path / "wandb-env")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "hpc-home"))


if os.environ.get("HPC_TEST_HYDRA_CLUSTER") == "1":   # not collected otherwise (the docstring)
    from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

    @pytest.mark.parametrize("launcher_name, overrides", [("hpc", LAUNCHER)])
    class TestHpcLauncherOnCluster(LauncherTestSuite):
        pass

    @pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", "hydra/launcher=hpc", *LAUNCHER])])
    class TestHpcLauncherOnClusterIntegration(IntegrationTestSuite):
        pass
