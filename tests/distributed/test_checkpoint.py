"""Checkpoints across real processes (gloo on CPU): resharding, crashes, corruption, full disk.

Each scenario runs ``_ckpt_worker.py`` as 1-3 separate processes on 127.0.0.1 with a free port,
so SIGKILL and a full disk behave exactly as they would in a job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_ckpt_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, scenario: str, ckpt: Path, out: Path, arg: str = "", *,
              timeout_s: float = 300.0, expect_kill: bool = False) -> list[dict[str, Any]]:
    """Runs one scenario on ``world`` processes; returns each rank's result (empty if killed).

    A port taken between :func:`_free_port` and rank 0's bind (other tests run beside this one)
    is retried on a new port, twice at most; a timeout fails with every rank's output.
    """
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        procs, logs, timed_out = _run_once(world, scenario, ckpt, out, arg, timeout_s, expect_kill)
        if not any("Address already in use" in log or "EADDRINUSE" in log for log in logs) or attempt == 2:
            break
    joined = "\n----\n".join(logs)
    assert not timed_out, f"{scenario} timed out after {timeout_s}s; the ranks' output:\n{joined}"
    if expect_kill:
        assert any(p.returncode == -signal.SIGKILL for p in procs), joined
        return []
    assert all(p.returncode == 0 for p in procs), joined
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]


def _run_once(world: int, scenario: str, ckpt: Path, out: Path, arg: str, timeout_s: float,
              expect_kill: bool) -> tuple[list[subprocess.Popen], list[str], bool]:
    """One try: the processes (ended), their output, and whether the deadline passed."""
    env_base = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(world), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env_base.pop("HPC_CKPT_TEST_KILL_AT", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(ckpt), str(out), arg],
                              env={**env_base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            killed = [p for p in procs if p.returncode == -signal.SIGKILL]
            if expect_kill and killed:
                time.sleep(0.5)  # the survivors are stuck at a collective with a dead peer
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = [p.stdout.read().decode(errors="replace") if p.stdout else "" for p in procs]
    for p in procs:
        if p.stdout:
            p.stdout.close()
    return procs, logs, timed_out


def _dirs(ckpt: Path) -> list[str]:
    return sorted(d.name for d in ckpt.iterdir())


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_save_at_2_loads_bit_exact_at_1_and_3(tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ck dir; echo hostile"
    run_ranks(2, "save", ckpt, tmp_path / "out", kind)
    for world in (1, 3):
        out = tmp_path / f"out{world}"
        out.mkdir()
        shutil.copy(tmp_path / "out" / "ref.pt", out / "ref.pt")
        results = run_ranks(world, "load", ckpt, out, kind)
        assert [r["step"] for r in results] == [2] * world
        assert [r["cursor"] for r in results] == [4] * world
        assert all(r["mismatch"] == [] for r in results), results


@pytest.mark.parametrize(("point", "mode"), [
    ("before_shards@1", "sync"),
    ("after_shards@1", "sync"),
    ("after_shards@0", "async"),
    ("before_manifest@0", "sync"),
    ("before_rename@0", "sync"),
    ("before_manifest@0", "async"),
])
def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path: Path, point: str, mode: str) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    run_ranks(2, "crash", ckpt, out, f"ddp:{point}:{mode}", expect_kill=True)
    assert "step-000002" not in _dirs(ckpt)
    assert (ckpt / "latest").read_text().strip() == "step-000001"
    results = run_ranks(2, "load", ckpt, out, "ddp")
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["mismatch"] == [] for r in results)
    assert _dirs(ckpt) == ["latest", "step-000001"], "the torn .tmp must be removed"


def test_killed_after_rename_is_a_complete_checkpoint(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    run_ranks(2, "crash", ckpt, out, "ddp:before_latest@0:sync", expect_kill=True)
    assert (ckpt / "latest").read_text().strip() == "step-000001"
    assert [r["step"] for r in run_ranks(1, "load", ckpt, out, "ddp")] == [2]
    assert (ckpt / "latest").read_text().strip() == "step-000002"


@pytest.fixture(scope="module")
def _steps_1_and_2_once(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two ranks commit steps 1 and 2 (ref.pt in ``out`` is step 1): run once per module (each
    run is two processes importing torch), damaged by each test in a copy of its own."""
    base = tmp_path_factory.mktemp("steps-1-and-2")
    ckpt, out = base / "ck", base / "out"
    run_ranks(2, "crash", ckpt, out, "ddp:none:sync")
    return ckpt, out


