"""The example trainer through `hpc run`, as a user runs it: deterministic, and an interrupted
run (stopped by the warning signal and resumed, several times, even at another world size)
ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.listeners import LOOPBACK, listeners, workers_of
from tests.wandb_offline import read_run

pytestmark = pytest.mark.distributed
TRAIN = REPO / "examples" / "train_gpt.py"


def start(job: Path, nproc: int = 2, *train_args: str, hpc_args: tuple[str, ...] = (),
          env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpc", "run", str(TRAIN), "--nproc-per-node", str(nproc),
           "--job-dir", str(job), *hpc_args, "--", "--preset", "tiny", *train_args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def result(job: Path) -> dict:
    return json.loads((job / "result.json").read_text())


def interrupt_after(p: subprocess.Popen, job: Path, seconds: float,
                    signals: tuple[int, ...] = (signal.SIGUSR2,)) -> tuple[int, str]:
    """Waits until this run trains, lets it go `seconds`, then sends the warning signal."""
    log = job / "logs"

    def started() -> int:
        return sum("start step" in f.read_text(errors="replace")
                   for f in log.glob("alloc-*/restart-*/rank-0.log"))

    # A resumed job's logs of earlier runs also say "start step": wait for one more. (A signal
    # sent before this run's launcher is up would kill it before it could handle the signal.)
    before = started()
    end = time.time() + 120
    while time.time() < end and started() <= before:
        time.sleep(0.1)
    time.sleep(seconds)
    for sig in signals:
        p.send_signal(sig)
        time.sleep(0.05)
    return finish(p)


@dataclass
class Baseline:
    """The module's uninterrupted run (its result.json, console output and job directory)."""

    result: dict
    out: str
    job: Path

    def __getitem__(self, key: str) -> object:
        return self.result[key]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """The uninterrupted run every test compares against; with a progress line every 10 steps of
    0.1 s, so that the console test reads its output instead of training a job of its own."""
    job = tmp_path_factory.mktemp("baseline") / "job"
    code, out = finish(start(job, 2, "--log-every", "10", "--step-sleep", "0.1"))
    assert code == 0, out
    return Baseline(result(job), out, job)


def test_same_seed_same_weights_and_an_inherited_wandb_service_is_not_used(baseline: Baseline,
                                                                          tmp_path: Path):
    """The same job again (with another step sleep than the baseline's) ends with the same
    weights and samples. And (one job for all three, to keep CI short) a job started from a
    process that used wandb inherits WANDB_SERVICE (wandb exports it): rank 0 must start its
    own service, not log into the starter's (gone here); and with --log-every 20 the console
    has the progress lines of steps 20 and 40 only (20 steps of >= 0.07 s: the one-a-second
    limit drops none)."""
    from wandb.sdk.lib.service.service_token import UnixServiceToken

    gone = UnixServiceToken(parent_pid=os.getpid(), path=str(tmp_path / "gone.sock")).env_value
    job = tmp_path / "job"
    code, out = finish(start(job, 2, "--log-every", "20", "--step-sleep", "0.07",
                             env={**os.environ, "WANDB_SERVICE": gone}))
    assert code == 0, out
    assert {20, 40} <= set(progress_lines(out)) and not {10, 30} & set(progress_lines(out)), out
    again = result(job)
    assert again["weights_sha256"] == baseline["weights_sha256"]
    assert again["sample_order_sha256"] == baseline["sample_order_sha256"]
    assert again["final_step"] == 40
    assert (job / "checkpoints" / "step-000040" / "manifest.json").exists()
    assert not (job / "metrics.jsonl").exists(), "W&B failed and fell back to JSONL"
    run = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip())
    assert max(run.steps) == 40
    launcher_logs = "".join(p.read_text() for p in (job / "logs" / "alloc-0").glob("node-*.log"))
    assert f"WANDB_SERVICE: {gone!r} -> (unset)" in launcher_logs  # the change is logged


def test_three_stops_and_resumes_end_bit_exact(baseline: Baseline, tmp_path: Path):
    job = tmp_path / "interrupted job"
    stops = []
    for i in range(3):
        # 0.3-0.6 s of training each (~14 steps/s): three stops land inside the 40 steps.
        code, out = interrupt_after(start(job, 2, "--step-sleep", "0.05"), job, 0.3 + 0.15 * i)
        assert code == 75, out                       # stopped on the warning, resumable
        outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
        assert outcome["kind"] in ("time_limit", "preempted"), outcome
        stops.append(outcome["step"])
    assert stops == sorted(stops) and stops[0] > 0 and stops[-1] < 40, stops
    code, out = finish(start(job, 2, "--step-sleep", "0.05"))
    assert code == 0, out
    final = result(job)
    assert final["weights_sha256"] == baseline["weights_sha256"]
    assert final["sample_order_sha256"] == baseline["sample_order_sha256"]
    # One W&B run for the whole job, each step logged once.
    run = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip())
    assert len(run.run_ids) == 1
    assert sorted(run.steps) == sorted(set(run.steps)) and max(run.steps) == 40


