"""The job-directory lock: one job per directory, stale locks broken, live ones explained."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.contract import joblock
from hpc.contract.joblock import Holder, JobDirInUse
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def plant(job_dir: Path, holder: Holder) -> None:
    (job_dir / joblock.LOCK).write_text(holder.to_json())


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_second_taker_is_refused_with_the_holder_and_what_to_do(tmp_path: Path) -> None:
    lock = joblock.acquire(tmp_path, "hpc run")
    with pytest.raises(JobDirInUse) as info:
        joblock.acquire(tmp_path, "hpc submit")
    text = str(info.value)
    assert str(tmp_path) in text
    assert f"`hpc run` (pid {os.getpid()} on host {socket.gethostname()}, since " in text
    assert f"kill -TERM {os.getpid()}" in text and "another --job-dir" in text
    lock.release()
    joblock.acquire(tmp_path, "hpc run").release()      # free again once released
    assert not (tmp_path / joblock.LOCK).exists()


def test_lock_of_a_dead_run_is_broken(tmp_path: Path) -> None:
    plant(tmp_path, replace(joblock.me("hpc run"), pid=dead_pid(), start_ticks=None))
    lock = joblock.acquire(tmp_path, "hpc run")
    assert joblock.read_holder(tmp_path) == lock.holder


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    me = joblock.me("hpc run")
    plant(tmp_path, replace(me, pid=os.getpid(), start_ticks=(me.start_ticks or 0) + 12345))
    joblock.acquire(tmp_path, "hpc run").release()


def test_launchers_still_running_keep_the_lock_after_hpc_run_died(tmp_path: Path) -> None:
    survivor = subprocess.Popen(["sleep", "30"])
    try:
        plant(tmp_path, replace(joblock.me("hpc run"), pid=dead_pid(), start_ticks=None,
                                processes=((survivor.pid, joblock.start_ticks(survivor.pid)),)))
        with pytest.raises(JobDirInUse, match=f"processes still running: {survivor.pid}"):
            joblock.acquire(tmp_path, "hpc run")
    finally:
        survivor.kill()
        survivor.wait()
    joblock.acquire(tmp_path, "hpc run").release()


def test_holder_on_another_host_is_respected_and_the_way_out_named(tmp_path: Path) -> None:
    plant(tmp_path, replace(joblock.me("hpc run"), host="node17", pid=dead_pid()))
    with pytest.raises(JobDirInUse) as info:
        joblock.acquire(tmp_path, "hpc run")
    assert "on host node17" in str(info.value) and f"remove {tmp_path / joblock.LOCK}" in str(info.value)


def test_holder_from_before_a_reboot_of_this_host_is_stale(tmp_path: Path) -> None:
    plant(tmp_path, replace(joblock.me("hpc run"), boot_id="an-earlier-boot"))
    joblock.acquire(tmp_path, "hpc run").release()


def submitted(tmp_path: Path, *, id_written_after: bool = True) -> None:
    holder = replace(joblock.me("hpc submit"), pid=dead_pid(), start_ticks=None,
                     since=time.time() - (0 if id_written_after else -10))
    plant(tmp_path, holder)
    (tmp_path / joblock.SLURM_JOB_ID).write_text("4242\n")


def test_submitted_job_holds_the_lock_while_slurm_runs_it(tmp_path: Path) -> None:
    submitted(tmp_path)
    with pytest.raises(JobDirInUse) as info:
        joblock.acquire(tmp_path, "hpc run", slurm_active=lambda job: True)
    assert "held by Slurm job 4242" in str(info.value) and "hpc cancel 4242" in str(info.value)


def test_submitted_job_that_ended_releases_the_lock(tmp_path: Path) -> None:
    submitted(tmp_path)
    joblock.acquire(tmp_path, "hpc submit", slurm_active=lambda job: False).release()


def test_submitted_job_that_slurm_cannot_be_asked_about_is_respected(tmp_path: Path) -> None:
    submitted(tmp_path)
    with pytest.raises(JobDirInUse, match=r"Slurm cannot be asked .* \(`sacct -j 4242`\)"):
        joblock.acquire(tmp_path, "hpc run", slurm_active=lambda job: None)


def test_a_submission_that_never_got_a_job_id_is_stale(tmp_path: Path) -> None:
    submitted(tmp_path, id_written_after=False)        # the id file is an older job's
    joblock.acquire(tmp_path, "hpc submit", slurm_active=lambda job: True).release()


# The winner holds the lock until every other taker has been answered: a taker that starts
# late (a loaded machine; seen in the unit tier at load 20+) would otherwise find the winner
# gone and rightly break its stale lock. Two winners still fail: each waits for 5 refusals.
RACE = """
import os, sys, time
from pathlib import Path
from hpc.contract import joblock
start = float(sys.argv[2])
answers = Path(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
try:
    joblock.acquire(Path(sys.argv[1]), "hpc run")
except joblock.JobDirInUse:
    print("refused")
    (answers / f"refused-{os.getpid()}").touch()
else:
    print("won")
    end = time.time() + 60
    while len(list(answers.iterdir())) < 5 and time.time() < end:
        time.sleep(0.05)     # hold it while the others look
"""


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_parallel_takers_exactly_one_wins(tmp_path: Path, stale: bool) -> None:
    if stale:
        plant(tmp_path, replace(joblock.me("hpc run"), pid=dead_pid(), start_ticks=None))
    start = time.time() + 1.5
    answers = tmp_path.parent / f"{tmp_path.name}-answers"
    answers.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), str(start), str(answers)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(6)]
    results = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert results == ["refused"] * 5 + ["won"], results


def test_a_swept_array_holds_the_lock_while_any_task_is_queued(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc.contract import slurm
    from hpc.contract.slurm_parse import JobState, QueueEntry

    def queue(self: object, ids: list[str]) -> dict[str, QueueEntry]:
        return {f"4242_{i}": QueueEntry(job_id=f"4242_{i}", state=state, raw_state=state.value,
                                        reason=None, nodes=(), partition="gpu", time_limit_s=None,
                                        elapsed_s=0, num_nodes=1, name="sweep", comment=None)
                for i, state in enumerate((JobState.COMPLETED, JobState.PENDING))}

    monkeypatch.setattr(slurm.SlurmClient, "queue", queue)
    holder = replace(joblock.me("hpc sweep"), pid=dead_pid(), start_ticks=None)
    plant(tmp_path, holder)
    (tmp_path / joblock.SLURM_JOB_ID).write_text("4242\n")
    with pytest.raises(JobDirInUse, match="held by Slurm job 4242"):
        joblock.acquire(tmp_path, "hpc run")


def test_a_submitter_that_lives_on_does_not_hold_the_lock_once_its_job_ended(tmp_path: Path) -> None:
    """hpc.api.submit() from a notebook: the process stays, the Slurm job decides."""
    plant(tmp_path, joblock.me("hpc submit"))            # this very (live) process submitted
    (tmp_path / joblock.SLURM_JOB_ID).write_text("4242\n")
    with pytest.raises(JobDirInUse, match="held by Slurm job 4242"):
        joblock.acquire(tmp_path, "hpc run", slurm_active=lambda job: True)
    joblock.acquire(tmp_path, "hpc run", slurm_active=lambda job: False).release()


def test_a_job_submitted_from_another_login_node_is_checked_with_slurm(tmp_path: Path) -> None:
    plant(tmp_path, replace(joblock.me("hpc submit"), host="login2", pid=dead_pid()))
    (tmp_path / joblock.SLURM_JOB_ID).write_text("4242\n")
    with pytest.raises(JobDirInUse, match="held by Slurm job 4242"):
        joblock.acquire(tmp_path, "hpc submit", slurm_active=lambda job: True)
    joblock.acquire(tmp_path, "hpc submit", slurm_active=lambda job: False).release()
