"""Rank 0's ``wandb.init`` does not hold the training back: the Session starts it on the metrics
sink's thread at ``restore`` and the loop goes on meanwhile; the rows logged before the run
exists wait in the sink's queue and all reach it.

Why: every rank waits for rank 0 at the first collective, so an init on the loop's path cost
every node its time at each start and restart (~2 s offline on the test cluster, in the
campaign's preemption; online, a connection's worth). A real Session (a world of one, gloo) in
a subprocess whose ``make_sink`` is slowed by 4 s (the real W&B sink, offline, made after).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.wandb_offline import offline_env, read_run

pytestmark = pytest.mark.distributed

SCRIPT = """
import json, sys, time
import torch
import runtime.session as rs
from runtime.session import Session

real = rs.make_sink
made = []
def slow(*a, **k):   # a wandb.init that takes 4 s (a slow link, a starved node)
    time.sleep(4.0)
    sink = real(*a, **k)
    made.append(time.time())
    return sink
rs.make_sink = slow

with Session(job_dir=sys.argv[1], log_every=1) as s:
    model = torch.nn.Linear(2, 1)
    t0 = time.time()
    start = s.restore(model=model)
    restored = time.time() - t0
    stepped = []
    for step in s.steps(start, 6):
        s.log(loss=float(step))
        stepped.append(time.time())
    print(json.dumps({"restore_s": restored, "first_step": stepped[0], "made": made}))
"""


def test_wandb_init_runs_beside_the_loop_and_every_row_reaches_the_run(tmp_path: Path):
    job = tmp_path / "job"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **offline_env(tmp_path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(job)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["restore_s"] < 3.0, out               # not the 4 s of the init
    assert out["made"] and out["first_step"] < out["made"][0], out   # trained while it was made
    run_id = (job / "wandb_run_id").read_text().strip()
    steps = sorted(row["_step"] for row in read_run(job / "wandb", run_id).history if "loss" in row)
    assert steps == [1, 2, 3, 4, 5, 6], steps