def test_world_size_change_consumes_every_sample_once(baseline: Baseline, tmp_path: Path):
    job = tmp_path / "elastic"
    code, out = interrupt_after(start(job, 2, "--step-sleep", "0.05"), job, 0.8)
    assert code == 75, out
    assert "checkpoint: saved step-" in out           # the stop's save, visible to the user
    code, out = finish(start(job, 1))                 # resume on one process
    assert code == 0, out
    assert "(saved at world size 2, now 1)" in out and "checkpoint: resumed from" in out
    final = result(job)
    assert final["world_size"] == 1 and final["final_step"] == 40
    # Same global batches in the same order: the consumed stream is identical.
    assert final["sample_order_sha256"] == baseline["sample_order_sha256"]
    assert final["cursor"] == baseline["cursor"] and final["epoch"] == baseline["epoch"]
    assert abs(final["final_loss"] - baseline["final_loss"]) < 0.05


def test_fsdp2_trains_and_resumes(tmp_path: Path):
    job = tmp_path / "fsdp"
    code, out = interrupt_after(start(job, 2, "--fsdp", "--step-sleep", "0.05"), job, 0.8)
    assert code == 75, out
    code, out = finish(start(job, 2, "--fsdp"))
    assert code == 0, out
    ref = tmp_path / "fsdp-ref"
    code, out = finish(start(ref, 2, "--fsdp"))
    assert code == 0, out
    assert result(job)["weights_sha256"] == result(ref)["weights_sha256"]


def test_sigterm_and_repeated_signals_during_saves_resume_exactly(baseline: Baseline, tmp_path: Path):
    """A checkpoint every step, so the warnings land in the middle of saves; SIGTERM (a
    preemption without a user signal) then USR2 (twice): no corrupt checkpoint, exact resume."""
    job = tmp_path / "busy"
    every = ("--checkpoint-every-steps", "1", "--keep-last", "2")
    code, out = interrupt_after(start(job, 2, "--step-sleep", "0.05", hpc_args=every), job, 0.7,
                                signals=(signal.SIGTERM,))
    assert code == 75, out
    assert json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])["kind"] == "preempted"
    code, out = interrupt_after(start(job, 2, "--step-sleep", "0.05", hpc_args=every), job, 0.7,
                                signals=(signal.SIGUSR2, signal.SIGUSR2))
    assert code == 75, out
    code, out = finish(start(job, 2, "--step-sleep", "0.05", hpc_args=every))
    assert code == 0, out
    assert not list((job / "checkpoints").glob("*corrupt*")), "a checkpoint was found corrupt"
    final = result(job)
    assert final["weights_sha256"] == baseline["weights_sha256"]
    assert final["sample_order_sha256"] == baseline["sample_order_sha256"]


def test_quick_start_crash_resumes_from_a_checkpoint_with_default_settings(tmp_path: Path):
    """The quick start's job with no checkpoint flag at all; rank 0 crashes in step 60 (once):
    torch's agent restarts the workers, which resume from the auto interval's first save (20
    steps in), not from step 0, and end with the weights of an uninterrupted run."""
    steps = ("--max-steps", "80", "--step-sleep", "0.05")
    ref = tmp_path / "uninterrupted"
    code, out = finish(start(ref, 2, *steps))
    assert code == 0, out
    job = tmp_path / "crashed"
    code, out = finish(start(job, 2, *steps, "--fail-at-step", "60", "--fail-once"))
    assert code == 0, out
    assert "injected failure at step 60" in out
    restarted = (job / "logs" / "alloc-0" / "restart-1" / "rank-0.log").read_text()
    assert "start step 20" in restarted, restarted[-2000:]
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["restarts"] == 1, outcome
    assert result(job)["weights_sha256"] == result(ref)["weights_sha256"]
    assert result(job)["sample_order_sha256"] == result(ref)["sample_order_sha256"]
    assert "hpc run: warning" not in out               # a Session script, auto interval: no warning