@pytest.fixture
def steps_1_and_2(_steps_1_and_2_once: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """This test's copy of the committed steps 1 and 2: (checkpoint dir, worker output dir)."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    shutil.copytree(_steps_1_and_2_once[0], ckpt, symlinks=True)
    shutil.copytree(_steps_1_and_2_once[1], out, symlinks=True)
    return ckpt, out


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_corrupt_newest_is_quarantined(steps_1_and_2: tuple[Path, Path], damage: str) -> None:
    ckpt, out = steps_1_and_2                            # steps 1 and 2 committed
    assert "step-000002" in _dirs(ckpt)
    shard = ckpt / "step-000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "bitflip":
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    else:
        (ckpt / "step-000002" / "rank-00001.local.pt").unlink()
    results = run_ranks(2, "load", ckpt, out, "ddp")
    assert [r["step"] for r in results] == [1, 1] and results[0]["mismatch"] == []
    names = _dirs(ckpt)
    assert "step-000002" not in names and any(n.startswith("step-000002.corrupt-") for n in names)
    assert (ckpt / "latest").read_text().strip() == "step-000001"


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    mnt = tmp_path / "small"
    mnt.mkdir()
    # The suite runs as root (scripts/test.sh installs packages and a Slurm cluster); a missing
    # mount would hide the full-disk behaviour, so it fails loudly instead of skipping.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.fail(f"cannot mount a 2 MiB tmpfs for the full-disk test (needs root): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_is_a_clear_error_and_previous_is_intact(small_disk: Path, tmp_path: Path, mode: str) -> None:
    ckpt, out = small_disk / "ck", tmp_path / "out"
    results = run_ranks(2, "diskfull", ckpt, out, f"ddp:{mode}")
    for r in results:
        assert "disk full" in r["error"] and "step-000001 is intact" in r["error"], r
        assert r["latest"] == 1
    assert _dirs(ckpt) == ["latest", "step-000001"]
    shutil.copy(out / "ref0.pt", out / "ref.pt")
    loaded = run_ranks(2, "load", ckpt, out, "ddp")
    assert [r["step"] for r in loaded] == [1, 1] and loaded[0]["mismatch"] == []


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_async_save_captures_state_at_save_time(tmp_path: Path, kind: str) -> None:
    results = run_ranks(2, "async", tmp_path / "ck", tmp_path / "out", kind)
    assert all(r["mismatch"] == [] for r in results), results


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_async_staging_buffers_made_ahead_reused_and_remade_when_the_structure_changes(
        tmp_path: Path, kind: str) -> None:
    results = run_ranks(2, "staging", tmp_path / "ck", tmp_path / "out", kind)
    for r in results:
        assert set(r["adam_step"]) == {1.0}, r  # the warm-up ran no zero step on a fresh optimizer
        assert any("staging buffers ready" in line for line in r["log"]), r["log"]
        by_step = {c["step"]: c for c in r["checks"]}
        for c in r["checks"]:  # every async save holds the state as of save(), bit-exact
            assert c["mismatch"] == [] and c["extra_ok"], c
        made_in_save = {s for s, c in by_step.items() if any("made in the save" in line for line in c["log"])}
        assert made_in_save == {4, 5}, by_step  # reused at 2 (made ahead) and 3; remade at 4 and 5
        assert all("the state's structure changed" in line for s in (4, 5) for line in by_step[s]["log"]
                   if "made in the save" in line)


def test_a_step_saved_twice_or_a_rank_that_cannot_prepare_fails_every_rank_alike(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    results = run_ranks(2, "prepfail", ckpt, tmp_path / "out", "ddp")
    for r in results:
        assert "already exists" in r["again"], r
        assert "rank 1: preparing the checkpoint state failed" in r["picky"] and "cannot snapshot" in r["picky"], r
        assert r["latest"] == 2
    assert results[0]["dirs_after_failure"] == ["latest", "step-000001"]  # no torn step-000002.tmp
    assert _dirs(ckpt) == ["latest", "step-000001", "step-000002"]


def test_retention_keeps_last_and_every_nth(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    results = run_ranks(2, "retention", ckpt, tmp_path / "out", "ddp")
    assert [r["latest"] for r in results] == [9, 9]
    assert _dirs(ckpt) == ["latest", "step-000004", "step-000008", "step-000009"]
    assert (ckpt / "latest").read_text().strip() == "step-000009"


def test_per_rank_rng_restored_and_new_ranks_reseeded(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    first = run_ranks(2, "rng", ckpt, tmp_path / "a", "ddp")
    again = run_ranks(2, "rng", ckpt, tmp_path / "b", "ddp")
    assert [r["draw"] for r in first] == [r["draw"] for r in again]
    assert first[0]["draw"] != first[1]["draw"]
    grown = run_ranks(3, "rng", ckpt, tmp_path / "c", "ddp")
    grown_again = run_ranks(3, "rng", ckpt, tmp_path / "d", "ddp")
    assert [r["draw"] for r in grown[:2]] == [r["draw"] for r in first]
    assert grown[2]["draw"] == grown_again[2]["draw"] and grown[2]["draw"] not in [r["draw"] for r in first]


# --- checkpoints that cannot run code (docs/security.md) ------------------------------------

class _Payload:
    """Unpickling this runs code: it writes ``marker`` (what a planted checkpoint file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('code from the checkpoint ran')",)


def _plant(step_dir: Path, name: str, data: bytes) -> None:
    """Replaces a checkpoint file and fixes its manifest entry: the CRC is not authentication."""
    import zlib

    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _armed(payload: bytes, tmp_path: Path) -> bytes:
    """Checks that the payload does run code when unpickled the old way (in a child process)."""
    probe = tmp_path / "probe.pt"
    probe.write_bytes(payload)
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(probe)!r}, weights_only=False)"],
                   capture_output=True, check=False)
    return payload


