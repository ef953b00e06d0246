"""A new rank 0 reads the run's offline files only once a lost rank 0's W&B service is done.

A SIGKILLed rank 0's service (``wandb-core --pid P``) outlives it and still writes the rows
it had received. CI of 6768ed4 (``test_steps_a_sigkilled_rank0_never_wrote_are_logged_by_the_rerun``):
the restarted rank 0 read the files first (rows 1..3), logged 7..10 again, and the old service
then wrote its 4..10: steps 7..10 twice. Here a stand-in service (a real process named
``wandb-core``, ``--pid`` of a process that is gone, the run's file open) writes once more
after 1.5 s and exits: the wait returns after that write, not before; another job's orphan
(its own file) is not waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.worker.wandb_sink import orphaned_services, settle_orphaned_writers

pytestmark = pytest.mark.unit

SERVICE = """
import sys, time
f = open(sys.argv[1], "ab")
time.sleep(float(sys.argv[2]))
f.write(b"late rows"); f.flush()
time.sleep(0.3)
"""


def _service(path: Path, after_s: float, dead_pid: int) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", 'exec -a /opt/wandb/bin/wandb-core "$@"', "svc", sys.executable,
                             "-c", SERVICE, str(path), str(after_s), "--pid", str(dead_pid)])


def test_the_lost_rank0s_service_is_waited_for_until_it_has_written(tmp_path: Path) -> None:
    folder = tmp_path / "offline-run-1-abc"
    folder.mkdir()
    run_file = folder / "run-abc.wandb"
    run_file.write_bytes(b"rows 1..3")
    gone = subprocess.Popen(["true"])
    gone.wait()
    svc = _service(run_file, 1.5, gone.pid)
    other = _service(tmp_path / "run-other.wandb", 30.0, gone.pid)   # another job's: not ours
    try:
        for _ in range(50):   # (the stand-in has opened the file)
            if orphaned_services("run-abc.wandb"):
                break
            time.sleep(0.1)
        assert orphaned_services("run-abc.wandb") == [svc.pid]
        waited = settle_orphaned_writers([folder], "abc", quiet_s=0.5, max_s=20)
        assert run_file.read_bytes().endswith(b"late rows"), "read before the old service wrote"
        assert 1.0 < waited < 15, waited
    finally:
        svc.kill()
        other.kill()


def test_no_orphan_and_an_old_file_cost_no_wait(tmp_path: Path) -> None:
    folder = tmp_path / "offline-run-1-abc"
    folder.mkdir()
    (folder / "run-abc.wandb").write_bytes(b"rows")
    os.utime(folder / "run-abc.wandb", (1.0, 1.0))
    assert settle_orphaned_writers([folder], "abc") < 0.5
    assert settle_orphaned_writers([], "abc") < 0.5


def test_the_quiet_wait_is_only_for_a_rank_0_that_ran_on_another_node(tmp_path: Path) -> None:
    """A restart on the node where every rank 0 ran sees any orphaned service in /proc, so it
    does not wait for the file to go quiet (3 s of every restart, all ranks waiting); a rank 0
    that ran elsewhere, or none recorded besides this one, keeps the wait."""
    import json

    from runtime.worker.wandb_sink import rank0_only_on

    def events(*nodes: str, other_rank: str = "c") -> None:
        lines = [{"t": 1.0 + i, "ev": "session_start", "alloc": 0, "node": n, "rank": 0, "restart": i}
                 for i, n in enumerate(nodes)]
        lines.append({"t": 9.0, "ev": "session_start", "alloc": 0, "node": other_rank, "rank": 1, "restart": 0})
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))

    events("a", "a")
    assert rank0_only_on(tmp_path, "a") and not rank0_only_on(tmp_path, "b")
    events("b", "a")
    assert not rank0_only_on(tmp_path, "a")
    events("a")
    assert not rank0_only_on(tmp_path, "a")
