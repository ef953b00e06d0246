"""The in-process variables a job may set are checked when the job is made (``--env``,
hpc.toml), naming the value and what it takes, and parsed the same way in the workers; the
ones the launcher sets for each worker are refused (pure)."""

from __future__ import annotations

import pytest

from hpc.contract import recovery_settings
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, value, says", [
    ("HPC_INPROC_WINDOW_S", "0", "from 0.1 to 600 seconds"),
    ("HPC_INPROC_WINDOW_S", "nan", "from 0.1 to 600 seconds"),
    ("HPC_INPROC_WINDOW_S", "inf", "from 0.1 to 600 seconds"),
    ("HPC_INPROC_TIMEOUT_S", "-1", "from 1 to 86400 seconds"),
    ("HPC_INPROC_COPY_MAX_MB", "nan", "MB"),
    ("HPC_INPROC_COPY_EVERY", "1.5", "a whole number"),
    ("HPC_INPROC_MAX_REFORMS", "0", "integer >= 1"),
    ("HPC_INPROC_WARM", "maybe", "one of 1, 0"),
    ("HPC_WARM_START", "maybe", "one of 1, 0"),
    ("HPC_INPROC_JOIN", "1", "set by the launcher"),
    ("HPC_INPROC_STORE", "10.0.0.1:29500", "set by the launcher"),
    ("HPC_RECOVERY", "inprocess", "use --recovery"),
])
def test_a_bad_or_launcher_owned_value_is_refused_naming_the_flag_and_the_value(
        name: str, value: str, says: str) -> None:
    with pytest.raises(SpecError) as e:
        JobSpec(script="train.py", env=((name, value),))
    text = str(e.value)
    assert name in text and repr(value) in text and says in text, text


def test_on_the_command_line_the_error_names_the_flag(tmp_path, capsys) -> None:
    from hpc.cli import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["render", str(script), "--env", "HPC_INPROC_WINDOW_S=nan"]) == 2
    err = capsys.readouterr().err
    assert "--env" in err and "HPC_INPROC_WINDOW_S=nan" in err and "from 0.1 to 600 seconds" in err, err


@pytest.mark.parametrize("name, value", [("HPC_INPROC_WINDOW_S", "5"), ("HPC_INPROC_TIMEOUT_S", "120"),
                                         ("HPC_INPROC_COPY_EVERY", "4"), ("HPC_INPROC_WARM", "0"),
                                         ("HPC_INPROC_MAX_REFORMS", "5"), ("NCCL_DEBUG", "INFO")])
def test_good_values_pass(name: str, value: str) -> None:
    assert dict(JobSpec(script="train.py", env=((name, value),)).env)[name] == value


def test_the_workers_parse_the_same_way() -> None:
    assert recovery_settings.parse_window_s("") == recovery_settings.DEFAULT_WINDOW_S and recovery_settings.parse_window_s("2.5") == 2.5
    assert recovery_settings.parse_timeout_s("") is None and recovery_settings.parse_timeout_s("30") == 30.0
    for bad in ("nan", "0", "x"):
        with pytest.raises(ValueError, match="HPC_INPROC_WINDOW_S"):
            recovery_settings.parse_window_s(bad)


def test_one_record_reads_them_all_and_the_launcher_writes_its_own_through_it() -> None:
    E = recovery_settings.InProcessEnvironment
    launcher = E(recovery="inprocess", store="node1:29400", join=True, max_world=6, channel="/dev/shm/c")
    env = {**launcher.to_env(), "HPC_INPROC_WINDOW_S": "5", "HPC_INPROC_COPY_EVERY": "4"}
    assert set(launcher.to_env()) == {"HPC_RECOVERY", "HPC_INPROC_STORE", "HPC_INPROC_JOIN",
                                      "HPC_INPROC_MAX_WORLD", "HPC_INPROC_CHANNEL"}   # no tunable
    got = E.from_env(env)
    assert (got.inprocess, got.store, got.join, got.max_world, got.channel) == (True, "node1:29400", True, 6, "/dev/shm/c")
    assert (got.window_s, got.copy_every, got.timeout_s, got.warm) == (5.0, 4, None, True)
    assert E().to_env() == {} and E(join=True).to_env() == {"HPC_INPROC_JOIN": "1"}


def test_the_restart_path_reads_only_the_mode_and_a_bad_value_names_its_variable() -> None:
    E = recovery_settings.InProcessEnvironment
    restart = E.from_env({"HPC_RECOVERY": "restart", "HPC_INPROC_WINDOW_S": "nan"})
    assert not restart.inprocess and restart.window_s == recovery_settings.DEFAULT_WINDOW_S
    with pytest.raises(ValueError, match="HPC_INPROC_WINDOW_S='nan'"):
        E.from_env({"HPC_RECOVERY": "inprocess", "HPC_INPROC_WINDOW_S": "nan"})
    with pytest.raises(ValueError, match="HPC_INPROC_MAX_WORLD='x'"):
        E.from_env({"HPC_RECOVERY": "inprocess", "HPC_INPROC_MAX_WORLD": "x"})
    with pytest.raises(SpecError, match="HPC_RECOVERY"):
        E.from_env({"HPC_RECOVERY": "sometimes"})
    assert not E.parsed({"HPC_INPROC_WARM": "0"}).warm   # the launcher's switch, before it sets the mode
