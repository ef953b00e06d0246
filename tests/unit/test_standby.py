"""The warm standby's pure rules, and how ``/proc`` readers see a standby that became a worker.

Real processes where the rule crosses one (a standby-like process whose command line names
the standby module, its order in the node-local file); the whole path (a killed worker's
joiner made from the standby, the weights of the uninterrupted run) is
tests/distributed/test_inprocess_standby.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.contract import recovery_settings
from runtime import node_files
from runtime.inprocess.launcher import standby
from runtime.launch import warm_start
from runtime.liveness import proc
from runtime.worker.warm import script_imports

pytestmark = pytest.mark.unit


def test_only_variables_read_after_the_imports_may_differ():
    base = {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin", "HPC_JOB_DIR": "/j", "RANK": "0"}
    joiner = {**base, "RANK": "2", "LOCAL_RANK": "2", recovery_settings.JOIN_ENV: "1", "MASTER_PORT": "29500",
              "TORCHELASTIC_ERROR_FILE": "/e", "HPC_PENDING_WARNING": "SIGUSR2@1.0", "NCCL_DEBUG": "INFO"}
    assert warm_start.differences(base, joiner) == []
    # torch reads OMP_NUM_THREADS when imported; a library path changes what loads
    assert warm_start.differences(base, {**joiner, "OMP_NUM_THREADS": "4"}) == ["OMP_NUM_THREADS"]
    assert warm_start.differences(base, {**joiner, "LD_LIBRARY_PATH": "/x"}) == ["LD_LIBRARY_PATH"]
    assert warm_start.differences({**base, "MKL_NUM_THREADS": "1"}, joiner) == ["MKL_NUM_THREADS"]


def test_the_switch_and_the_command_a_standby_can_run():
    assert standby.enabled({}) and standby.enabled({recovery_settings.WARM_ENV: "1"})
    assert not standby.enabled({recovery_settings.WARM_ENV: "0"}) and not standby.enabled({recovery_settings.WARM_ENV: "off"})
    assert warm_start.worker_command(["/py", "-m", "runtime.worker", "train.py", "--x"])
    assert not warm_start.worker_command(["/py", "-u", "-m", "runtime.worker", "train.py"])
    assert not warm_start.worker_command(["/py", "train.py"])


def test_the_order_round_trips():
    order = node_files.Order(argv=("/py", "-m", "runtime.worker", "a b.py", "--lr=1"),
                        env={"A": "1", "B": "x=y"}, cwd="/w", stdout="/l/rank-2.log")
    assert node_files.Order.decode(order.encode()) == order
    assert node_files.order_file(123).endswith(f"/hpc-{os.getuid()}/standby-123.json")


def test_a_scripts_libraries_are_warmed_not_its_own_modules(tmp_path: Path):
    (tmp_path / "mymodel.py").write_text("raise SystemExit('imported the job's own module')\n")
    script = tmp_path / "train.py"
    script.write_text("import json\nimport numpy as np\nfrom mymodel import Net\nfrom . import rel\n"
                      "from runtime.session import Session\n"
                      "def main():\n    import torch.fx\n")
    assert script_imports(str(script)) == ["json", "numpy", "runtime.session"]
    assert script_imports(str(tmp_path / "missing.py")) == []


def _sleeper(*extra: str, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", *extra],
                         stdin=subprocess.PIPE, env=env)
    deadline = time.time() + 30   # (in its exec, a process's /proc command line reads empty)
    while "-c" not in proc.cmdline(p.pid) and time.time() < deadline:
        time.sleep(0.01)
    return p


def test_a_standby_that_became_a_worker_is_seen_as_that_worker():
    idle = _sleeper(node_files.STANDBY_MODULE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert idle.pid not in proc.workers(os.getpid())   # idle: not a worker, not a local rank
        order = node_files.Order(argv=(sys.executable, "-m", "runtime.worker", "train.py"),
                            env={"LOCAL_RANK": "2", "OMP_NUM_THREADS": "1"}, cwd="/")
        path = Path(node_files.order_file(idle.pid))
        path.write_text(order.encode())
        try:
            assert idle.pid in proc.workers(os.getpid())
            assert proc.cmdline(idle.pid) == list(order.argv)
            assert proc.environ(idle.pid) == {"LOCAL_RANK": "2", "OMP_NUM_THREADS": "1"}
        finally:
            path.unlink()
    finally:
        idle.kill()
        idle.wait()
    other = _sleeper()   # an order file is read only for a standby's command line
    try:
        Path(node_files.order_file(other.pid)).write_text(order.encode())
        assert proc.cmdline(other.pid)[:2] == [sys.executable, "-c"]
    finally:
        Path(node_files.order_file(other.pid)).unlink()
        other.kill()
        other.wait()


def test_a_joiner_starts_cold_when_its_standby_was_started_otherwise():
    warm = standby.Standby()
    warm.proc = _sleeper(node_files.STANDBY_MODULE)
    warm.python, warm.env = sys.executable, {"OMP_NUM_THREADS": "2", "PATH": "/bin"}
    argv = [sys.executable, "-m", "runtime.worker", "train.py"]
    try:
        assert warm.take(argv, {"OMP_NUM_THREADS": "4", "PATH": "/bin"}) is None   # read at import
        assert warm.take(["/other/python", *argv[1:]], dict(warm.env)) is None
        assert warm.proc is not None and warm.proc.poll() is None   # kept for the next joiner
        got = warm.take(argv, {**warm.env, "RANK": "2"}, stdout="/l/rank-2.log")
        assert got is not None and warm.proc is None and warm.handed == [got.pid]
        assert got.wait(timeout=30) == 0   # (the stand-in read its order and ended)
        assert node_files.Order.decode(Path(node_files.order_file(got.pid)).read_text()).stdout == "/l/rank-2.log"
    finally:
        warm.close()
        for p in filter(None, [warm.proc]):
            p.kill()
    assert not Path(node_files.order_file(got.pid)).exists()   # its record goes once it is gone


def test_no_standby_before_the_delay_and_none_after_repeated_deaths(monkeypatch: pytest.MonkeyPatch):
    started: list[list[str]] = []

    class Dead:
        pid, stdin = 1, None

        def __init__(self, argv: list[str], **_: object) -> None:
            started.append(argv)

        def poll(self) -> int:
            return 1

    monkeypatch.setattr(standby.subprocess, "Popen", Dead)
    warm = standby.Standby(after_s=10)
    argv = ["/py", "-m", "runtime.worker", "train.py"]
    warm.tend(argv, {}, now=-50, ready=lambda: False)   # the workers are still starting
    warm.tend(argv, {"RANK": "1", "LOCAL_RANK": "1", "A": "1"}, now=0)   # their first step: armed
    warm.tend(argv, {}, now=9)
    assert started == []
    for t in (10, 20, 30, 40, 50, 60):
        warm.tend(argv, {"RANK": "1", "LOCAL_RANK": "1", "A": "1"}, now=t)
    assert started[0] == ["/py", "-m", node_files.STANDBY_MODULE, "train.py"]
    assert len(started) == standby.MAX_FAILURES and warm.env == {"A": "1"}   # no rank of its own


def test_a_standby_starts_with_the_workers_only_where_cpus_are_to_spare():
    assert standby.at_launch(96, 8)                                  # a GPU node
    assert not standby.at_launch(2, 1) and not standby.at_launch(16, 4)   # this machine's nodes, a busy one
