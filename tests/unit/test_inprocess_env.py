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
