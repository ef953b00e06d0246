"""A node other than the rendezvous host reads a rendezvous error on evidence: does the host's
store answer? (runtime/launch/host_store.py, runtime/launch/main.py)

Before, every ``RendezvousError`` on such a node was read as the host's loss: a node failure
recorded and a requeue (under Slurm: an election that fences the live host) also when the
host was alive and the round had only timed out, or had been closed by the others. Here the
host is a real store in a process of its own, and node 1 is a real launcher
(``python -m runtime.launch``) of a 2-node job:

* the store answers and nobody else comes: node 1's round times out, the store still answers,
  so node 1 records nothing (node 0 records the allocation), says the host answered, and
  ends as the application error the timeout is, not as a node failure;
* the store's process dies after node 1 arrived: the host is lost, node 1 records the node
  failure (the host-loss path, as before);
* the probe itself against a store that answers, is stopped (SIGSTOP: a frozen node, nothing
  closed) and is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc.contract.jobspec import JobSpec
from runtime.ending.outcome import EXIT_CODES
from runtime.launch import host_store
from tests.conftest import REPO
from tests.distributed.support import PROBE, outcomes

pytestmark = pytest.mark.distributed

# A rendezvous host's store and nothing else; with --stop-on-arrival it dies (SIGKILL itself)
# once a node has arrived in the listed round (runtime/launch/rendezvous.py's counter).
HOST = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    print(store.port, flush=True)
    key = "hpc.rendezvous." + sys.argv[1] + ".arrived"
    while True:
        time.sleep(0.2)
        if len(sys.argv) > 2 and store.check([key]) and int(store.add(key, 0)) >= 1:
            os.kill(os.getpid(), signal.SIGKILL)
""")


def serve(run_id: str = "x", *extra: str) -> tuple[subprocess.Popen, int]:
    host = subprocess.Popen([sys.executable, "-c", HOST, run_id, *extra], stdout=subprocess.PIPE, text=True)
    return host, int(host.stdout.readline())


def node1(job: Path, port: int, run_id: str) -> subprocess.Popen:
    job.mkdir()
    spec = JobSpec(script=str(PROBE), script_args=("--out", str(job), "--steps", "3"), nodes=(2, 2),
                   nproc_per_node=1, job_dir=str(job), rdzv_timeout_s=10, wandb_mode="disabled")
    (job / "jobspec.json").write_text(spec.to_json())
    return subprocess.Popen([sys.executable, "-m", "runtime.launch", "--job-dir", str(job), "--node-rank", "1",
                             "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port), "--run-id", run_id, "--local"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_the_probe_tells_an_answering_store_from_a_stopped_and_a_gone_one():
    host, port = serve()
    try:
        endpoint = f"127.0.0.1:{port}"
        assert host_store.answers(endpoint)
        os.kill(host.pid, signal.SIGSTOP)   # a frozen node: the port accepts, nobody answers
        t = time.monotonic()
        assert not host_store.answers(endpoint, timeout_s=3.0)
        assert time.monotonic() - t < 3.0 + 3.0
        os.kill(host.pid, signal.SIGCONT)
        assert host_store.answers(endpoint)
    finally:
        host.kill()
        host.wait()
    t = time.monotonic()
    assert not host_store.answers(endpoint)   # refused
    assert time.monotonic() - t < 2.0


@pytest.mark.parametrize("host_dies", [False, True], ids=["host-answers", "host-dies"])
def test_a_rendezvous_error_is_the_hosts_loss_only_when_its_store_does_not_answer(tmp_path: Path,
                                                                                   host_dies: bool):
    run_id = "evidence"
    host, port = serve(run_id, *(["--die-on-arrival"] if host_dies else []))
    launcher = node1(tmp_path / "job", port, run_id)
    try:
        out, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        host.kill()
        host.wait()
    recorded = outcomes(tmp_path / "job") if (tmp_path / "job" / "outcomes.jsonl").exists() else []
    if not host_dies:
        assert recorded == [], recorded   # node 0 records the allocation, not node 1 (before: node_failure)
        assert launcher.returncode == EXIT_CODES["app_error"], (launcher.returncode, out[-3000:])
        assert f"while its host 127.0.0.1:{port} answered, so the host is not lost" in out, out[-3000:]
        assert "within 10 s (--rdzv-timeout" in out, out[-3000:]
    else:
        assert "answered" not in out, out[-3000:]
        assert [o["kind"] for o in recorded] == ["node_failure"], recorded
        assert launcher.returncode == EXIT_CODES["node_failure"], (launcher.returncode, out[-3000:])
