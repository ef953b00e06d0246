"""SlurmClient's retry decisions with a scripted runner (the real behaviour: tests/slurm).

The runner here replays answers; it only stands in for the process boundary so that the decision
(retry or not, look up the tag or not) can be checked in milliseconds. The same paths run against
the real cluster in tests/slurm/test_slurm_client.py.
"""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

import pytest

from hpc.contract.slurm import SlurmClient, SlurmError, TransientSlurmError, controller_unavailable

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
DOWN = ("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)\n")


class ScriptedRunner:
    """Answers each command with the next scripted (returncode, stdout, stderr) for its name."""

    def __init__(self, script: dict[str, list[tuple[int, str, str] | Exception]]) -> None:
        self.script = script
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], stdin: str | None, timeout_s: float,
                 env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        answer = self.script[argv[0]].pop(0)
        if isinstance(answer, Exception):
            raise answer
        rc, out, err = answer
        return subprocess.CompletedProcess(list(argv), rc, out, err)

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)


def client(runner: ScriptedRunner) -> SlurmClient:
    return SlurmClient({}, runner=runner, retry_total_s=5.0, user="alice")


def test_transient_markers() -> None:
    assert controller_unavailable(DOWN)
    assert controller_unavailable("squeue: error: slurm_receive_msg: Socket timed out on send/recv operation")
    assert controller_unavailable("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying")
    assert not controller_unavailable((FIXTURES / "sbatch_error_invalid_partition.txt").read_text())


def test_transient_error_is_retried_and_tag_looked_up_first() -> None:
    runner = ScriptedRunner({
        "sbatch": [(1, "", DOWN), (0, "42\n", "")],
        "squeue": [(0, "", "")],
        "sacct": [(0, "", "")],
    })
    assert client(runner).submit("#!/bin/sh\n", tag="abc") == "42"
    assert [c[0] for c in runner.calls] == ["sbatch", "squeue", "sacct", "sbatch"]
    assert "--comment=hpc-tag:abc" in runner.calls[0]
    assert "--user=alice" in runner.calls[1]


def test_lost_answer_returns_existing_job_instead_of_resubmitting() -> None:
    queued = "77|PENDING|Priority||debug|1:00:00|0:00|1|train|hpc-tag:abc\n"
    runner = ScriptedRunner({
        "sbatch": [subprocess.TimeoutExpired(["sbatch"], 30)],
        "squeue": [(0, queued, "")],
    })
    assert client(runner).submit("#!/bin/sh\n", tag="abc") == "77"
    assert runner.count("sbatch") == 1


def test_tag_found_only_in_accounting() -> None:
    sacct = ("78|78|train|debug|COMPLETED|0:0|00:00:01|node1|2026-11-22T03:36:11|"
             "2026-11-22T03:36:12|2026-11-22T03:36:10|None|hpc-tag:abc\n")
    runner = ScriptedRunner({
        "sbatch": [(1, "", "sbatch: error: Socket timed out on send/recv operation\n")],
        "squeue": [(0, "", "")],
        "sacct": [(0, sacct, "")],
    })
    assert client(runner).submit("#!/bin/sh\n", tag="abc") == "78"


def test_accounting_is_searched_only_since_the_submission_began() -> None:
    """Accounting outlives a cluster's job ids: an old job with the same tag is not ours."""
    runner = ScriptedRunner({
        "sbatch": [(1, "", DOWN), (0, "42\n", "")],
        "squeue": [(0, "", "")],
        "sacct": [(0, "", "")],
    })
    before = datetime.datetime.now() - datetime.timedelta(minutes=6)
    client(runner).submit("#!/bin/sh\n", tag="abc")
    (window,) = [a for a in runner.calls[2] if a.startswith("--starttime=")]
    since = datetime.datetime.fromisoformat(window.removeprefix("--starttime="))
    assert before < since < datetime.datetime.now()


@pytest.mark.parametrize("fixture, words", [
    ("sbatch_error_invalid_partition.txt", "invalid partition specified: foo"),
    ("sbatch_error_too_many_nodes.txt", "Node count specification invalid"),
    ("sbatch_error_time_limit.txt", "Requested time limit is invalid"),
])
def test_rejections_are_not_retried(fixture: str, words: str) -> None:
    runner = ScriptedRunner({"sbatch": [(1, "", (FIXTURES / fixture).read_text())]})
    with pytest.raises(SlurmError) as info:
        client(runner).submit(Path("/x/job.sh"), ["-p", "foo"])
    assert not isinstance(info.value, TransientSlurmError)
    assert str(info.value).startswith(f"sbatch rejected the job: ")
    assert words in str(info.value) and "sbatch: error:" not in str(info.value).split(" (command")[0]
    assert runner.count("sbatch") == 1 and runner.calls[0][-1] == "/x/job.sh"


def test_retries_stop_after_the_budget() -> None:
    runner = ScriptedRunner({"squeue": [(1, "", DOWN)] * 100})
    c = SlurmClient({}, runner=runner, retry_total_s=1.0)
    with pytest.raises(TransientSlurmError, match="Unable to contact slurm controller"):
        c.queue(["1"])
    assert 2 <= runner.count("squeue") < 10


def test_comment_is_reserved_for_the_tag() -> None:
    with pytest.raises(ValueError, match="--comment is reserved"):
        client(ScriptedRunner({})).submit("#!/bin/sh\n", ["--comment=mine"])


def test_missing_slurm_command_is_a_clear_error() -> None:
    runner = ScriptedRunner({"scancel": [FileNotFoundError("scancel")]})
    with pytest.raises(SlurmError, match="'scancel' is not installed here"):
        client(runner).cancel("5", signal="USR2")
    assert runner.calls == [["scancel", "--signal=USR2", "5"]]
