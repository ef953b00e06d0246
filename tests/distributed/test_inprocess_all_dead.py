"""Every member of an in-process job dies at once: the job falls back to the restart path.

A joiner (the launcher's replacement of a dead worker) is taken in by a living member and
receives the state from it; with no member left alive nobody holds the state in memory and
nobody leads a generation, and before this fix the launcher still started joiners, which waited
forever. ``hpc run --recovery inprocess`` (2 workers, a save every 2 steps), both workers
SIGKILLed at once: the launcher must say why it falls back (``inproc_fallback``), torch's
restart path must resume from the last checkpoint, and the job must finish at its last step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.inprocess_support import hpc_run, lines

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

STEPS = 16


def test_when_every_member_dies_the_job_falls_back_to_restart_and_says_why(tmp_path: Path):
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, STEPS, "--nproc-per-node", "2", "--max-restarts", "2",
                  "--checkpoint-every-steps", "2")
    try:
        deadline = time.time() + 240
        while not ((r := lines(out)) and len(r) == 2 and all(len(v) >= 6 for v in r.values())):
            assert time.time() < deadline and run.poll() is None, "the workers never reached step 6"
            time.sleep(0.05)
        for pid in r:
            os.kill(pid, signal.SIGKILL)
        try:   # before the fix: the joiners waited for a member that would never come
            text, _ = run.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            run.kill()
            pytest.fail(f"the job hung after every member died\n{run.communicate()[0][-4000:]}")
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, text[-4000:]
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == STEPS, outcome
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    falls = [e for e in events if e["ev"] == "inproc_fallback"]
    assert any("every member of generation" in e["reason"] for e in falls), falls
    restored = [e for e in events if e["ev"] == "restore_end" and e.get("from_checkpoint")]
    assert restored and restored[-1]["step"] >= 2, "the restart path did not resume from the checkpoint"
    print(f"fell back, resumed from step {restored[-1]['step']}; test {time.time() - t0:.0f} s, "
          f"load {os.getloadavg()[0]:.1f}")
