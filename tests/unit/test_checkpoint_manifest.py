"""Manifest round trip, verification, retention, the save schedule (fake clock), retries."""

from __future__ import annotations

import errno
import zlib
from pathlib import Path

import pytest

from runtime.checkpoint import manifest as cm
from runtime.checkpoint.manifest import FileEntry, Manifest, SaveSchedule, steps_to_prune, verify

pytestmark = pytest.mark.unit


def _make_step(root: Path, step: int, files: dict[str, bytes]) -> Path:
    d = root / cm.step_dirname(step)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    entries = tuple(FileEntry(n, len(b), zlib.crc32(b)) for n, b in files.items())
    cm.write_atomic(d / cm.MANIFEST_NAME, Manifest(step, 2, entries, {"cursor": 5}).to_json())
    return d


def test_names() -> None:
    assert cm.step_dirname(123) == "step-000123"
    assert cm.parse_step("step-000123") == 123
    assert cm.parse_step("step-000123.tmp") is None and cm.is_tmp_dir("step-000123.tmp")
    assert cm.parse_step("step-000123.corrupt-17") is None
    with pytest.raises(ValueError):
        cm.step_dirname(-1)


def test_manifest_round_trip() -> None:
    m = Manifest(7, 3, (FileEntry("a", 1, 2),), {"wandb_run_id": "x"}, "2.13", 1.5, 0.25)
    assert Manifest.from_json(m.to_json()) == m
    assert m.total_bytes == 1 and m.wandb_run_id == "x"
    with pytest.raises(ValueError, match="not a checkpoint manifest"):
        Manifest.from_json('{"step": 1}')


def test_verify_detects_truncation_bitflip_and_missing(tmp_path: Path) -> None:
    d = _make_step(tmp_path, 3, {"a.distcp": b"x" * 100, "b.distcp": b"y" * 50})
    manifest, reason = verify(d)
    assert reason is None and manifest is not None and manifest.metadata == {"cursor": 5}
    data = bytearray((d / "a.distcp").read_bytes())
    data[10] ^= 1
    (d / "a.distcp").write_bytes(bytes(data))
    assert "CRC-32 mismatch" in str(verify(d)[1])
    assert verify(d, checksums=False)[1] is None  # same size: only the checksum sees it
    (d / "b.distcp").write_bytes(b"y" * 10)
    assert "size 10 != 50" in str(verify(d, checksums=False)[1])
    (d / "b.distcp").unlink()
    assert "b.distcp" in str(verify(d, checksums=False)[1])
    (d / cm.MANIFEST_NAME).unlink()
    assert verify(d) == (None, verify(d)[1]) and "manifest unreadable" in str(verify(d)[1])


def test_crc_stream_matches_file(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as raw:
        s = cm.Crc32Stream(raw)
        s.write(b"hello ")
        s.write(memoryview(b"world"))
        assert s.tell() == 11
    assert cm.file_crc32(tmp_path / "f") == FileEntry("f", s.size, s.crc32)


@pytest.mark.parametrize(("steps", "keep_last", "keep_every", "protect", "expected"), [
    ([1, 2, 3, 4, 5], 3, None, (), [1, 2]),
    ([10, 20, 30, 40, 50], 2, 20, (), [10, 30]),
    ([1, 2, 3], 1, None, (1,), [2]),
    ([], 3, None, (), []),
    ([5], 1, None, (), []),
])
def test_retention(steps: list[int], keep_last: int, keep_every: int | None,
                   protect: tuple[int, ...], expected: list[int]) -> None:
    assert steps_to_prune(steps, keep_last=keep_last, keep_every=keep_every, protect=protect) == expected


def test_retention_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_prune([1], keep_last=0, keep_every=None)
    with pytest.raises(ValueError, match="keep_every"):
        steps_to_prune([1], keep_last=1, keep_every=0)


def test_schedule_with_fake_clock() -> None:
    by_steps = SaveSchedule(every_steps=10)
    assert [s for s in range(1, 35) if by_steps.due(s, 0.0, last_step=None, last_time=0.0)] == [10, 20, 30]
    by_time = SaveSchedule(every_min=2)
    clock, last, saved = 1000.0, 1000.0, []
    for step in range(1, 20):
        clock += 30.0  # 30 s per step: due every 4 steps
        if by_time.due(step, clock, last_step=None, last_time=last):
            saved.append(step)
            last = clock
    assert saved == [4, 8, 12, 16]
    assert not SaveSchedule(every_steps=1).due(5, 0, last_step=5, last_time=0)
    # An in-process recovery that went back to its FSDP2 peer copies recomputes steps it saved:
    # the saved step is not saved again (a step is saved once, never overwritten).
    assert not SaveSchedule(every_steps=2).due(4, 0, last_step=6, last_time=0)
    with pytest.raises(ValueError):
        SaveSchedule(every_min=0)


def test_transient_errors_are_retried_enospc_is_not() -> None:
    calls: list[int] = []

    @cm.retry_transient
    def flaky(code: int) -> str:
        calls.append(code)
        if len(calls) < 3:
            raise OSError(code, "boom")
        return "ok"

    assert flaky(errno.ESTALE) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(OSError) as info:
        flaky(errno.ENOSPC)
    assert info.value.errno == errno.ENOSPC and len(calls) == 1


@pytest.mark.parametrize(("content", "expected"), [
    (b"step-000007\n", ("step-000007", None)),
    (b"\xff\xfe\x80", (None, "is not UTF-8 text")),
    (b"../../etc\n", (None, "does not name a step directory")),
])
def test_latest_pointer_is_advisory(tmp_path: Path, content: bytes, expected: tuple[str | None, str | None]) -> None:
    (tmp_path / cm.LATEST_NAME).write_bytes(content)
    name, problem = cm.read_latest(tmp_path)
    assert name == expected[0]
    assert (problem is None) if expected[1] is None else (expected[1] in str(problem))
    assert cm.read_latest(tmp_path / "missing") == (None, None)


def test_quarantine_retention_keeps_the_newest_two() -> None:
    names = ["latest", "step-000009", "step-000001.corrupt-100", "step-000003.corrupt-300",
             "step-000002.corrupt-300", "step-000002.corrupt-300-1", "step-000004.corrupt-50.deleting"]
    assert cm.KEEP_QUARANTINED == 2
    assert cm.quarantined_to_prune(names) == ["step-000001.corrupt-100", "step-000002.corrupt-300"]
    assert cm.quarantined_to_prune(names, keep=0) == [
        "step-000001.corrupt-100", "step-000002.corrupt-300", "step-000002.corrupt-300-1", "step-000003.corrupt-300"]


def test_quarantine_names_never_collide(tmp_path: Path) -> None:
    first = cm.quarantine_name(tmp_path / "step-000002", 1000.0)
    first.mkdir()
    assert first.name == "step-000002.corrupt-1000"
    assert cm.quarantine_name(tmp_path / "step-000002", 1000.0).name == "step-000002.corrupt-1000-1"


def test_verify_rejects_file_names_outside_the_step_directory(tmp_path: Path) -> None:
    d = _make_step(tmp_path, 4, {"a.distcp": b"x"})
    (tmp_path / "outside").write_bytes(b"y")
    m = Manifest(4, 1, (FileEntry("../outside", 1, zlib.crc32(b"y")),))
    cm.write_atomic(d / cm.MANIFEST_NAME, m.to_json())
    assert "not a plain file name" in str(verify(d)[1])
