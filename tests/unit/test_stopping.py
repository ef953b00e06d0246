"""The stop contract's pure parts: notices, outcome amendment, the HPC_* variables, W&B defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.contract.environment import JobEnvironment
from runtime import stopping
from runtime.launch.main import env_defaults
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def test_warning_near_the_end_is_the_time_limit_and_its_deadline_is_the_end() -> None:
    n = stopping.notice_for("SIGUSR2", 1000.0, allocation=2, job_end_time=1120.0, lead_s=120,
                            grace_s=10)
    assert (n.kind, n.deadline, n.allocation) == ("time_limit", 1120.0, 2)


def test_warning_long_before_the_end_is_a_preemption_with_grace_time() -> None:
    n = stopping.notice_for("SIGUSR2", 1000.0, allocation=0, job_end_time=9000.0, lead_s=120,
                            grace_s=10)
    assert (n.kind, n.deadline) == ("preempted", 1010.0)


def test_sigterm_first_is_a_preemption_due_now() -> None:
    n = stopping.notice_for("SIGTERM", 1000.0, allocation=0, job_end_time=None, lead_s=120,
                            grace_s=None)
    assert (n.kind, n.deadline) == ("preempted", 1000.0)


def test_tracker_writes_the_first_notice_and_a_sigterm_brings_the_deadline_forward(tmp_path: Path) -> None:
    t = stopping.StopTracker(tmp_path / "a" / "stop.json", allocation=1, job_end_time=None,
                             lead_s=120, grace_s=None)
    assert not t.stopping
    t.on_signal("SIGUSR2", 1000.0)
    t.on_signal("SIGTERM", 1005.0)
    t.on_signal("SIGUSR2", 1006.0)
    got = stopping.StopNotice.read(tmp_path / "a" / "stop.json")
    assert got == t.notice
    assert (got.signal, got.kind, got.received_at, got.deadline) == ("SIGUSR2", "time_limit", 1000.0, 1005.0)


def test_without_slurm_workers_outliving_a_sigterm_are_killed_once_after_the_wait(tmp_path: Path) -> None:
    """hpc run has no KillWait: the first SIGTERM (not a warning) starts the one countdown to
    the SIGKILL; the workers ending first (cancel) stops it."""
    import threading

    calls: list[float] = []
    done = threading.Event()

    def kill() -> list[int]:
        calls.append(time.monotonic())
        done.set()
        return [4242]

    t = stopping.StopTracker(tmp_path / "stop.json", allocation=0, job_end_time=None, lead_s=120,
                             grace_s=None, under_slurm=False, kill_workers=kill, kill_after_s=0.3)
    t.on_signal("SIGUSR2", time.time())        # a warning: the workers save, no countdown
    assert t.kill_timer is None
    started = time.monotonic()
    t.on_signal("SIGTERM", time.time())
    t.on_signal("SIGTERM", time.time())        # a second SIGTERM: the same countdown
    assert done.wait(10) and calls[0] - started >= 0.3
    time.sleep(0.5)
    assert len(calls) == 1
    t.cancel()

    spared = stopping.StopTracker(tmp_path / "s2.json", allocation=0, job_end_time=None, lead_s=120,
                                  grace_s=None, under_slurm=False, kill_workers=kill, kill_after_s=0.3)
    spared.on_signal("SIGTERM", time.time())
    spared.cancel()                            # the workers ended by themselves
    time.sleep(0.6)
    assert len(calls) == 1


def test_unreadable_notice_is_none(tmp_path: Path) -> None:
    (tmp_path / "stop.json").write_text("{")
    assert stopping.StopNotice.read(tmp_path / "stop.json") is None
    assert stopping.StopNotice.read(tmp_path / "missing.json") is None
    assert stopping.StopNotice.read("") is None


def test_workers_that_die_after_a_stop_began_are_the_stop_not_an_app_error() -> None:
    n = stopping.StopNotice(0, "preempted", "SIGUSR2", 1.0, 11.0)
    kind, reason = stopping.amend_outcome("app_error", "rank 0 exited with -15: Signals.SIGTERM", n)
    assert kind == "preempted"
    assert reason.startswith("SIGUSR2 (preempted): the workers did not stop by themselves; rank 0")
    assert stopping.amend_outcome("app_error", "boom", None) == ("app_error", "boom")
    assert stopping.amend_outcome("finished", "", n) == ("finished", "")
    assert stopping.amend_outcome("cancelled", "x", n) == ("cancelled", "x")


def test_a_script_that_stopped_for_the_warning_exits_75_and_is_the_stop() -> None:
    n = stopping.StopNotice(0, "time_limit", "SIGUSR2", 1.0, 11.0)
    said = ("time_limit", "SIGUSR2 (time_limit): the script stopped for it (exit 75)")
    assert stopping.amend_outcome("app_error", "rank 0 exited with 75: x", n, exit_codes=(75,)) == said
    # Another rank may be seen first (stopped by the agent, or its peer gone): still the script's stop.
    assert stopping.amend_outcome("app_error", "rank 1 exited with -15", n, exit_codes=(-15, 75)) == said
    # Without a stop, 75 is an error like any other; 0 after a stop is a finish.
    assert stopping.amend_outcome("app_error", "e", None, exit_codes=(75,)) == ("app_error", "e")
    assert stopping.amend_outcome("finished", "", n) == ("finished", "")


def test_a_script_that_saved_for_the_stop_but_exited_too_slowly_is_still_the_stop() -> None:
    """CI of 3dc5ca1: a Trainer saved for the warning, exited 75, but torch's teardown outlived
    the grace and the launcher's SIGTERM ended it (-15): rank 0's exit intent says it stopped."""
    n = stopping.StopNotice(0, "preempted", "SIGUSR2", 1.0, 11.0)
    intent = {"allocation": 0, "kind": "preempted", "step": 7, "reason": "x", "time": 5.0}
    kind, reason = stopping.amend_outcome("app_error", "rank 0 exited with -15", n, exit_codes=(-15,),
                                          intent=intent)
    assert kind == "preempted"
    assert reason == ("SIGUSR2 (preempted): the script stopped for it (saved step 7; its exit was "
                      "cut short: rank 0 exited with -15)")
    # An intent of another kind (a mesh that cannot form) is no evidence of this stop.
    other = {**intent, "kind": "node_failure"}
    _, reason = stopping.amend_outcome("app_error", "rank 0 exited with -15", n, intent=other)
    assert "did not stop by themselves" in reason
    # Without an intent the workers that died of the SIGTERM did not stop by themselves.
    _, reason = stopping.amend_outcome("app_error", "rank 0 exited with -15", n)
    assert "did not stop by themselves" in reason


def test_contract_variables_round_trip_and_zero_is_written() -> None:
    env = JobEnvironment(job_dir="/j", checkpoint_dir="/j/checkpoints", resumed=False,
                         requeue_count=0, restart_count=0, warning_lead_s=120.0,
                         stop_file="/j/logs/alloc-0/stop.json").to_env()
    assert env == {"HPC_JOB_DIR": "/j", "HPC_CHECKPOINT_DIR": "/j/checkpoints", "HPC_RESUMED": "0",
                   "HPC_REQUEUE_COUNT": "0", "HPC_RESTART_COUNT": "0", "HPC_WARNING_LEAD_S": "120",
                   "HPC_STOP_FILE": "/j/logs/alloc-0/stop.json"}
    back = JobEnvironment.from_env(env)
    assert (back.resumed, back.requeue_count, back.restart_count) == (False, 0, 0)
    assert "HPC_RESUMED" not in JobEnvironment().to_env()


def test_worker_contract_marks_a_restart_as_a_resume() -> None:
    from runtime.worker.start import script_contract

    job = JobEnvironment(resumed=False)
    assert script_contract(job, {"TORCHELASTIC_RESTART_COUNT": "2"}) == {
        "HPC_RESTART_COUNT": "2", "HPC_RESUMED": "1"}
    assert script_contract(job, {}) == {"HPC_RESTART_COUNT": "0", "HPC_RESUMED": "0"}
    assert script_contract(JobEnvironment(), {}) == {"HPC_RESTART_COUNT": "0"}   # plain torchrun


def test_a_worker_started_in_a_stopping_allocation_exits_at_once_and_says_why(tmp_path: Path) -> None:
    """The guard runs in a real child of this process (it checks its parent's pid)."""
    notice = stopping.notice_path(tmp_path, 3)
    notice.parent.mkdir(parents=True)
    notice.write_text(json.dumps({"allocation": 3, "kind": "preempted", "signal": "SIGUSR2",
                                  "received_at": 1.0, "deadline": 11.0}))
    script = tmp_path / "never.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")} | {
        "HPC_JOB_DIR": str(tmp_path), "HPC_AGENT_PID": str(os.getpid()), "RANK": "0",
        "HPC_PENDING_WARNING": "SIGUSR2@1.000", "HPC_REQUEUE_COUNT": "3",
        "HPC_STOP_FILE": str(notice)}
    r = subprocess.run([sys.executable, "-m", "runtime.worker", str(script)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "the allocation is stopping (SIGUSR2@1.000, preempted)" in r.stderr
    assert not Path(str(script) + ".ran").exists()
    intent = json.loads((tmp_path / "exit-intent.json").read_text())
    assert (intent["allocation"], intent["kind"]) == (3, "preempted")
    del env["HPC_PENDING_WARNING"]                                   # no stop: it runs
    r = subprocess.run([sys.executable, "-m", "runtime.worker", str(script)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and Path(str(script) + ".ran").exists(), r.stderr


def test_wandb_defaults_name_the_jobs_run_and_keep_the_users_values(tmp_path: Path) -> None:
    from runtime.wandb_env import defaults
    from runtime.worker.wandb_sink import load_or_create_run_id

    wanted = defaults(tmp_path, "offline")
    run_id = load_or_create_run_id(tmp_path)
    assert {k: v for k, (v, _) in wanted.items()} == {
        "WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow", "WANDB_DIR": str(tmp_path),
        "WANDB_MODE": "offline"}
    assert defaults(tmp_path, "offline")["WANDB_RUN_ID"][0] == run_id      # stable
    changes = {c.name: c for c in env_defaults({"WANDB_RUN_ID": "mine", "WANDB_MODE": "online"}, wanted)}
    assert changes["WANDB_RUN_ID"].kept_user_value and changes["WANDB_MODE"].kept_user_value
    assert not changes["WANDB_RESUME"].kept_user_value


def test_launcher_sigterm_comes_ahead_of_slurms() -> None:
    tl = stopping.StopNotice(0, "time_limit", "SIGUSR2", 1000.0, 1120.0)
    assert stopping.enforce_in(tl, 1000.0) == 110.0             # 10 s before the limit
    assert stopping.enforce_in(tl, 1110.0) == 5.0               # at most half of what is left
    assert stopping.enforce_in(tl, 1130.0) == 0.0               # late: at once
    pre = stopping.StopNotice(0, "preempted", "SIGUSR2", 1.0, 31.0)
    assert stopping.enforce_in(pre, 1.0) == 27.0                 # 3 s before Slurm's SIGTERM
    assert stopping.enforce_in(stopping.StopNotice(0, "preempted", "SIGUSR2", 1.0, 11.0), 1.0) == 7.5
    assert stopping.enforce_in(stopping.StopNotice(0, "time_limit", "SIGTERM", 1.0, 1.0), 1.0) is None


def test_enforcement_line_without_slurm_names_no_slurm_and_no_epoch() -> None:
    notice = stopping.notice_for("SIGUSR2", 1_795_000_000.0, allocation=0, job_end_time=None,
                                 lead_s=60, grace_s=30, under_slurm=False)
    line = stopping.enforcement_line(notice, 22.5, under_slurm=False)
    assert "slurm" not in line.lower() and "1795" not in line, line
    assert "a stop was asked for" in line and "get SIGTERM" in line and "(22 s from now)" in line
    under = stopping.enforcement_line(notice, 22.5, under_slurm=True)
    assert "ahead of Slurm's at " in under and "1795" not in under, under
