"""The Hydra launcher's pure parts: options as JobSpec values, task arguments, job ids."""

from __future__ import annotations

import pytest

from hpc.contract.errors import SpecError

pytestmark = pytest.mark.unit


def test_options_are_parsed_like_their_hpc_toml_keys_over_the_profile() -> None:
    from hydra_plugins.hpc_launcher.launcher import job_options

    got = job_options({"_target_": "x", "throttle": 2, "nodes": "2:4", "time": "1:30:00",
                       "nproc_per_node": 8, "partition": None, "job_dir": "rel/dir"},
                      base={"partition": "gpu", "nproc_per_node": 4, "profile": "site"})
    assert got["nodes"] == (2, 4) and got["time_limit_s"] == 5400
    assert got["nproc_per_node"] == 8                       # the launcher's value wins
    assert got["partition"] == "gpu"                        # unset (None): the profile's
    assert got["job_dir"].endswith("/rel/dir") and got["job_dir"].startswith("/")
    assert "throttle" not in got and "profile" not in got and "_target_" not in got


def test_a_bad_value_names_the_launcher_key_and_an_unknown_one_the_closest() -> None:
    from hydra_plugins.hpc_launcher.launcher import job_options

    with pytest.raises(SpecError, match=r"\[hydra\.launcher\] nproc_per_node = \"eight\" is invalid: a TOML integer"):
        job_options({"nproc_per_node": "eight"}, base={})
    with pytest.raises(SpecError, match=r"hydra\.launcher\.gpus_per_nod.*did you mean gpus_per_node"):
        job_options({"gpus_per_nod": 1}, base={})


def test_each_task_gets_its_job_number_then_its_overrides() -> None:
    from hydra_plugins.hpc_launcher.launcher import task_args

    assert task_args([["lr=1"], ["lr=2", "+a=b c"]], 3) == [
        ("--hydra-job-num=3", "lr=1"), ("--hydra-job-num=4", "lr=2", "+a=b c")]


def test_the_hydra_job_id_is_the_array_tasks_slurm_id() -> None:
    from hydra_plugins.hpc_launcher._task import job_id

    assert job_id({"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "78"}, 1) == "77_1"
    assert job_id({"SLURM_JOB_ID": "78"}, 0) == "78"
    assert job_id({}, 4) == "local-4"


def test_the_launcher_configs_offer_every_hpc_toml_key() -> None:
    from hydra_plugins.hpc_launcher.config import HpcLauncherConf, HpcLocalLauncherConf

    from hpc.contract.jobspec import CONFIG_KEYS

    for conf in (HpcLauncherConf, HpcLocalLauncherConf):
        fields = set(conf.__dataclass_fields__)
        assert set(CONFIG_KEYS) <= fields and {"throttle", "poll_interval_s", "timeout_s"} <= fields
    assert HpcLauncherConf().job_dir == "${hydra.sweep.dir}/.hpc"


def test_hpcs_advice_speaks_of_the_hydra_app_not_the_task_runner(tmp_path) -> None:
    from hydra_plugins.hpc_launcher.launcher import app_notes

    note = ("_task.py does not import runtime.session, so hpc-elastic saves no checkpoint for it: "
            "only the script's own saves (in $HPC_CHECKPOINT_DIR) survive a crash (docs/own-script.md)")
    plain, with_session = tmp_path / "train.py", tmp_path / "fit.py"
    plain.write_text("import hydra\n")
    with_session.write_text("from runtime.session import Session\n")
    other = "--cpus-per-task is not set"
    assert app_notes([note, other], plain) == [note.replace("_task.py", "train.py"), other]
    assert app_notes([note, other], with_session) == [other]
    assert app_notes([note], None) == []