def test_planted_rank_local_pickle_runs_no_code_and_resume_falls_back(steps_1_and_2: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    import io

    import torch

    (ckpt, out), marker = steps_1_and_2, tmp_path / "pwned"   # steps 1 and 2; ref.pt is step 1
    buf = io.BytesIO()
    torch.save({"_rng": _Payload(marker)}, buf)
    _armed(buf.getvalue(), tmp_path)
    assert marker.exists(), "the payload must be live for this test to mean anything"
    marker.unlink()
    _plant(ckpt / "step-000002", "rank-00001.local.pt", buf.getvalue())

    results = run_ranks(2, "load", ckpt, out, "ddp")
    assert not marker.exists(), "code from the checkpoint directory ran"
    assert [r["step"] for r in results] == [1, 1] and results[0]["mismatch"] == []
    names = _dirs(ckpt)
    assert "step-000002" not in names and any(n.startswith("step-000002.corrupt-") for n in names)
    assert (ckpt / "latest").read_text().strip() == "step-000001"
    refused = [line for line in results[0]["log"] if "rank-00001.local.pt: refused to unpickle" in line]
    assert len(refused) == 1 and "(global exec)" in refused[0] and "quarantined as step-000002.corrupt-" in refused[0]
    assert any("resuming from the earlier step-000001" in line for line in results[0]["log"])


def test_planted_dcp_metadata_runs_no_code_and_a_run_with_nothing_left_starts_at_0(tmp_path: Path) -> None:
    import pickle

    ckpt, out, marker = tmp_path / "ck", tmp_path / "out", tmp_path / "pwned"
    run_ranks(2, "save", ckpt, out, "ddp")  # the only checkpoint: step 2
    os.remove(out / "ref.pt")
    _plant(ckpt / "step-000002", ".metadata", pickle.dumps(_Payload(marker)))

    results = run_ranks(2, "load", ckpt, out, "ddp")
    assert not marker.exists(), "code from the checkpoint directory ran"
    assert [r["step"] for r in results] == [None, None]
    log = results[0]["log"]
    assert any(".metadata: refused to unpickle (global builtins.exec)" in line for line in log), log
    assert any("no checkpoint verified (quarantined: step-000002.corrupt-" in line
               and "starting from step 0" in line for line in log), log
    assert not any("previous" in line for line in log), log
    assert [n for n in _dirs(ckpt) if not n.startswith("step-000002.corrupt-")] == [], "no stale latest pointer"


def test_checkpoint_path_that_is_a_file_is_one_clear_error_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    ckpt.write_text("not a directory\n")
    results = run_ranks(2, "ctor", ckpt, tmp_path / "out")   # fails at once, not at a timeout
    for r in results:
        assert r["error"] == (f"checkpoint directory {ckpt} exists and is not a directory; move it away or "
                              "choose another checkpoint directory"), r
    assert ckpt.read_text() == "not a directory\n"


@pytest.mark.parametrize("peer", ["dead", "silent"])
def test_a_crashed_rank_waits_for_its_save_in_flight_only_as_long_as_it_can_finish(tmp_path: Path,
                                                                                   peer: str) -> None:
    """Checkpointer.settle (a crashed rank's wait for its async save) never hangs on a bad peer:
    a peer killed mid-write fails the save as soon as its sockets close, a peer that is alive
    but never finishes is waited for 8 s (the bound given). The previous checkpoint stands.
    The healthy side (a save that finishes is committed) is test_mesh_training's crash test."""
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "settle", str(ckpt), str(out), f"ddp:{peer}"],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(2)]
    try:
        log0 = procs[0].communicate(timeout=120)[0].decode(errors="replace")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, log0
    result = json.loads((out / "settle-rank0.json").read_text())
    assert result["latest"] == "step-000001", result
    if peer == "dead":
        assert "the async save of step 2 failed" in result["note"] and result["settle_s"] < 8, result
    else:
        assert "still runs after 8 s: given up" in result["note"] and 7.5 < result["settle_s"] < 20, result
