"""Hydra's own launcher test suites against ``hydra/launcher=hpc_local``, as every Hydra
launcher plugin runs them: each job is a real ``hpc run`` (a launcher, torchrun, the pickled
task function, rank 0's ``JobReturn``). ``IntegrationTestSuite`` starts the user's app in a
process of its own and runs it twice into one sweep directory in places
(``test_to_absolute_path_multirun``): the second multirun must run its tasks again, not return
the first one's results (:func:`hydra_plugins.hpc_launcher.launcher.set_aside`).

The budget (docs/testing.md): ``LauncherTestSuite`` whole (9 tests, ~70 s) and the two
multirun cases of ``IntegrationTestSuite`` run in every suite run; its nine cases of Hydra's
own output naming (``test_custom_task_name``, ``test_custom_sweeper_run_workdir``: ~5 min, each
one more app start and ``hpc run``) run with ``HPC_TEST_HYDRA_ALL=1`` (all 20 pass).
"""

from __future__ import annotations

import os

import pytest
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite


pytestmark = [pytest.mark.distributed,
              pytest.mark.usefixtures("hydra_restore_singletons", "hydra_quiet_wandb")]


@pytest.mark.parametrize("launcher_name, overrides", [("hpc_local", [])])
class TestHpcLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", "hydra/launcher=hpc_local"])])
class TestHpcLocalLauncherIntegration(IntegrationTestSuite):
    if os.environ.get("HPC_TEST_HYDRA_ALL") != "1":   # not collected (see the module docstring)
        test_custom_task_name = None
        test_custom_sweeper_run_workdir = None
