"""FSDP2 under ``hpc run --recovery inprocess``: a lost rank's shards come from their peer copy.

Two local "nodes" x 2 processes (real launchers, torch's elastic agent, gloo), an FSDP2 model
with AdamW. Each rank keeps a copy of the shards of the rank at its place on the other node.

- Both workers of node 1 (ranks 2 and 3: every shard of the node) are SIGKILLed at once: its
  launcher starts them again as joiners, the survivors (same PIDs) and the joiners agree on the
  newest step every shard has, each joiner receives its shards from the holder of its copy on
  node 0, no checkpoint file is read, and the job ends with weights bit-equal to an
  uninterrupted run beside it.
- A whole node is lost (its launcher and its worker SIGKILLed, 2 nodes x 1 process and a hot
  spare node): the spare's worker joins at the lost rank's place and receives its shards from
  the copy on the surviving node; the survivor keeps its PID, weights bit-equal.
- Both holders of a shard (rank 0 and rank 2 hold each other's copies) are SIGKILLed at once:
  no copy of their shards is left, so the new generation falls back to the restart path, an
  ``inproc_fallback`` event names the shards, and the job resumes from the last checkpoint and
  finishes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from tests.distributed.inprocess_fsdp_support import STEPS, events, hpc_run, kill_ranks, results
from tests.distributed.inprocess_support import lines
from tests.distributed.support import launcher_pid

pytestmark = pytest.mark.distributed


def test_a_nodes_killed_workers_shards_come_from_the_peer_copies_and_the_weights_are_the_uninterrupted_ones(
        tmp_path: Path):
    t0 = time.time()
    plain = hpc_run(tmp_path / "plain out", tmp_path / "plain job")   # the uninterrupted run, beside
    out, job = tmp_path / "out", tmp_path / "job dir"
    run = hpc_run(out, job)
    try:
        killed = kill_ranks(run, out, {2, 3}, 5, time.time() + 240)
        originals = set(lines(out))
        text, _ = run.communicate(timeout=240)
        plain_text, _ = plain.communicate(timeout=240)
    finally:
        for p in (run, plain):
            if p.poll() is None:
                p.kill()
    assert run.returncode == 0, text[-5000:]
    assert plain.returncode == 0, plain_text[-3000:]
    got = results(out)
    joiners = set(got) - originals
    assert len(joiners) == 2 and set(got) == (originals - set(killed)) | joiners, (sorted(got), killed)
    assert {r["step"] for r in got.values()} == {STEPS} and {r["world"] for r in got.values()} == {4}
    expected = results(tmp_path / "plain out")
    assert {r["weights"] for r in got.values()} == {next(iter(expected.values()))["weights"]}, \
        "not the uninterrupted run's weights"
    ckpt = str(job / "checkpoints")
    for r in got.values():   # no checkpoint file read to recover or to join
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
    rec = [e for e in events(job) if e["ev"] == "inproc_recovery"]
    assert len(rec) == 1 and rec[0]["world_size"] == 4, rec
    # Node 1's shards from the copies on node 0 (rank 2's at rank 0, rank 3's at rank 1).
    assert rec[0]["shards"]["2"] == [0, "peer"] and rec[0]["shards"]["3"] == [1, "peer"], rec
    # A copy step (every 2); the kill may land during an exchange: the copy before it is used.
    assert rec[0]["step"] % 2 == 0 and rec[0]["step"] >= 2, rec
    assert sorted(got[j]["rank"] for j in joiners) == [2, 3], [got[j] for j in joiners]
    joiner = got[min(joiners)]
    assert joiner["copies_made"] > 0, joiner   # the joiners keep copies again
    print(f"peer-copy recovery: step {rec[0]['step']}, {rec[0]['bytes']} bytes moved by rank 0; copy "
          f"{joiner['copy_bytes']} bytes/rank, held {joiner['held_bytes']} bytes; test took "
          f"{time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")


def _crash_node_1(run, out: Path, job: Path, ready, gone: Collection[int] = ()) -> int:
    """Once rank 1 has run 5 steps and ``ready()``: node rank 1's launcher and worker are
    SIGKILLed (the node crashes). Returns rank 0's PID (``gone``: workers killed before)."""
    deadline = time.time() + 240
    while True:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        ran = lines(out)
        victim = next((p for p, r in ran.items() if r and r[0]["rank"] == 1 and len(r) >= 5
                       and p not in gone), None)
        if victim is not None and ready():
            break
        time.sleep(0.05)
    os.killpg(launcher_pid(job, 1), signal.SIGKILL)
    os.kill(victim, signal.SIGKILL)
    return next(p for p, r in ran.items() if r and r[0]["rank"] == 0 and p not in gone)


