"""The Hydra launcher plugin (``hydra/launcher=hpc``), with Hydra's own launcher test helpers.

Each Hydra job runs as an hpc job for real: ``hydra/launcher=hpc_local`` runs the tasks the
Slurm array would run (``_task.py`` under the per-node launcher and torchrun, the pickled task
function, rank 0's ``JobReturn``) with ``hpc run``, so Hydra's checks of what comes back (config,
overrides, job name/id/num, the output directories) apply to the same code path as on the
cluster (tests/slurm/test_hydra_on_cluster.py submits the array). Hydra's own suites
run in tests/distributed/test_hydra_suites.py; here, the project's own cases: a job that fails
inside its hpc job, Hydra's own refusal to sweep its config, a bad launcher option.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra.errors import HydraException
from hydra.test_utils.launcher_common_tests import sweep_1_job


pytestmark = [pytest.mark.distributed,
              pytest.mark.usefixtures("hydra_restore_singletons", "hydra_quiet_wandb")]


def returns_100(_: object) -> int:
    return 100


LAUNCHER = ["hydra/launcher=hpc_local"]


def fails_in_the_job(_: object) -> int:
    raise ValueError("the task function failed inside its hpc job")


@pytest.mark.timeout(180)
def test_a_job_whose_task_function_raises_is_raised_by_hydra_with_its_error(hydra_sweep_runner,
                                                                             tmpdir) -> None:
    # The error happens in the worker; its JobReturn (status FAILED, the exception) comes back
    # through the job directory and Hydra raises it in the submitting process.
    with pytest.raises(ValueError, match="the task function failed inside its hpc job"):
        sweep_1_job(hydra_sweep_runner, overrides=[*LAUNCHER, "hydra.launcher.max_restarts=0"],
                    task_function=fails_in_the_job, temp_dir=tmpdir)


def test_sweeping_hydras_own_config_is_refused_before_anything_runs(hydra_sweep_runner, tmpdir) -> None:
    with pytest.raises(HydraException, match=re.escape("Sweeping over Hydra's configuration is not "
                                                       "supported : 'hydra.verbose=true,false'")):
        with hydra_sweep_runner(calling_file=None, calling_module="hydra.test_utils.a_module",
                                task_function=None, config_path="configs", config_name="compose.yaml",
                                overrides=[*LAUNCHER, "+a=0,1", "hydra.verbose=true,false"],
                                temp_dir=tmpdir):
            pass
    assert not (Path(tmpdir) / ".hpc").exists()


def test_a_bad_launcher_option_names_the_key_and_what_it_takes(hydra_sweep_runner, tmpdir) -> None:
    with pytest.raises(Exception, match=r"hydra\.launcher\] nproc_per_node = .*is invalid"):
        sweep_1_job(hydra_sweep_runner, overrides=[*LAUNCHER, "hydra.launcher.nproc_per_node=many"],
                    task_function=returns_100, temp_dir=tmpdir)
    with pytest.raises(Exception, match=r"Could not override 'hydra.launcher.nprocs'"):  # Hydra's check
        sweep_1_job(hydra_sweep_runner, overrides=[*LAUNCHER, "hydra.launcher.nprocs=2"],
                    task_function=returns_100, temp_dir=tmpdir)
    with pytest.raises(Exception, match=r"hydra\.launcher\.nproc_per_nod .*did you mean nproc_per_node"):
        sweep_1_job(hydra_sweep_runner, overrides=[*LAUNCHER, "+hydra.launcher.nproc_per_nod=2"],
                    task_function=returns_100, temp_dir=tmpdir)
