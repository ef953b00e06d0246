"""The example GPT on a 2-D mesh (FSDP2 x tensor parallel) through ``hpc run``, on real gloo
processes: it trains like the unsplit model, resumes bit-exact at the same mesh, and a
checkpoint saved at ``dp 2 x tp 2`` resumes at ``dp 1 x tp 2`` (a lost node's survivors) with
the loss continuing where it was and the sample cursor exact.

Four processes on two cores: the model is the tiny preset and the runs are 10 steps.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed.mesh_support import losses, result, run

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run at dp 2 x tp 2."""
    job = tmp_path_factory.mktemp("mesh") / "reference"
    code, out = run(job, 4, hpc_args=("--tp", "2"))
    assert code == 0, out
    assert "world 4 (dp_shard 2 x tp 2), global batch 16 = 2 x 4 x 2 accumulation" in out, out
    return job


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Rank 0 fails in step 7 once; torch's agent restarts the workers, which resume from the
    step-5 checkpoint (DTensor shards through DCP). Each rank's writes take 2 s (a slow file
    system): the async save of step 5 is still in flight when rank 0 fails."""
    job = tmp_path_factory.mktemp("mesh") / "crash"
    code, out = run(job, 4, "--fail-at-step", "7", "--fail-once",
                    hpc_args=("--tp", "2", "--checkpoint-every-steps", "5",
                              "--env", "HPC_CKPT_TEST_WRITE_DELAY_S=2"))
    assert code == 0, out
    return job, out


def test_fsdp_x_tp_trains_as_the_unsplit_model_does(reference: Path, tmp_path: Path) -> None:
    """The same steps on one process with the whole model: the split model computes the same
    losses (to float rounding: TP sums partial products in another order)."""
    job = tmp_path / "whole"
    code, out = run(job, 1)
    assert code == 0, out
    ours, theirs = losses(reference), losses(job)
    assert sorted(ours) == list(range(1, 11)) == sorted(theirs)
    assert all(abs(ours[s] - theirs[s]) < 1e-3 for s in ours), (ours, theirs)
    assert result(reference)["sample_order_sha256"] == result(job)["sample_order_sha256"]


def test_a_crash_resumes_bit_exact_at_the_same_mesh(reference: Path, crashed: tuple[Path, str]) -> None:
    job, out = crashed
    assert "injected failure at step 7" in out and "start step 5" in out, out
    assert result(job)["weights_sha256"] == result(reference)["weights_sha256"]
    assert result(job)["sample_order_sha256"] == result(reference)["sample_order_sha256"]


def test_a_crash_while_an_async_save_is_in_flight_resumes_from_that_save(crashed: tuple[Path, str]) -> None:
    """The crashed rank waits (bounded) for the save its peers are still writing before it
    exits, so the restart resumes at step 5, not at step 0. Before the fix it exited at once,
    the agent ended its peers mid-save and the save was lost (CI of 32c4e0b, pipeline test)."""
    _, out = crashed
    assert "injected failure at step 7" in out, out
    assert "after the error: the async save of step 5 is committed" in out, out
    assert out.count("start step 0") == 1 and "start step 5" in out, out   # the restart: at 5


def test_a_checkpoint_at_dp2_x_tp2_resumes_at_dp1_x_tp2(reference: Path, crashed: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    """The step-5 checkpoint of 4 ranks, resumed on 2 ranks of one TP group (a lost node's
    survivors): the loss goes on from the reference's, and the samples consumed are the same
    ones in the same order (the global batch is constant: accumulation doubles)."""
    job = tmp_path / "reshard"
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(crashed[0] / "checkpoints" / "step-000005", ckpt / "step-000005")
    code, out = run(job, 2, hpc_args=("--tp", "2", "--checkpoint-dir", str(ckpt)))
    assert code == 0, out
    assert "world 2 (tp 2), global batch 16 = 1 x 4 x 4 accumulation" in out, out
    assert "start step 5" in out and "(saved at world size 4, now 2)" in out, out
    ours, ref = losses(job), losses(reference)
    assert sorted(ours) == list(range(6, 11)), ours
    assert all(abs(ours[s] - ref[s]) < 1e-3 for s in ours), (ours, ref)
    final, expected = result(job), result(reference)
    assert (final["cursor"], final["epoch"]) == (expected["cursor"], expected["epoch"])
    assert final["sample_order_sha256"] == expected["sample_order_sha256"]
    assert final["mesh"] == "tp 2" and final["final_step"] == 10


NO_MESH = """
from runtime.session import Session
with Session() as s:
    print("trained on a mesh of", s.world_size)
"""


def test_survivors_that_cannot_form_a_whole_pipeline_end_cleanly_for_a_requeue(tmp_path: Path) -> None:
    """A job of 2 to 4 nodes x 1 process with 2 pipeline stages, left with 3 ranks: no rank
    trains on a wrong mesh; every rank exits 0 and rank 0's exit intent is a node failure,
    which the launcher classifies as such and Slurm requeues."""
    from hpc.contract.jobspec import JobSpec
    from runtime.ending.outcome import classify
    from runtime.ending.requeue import decide_requeue

    job = tmp_path / "job"
    job.mkdir()
    (job / "jobspec.json").write_text(JobSpec(script="s", nodes=(2, 4), nproc_per_node=1, pp=2,
                                              job_dir=str(job)).to_json())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-c", NO_MESH], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled",
                        "HPC_JOB_DIR": str(job), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1"})
        for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert not any("trained" in o for o in outs), outs
    intent = json.loads((job / "exit-intent.json").read_text())
    assert intent["kind"] == "node_failure", intent
    assert "a world of 3 ranks cannot form whole groups of tp 1 x pp 2 = 2 ranks" in intent["reason"]
    kind = classify("succeeded", intent, intent["allocation"])
    assert kind == "node_failure"
    assert decide_requeue(kind, policy="auto", allocation=0, max_requeues=20, under_slurm=True).requeue