def progress_lines(out: str) -> dict[int, str]:
    """Rank 0's progress lines by step: ``step 10/40 (25.0%) | ... | loss 3.4112 | eta 6s``."""
    import re

    return {int(m.group(1)): m.group(0) for m in re.finditer(r"step (\d+)/\d+ \(.*", out)}


def test_the_console_follows_log_every_and_agrees_with_the_result(baseline: Baseline):
    """--log-every N: a progress line every N steps (steps of >= 0.1 s, so the one-a-second
    limit does not drop any; the baseline's run, --log-every 10); the last line's loss is the
    final line's and result.json's; the same command on the finished job dir again does nothing
    and keeps result.json. (--log-every 20: in the same-seed test's run.)"""
    job, out = baseline.job, baseline.out
    lines = progress_lines(out)
    assert {10, 20, 30, 40} <= set(lines), out
    final = result(job)
    last_loss = lines[40].split("| loss ")[1].split(" ")[0]
    assert f"train_gpt: done at step 40, loss {last_loss}," in out
    assert f"{final['final_loss']:.4f}" == last_loss
    before = (job / "result.json").read_bytes()
    t0 = time.monotonic()
    code, again = finish(start(job, 2, "--log-every", "10", "--step-sleep", "0.1"))
    assert code == 0, again
    assert "already finished this job (at step 40)" in again and "train_gpt:" not in again
    assert time.monotonic() - t0 < 10                     # no launcher, no workers started
    assert (job / "result.json").read_bytes() == before
    # The same job dir with other arguments that train no further: the script says so.
    code, other = finish(start(job, 2, "--log-every", "20"))
    assert code == 0, other
    assert "train_gpt: already finished at step 40" in other
    assert (job / "result.json").read_bytes() == before
    # Stopped after its last checkpoint and before its result was written (a crash or a warning
    # in between): the checkpoint alone gives the result, the same weights and samples.
    lost = job.parent / f"{job.name}-no-result"
    shutil.copytree(job / "checkpoints", lost / "checkpoints")
    shutil.copy(job / "jobspec.json", lost)      # a job dir to resume (no record of its end)
    code, out = finish(start(lost, 2, "--log-every", "10"))
    assert code == 0, out
    again = result(lost)
    assert (again["final_step"], again["weights_sha256"], again["sample_order_sha256"]) == \
        (40, final["weights_sha256"], final["sample_order_sha256"]), out


def test_no_store_of_a_session_job_listens_beyond_this_machine(tmp_path: Path):
    """Under `hpc run` the workers' own store (MASTER_PORT, rank 0's) listens on 127.0.0.1 only,
    as the rendezvous store does: read from /proc/net/tcp while the two workers train. And the
    forked workers' order files in node memory hold their environment without its secrets."""
    from runtime import node_files

    job = tmp_path / "job"
    key = "hpc-test-" + "0" * 31                      # a W&B key's 40 characters
    p = start(job, 2, "--step-sleep", "0.2", env={**os.environ, "WANDB_API_KEY": key})
    try:
        end = time.time() + 120
        while len(workers := workers_of(job)) < 2 or not (job / "progress.json").exists():
            assert p.poll() is None and time.time() < end, p.communicate()[0][-3000:]
            time.sleep(0.2)
        ports = {int(env["MASTER_PORT"]) for env in workers.values()}
        assert len(ports) == 1, workers
        port = ports.pop()
        assert listeners(port) == {LOOPBACK}, (port, listeners(port))
        orders = [Path(node_files.order_file(pid)) for pid in workers]
        assert all(o.exists() for o in orders), orders           # forked from the warm server
        assert not any(key in o.read_text() for o in orders)
        assert all("WANDB_API_KEY" not in env and "RANK" in env for env in workers.values())
    finally:
        p.send_signal(signal.SIGTERM)    # saves and stops: the job need not go on
        code, out = finish(p)
    assert code in (0, 75), out


def test_a_usage_error_ends_the_job_without_spending_restarts(tmp_path: Path):
    """A script that refuses its command line (argparse: status 2) fails the same way at every
    start: the job ends with its error after one start, not after every restart."""
    job = tmp_path / "job"
    code, out = finish(start(job, 2, "--no-such-flag", hpc_args=("--max-restarts", "3")))
    assert code != 0, out
    assert "unrecognized arguments: --no-such-flag" in out, out
    assert "starting the workers again" not in out, out
    assert [p.name for p in (job / "logs" / "alloc-0").glob("restart-*")] == ["restart-0"], out
    launcher = "".join(p.read_text() for p in (job / "logs" / "alloc-0").glob("node-*.log"))
    assert "exited with status 2 (a usage error) before its first step" in launcher, launcher
