"""Slurm output parsers on outputs recorded from the real test cluster (tests/fixtures/slurm)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from hpc.contract.slurm_parse import (
    JobState, expand_hostlist, latest_runs, parse_duration, parse_exit_code, parse_job_state,
    parse_key_values, parse_sacct, parse_sbatch, parse_show_job, parse_show_partitions,
    parse_sinfo, parse_squeue, parse_timestamp,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# ------------------------------------------------------------------ host lists


@pytest.mark.parametrize("text, hosts", [
    # Examples from Slurm's documentation (hostlist expressions, scontrol show hostnames).
    ("node[1-3,5]", ("node1", "node2", "node3", "node5")),
    ("gpu-a[01-02],cpu7", ("gpu-a01", "gpu-a02", "cpu7")),
    ("n[001-003]-ib", ("n001-ib", "n002-ib", "n003-ib")),
    ("lx[10-20]", tuple(f"lx{i}" for i in range(10, 21))),
    ("tux[2,1-2]", ("tux2", "tux1", "tux2")),
    ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
    ("node7", ("node7",)),
    ("", ()),
    ("None assigned", ()),
    ("(null)", ()),
])
def test_expand_hostlist(text: str, hosts: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[a-b]", "node[1-]"])
def test_expand_hostlist_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


# ------------------------------------------------------------------ scalars


@pytest.mark.parametrize("text, seconds", [
    ("UNLIMITED", None), ("INFINITE", None), ("Partition_Limit", None), ("NONE", None),
    ("1-02:03:04", 93784), ("05:06", 306), ("0:02", 2), ("1:00:00", 3600), ("10:00", 600),
    ("2-03", 183600), ("2-03:04", 183840), ("00:00:00", 0), ("01:02.345", 62), ("30", 1800),
])
def test_parse_duration(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "soon", "1:2:3:4", "-5"])
def test_parse_duration_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        parse_duration(bad)


def test_timestamps_and_exit_codes() -> None:
    assert parse_timestamp("2026-11-22T03:36:11") == datetime(2026, 11, 22, 3, 36, 11)
    assert parse_timestamp("Unknown") is None and parse_timestamp("") is None
    assert parse_exit_code("3:0") == (3, 0) and parse_exit_code("0:15") == (0, 15)
    assert parse_exit_code("") is None


@pytest.mark.parametrize("text, state", [
    ("PENDING", JobState.PENDING), ("PD", JobState.PENDING), ("R", JobState.RUNNING),
    ("CANCELLED by 0", JobState.CANCELLED), ("CANCELLED+", JobState.CANCELLED),
    ("REQUEUED", JobState.REQUEUED), ("PREEMPTED", JobState.PREEMPTED),
    ("NODE_FAIL", JobState.NODE_FAIL), ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
    ("OOM", JobState.OUT_OF_MEMORY), ("TIMEOUT", JobState.TIMEOUT),
    ("REQUEUE_HOLD", JobState.REQUEUE_HOLD), ("REQUEUE_FED", JobState.REQUEUED),
    ("SPECIAL_EXIT", JobState.FAILED), ("STOPPED", JobState.SUSPENDED),
    ("completing", JobState.COMPLETING), ("NEW_STATE_2030", JobState.UNKNOWN),
    ("SIGNALING", JobState.RUNNING), ("SI", JobState.RUNNING),
])
def test_job_state_table(text: str, state: JobState) -> None:
    assert parse_job_state(text) is state


def test_terminal_states() -> None:
    terminal = {s for s in JobState if s.is_terminal}
    assert terminal == {JobState.PREEMPTED, JobState.COMPLETED, JobState.FAILED,
                        JobState.CANCELLED, JobState.TIMEOUT, JobState.NODE_FAIL,
                        JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL, JobState.DEADLINE}
    assert not JobState.REQUEUED.is_terminal and not JobState.COMPLETING.is_terminal


# ------------------------------------------------------------------ sbatch


def test_sbatch_parsable() -> None:
    sub = parse_sbatch(fixture("sbatch_parsable.txt"))
    assert sub.job_id == "1" and sub.cluster is None
    fed = parse_sbatch("4242;hpctest\n")
    assert fed.job_id == "4242" and fed.cluster == "hpctest"
    with pytest.raises(ValueError, match="no job id"):
        parse_sbatch("")


# ------------------------------------------------------------------ squeue


def test_squeue_recorded() -> None:
    entries = {e.job_id: e for e in parse_squeue(fixture("squeue.txt"))}
    assert entries["1"].state is JobState.COMPLETED and entries["1"].nodes == ("node1", "node2")
    assert entries["2"].state is JobState.FAILED and entries["2"].reason == "NonZeroExitCode"
    pending = entries["5"]
    assert pending.state is JobState.PENDING and pending.reason == "Resources"
    assert pending.nodes == () and pending.time_limit_s == 600 and pending.comment is None
    low = entries["4"]
    assert low.name == "low job" and low.comment == "hpc-tag:low-1" and low.elapsed_s == 2


def test_squeue_partition_limit_reasons_when_not_enforced() -> None:
    entries = parse_squeue(fixture("squeue_partition_limits_not_enforced.txt"))
    assert [(e.reason, e.num_nodes, e.time_limit_s) for e in entries] == [
        ("PartitionNodeLimit", 5, 3600), ("PartitionTimeLimit", 1, 7200)]


def test_squeue_job_name_with_pipe() -> None:
    (entry,) = parse_squeue("7|RUNNING|None|node1|debug|UNLIMITED|1-00:00:01|1|a|b|hpc-tag:x\n")
    assert entry.name == "a|b" and entry.comment == "hpc-tag:x"
    assert entry.time_limit_s is None and entry.elapsed_s == 86401


# ------------------------------------------------------------------ sacct


def test_sacct_requeued_preempted_failed() -> None:
    records = parse_sacct(fixture("sacct_duplicates.txt"))
    allocations = [(r.job_id, r.state) for r in records if r.step is None]
    assert allocations == [
        ("1", JobState.COMPLETED), ("2", JobState.FAILED), ("3", JobState.REQUEUED),
        ("4", JobState.PREEMPTED), ("5", JobState.CANCELLED), ("3", JobState.CANCELLED),
        ("6", JobState.COMPLETED), ("4", JobState.CANCELLED)]
    steps = {(r.job_id, r.step) for r in records if r.step is not None}
    assert {("1", "batch"), ("1", "0"), ("2", "0")} <= steps
    failed = next(r for r in records if r.job_id == "2" and r.step is None)
    assert failed.exit_code == (3, 0) and failed.comment == "hpc-tag:fail-1"
    preempted = next(r for r in records if r.state is JobState.PREEMPTED)
    assert preempted.name == "low job" and preempted.elapsed_s == 16
    assert preempted.nodes == ("node3",) and preempted.partition == "debug"


def test_latest_runs_pick_the_last_record_of_a_requeued_job() -> None:
    latest = latest_runs(parse_sacct(fixture("sacct_duplicates.txt")))
    assert latest["3"].state is JobState.CANCELLED and latest["3"].nodes == ("node2",)
    assert latest["4"].state is JobState.CANCELLED and latest["4"].reason == "BeginTime"
    assert latest["1"].state is JobState.COMPLETED


def test_sacct_node_fail_then_pending_again() -> None:
    records = parse_sacct(fixture("sacct_node_fail.txt"))
    first, batch, again = records
    assert first.state is JobState.NODE_FAIL and first.elapsed_s == 18
    assert batch.step == "batch" and batch.exit_code is None
    assert again.state is JobState.PENDING and again.nodes == () and again.start is None
    assert latest_runs(records)["1"] is again


# ------------------------------------------------------------------ scontrol


def test_show_job_requeued() -> None:
    info = parse_show_job(fixture("scontrol_show_job_requeued.txt"))
    assert info.job_id == "3" and info.restarts == 1 and info.requeue
    assert info.state is JobState.RUNNING and info.nodes == ("node2",)
    assert info.batch_host == "node2" and info.time_limit_s == 3600
    assert info.command == "/tmp/hpcw/long.sh" and info.work_dir == "/tmp/hpcw"
    assert info.comment == "hpc-tag:requeue-1"
    assert info.fields["AllocNode:Sid"] == "localhost:3621"
    assert info.fields["TRES"] == "cpu=1,node=1,billing=1"


def test_a_heterogeneous_jobs_nodes_are_all_its_components_nodes() -> None:
    """Recorded on the test cluster: a two-component job (TorchX's shape), one node each.
    Reading only the leader's line took the other node for one Slurm dropped: the quorum
    watch ended a healthy TorchX job whose second node was slow to join (CI of 9ab6154)."""
    info = parse_show_job(fixture("scontrol_show_job_het_running.txt"))
    assert info.job_id == "53" and info.state is JobState.RUNNING
    assert info.nodes == ("node1", "node2") and info.batch_host == "node1"


def test_show_job_preempted_name_with_space() -> None:
    info = parse_show_job(fixture("scontrol_show_job_preempted.txt"))
    assert info.name == "low job" and info.restarts == 1 and info.partition == "debug"


def test_show_job_in_preemption_grace_has_preempt_time_and_end_rewritten() -> None:
    """Recorded on the test cluster (Slurm 22.05, GraceTime=10): 0.1 s after a preempting
    job was submitted, EndTime went from the time limit to PreemptTime + GraceTime."""
    before = parse_show_job(fixture("scontrol_show_job_before_preempt.txt"))
    assert before.preempt_time is None
    assert before.end_time == datetime(2026, 11, 25, 19, 50, 45)     # StartTime + 10 minutes
    during = parse_show_job(fixture("scontrol_show_job_preempt_grace.txt"))
    assert during.state is JobState.RUNNING and during.time_limit_s == 600
    assert during.preempt_time == datetime(2026, 11, 25, 19, 40, 47)
    assert (during.end_time - during.preempt_time).total_seconds() == 10
    requeued = parse_show_job(fixture("scontrol_show_job_requeued_completing.txt"))
    assert requeued.state is JobState.COMPLETING and requeued.restarts == 1
    assert requeued.preempt_time is None


def test_show_job_failed_and_pending_reason() -> None:
    failed = parse_show_job(fixture("scontrol_show_job_failed.txt"))
    assert failed.state is JobState.FAILED and failed.exit_code == (3, 0)
    assert failed.reason == "NonZeroExitCode"
    line = "JobId=9 JobName=x JobState=PENDING Reason=ReqNodeNotAvail,_UnavailableNodes:node2 Dependency=(null) Restarts=0"
    pending = parse_show_job(line)
    assert pending.reason == "ReqNodeNotAvail,_UnavailableNodes:node2" and pending.nodes == ()
    with pytest.raises(ValueError, match="not an scontrol job record"):
        parse_show_job("slurm_load_jobs error: Invalid job id specified")


def test_key_values_keep_spaces_inside_values() -> None:
    kv = parse_key_values("JobId=1 JobName=my long name Comment=a b  WorkDir=/tmp/with space Power=")
    assert kv == {"JobId": "1", "JobName": "my long name", "Comment": "a b",
                  "WorkDir": "/tmp/with space", "Power": ""}


def test_show_partitions() -> None:
    debug, high = parse_show_partitions(fixture("scontrol_show_partition.txt"))
    assert debug.name == "debug" and debug.default and debug.max_time_s == 3600
    assert debug.max_nodes is None and debug.total_nodes == 3 and debug.total_cpus == 12
    assert debug.nodes == ("node1", "node2", "node3") and debug.grace_time_s == 10
    assert debug.preempt_mode == "REQUEUE" and debug.default_time_s is None
    assert high.priority_tier == 10 and high.preempt_mode == "OFF" and not high.default
    (only,) = parse_show_partitions(fixture("scontrol_show_partition_debug.txt"))
    assert only == debug


# ------------------------------------------------------------------ sinfo


def test_sinfo() -> None:
    debug, high = parse_sinfo(fixture("sinfo.txt"))
    assert debug.partition == "debug" and debug.default and debug.available
    assert debug.time_limit_s == 3600 and debug.node_count == 3 and debug.state == "idle"
    assert high.nodes == ("node1", "node2", "node3") and not high.default
