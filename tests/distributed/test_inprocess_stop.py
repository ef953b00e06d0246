"""A stop under ``hpc run --recovery inprocess``: the workers the stop ends are not replaced.

In-process recovery replaces a dead worker by a joiner. A worker ended by the allocation's own
stop (SIGTERM forwarded on a preemption, or a cut-off rendezvous host's fence killing its
workers) is no fault to recover from: starting a joiner in its place only delays the stop,
and on the Slurm cluster a fenced host went on replacing the workers it had just killed
(``runtime.inprocess.launcher.agent``'s ``stopping``). Here a script that does not handle
SIGTERM (it dies of it, as a script without the Session does) is stopped with SIGTERM: the
launcher announces the deaths, starts no joiner, records no fallback to the restart path (there
is none: the allocation stops), and the run ends preempted (exit 75), with no worker process
started after the signal.
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

from tests.conftest import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

PLAIN = """
import os, sys, time
open(os.path.join(sys.argv[1], f"up-{os.environ['RANK']}-{os.getpid()}"), "w").close()
while True:
    time.sleep(0.1)
"""


def test_workers_ended_by_the_stop_are_not_replaced_by_joiners(tmp_path: Path) -> None:
    script, out, job = tmp_path / "plain.py", tmp_path / "out", tmp_path / "job"
    script.write_text(PLAIN)
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2",
                            "--recovery", "inprocess", "--job-dir", str(job), "--", str(out)],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while len(list(out.glob("up-*"))) < 2:
            assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.poll() is not None else "no workers"
            time.sleep(0.1)
        time.sleep(1.0)
        run.send_signal(signal.SIGTERM)
        log, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 75, log
    assert "joiner" not in log, log
    evs = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    assert not [e for e in evs if e["ev"] in ("inproc_replace", "inproc_fallback")], evs
    assert len(list(out.glob("up-*"))) == 2, sorted(p.name for p in out.glob("up-*"))
    assert [e["kind"] for e in evs if e["ev"] == "alloc_end"] == ["preempted"], evs
