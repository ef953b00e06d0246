"""The listed first rendezvous round for real: ``hpc run --nodes 3``, real launchers, torch's
agent, a real TCPStore, gloo workers (runtime/launch/rendezvous.py).

One job checks what a user of a many-node job relies on: the first round forms from the node
list with the host as rank 0 (waiting for a node that starts late, as c10d's round does), the
decision is in the launcher's log, and when a worker dies later, every node meets again in
torch's c10d round (the listed round's ``waiting`` counter tells the nodes whose workers still
run) and the job finishes with all three nodes. The store serves on the socket ``hpc run`` bound
and handed to node 0 (no other process can take its port first), on loopback only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.listeners import LOOPBACK, listeners

pytestmark = pytest.mark.distributed
PROBE = REPO / "tests" / "distributed" / "scripts" / "worker_probe.py"


def test_three_nodes_form_the_listed_round_then_meet_in_c10d_after_a_worker_dies(tmp_path: Path):
    job = tmp_path / "job"
    job.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(PROBE), "--nodes", "3", "--nproc-per-node", "1",
                          "--job-dir", str(job), "--env", "HPC_TEST_SLOW_JOIN=2:3", "--",
                          "--out", str(job), "--seconds", "8"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        end = time.time() + 120
        while not (job / "pid-1-0").exists():
            assert p.poll() is None and time.time() < end, "worker 1 never started"
            time.sleep(0.1)
        nodes = "\n".join(f.read_text() for f in (job / "logs" / "alloc-0").glob("node-*.log"))
        served = re.search(r"the store serves on the inherited socket 127\.0\.0\.1:(\d+)", nodes)
        assert served, nodes[-3000:]
        assert listeners(int(served.group(1))) == {LOOPBACK}, listeners(int(served.group(1)))
        time.sleep(1.5)
        os.kill(int((job / "pid-1-0").read_text()), signal.SIGKILL)
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, out[-3000:]
    log = "\n".join(f.read_text() for f in (job / "logs" / "alloc-0").glob("node-*.log"))
    assert log.count("rendezvous: first round from the node list (3 nodes, per-node keys)") == 3, log[-3000:]
    assert "listed round formed: 3 of 3 nodes" in log, log[-3000:]
    assert "HPC_TEST_SLOW_JOIN: joining the rendezvous 3s late" in log     # and it was waited for
    for r in range(3):
        assert f"[hpc launch node {r}] INFO rendezvous: rank {r} of 3 in the listed round" in log
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["ev"] == "workers_started"]
    # Two rounds on every node (the listed one, then c10d's after the kill), three nodes each.
    assert sorted(e["node_rank"] for e in started) == [0, 0, 1, 1, 2, 2], started
    assert all(e["nodes"] == 3 for e in started), started
    ended = [e for e in events if e["ev"] == "workers_ended"]
    assert sorted(e["node_rank"] for e in ended if e["state"] == "SUCCEEDED") == [0, 1, 2], ended
    assert "restart 1 did" in (job / "logs/alloc-0/restart-1/rank-1.log").read_text() or any(
        "restart 1 did" in f.read_text() for f in (job / "logs/alloc-0").glob("restart-1/rank-*.log"))
