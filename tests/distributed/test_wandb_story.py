"""The job's story on its W&B run after `hpc sync`, checked on the local stand-in server.

The job is a recorded real one with a fault (tests/fixtures/events/preempt_node_crash: preempted
at step 10, requeued, then a node crashed at step 15 and the survivors went on), whose run has
two offline segments made by real wandb (the training loop's loss). `hpc sync` writes the story
as one more offline segment (wandb in its own process) and uploads all three through wandb's
own `wandb sync` to tests/fake_wandb_server.py, which keeps what it received: the goodput
table and the event table as uploaded files, the timeline PNG, the event rows and the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.contract.ledger import CATEGORIES
from tests.conftest import REPO
from tests.distributed.support import real_sync_env
from tests.wandb_offline import offline_env

pytestmark = pytest.mark.distributed
FIXTURE = REPO / "tests" / "fixtures" / "events" / "preempt_node_crash"

LOSS_SEGMENTS = """
import sys, wandb
job, run_id = sys.argv[1], sys.argv[2]
for first, last in ((1, 10), (11, 40)):    # allocation 0, then allocation 1 from its checkpoint
    run = wandb.init(id=run_id, resume="allow", dir=job, project="story-test")
    for s in range(first, last + 1):
        run.log({"loss": 1.0 / s}, step=s)
    run.finish()
"""


def table(run, key: str) -> dict:
    """The table a history row points to, as the server received the file."""
    [row] = [r for r in run.history if key in r]
    ref = row[key]
    assert ref["_type"] == "table-file", ref
    return json.loads(run.files[ref["path"]])


@pytest.mark.timeout(240)
def test_a_job_with_a_fault_shows_its_ledger_picture_and_events_after_hpc_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc import sync
    from hpc.report.load import load
    from tests.fake_wandb_server import FakeWandbServer

    job = tmp_path / "job's dir"
    job.mkdir()
    for name in ("events.jsonl", "outcomes.jsonl"):
        shutil.copy(FIXTURE / name, job / name)
    (job / "jobspec.json").write_text("{}")
    (job / "wandb_run_id").write_text("storyrun\n")
    r = subprocess.run([sys.executable, "-c", LOSS_SEGMENTS, str(job), "storyrun"],
                       env=dict(os.environ) | offline_env(tmp_path / "env"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ledger = load(job)
    from hpc.report import wandb_story
    assert wandb_story.write(job, "storyrun", [], ended=False) is None   # told at the end only
    assert not (job / "wandb_story.json").exists()

    lines: list[str] = []
    with FakeWandbServer() as server:
        real_sync_env(tmp_path, server.url, monkeypatch)
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lines.append) == 3, lines
        assert list(server.runs) == ["storyrun"], list(server.runs)
        run = server.runs["storyrun"]
        assert run.project == "story-test"             # the run's own project, not a new one
        assert any("the job's story (2 allocation(s), 8 event(s), goodput 19.8%)" in x for x in lines), lines

        # The goodput ledger per allocation, as a table.
        goodput = table(run, "hpc/goodput")
        cols = goodput["columns"]
        rows = [dict(zip(cols, row)) for row in goodput["data"]]
        assert [(r["allocation"], r["ended"]) for r in rows] == [("0", "preempted"), ("1", "finished"),
                                                                  ("all", "finished")]
        for r, a in zip(rows, ledger.allocations):
            assert r["nodes"] == len(a.nodes) and r["restarts"] == a.restarts
            assert r["node_s"] == pytest.approx(a.node_s, abs=1e-3)
            assert all(r[f"{c}_s"] == pytest.approx(a.categories[c], abs=1e-3) for c in CATEGORIES)
        assert rows[2]["goodput_pct"] == pytest.approx(ledger.goodput * 100, abs=0.01)
        assert rows[1]["lost_steps"] == 1 and rows[1]["lost_s"] > 0        # the node crash's cost
        # wandb logs each table as a run_table artifact too (what W&B's table panels read).
        [art] = [a for a in server.artifacts.values() if "hpc/goodput.table.json" in a["files"]]
        assert (art["type"], art["state"]) == ("run_table", "COMMITTED"), art
        in_artifact = json.loads(art["files"]["hpc/goodput.table.json"])
        assert (in_artifact["columns"], in_artifact["data"]) == (goodput["columns"], goodput["data"])

        # The timeline picture.
        [row] = [r for r in run.history if "hpc/timeline" in r]
        image = row["hpc/timeline"]
        assert image["_type"] == "image-file" and run.files[image["path"]].startswith(b"\x89PNG")

        # Each fault and recovery, as a table and as a row at its training step.
        events = [dict(zip(table(run, "hpc/events")["columns"], e))
                  for e in table(run, "hpc/events")["data"]]
        kinds = [(e["allocation"], e["kind"], e["step"]) for e in events]
        assert (0, "stop", 10) in kinds and (1, "allocation", 10) in kinds
        assert (1, "failure", 15) in kinds and (1, "restart", 15) in kinds
        charted = [(k.split("/")[-1], r.get("hpc/at_step")) for r in run.history for k in r
                   if k.startswith("hpc/event/")]
        assert ("failure", 15) in charted and ("restart", 15) in charted and ("stop", 10) in charted
        assert len(charted) == len(events) == 8
        assert run.summary["hpc/goodput_pct"] == pytest.approx(ledger.goodput * 100, abs=0.01)
        assert run.summary["hpc/interruptions"] == 2
        # The loss curve is there too, every step once: the story did not disturb it.
        assert sorted(r["_step"] for r in run.history if "loss" in r) == list(range(1, 41))

        # Told once: a second sync writes and sends nothing.
        before = len(server.requests)
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lines.append) == 0
        assert len(server.requests) == before
    assert len(list((job / "wandb").glob("offline-run-*"))) == 3
