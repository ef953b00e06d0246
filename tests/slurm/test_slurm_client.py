"""SlurmClient against the real test cluster: submit, query, cancel, requeue, retries, errors."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from typing import Callable, Mapping, Sequence, TypeVar

import pytest

from hpc.contract.slurm import SlurmClient, SlurmError, TransientSlurmError, UnknownJobError
from hpc.contract.slurm_parse import JobState
from runtime.ending.outcome import left_behind

pytestmark = pytest.mark.slurm

T = TypeVar("T")
SLEEP = "#!/bin/sh\nsleep 300\n"


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def tag() -> str:
    """A submission tag that no earlier run has used (accounting keeps old jobs' comments)."""
    return f"t-{uuid.uuid4().hex[:12]}"


def jobs_with_comment(env: Mapping[str, str], comment: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%k"], capture_output=True,
                         text=True, env=dict(env), check=True).stdout
    return [line.split("|")[0] for line in out.splitlines() if line.split("|", 1)[1] == comment]


class CountingRunner:
    """Runs commands for real, counting them; can lose the answer of the first sbatch."""

    def __init__(self, lose_first_sbatch_answer: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.lose_first_sbatch_answer = lose_first_sbatch_answer

    def __call__(self, argv: Sequence[str], stdin: str | None, timeout_s: float,
                 env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=timeout_s, env=dict(env))
        if argv[0] == "sbatch" and self.lose_first_sbatch_answer:
            self.lose_first_sbatch_answer = False
            raise subprocess.TimeoutExpired(list(argv), timeout_s)  # the job exists, answer lost
        return proc

    def count(self, command: str) -> int:
        return sum(1 for c in self.calls if c[0] == command)


@pytest.fixture
def client(slurm_cluster) -> SlurmClient:
    return SlurmClient(slurm_cluster.env, retry_total_s=30.0, command_timeout_s=20.0)


def test_submit_queue_accounting_cancel(client: SlurmClient, slurm_cluster, tmp_path, tag: str) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SLEEP)
    job = client.submit(script, ["-N", "2", "--job-name", "two nodes"], tag=tag)

    entry = wait_for("RUNNING", lambda: (e := client.queue([job]).get(job))
                     and e.state is JobState.RUNNING and e)
    assert entry.num_nodes == 2 and len(entry.nodes) == 2
    assert entry.name == "two nodes" and entry.comment == f"hpc-tag:{tag}"
    info = client.show_job(job)
    assert info.nodes == entry.nodes and info.batch_host == entry.nodes[0]
    assert info.restarts == 0 and info.time_limit_s == 3600
    # A launcher tells a cut-off node (no longer counted in the running job) from a survivor.
    other = next(n for n in slurm_cluster.nodes if n not in entry.nodes)
    assert left_behind(job, entry.nodes[1], client) is None
    assert f"no longer counts {other} in running job {job}" in left_behind(job, other, client)

    client.cancel(job)
    wait_for("CANCELLED in squeue", lambda: client.queue([job])[job].state is JobState.CANCELLED)
    record = wait_for("sacct allocation record", lambda: next(
        (r for r in client.accounting([job]) if r.step is None and r.name == "two nodes"
         and r.state is JobState.CANCELLED), None))
    assert record.comment == f"hpc-tag:{tag}" and record.nodes == entry.nodes


def test_failed_job_reports_exit_code(client: SlurmClient) -> None:
    job = client.submit("#!/bin/sh\nexit 3\n", ["-N", "1"])
    wait_for("FAILED", lambda: client.queue([job])[job].state is JobState.FAILED)
    record = wait_for("sacct FAILED", lambda: next(
        (r for r in client.accounting([job]) if r.step is None and r.state is JobState.FAILED),
        None))
    assert record.exit_code == (3, 0)


def test_queue_batches_ids_and_omits_forgotten_jobs(client: SlurmClient) -> None:
    runner = CountingRunner()
    counting = SlurmClient(client.env, runner=runner)
    jobs = [counting.submit(SLEEP, ["-N", "1"]) for _ in range(3)]
    states = counting.queue([*jobs, "999999"])
    assert sorted(states) == sorted(jobs)
    assert runner.count("squeue") == 1
    assert counting.queue(["999999"]) == {}
    with pytest.raises(UnknownJobError, match="999999 is not known"):
        counting.show_job("999999")


def test_requeue_restarts_the_job_under_the_same_id(client: SlurmClient) -> None:
    job = client.submit(SLEEP, ["-N", "1", "--requeue"])
    wait_for("RUNNING", lambda: client.queue([job])[job].state is JobState.RUNNING)
    client.requeue(job)
    info = wait_for("running again after requeue", lambda: (i := client.show_job(job))
                    and i.restarts == 1 and i.state is JobState.RUNNING and i, timeout=40)
    assert info.job_id == job
    states = wait_for("two sacct runs", lambda: [
        r.state for r in client.accounting([job]) if r.step is None] if len(
            [r for r in client.accounting([job]) if r.step is None]) >= 2 else None)
    assert states[0] is JobState.REQUEUED


def test_submit_retries_while_controller_is_down(slurm_cluster, client: SlurmClient,
                                                 tag: str) -> None:
    slurm_cluster.stop_controller()
    result: dict[str, object] = {}

    def submit() -> None:
        try:
            result["job"] = client.submit(SLEEP, ["-N", "1"], tag=tag)
        except Exception as exc:  # surfaced by the assertion below
            result["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=submit)
    thread.start()
    time.sleep(5)
    assert thread.is_alive(), f"submit returned while the controller was down: {result}"
    slurm_cluster.start_controller()
    thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert time.monotonic() - t0 >= 5
    assert jobs_with_comment(slurm_cluster.env, f"hpc-tag:{tag}") == [result["job"]]


def test_lost_sbatch_answer_does_not_submit_twice(slurm_cluster, tag: str) -> None:
    runner = CountingRunner(lose_first_sbatch_answer=True)
    client = SlurmClient(slurm_cluster.env, runner=runner, retry_total_s=30.0)
    job = client.submit(SLEEP, ["-N", "1"], tag=tag)
    assert runner.count("sbatch") == 1
    assert jobs_with_comment(slurm_cluster.env, f"hpc-tag:{tag}") == [job]


@pytest.mark.parametrize("args, message", [
    (["--partition", "nosuch"], "sbatch rejected the job: invalid partition specified: nosuch"),
    (["-N", "5"], "Node count specification invalid"),
    (["--time", "2:00:00"], "Requested time limit is invalid"),
])
def test_bad_requests_fail_at_once_with_a_clear_message(slurm_cluster, args: list[str],
                                                        message: str) -> None:
    runner = CountingRunner()
    client = SlurmClient(slurm_cluster.env, runner=runner, retry_total_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(SlurmError) as info:
        client.submit("#!/bin/sh\ntrue\n", args)
    assert not isinstance(info.value, TransientSlurmError)
    assert message in str(info.value)
    assert info.value.returncode == 1 and "sbatch" in info.value.argv
    assert runner.count("sbatch") == 1 and time.monotonic() - t0 < 5


def test_partitions(client: SlurmClient) -> None:
    debug = client.show_partition("debug")
    assert debug.default and debug.max_time_s == 3600 and debug.total_nodes == 3
    assert debug.preempt_mode == "REQUEUE" and debug.grace_time_s == 10
    assert {p.name for p in client.partitions()} == {"debug", "patient", "high"}
    assert client.show_partition("patient").grace_time_s == 30
    with pytest.raises(SlurmError, match="partitions are: debug, patient, high"):
        client.show_partition("gpu")
