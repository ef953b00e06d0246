"""Checkpoint odd states and planted files, in one process (no process group: a world of one).

What a user cares about: a planted symlink never makes a save overwrite another file, a value
in the shards never runs code on resume, odd leftovers in the checkpoint directory either load
or fail with one clear line, and what the runtime creates is private.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointError, Checkpointer
from runtime.checkpoint.storage import SafeLoadPlanner, UnsafeCheckpointError

pytestmark = [pytest.mark.distributed,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


class Counter:
    """A small Stateful: the step it was saved at comes back on resume."""

    def __init__(self, value: Any = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _state(value: Any = 0) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 3), "counter": Counter(value)}


def _save(directory: Path, *steps: int, **kwargs: Any) -> None:
    ckpt = Checkpointer(directory, async_save=False, **kwargs)
    for step in steps:
        ckpt.save(step, _state(step), blocking=True)
    ckpt.close()


def _resume(directory: Path, **kwargs: Any) -> tuple[int | None, int]:
    state = _state(-1)
    ckpt = Checkpointer(directory, async_save=False, **kwargs)
    manifest = ckpt.load_latest(state)
    ckpt.close()
    return (manifest.step if manifest else None), state["counter"].value


# --- planted symlinks ----------------------------------------------------------------------

def test_symlinks_at_the_old_temp_names_leave_the_victim_unchanged(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ckpt = tmp_path / "ck"
    ckpt.mkdir(mode=0o700)
    (ckpt / ".latest.tmp").symlink_to(victim)
    (ckpt / "step-000002.tmp").symlink_to(tmp_path, target_is_directory=True)  # a whole directory
    original = Checkpointer._prepare

    def plant(self: Checkpointer, step: int, tmp: Path) -> str | None:
        err = original(self, step, tmp)
        (tmp / ".manifest.json.tmp").symlink_to(victim)
        return err

    monkeypatch.setattr(Checkpointer, "_prepare", plant)
    _save(ckpt, 1, 2)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "victim.txt"], "nothing written beside the victim"
    assert _resume(ckpt) == (2, 2)


@pytest.mark.parametrize("name", [".metadata.tmp", "__0_0.distcp", "rank-00000.local.pt"])
def test_a_symlink_planted_among_the_shards_fails_the_save_not_the_victim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ckpt = tmp_path / "ck"
    _save(ckpt, 1)
    original = Checkpointer._prepare

    def plant(self: Checkpointer, step: int, tmp: Path) -> str | None:
        err = original(self, step, tmp)
        (tmp / name).symlink_to(victim)
        return err

    monkeypatch.setattr(Checkpointer, "_prepare", plant)
    ckpt_obj = Checkpointer(ckpt, async_save=False)
    with pytest.raises(CheckpointError, match="the last good checkpoint step-000001 is intact|no earlier"):
        ckpt_obj.save(2, _state(2), blocking=True)
    ckpt_obj.close()
    assert victim.read_text() == "precious\n"
    monkeypatch.undo()
    assert _resume(ckpt) == (1, 1)


# --- values in the shards ------------------------------------------------------------------

def test_a_value_in_the_shards_that_would_run_code_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ck"
    _save(ckpt, 1)
    # DCP itself pickles a non-tensor value into the shard; before, resume unpickled it freely
    state = _state(Payload(marker))
    Checkpointer(ckpt, async_save=False).save(2, state, blocking=True)
    assert not marker.exists()
    with caplog.at_level(logging.INFO, logger="hpc.checkpoint"):
        assert _resume(ckpt) == (1, 1)
    assert not marker.exists(), "code from the checkpoint directory ran"
    assert "__0_0.distcp (value 'counter.value'): refused to unpickle (global exec)" in caplog.text
    assert "resuming from the earlier step-000001" in caplog.text


def test_the_planner_refuses_a_non_tensor_value_that_needs_a_global(tmp_path: Path) -> None:
    import io

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    buf.seek(0)

    class Item:
        class dest_index:  # noqa: N801
            fqn = "counter.value"

    with pytest.raises(UnsafeCheckpointError, match=r"value 'counter.value' in the shards: refused"):
        SafeLoadPlanner().load_bytes(Item(), buf)
    assert not marker.exists()


def test_safe_globals_admit_the_users_own_types(tmp_path: Path) -> None:
    from fractions import Fraction

    ckpt = tmp_path / "ck"
    state = _state(Fraction(1, 3))
    Checkpointer(ckpt, async_save=False).save(3, state, blocking=True)
    fresh = _state(-1)
    manifest = Checkpointer(ckpt, async_save=False, safe_globals=[Fraction]).load_latest(fresh)
    assert manifest is not None and manifest.step == 3 and fresh["counter"].value == Fraction(1, 3)


# --- odd states ----------------------------------------------------------------------------

def test_non_utf8_latest_pointer_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "ck"
    _save(ckpt, 1, 2)
    (ckpt / "latest").write_bytes(b"\xff\xfestep-\x80\n")
    with caplog.at_level(logging.WARNING, logger="hpc.checkpoint"):
        assert _resume(ckpt) == (2, 2)
    assert f"ignoring the latest pointer: {ckpt / 'latest'} is not UTF-8 text" in caplog.text
    assert (ckpt / "latest").read_text() == "step-000002\n"
    _save(ckpt, 3)  # a save after it (retention reads the pointer) works too


def test_a_checkpoint_path_that_is_a_file_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints"
    path.write_text("x")
    with pytest.raises(CheckpointError) as info:
        Checkpointer(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="is not a directory"):
        Checkpointer(path / "sub")


def test_quarantined_directories_are_pruned_to_the_newest_two(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    _save(ckpt, 5)
    for name in ("step-000001.corrupt-100", "step-000002.corrupt-300", "step-000003.corrupt-200",
                 "step-000004.corrupt-300-1"):
        (ckpt / name).mkdir()
        (ckpt / name / "__0_0.distcp").write_bytes(b"x" * 10)
    assert _resume(ckpt) == (5, 5)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest", "step-000002.corrupt-300", "step-000004.corrupt-300-1", "step-000005"]
    # a bad checkpoint found now is the newest quarantine; the retention after a save keeps two
    (ckpt / "step-000005" / "__0_0.distcp").write_bytes(b"y")
    assert _resume(ckpt) == (None, -1)
    names = sorted(p.name for p in ckpt.iterdir())
    assert len(names) == 2 and "step-000004.corrupt-300-1" in names and names[1].startswith("step-000005.corrupt-")


def test_directories_the_runtime_creates_are_private(tmp_path: Path) -> None:
    outside = tmp_path / "scratch"
    outside.mkdir(mode=0o755)
    outside.chmod(0o755)
    ckpt = outside / "project" / "run1" / "checkpoints"
    _save(ckpt, 1)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755, "an existing directory keeps its mode"
    for d in (outside / "project", outside / "project" / "run1", ckpt, ckpt / "step-000001"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (ckpt / "step-000001").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f


def test_a_checkpoint_directory_others_can_write_is_warned_about(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    ckpt.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="hpc.checkpoint"):
        Checkpointer(ckpt)
    assert f"{ckpt} is writable by its group and other users" in caplog.text
