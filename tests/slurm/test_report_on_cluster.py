"""Goodput on the real cluster: a job preempted at a known step, requeued, then one of its nodes
crashes and the survivors go on; ``hpc report JOBID`` must account for all of it.

Checks what the report promises: each allocation's categories add up to its allocated node-time
(within 1 %) and to Slurm's own start/end; queue waits come from sacct; the preemption loses no
step and the next allocation resumes exactly at the saved step; the node crash appears as a
re-form with at most the steps since the last checkpoint lost; the picture is a real PNG.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import sacct_rows, wait_until
from tests.slurm.support import ELASTIC, TRAIN, hpc, latest_step, outcomes, progress, wait_done

pytestmark = pytest.mark.slurm


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def test_report_of_a_preempted_then_node_crashed_job(env, slurm_cluster, tmp_path):
    job = tmp_path / "goodput"
    r = hpc(env, "submit", str(TRAIN), "--nproc-per-node", "2", "--job-dir", str(job),
            "--nodes", "2:3", "--max-restarts", "2", "--partition", "debug",
            "--checkpoint-every-steps", "2", "--checkpoint-interval", "auto:1h",
            "--", "--preset", "tiny", "--step-sleep", "1.0", *ELASTIC)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    wait_until(lambda: latest_step(job) >= 6, 240, "training to checkpoint step 6")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", "3", "-t", "2",
                           "-o", str(tmp_path / "high.out"), "--wrap", "sleep 4"], env=env,
                          capture_output=True, text=True)
    assert high.returncode == 0, high.stderr
    wait_until(lambda: any(o["kind"] == "preempted" for o in outcomes(job)), 60, "the preemption outcome")
    saved = [o for o in outcomes(job) if o["kind"] == "preempted"][0]["step"]
    # The second allocation trains on 3 nodes past a few more checkpoints, then node3 dies.
    wait_until(lambda: (progress(job).get("allocation") == 1 and progress(job).get("world_size") == 6
                        and latest_step(job) >= saved + 4), 240, "the requeued allocation to train")
    slurm_cluster.crash("node3")
    crashed_at_checkpoint = latest_step(job)
    # What node3's time is depends on Slurm dropping it while the job still trains: Slurm
    # marks it down a SlurmdTimeout (10 s) and a ping after the crash; the step sleep keeps
    # the twenty-odd steps left longer than that on any machine.
    wait_until(lambda: slurm_cluster.node_states().get("node3", "").startswith("down"), 120,
               "Slurm to mark the crashed node3 down")
    assert all(o["kind"] != "finished" for o in outcomes(job)), \
        f"the job ended before Slurm dropped node3, nothing below could show: {outcomes(job)}"
    wait_done(env, job_id, job, timeout=500)
    assert outcomes(job)[-1]["kind"] == "finished", outcomes(job)
    # The report reads sacct, which slurmdbd fills a moment after the job ended: wait for the
    # last run's end there (bounded) so that the report is not judged on a lagging record.
    acct = sacct_rows(env, job_id, "State,Elapsed,End", "-D",
                      until=lambda rows: rows and rows[-1][0] == "COMPLETED" and rows[-1][2] != "Unknown")

    rep = hpc(env, "report", job_id, "--json")
    assert rep.returncode == 0, rep.stderr
    ledger = json.loads(rep.stdout)
    (job / "report.json").write_text(rep.stdout)
    a0, a1 = ledger["allocations"]
    assert (a0["kind"], a1["kind"]) == ("preempted", "finished")
    for a in (a0, a1):
        assert sum(a["categories"].values()) == pytest.approx(a["node_s"], rel=0.01)
        assert a["categories"]["unaccounted"] < 0.02 * a["node_s"], a["categories"]
        assert a["queue_s"] is not None and a["queue_s"] >= 0          # from sacct
    assert sum(ledger["categories"].values()) == pytest.approx(ledger["allocated_node_s"], rel=1e-6)
    # Slurm's own frame: one record per run, and a resized run (the node loss) in two records.
    elapsed, resizing = [], False
    for state, e, _ in acct:
        seconds = sum(int(x) * m for x, m in zip(e.split(":"), (3600, 60, 1)))
        elapsed[-1:] = [elapsed[-1] + seconds] if resizing else elapsed[-1:] + [seconds]
        resizing = state.startswith("RESIZING")
    assert len(elapsed) == 2, acct
    for a, e in zip((a0, a1), elapsed):
        assert abs(a["wall_s"] - e) <= max(2.0, 0.01 * e), (a["wall_s"], e)
    # node3 counts until Slurm dropped it from the job (the resize), not to the end.
    assert a1["node_ends"]["node3"] < a1["end"] - 1.0
    # ... and from the failure the survivors saw until then, its time is lost.
    assert a1["node_dead"]["node3"] <= a1["node_ends"]["node3"]
    # The preemption: handled in its own category, nothing lost, resumed at the saved step.
    assert a0["categories"]["preemption"] > 0 and a0["lost_steps"] == 0
    assert a1["start_step"] == saved == a0["last_step"]
    sigs = [m for m in a0["markers"] if m[1] in ("signal", "stop")]
    assert sigs and all(a0["start"] <= m[0] <= a0["end"] for m in sigs)
    # The node crash: a re-form inside the second allocation, the survivors resumed at the
    # checkpoint that was the latest when the node died, at most those steps since were lost.
    assert a1["restarts"] >= 1 and a1["categories"]["rendezvous"] > 0
    assert 0 <= a1["lost_steps"] <= 4
    assert ledger["lost_steps"] == a1["lost_steps"]
    restarts = [m for m in a1["markers"] if m[1] == "restart"]
    assert restarts and any(m[1] == "failure" for m in a1["markers"])
    assert ledger["checkpoint_interval"]["every_s"] >= 10 and ledger["interruptions"] >= 2
    # --checkpoint-interval auto:1h: recomputed at each start, shorter after each interruption.
    from hpc.contract.events import read_events

    chosen = [e for e in read_events(job) if e["ev"] == "ckpt_interval"]
    # The rule's optimum, before the 5-30 min bounds (which every_s keeps here: saves of ms).
    calm = [c["optimum_s"] for c in chosen if c["interruptions"] == 0 and c["source"] == "measured"]
    after = [c["optimum_s"] for c in chosen if c["interruptions"] >= 1]
    assert all(c["every_s"] == 300 for c in chosen)
    assert calm and len(after) >= 2 and max(after) < min(calm) and after == sorted(after, reverse=True)
    assert {c["alloc"] for c in chosen} == {0, 1}
    assert crashed_at_checkpoint >= saved + 4

    from tests.wandb_offline import read_run

    cfg = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip()).config
    assert cfg["goodput/lost_steps"] == ledger["lost_steps"] and cfg["goodput/interruptions"] == 2

    png = tmp_path / "goodput.png"
    pic = hpc(env, "report", str(job), "--png", str(png))
    assert pic.returncode == 0, pic.stderr
    from matplotlib.image import imread

    img = imread(str(png))
    assert img.shape[0] > 250 and img.std() > 0.05
