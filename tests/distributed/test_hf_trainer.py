"""examples/hf_trainer_resume.py under `hpc run`: a real Trainer on real torchrun (issue 30).

The finding this pins: the Trainer alone ignores the warning and resumes (with transformers'
``get_last_checkpoint``) from whatever ``checkpoint-N`` is newest, even one a SIGTERM cut
short; with ``HPCCallback`` it saves on the warning, exits 75, and the next run resumes from
that save to exactly the weights of an uninterrupted run, in one W&B run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed.own_script_support import env_for, launcher_pid, outcomes, wait_for
from tests.wandb_offline import read_run

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "examples" / "hf_trainer_resume.py"
STEPS = 24


def hpc_run(tmp: Path, job: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
                             "--job-dir", str(job), "--", "--steps", str(STEPS), "--save-steps", "5",
                             "--out", str(job / "result.json"), *args],
                            cwd=REPO, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(p: subprocess.Popen[str], timeout: float = 150) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return out


@pytest.mark.timeout(300)
def test_trainer_saves_on_the_warning_exits_75_and_resumes_exactly_in_one_wandb_run(tmp_path: Path):
    job, ref = tmp_path / "job", tmp_path / "reference"
    p = hpc_run(tmp_path, job, "--step-sleep", "0.3", "--wandb")
    reference = hpc_run(tmp_path, ref)
    try:
        wait_for(lambda: (job / "checkpoints" / "checkpoint-5" / "trainer_state.json").exists(), 150,
                 "the Trainer's checkpoint-5")
        os.kill(launcher_pid(job), signal.SIGUSR2)        # the warning, as Slurm sends it
    finally:
        out = finish(p)
    assert p.returncode == 75, out[-3000:]
    [record] = outcomes(job)
    assert (record["kind"], record["exit_code"]) == ("preempted", 75), record
    assert record["reason"] == "SIGUSR2 (preempted): the script stopped for it (exit 75)", record
    rank0 = (job / "logs/alloc-0/restart-0/rank-0.log").read_text(errors="replace")
    [line] = [x for x in rank0.splitlines() if "[hpc] SIGUSR2 (preempted) at step" in x]
    stopped = int(line.split("at step ")[1].split(":")[0])
    assert 5 < stopped < STEPS, line                       # saved on the warning, not at save_steps
    assert (job / "checkpoints" / f"checkpoint-{stopped}" / "trainer_state.json").exists()
    assert "done" not in rank0.split(line)[1], "the script went on after the stop"

    again = hpc_run(tmp_path, job, "--wandb")
    out = finish(again)
    assert again.returncode == 0, out[-3000:]
    assert f"resuming from {job / 'checkpoints' / f'checkpoint-{stopped}'}" in out, out[-3000:]
    assert [o["kind"] for o in outcomes(job)] == ["preempted", "finished"]

    ref_out = finish(reference)
    assert reference.returncode == 0, ref_out[-3000:]
    got = json.loads((job / "result.json").read_text())
    expected = json.loads((ref / "result.json").read_text())
    assert got["steps"] == expected["steps"] == STEPS
    assert got["weights"] == expected["weights"]            # the resume is exact

    # The Trainer's own WandbCallback (wandb.init with no id) continued the job's one run.
    run_id = (job / "wandb_run_id").read_text().strip()
    run = read_run(job / "wandb", run_id)
    assert run.run_ids == {run_id} and len(run.files) == 2, (run.run_ids, run.files)
    logged = {int(r["train/global_step"]) for r in run.history if "train/loss" in r}
    assert logged == set(range(1, STEPS + 1)), sorted(logged)


def test_last_checkpoint_skips_and_sets_aside_a_save_cut_short(tmp_path: Path, monkeypatch):
    """What a SIGTERM in the middle of ``_save_checkpoint`` leaves: no trainer_state.json."""
    from transformers.trainer_utils import get_last_checkpoint

    from runtime.integrations.hf import last_checkpoint

    out = tmp_path / "out put's"
    for step in (5, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x")
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    cut = out / "checkpoint-15"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"half")
    assert get_last_checkpoint(str(out)) == str(cut)        # transformers' own: the cut one

    monkeypatch.setenv("RANK", "1")                         # other ranks skip it, rename nothing
    assert last_checkpoint(out) == str(out / "checkpoint-10") and cut.exists()
    monkeypatch.setenv("RANK", "0")
    assert last_checkpoint(out) == str(out / "checkpoint-10")
    assert not cut.exists()
    [aside] = out.glob("checkpoint-15.incomplete-*")
    assert (aside / "model.safetensors").read_bytes() == b"half"   # kept, not deleted
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-10")
    assert last_checkpoint(tmp_path / "missing") is None and last_checkpoint(None) is None


def test_the_callback_stops_for_a_warning_mid_run_but_not_at_the_last_step(monkeypatch):
    """One process (no group): the decision alone. A warning during the last step is no stop:
    the work is done and the script must end as finished, not be requeued to train 0 steps."""
    from transformers import TrainerControl, TrainerState

    from runtime.integrations.hf import STOPPED_EXIT, HPCCallback

    env = {"HPC_WARNING_SIGNAL": "SIGUSR2"}
    last = HPCCallback(environ=env)
    os.kill(os.getpid(), signal.SIGUSR2)                 # recorded by its handler, nothing else
    control = TrainerControl()
    last.on_step_end(None, TrainerState(global_step=10, max_steps=10), control)
    assert not last.stopped and not control.should_save
    last.on_train_end(None, TrainerState(global_step=10, max_steps=10), control)   # no exit

    mid = HPCCallback(environ=env | {"HPC_PENDING_WARNING": "SIGUSR2@1.0"})   # came before it existed
    control = TrainerControl()
    mid.on_step_end(None, TrainerState(global_step=4, max_steps=10), control)
    assert mid.stopped and control.should_save and control.should_training_stop
    with pytest.raises(SystemExit) as leaving:
        mid.on_train_end(None, TrainerState(global_step=4, max_steps=10), control)
    assert leaving.value.code == STOPPED_EXIT
    assert signal.getsignal(signal.SIGUSR2) is not mid._watcher._record   # handler given back