def test_a_lost_nodes_shards_go_to_a_hot_spare_from_the_peer_copy(tmp_path: Path):
    t0 = time.time()
    plain = hpc_run(tmp_path / "plain out", tmp_path / "plain job", nproc=1, window_s=5)
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, "--spare-nodes", "1", nproc=1, window_s=5)
    try:
        # The spare's joiner must wait in the store when the node is lost (at load its start
        # took longer than 5 steps: that case is the next test's).
        survivor = _crash_node_1(run, out, job, ready=lambda: any(
            e["ev"] == "spare_ready" for e in events(job)))
        text, _ = run.communicate(timeout=240)
        plain_text, _ = plain.communicate(timeout=240)
    finally:
        for p in (run, plain):
            if p.poll() is None:
                p.kill()
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == STEPS, (outcome, text[-5000:])
    assert plain.returncode == 0, plain_text[-3000:]
    got = results(out)
    assert survivor in got and len(got) == 2, (sorted(got), survivor)   # the survivor kept its PID
    [spare] = set(got) - {survivor}
    assert got[spare]["rank"] == 1 and {r["step"] for r in got.values()} == {STEPS}
    expected = results(tmp_path / "plain out")
    assert {r["weights"] for r in got.values()} == {next(iter(expected.values()))["weights"]}
    for r in got.values():
        assert not [f for f in r["opened_while_recovering"] if f.startswith(str(job / "checkpoints"))], r
    rec = [e for e in events(job) if e["ev"] == "inproc_recovery"]
    assert len(rec) == 1 and rec[0]["shards"]["1"] == [0, "peer"], rec
    print(f"lost node -> spare: shards of step {rec[0]['step']} from rank 0's copy; test took "
          f"{time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")


def test_a_node_lost_while_the_spare_still_starts_falls_back_and_the_spare_joins_the_restart(tmp_path: Path):
    """The spare's joiner is not in the store yet (a slow start: it sleeps first), so the FSDP2
    world would shrink: the survivor gives up in-process recovery, and the spare's launcher
    ends its joiner and joins torch's rendezvous, so the restart has the job's two nodes (it
    once waited for a second node until the rendezvous timeout) and the job finishes."""
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, "--spare-nodes", "1", nproc=1, window_s=5, script_args=("--joiner-sleep", "900"))
    try:
        _crash_node_1(run, out, job, ready=lambda: True)
        text, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == STEPS, (outcome, text[-5000:])
    ev = events(job)
    assert any(e["ev"] == "inproc_fallback" and e.get("spare") and "joins torch's rendezvous" in e["reason"]
               for e in ev), [e for e in ev if e["ev"] == "inproc_fallback"]
    assert not any(e["ev"] == "spare_ready" for e in ev)
    got = results(out)
    assert len(got) == 2 and {r["step"] for r in got.values()} == {STEPS} \
        and {r["world"] for r in got.values()} == {2}, got
    assert len({r["weights"] for r in got.values()}) == 1
    print(f"node lost before the spare was ready -> restart path with the spare; test took "
          f"{time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")


def test_after_every_member_started_again_the_spare_still_replaces_a_lost_node(tmp_path: Path):
    """Both workers killed at once: no member is left, every launcher takes torch's restart
    path into a new round (a new namespace) that does not need the spare. The spare's joiners
    start again in the new round (they once waited in the old one, where nobody would take
    them in), so a node lost after the restart is still replaced from the peer copy."""
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job"
    # 1.5-s steps: the job still runs when the spare's new joiners are ready, whatever the load.
    run = hpc_run(out, job, "--spare-nodes", "1", nproc=1, window_s=5, steps=30,
                  script_args=("--step-sleep", "1.5"))
    try:
        first = kill_ranks(run, out, {0, 1}, 2, time.time() + 240,
                           ready=lambda: any(e["ev"] == "spare_ready" for e in events(job)))
        survivor = _crash_node_1(run, out, job, gone=first, ready=lambda: sum(
            e["ev"] == "spare_ready" for e in events(job)) >= 2)
        text, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["step"] == 30, (outcome, text[-5000:])
    got = results(out)
    assert survivor in got and len(got) == 2 and not set(first) & set(got), (sorted(got), survivor, first)
    assert {r["step"] for r in got.values()} == {30} and {r["world"] for r in got.values()} == {2}
    assert len({r["weights"] for r in got.values()}) == 1
    rec = [e for e in events(job) if e["ev"] == "inproc_recovery"]
    assert rec and rec[-1]["shards"]["1"] == [0, "peer"], rec
    print(f"all members restarted, then a node lost -> spare from the peer copy at step {rec[-1]['step']}; "
          f"test took {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")


def test_both_copies_of_a_shard_lost_falls_back_to_the_checkpoint_and_says_which(tmp_path: Path):
    t0 = time.time()
    out, job = tmp_path / "out", tmp_path / "job dir"
    # The step-4 save is asynchronous: its commit (the rename to step-000004/) may come after
    # step 6 under load, and a kill before it leaves no checkpoint (CI of 7336388: a restart from
    # step 0, as it should). The kill waits for the commit; 40 steps leave the job running.
    run = hpc_run(out, job, "--checkpoint-every-steps", "4", steps=40)
    try:
        kill_ranks(run, out, {0, 2}, 6, time.time() + 240,
                   ready=lambda: (job / "checkpoints" / "step-000004").is_dir())
        text, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, text[-5000:]
    ev = events(job)
    fallback = [e for e in ev if e["ev"] == "inproc_fallback"]
    assert any("rank(s) 0, 2 have no copy left" in e["reason"] for e in fallback), fallback
    restored = [e for e in ev if e["ev"] == "restore_end" and e.get("from_checkpoint")]
    assert restored and restored[-1]["step"] >= 4, "the restart path did not resume from the checkpoint"
    assert {r["step"] for r in results(out).values()} == {40}
    print(f"both copies lost -> fallback, resumed from step {restored[-1]['step']}; test took "
          f"{time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
