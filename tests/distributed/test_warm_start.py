"""Workers forked from the node's warm fork server (runtime.launch.warm_start) are the workers a
cold start makes: the launcher's children in their own sessions, with their own rank's
environment, fresh random generators, the script run as ``__main__``, exit statuses and atexit
handlers as an interpreter's; a restart forks again. ``HPC_WARM_START=0`` starts them cold.

One ``hpc run`` of a torch-only probe per mode (a crash of rank 1 and one restart in each):
the cheapest level that shows a fork crossing into torch's agent and back. The restarted
workers end 100 DDP process groups as torchrun scripts do, which hung without
runtime.worker.pg_release."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

PROBE = REPO / "tests" / "distributed" / "scripts" / "warm_probe.py"


def _run(tmp_path: Path, *env: str) -> tuple[subprocess.CompletedProcess[str], Path, dict]:
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    cmd = [sys.executable, "-m", "hpc", "run", str(PROBE), "--nproc-per-node", "2", "--job-dir", str(job),
           "--max-restarts", "1", *[a for e in env for a in ("--env", e)], "--", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    recs = {p.stem[4:]: json.loads(p.read_text()) for p in out.glob("rec-*.json")}
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(recs) == {"0-0", "1-0", "0-1", "1-1"}, (sorted(recs), r.stdout + r.stderr)
    assert {p.name for p in out.glob("atexit-*")} == {f"atexit-{k}" for k in recs}, "an atexit handler did not run"
    # a script's destroy_process_group() keeps its groups until it ends (runtime.worker.pg_release):
    # patched on a fork (torch came with it) and on a cold start (when the script imports it)
    assert all(rec["keeps_groups"] for rec in recs.values()), recs
    assert {p.name: p.read_text() for p in out.glob("teardowns-*")} == {"teardowns-0": "100", "teardowns-1": "100"}
    return r, job, recs


def test_forked_workers_are_the_launchers_children_with_their_own_rank_and_a_restart_forks_again(tmp_path: Path) -> None:
    r, job, recs = _run(tmp_path)
    assert all(rec["warm"] for rec in recs.values()), recs   # torch came with the fork, both starts
    for key, rec in recs.items():
        assert rec["ppid"] == rec["agent"], (key, rec)     # the launcher's child, as a cold worker
        assert rec["sid"] == rec["pid"], (key, rec)        # its own session (torch's agent kills its group)
        assert rec["name"] == "__main__" and rec["path0"] == str(PROBE.parent), rec
        assert rec["argv"] == [str(PROBE), "--out", str(tmp_path / "out")], rec
        assert rec["cwd"] == str(tmp_path) and rec["stdin"] == "/dev/null", rec
        assert rec["threads"] == int(rec["omp"]), rec       # the launcher's OMP_NUM_THREADS holds
    for restart in ("0", "1"):
        a, b = recs[f"0-{restart}"], recs[f"1-{restart}"]
        assert a["random"] != b["random"] and a["numpy"] != b["numpy"], (a, b)   # no shared generator state
    assert recs["0-0"]["pid"] != recs["0-1"]["pid"]
    assert "rank 1 exited with 3" in r.stderr, r.stdout + r.stderr   # the status came back through the fork
    logs = job / "logs" / "alloc-0"
    assert "warm probe rank 1 restart 0" in (logs / "restart-0" / "rank-1.log").read_text()
    assert "warm probe rank 1 restart 1" in (logs / "restart-1" / "rank-1.log").read_text()
    node_log = "".join(p.read_text() for p in logs.glob("node-*.log"))
    assert "starting the workers again" in node_log and "warm start" not in node_log, node_log


def test_warm_start_off_starts_every_worker_cold(tmp_path: Path) -> None:
    _r, _job, recs = _run(tmp_path, "HPC_WARM_START=0")
    assert not any(rec["warm"] for rec in recs.values()), recs
    assert all(rec["ppid"] == rec["agent"] and rec["sid"] == rec["pid"] for rec in recs.values()), recs
