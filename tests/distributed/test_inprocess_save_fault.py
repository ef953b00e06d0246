"""A peer leaves while the others are in a checkpoint save's collectives (issue 26, node crash).

On the real cluster a node crashed at step 11 of an in-process job and the survivors never
trained again: one of them had entered the step-12 save (the checkpointer's all-gather, on its
own gloo group) while the rank that saw the crash first had gone to the re-form. Only the
training group's connections were broken at a recovery, so that gather waited for a peer that
would never come, for the group's timeout (1860 s), inside the ``save`` phase whose busy mark
kept the re-form waiting for it too.

Here ``hpc run --recovery inprocess`` (launcher, torch's agent, 3 workers, gloo, DDP, a save
every 2 steps) and rank 1 leaves the step boundary exactly as the save after 10 steps starts
(``HPC_TEST_INPROC_FAULT=1:10:save``): its peers are in that save's collectives. The outcome a user cares about: the job finishes within its time, every worker is
the same process, the world never shrank, no checkpoint was read to recover, at most one step
was computed twice and the weights are bit-equal across ranks.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.inprocess_support import lines

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 16


def test_a_rank_leaving_as_a_save_starts_does_not_strand_its_peers_in_the_save(tmp_path: Path):
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60",
               HPC_TEST_INPROC_FAULT="1:10:save")
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                            "--recovery", "inprocess", "--checkpoint-every-steps", "2",
                            "--job-dir", str(job), "--", "--out", str(out), "--steps", str(STEPS),
                            "--step-sleep", "0.1"],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Without the fix the peers wait in the save's gather for the group's timeout (1860 s).
        text, _ = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        run.kill()
        text = run.communicate()[0]
        pytest.fail(f"the job did not finish: survivors stranded in the save's collectives\n{text[-4000:]}")
    assert run.returncode == 0, text[-4000:]
    results = [json.loads(f.read_text()) for f in out.glob("result-*.json")]
    ran = lines(out)
    assert len(ran) == 3 and {r["pid"] for r in results} == set(ran), "a worker was restarted"
    assert {r["step"] for r in results} == {STEPS} and {r["world"] for r in results} == {3}
    assert len({r["weights"] for r in results}) == 1, "replicas differ after the recovery"
    ckpt = str(job / "checkpoints")
    for r in results:
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
    for pid, steps in ran.items():
        again = [s for s, n in collections.Counter(x["step"] for x in steps).items() if n > 1]
        assert len(again) <= 1, (pid, again)
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    rec = [e for e in events if e["ev"] == "inproc_recovery"]
    assert len(rec) == 1 and rec[0]["step"] == 10 and rec[0]["world_size"] == 3, rec
    assert "injected fault" in rec[0]["reason"] or "at the step boundary" in rec[0]["reason"], rec
    print(f"recovered at step {rec[0]['step']} in {rec[0]['t_transfer'] - rec[0]['t_detect']:.2f} s; "
          f"test {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
