"""hpc report / hpc status tell the in-process recoveries (hpc.report.inproc, pure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hpc.report import inproc

DETECT = {"t": 100.0, "ev": "inproc_detect", "alloc": 0, "node": "node2", "pid": 4242, "rank": 2,
          "exit": "signal 9", "gen": 0}
RECOVERY = {"t": 100.5, "ev": "inproc_recovery", "alloc": 0, "node": "node1", "gen": 1,
            "reason": "all-reduce: Connection closed by peer", "world_size": 2, "old_world_size": 3,
            "old_rank": 0, "step": 9, "held": 9, "dirty": True, "source": 0, "left": ["node2/4242"],
            "t_detect": 100.1, "t_abort": 100.101, "t_reform": 100.25, "t_group": 100.26,
            "t_transfer": 100.5, "bytes": 2048}
FALLBACK = {"t": 130.0, "ev": "inproc_fallback", "alloc": 0, "node": "node3",
            "reason": "every local worker is gone"}
OTHER = {"t": 99.0, "ev": "steps", "alloc": 0, "first": 1, "last": 8, "t0": 90.0}


def test_each_recovery_is_one_line_with_its_stages_world_step_and_time_from_the_launchers_word():
    lines = inproc.story([FALLBACK, RECOVERY, OTHER, DETECT])   # any order: told in time order
    assert len(lines) == 3
    assert lines[0] == ("allocation 0: worker pid 4242 (rank 2) on node2 died (signal 9), "
                        "announced to generation 0")
    rec = lines[1]
    assert "generation 1: world 3 -> 2, going on from step 9" in rec
    assert "in 0.50s from the launcher's word" in rec   # 100.0 (launcher) -> 100.5 (state in place)
    assert "abort 0.001s, re-form 0.149s, group 0.010s, transfer 0.240s" in rec
    assert "cause: all-reduce: Connection closed by peer" in rec
    assert lines[2].startswith("allocation 0: node3 fell back to restarting its workers: every")


def test_a_recovery_without_the_launchers_word_counts_from_the_fault_seen():
    (r,) = inproc.recoveries([RECOVERY])
    assert r.detected_at is None and abs(r.end_s - 0.4) < 1e-9
    assert "from the fault seen" in r.line()


def test_a_word_about_another_generation_or_allocation_is_not_this_recoverys():
    other_gen = dict(DETECT, gen=3)
    other_alloc = dict(DETECT, alloc=1)
    (r,) = inproc.recoveries([RECOVERY, other_gen, other_alloc])
    assert r.detected_at is None


def test_the_running_note_counts_and_names_the_last():
    second = dict(RECOVERY, t=200.5, gen=2, world_size=2, old_world_size=2, step=30,
                  t_detect=200.0, t_abort=200.0, t_reform=200.1, t_group=200.2, t_transfer=200.3)
    assert inproc.note([RECOVERY, second]) == ("2 in-process recoveries, last: generation 2, "
                                               "world 2 -> 2, step 30, 0.30s")
    assert inproc.note([RECOVERY], allocation=1) == ""
    assert inproc.note([OTHER]) == ""


def test_hpc_report_prints_the_recoveries(tmp_path: Path):
    job = tmp_path / "job"
    job.mkdir()
    evs = [{"t": 90.0, "ev": "alloc_start", "alloc": 0, "node": "node1", "node_rank": 0},
           {"t": 91.0, "ev": "session_start", "alloc": 0, "node": "node1", "rank": 0, "restart": 0},
           {"t": 92.0, "ev": "loop_start", "alloc": 0, "node": "node1", "rank": 0, "restart": 0, "step": 0},
           dict(OTHER, node="node1", rank=0, restart=0), DETECT, RECOVERY]
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    r = subprocess.run([sys.executable, "-m", "hpc", "report", str(job)], capture_output=True,
                       text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert "in-process recoveries" in r.stdout and "world 3 -> 2, going on from step 9" in r.stdout, r.stdout


def test_hpc_status_notes_the_running_allocations_recoveries(tmp_path: Path):
    from hpc.status import running_notes

    job = tmp_path / "job"
    job.mkdir()
    (job / "events.jsonl").write_text(json.dumps(DETECT) + "\n" + json.dumps(RECOVERY) + "\n")
    assert "1 in-process recovery, last: generation 1, world 3 -> 2, step 9" in running_notes(job)


def test_a_death_announced_by_a_lifeline_or_a_beacon_names_the_workers_and_how():
    # Before, these read "worker pid None (rank None) ... died (?)".
    lifeline = {"t": 1.0, "ev": "inproc_detect", "alloc": 0, "node": "node1", "by": "lifeline",
                "workers": ["node3/4832"], "lost_node": "node3", "launcher": "node3/4687",
                "launcher_gone": True, "gen": 0}
    beacon = {"t": 6.0, "ev": "inproc_detect", "alloc": 0, "node": "node1", "lost_node": "node3",
              "lost_rank": 2, "silent_s": 5.47, "workers": [], "gen": 1}
    a, b = inproc.story([lifeline, beacon])
    assert a == ("allocation 0: worker(s) node3/4832 announced dead by node1: its lifeline closed with its "
                 "launcher's (node lost); generation 0")
    assert "none announced dead by node1: node node3 lost (beacon still 5.47s)" in b and "None" not in a + b
