"""A second fault during an in-process recovery re-forms again, in process (issue 26).

Four Session workers (``scripts/inproc_train.py``, DDP, gloo) train with ``HPC_RECOVERY=inprocess``
on a store this test hosts, as the launcher does. Rank 3 dies (SIGKILL, as a node dies) at step
6; the three survivors re-form (generation 1) and rank 0, the source of the state, dies in the
middle of sending it (after its first tensor broadcast: its peers are part way through the
transfer). A cascading fault like this one (a node's switch neighbour going seconds later) used
to escape the recovery: every survivor exited 1 and the job fell back to torch's restart path.

The outcome a user cares about: the two last survivors re-form again without the dead source
(generation 2, no restart, no fallback), are the same processes, read no checkpoint, finish the
run with bit-equal replicas, the sample order exact and the global batch constant.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest

from tests.distributed.inprocess_support import (GLOBAL_BATCH, STEPS, expected_batches, logs, result_of,
                                                 run_world, steps_of)

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]


def test_the_source_dying_during_the_state_transfer_leads_to_another_in_process_re_form(tmp_path: Path):
    procs, codes, out = run_world(tmp_path, fault="3:6:kill,0:1:transfer", world=4, window_s=6.0,
                                   extra=("--micro", "1"))   # 12 samples a step at worlds 4, 3 and 2
    text = logs(procs)
    assert codes == [-9, 0, 0, -9], text
    survivors = procs[1:3]
    results = [result_of(out, p.pid) for p in survivors]
    # The same processes finished the run (no restart), at the last step, on a world of 2.
    assert [r["pid"] for r in results] == [p.pid for p in survivors]
    assert [r["step"] for r in results] == [STEPS, STEPS] and [r["world"] for r in results] == [2, 2]
    assert results[0]["weights"] == results[1]["weights"], "replicas differ after the second re-form"
    ckpt = str(tmp_path / "job" / "checkpoints")
    for r in results:
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
        assert r["sampler"]["cursor"] == STEPS * GLOBAL_BATCH   # the global batch stayed 12
    for p in survivors:
        ran = steps_of(out, p.pid)
        twice = [s for s, n in collections.Counter(x["step"] for x in ran).items() if n > 1]
        assert len(twice) <= 1, f"steps computed twice: {twice}"
        assert {x["world"] for x in ran} == {4, 2}, "a step ran in the generation whose recovery failed"
        assert all(x["n"] == GLOBAL_BATCH for x in ran)
        last = {x["step"]: x["first"] for x in ran}
        assert [last[k] for k in range(STEPS)] == expected_batches()   # the sample order is exact
    events = [json.loads(x) for x in (tmp_path / "job" / "events.jsonl").read_text().splitlines() if x.strip()]
    assert not [e for e in events if e["ev"] == "inproc_fallback"], events
    rec = [e for e in events if e["ev"] == "inproc_recovery"]
    # Generation 1's recovery failed in its transfer (its rank 0, which would have recorded it,
    # is the one that died); generation 2 went on from the same step with the two left.
    assert len(rec) == 1, rec
    [second] = rec
    assert second["gen"] == 2 and second["world_size"] == 2 and second["step"] == 7, second
    [retry] = second["retries"]
    assert retry["gen"] == 1 and retry["stage"] == "transfer" and retry["holds"] == 7, retry
    assert "a second fault" in text and "re-forming again" in text, text


def test_a_second_fault_during_an_fsdp2_shard_transfer_falls_back_to_the_checkpoint_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # FSDP2 (two local "nodes" x 2, real launchers): node 1's workers die, the launcher starts
    # them again as joiners, and in generation 1's shard transfer rank 0, which holds rank 2's
    # copy, dies after the first shard's move. Shards may be half moved: the state is not
    # taken from memory (no rank may train on mixed state); the disk checkpoint is, and the
    # fallback's reason names the second fault.
    from tests.distributed.inprocess_fsdp_support import events, hpc_run, kill_ranks, results

    t0 = time.time()
    monkeypatch.setenv("HPC_TEST_INPROC_FAULT", "0:1:transfer")
    out, job = tmp_path / "out", tmp_path / "job dir"
    # The kill waits for the step-4 checkpoint's commit (an asynchronous save: killed before it,
    # its writers lost, there is no checkpoint to fall back to); 40 steps leave the job running.
    run = hpc_run(out, job, "--checkpoint-every-steps", "4", steps=40)
    try:
        kill_ranks(run, out, {2, 3}, 6, time.time() + 240,
                   ready=lambda: (job / "checkpoints" / "step-000004").is_dir())
        text, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, text[-5000:]
    ev = events(job)
    fallback = [e for e in ev if e["ev"] == "inproc_fallback"]
    assert any("a second fault during the recovery into generation 1 (transfer)" in e["reason"]
               and "half moved" in e["reason"] for e in fallback), (fallback, text[-5000:])
    assert not [e for e in ev if e["ev"] == "inproc_recovery"], "a generation went on from mixed state"
    restored = [e for e in ev if e["ev"] == "restore_end" and e.get("from_checkpoint")]
    assert restored and restored[-1]["step"] >= 4, "the restart path did not resume from the checkpoint"
    assert {r["step"] for r in results(out).values()} == {40}
    print(f"second fault in the shard transfer -> fallback, resumed from step {restored[-1]['step']}; "
          f"test took {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
