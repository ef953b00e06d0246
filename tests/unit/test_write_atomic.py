"""The one atomic writer (hpc.contract.jobdir.write_atomic) never writes through a planted symlink.

Every earlier copy used a predictable temporary name (``.latest.tmp``, ``.manifest.json.tmp``,
``.progress.json.<pid>.tmp``) opened without ``O_EXCL``: a symlink planted there made the next
write overwrite any file the job can write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpc.contract import jobdir
from runtime.worker import metrics
from runtime.checkpoint import manifest

pytestmark = pytest.mark.unit


def _old_temp_names(name: str) -> list[str]:
    return [f".{name}.tmp", f".{name}.{os.getpid()}.tmp"]


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize("name", ["latest", "manifest.json", "progress.json", "wandb_state.json"])
def test_planted_symlinks_at_old_temp_names_do_not_redirect_the_write(tmp_path: Path, name: str,
                                                                      durable: bool) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    work = tmp_path / "dir"
    work.mkdir()
    for tmp_name in _old_temp_names(name):
        (work / tmp_name).symlink_to(victim)
    jobdir.write_atomic(work / name, "new\n", durable=durable)
    assert victim.read_text() == "precious\n"
    assert (work / name).read_text() == "new\n" and not (work / name).is_symlink()
    assert sorted(p.name for p in work.iterdir()) == sorted([name, *_old_temp_names(name)])


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "latest").symlink_to(victim)
    jobdir.write_atomic(tmp_path / "latest", "step-000002\n")
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "latest").read_text() == "step-000002\n" and not (tmp_path / "latest").is_symlink()


def test_one_writer_for_checkpoints_metrics_and_the_job_directory() -> None:
    assert manifest.write_atomic is jobdir.write_atomic
    assert metrics.write_atomic is jobdir.write_atomic


def test_mode_is_kept_and_a_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    jobdir.write_atomic(tmp_path / "job.sbatch", "#!/bin/bash\n", mode=0o700)
    assert stat.S_IMODE((tmp_path / "job.sbatch").stat().st_mode) == 0o700
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):
        jobdir.write_atomic(tmp_path / "adir", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "job.sbatch"]


def test_step_filter_marks_survive_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    state = tmp_path / "wandb_state.json"
    for tmp_name in _old_temp_names(state.name):
        (tmp_path / tmp_name).symlink_to(victim)
    metrics.StepFilter(state, "run1").mark(5)
    assert victim.read_text() == "precious\n"
    assert metrics.StepFilter(state, "run1").last_step == 5
