"""A damaged job directory costs its damaged lines, never the job (issue 23's probe findings).

Each test plants what a reliability probe found (a non-UTF-8 byte in ``hangs.jsonl``, garbled
``outcomes.jsonl`` lines, the heartbeat directory a launcher killed with SIGKILL leaves in
``/dev/shm``) and runs the real ``hpc run`` / ``hpc report`` on it, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.liveness.watchdog import HEARTBEAT_DIR_QUIET_S, heartbeat_root
from tests.conftest import REPO

pytestmark = pytest.mark.distributed
PROBE = REPO / "tests" / "distributed" / "scripts" / "stall_probe.py"

PREVIOUS = {"allocation": 0, "kind": "preempted", "exit_code": 75, "step": 3, "time": 1.0}
HANG = {"allocation": 0, "node": "n1", "node_rank": 0, "reason": "old stall", "suspect_rank": 1,
        "stacks": "logs/alloc-0/hang-n1-1.txt", "time": 1.0}


def plant(job: Path, damaged_outcomes: bool) -> None:
    """A job directory an earlier allocation left, then damaged (a disk error, a bad editor)."""
    job.mkdir(mode=0o700)
    garbage = b"[1, 2]\n" + b'{"allocation": 1, "kind": "exploded"}\n' + b"\xff\xfe\x00garbage\n"
    (job / "outcomes.jsonl").write_bytes(json.dumps(PREVIOUS).encode() + b"\n"
                                         + (garbage if damaged_outcomes else b""))
    (job / "hangs.jsonl").write_bytes(json.dumps(HANG).encode() + b"\n" + b"\xff not utf-8\n")


@pytest.mark.parametrize("damaged_outcomes", [False, True], ids=["hangs", "hangs+outcomes"])
def test_run_on_damaged_records_finishes_and_records_its_own_outcome(tmp_path: Path,
                                                                      damaged_outcomes: bool) -> None:
    job = tmp_path / "job"
    plant(job, damaged_outcomes)
    p = subprocess.run([sys.executable, "-m", "hpc", "run", str(PROBE), "--nproc-per-node", "2",
                        "--job-dir", str(job), "--", "--out", str(job), "--steps", "12",
                        "--step-s", "0.05"], cwd=REPO, timeout=240, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout
    assert p.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    # Its own outcome, not the previous allocation's:
    assert "hpc run: finished" in out and "hpc run: preempted" not in out, out[-2000:]
    assert json.loads((job / "result.json").read_text())["final_step"] == 12
    lines = (job / "outcomes.jsonl").read_bytes().splitlines()
    assert json.loads(lines[-1])["kind"] == "finished" and json.loads(lines[-1])["allocation"] == 1
    # The damage is named (file and line), not hidden:
    assert f"{job / 'hangs.jsonl'}, line 2: not UTF-8" in out, out[-4000:]
    if damaged_outcomes:
        assert f"{job / 'outcomes.jsonl'}, line 2" in out, out[-4000:]

    report = subprocess.run([sys.executable, "-m", "hpc", "report", str(job), "--json"], cwd=REPO,
                            timeout=120, text=True, capture_output=True)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "Traceback" not in report.stderr, report.stderr[-3000:]
    assert "hangs.jsonl, line 2: not UTF-8" in report.stderr, report.stderr
    if damaged_outcomes:
        assert "outcomes.jsonl, line 4: not UTF-8" in report.stderr, report.stderr


@pytest.mark.waits   # 13 CPU-s of 43 s at load 5 (2 cores): mostly waits; CI's clock lane
def test_heartbeat_dir_of_a_killed_launcher_is_cleaned_by_the_next_start(tmp_path: Path) -> None:
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "hpc", "run", str(PROBE), "--nproc-per-node", "2", "--job-dir",
           str(job), "--", "--out", str(job), "--steps", "400", "--step-s", "0.1"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        end = time.time() + 120
        left: list[Path] = []
        while time.time() < end and not left:
            found = subprocess.run(["pgrep", "-f", f"runtime.launch --job-dir {job}"],
                                   capture_output=True, text=True).stdout.split()
            left = [d for d in (heartbeat_root() / f"hpc-liveness-{os.getuid()}-{pid}" for pid in found)
                    if d.is_dir() and any(d.glob("*.json"))]     # a worker beats in it
            time.sleep(0.3)
        assert left, "the launcher never published a heartbeat directory"
        launcher = int(left[0].name.rsplit("-", 1)[1])
        os.kill(launcher, signal.SIGKILL)
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    time.sleep(2)
    assert left[0].is_dir(), "kill -9 left nothing behind: nothing to clean"
    then = time.time() - HEARTBEAT_DIR_QUIET_S - 10    # as if the kill was minutes ago
    for p in (*left[0].iterdir(), left[0]):
        os.utime(p, (then, then))
    second = subprocess.run([*cmd[:-4], "--steps", "5", "--step-s", "0.01"], cwd=REPO, timeout=240,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert second.returncode == 0, second.stdout[-3000:]
    # Cleaned by the next start (the node log names it), or by any other launcher of this user
    # that started meanwhile on this machine: either way it is gone, never left for good.
    assert not left[0].exists(), "the next start did not clean the killed launcher's directory"


def _run_with_restarts(job: Path, script: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    p = subprocess.run([sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2",
                        "--job-dir", str(job), "--max-restarts", "3", "--", "--out", str(job), *args],
                       cwd=REPO, timeout=240, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = (job / "outcomes.jsonl").read_text().splitlines() if (job / "outcomes.jsonl").exists() else []
    return p, (json.loads(lines[-1]) if lines else {})


def test_checkpoints_being_a_file_ends_the_allocation_at_the_first_failure(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    (job / "outcomes.jsonl").write_text("")          # a job directory (no allocation yet)
    (job / "checkpoints").write_text("a file where the checkpoints go\n")
    p, last = _run_with_restarts(job, PROBE, "--steps", "5")
    out = p.stdout
    assert p.returncode == 1, out[-3000:]
    assert last["kind"] == "app_error" and last["restarts"] == 0, last
    assert f"checkpoint directory {job / 'checkpoints'} exists and is not a directory" in last["reason"]
    assert "no restart (3 left unused)" in out and "cannot be a directory" in out, out[-3000:]
    assert not (job / "logs" / "alloc-0" / "restart-1").exists()
    assert out.count("Traceback") <= 2, out          # one failed group, not four
    # Resumable: with the file moved away, the same command runs the job.
    (job / "checkpoints").rename(job / "checkpoints.moved")
    p, last = _run_with_restarts(job, PROBE, "--steps", "5")
    assert p.returncode == 0 and last["kind"] == "finished", p.stdout[-3000:]




def test_a_save_larger_than_the_room_left_ends_the_allocation_at_once(small_disk: Path) -> None:
    job = small_disk / "job"
    p, last = _run_with_restarts(job, REPO / "tests" / "distributed" / "scripts" / "big_save.py")
    out = p.stdout
    assert p.returncode == 1, out[-3000:]
    assert last["kind"] == "app_error" and last["restarts"] == 0, last
    assert "No space left on device" in last["reason"], last
    assert "failed with 'No space left on device'" in out and "no restart (3 left unused)" in out, out[-3000:]
    assert not (job / "logs" / "alloc-0" / "restart-1").exists()
