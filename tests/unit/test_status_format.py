"""Status view and table from recorded Slurm output (pure), the poller's backoff, logs order."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hpc.contract import jobdir
from hpc.logs import Follower, follow, log_files, rank_logs
from hpc.contract.slurm_parse import parse_sacct, parse_squeue
from hpc.status import Poller, build_views, format_table, to_json
from hpc.contract.index import JobRecord
from hpc.submission import check_partition, explain_rejection
from hpc.contract.jobspec import JobSpec
from hpc.contract.errors import SpecError
from hpc.contract.slurm_parse import parse_show_partitions

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def _rec(job_id: str, job_dir: str = "") -> JobRecord:
    return JobRecord(job_id, job_dir, f"job{job_id}", "sbatch", 0.0)


def test_views_join_sacct_duplicates_and_outcomes() -> None:
    acct = parse_sacct((FIX / "sacct_duplicates.txt").read_text())
    outcomes = {"4": [jobdir.Outcome(allocation=0, kind="preempted", exit_code=75, step=12,
                                     reason="SIGTERM")]}
    views = {v.job_id: v for v in build_views([_rec("3"), _rec("4"), _rec("1")], {}, acct, outcomes)}
    assert views["3"].requeues == 1 and views["4"].requeues == 1 and views["1"].requeues == 0
    assert views["4"].allocations[0].describe() == "#0 PREEMPTED (preempted, checkpoint 12: SIGTERM)"
    assert [a.slurm_state for a in views["3"].allocations] == ["REQUEUED", "CANCELLED"]
    assert views["1"].state == "COMPLETED" and views["1"].nodes == "2 (node1,node2)"


def test_live_state_from_squeue_wins() -> None:
    queue = {e.job_id: e for e in parse_squeue((FIX / "squeue_after_requeue.txt").read_text())}
    acct = parse_sacct((FIX / "sacct_duplicates.txt").read_text())
    view = build_views([_rec("3")], queue, acct, {})[0]
    assert view.state == "RUNNING" and view.nodes == "1 (node2)"


def test_running_allocation_shown_running_while_sacct_still_says_pending() -> None:
    # Recorded 0.5-1.5 s after a job started: slurmdbd had not caught up with squeue yet.
    queue = {e.job_id: e for e in parse_squeue((FIX / "squeue_running_sacct_lagging.txt").read_text())}
    acct = parse_sacct((FIX / "sacct_lagging_pending.txt").read_text())
    view = build_views([_rec("28")], queue, acct, {})[0]
    assert view.state == "RUNNING"
    assert [a.describe() for a in view.allocations] == ["#0 RUNNING"]
    assert view.allocations[0].nodes == "node1"


def test_node_fail_then_pending_counts_one_requeue() -> None:
    acct = parse_sacct((FIX / "sacct_node_fail.txt").read_text())
    view = build_views([_rec("1")], {}, acct, {})[0]
    assert view.requeues == 1 and view.state == "PENDING"
    assert [a.slurm_state for a in view.allocations] == ["NODE_FAIL"]


def test_unknown_job() -> None:
    view = build_views([_rec("99")], {}, (), {})[0]
    assert view.state == "UNKNOWN" and not view.terminal


def test_table_and_json() -> None:
    acct = parse_sacct((FIX / "sacct_duplicates.txt").read_text())
    views = build_views([_rec("3"), _rec("4")], {}, acct, {})
    text = format_table(views, width=160)
    assert "REQUEUES" in text and "#0 REQUEUED" in text and "#1 CANCELLED" in text
    assert '"job_id": "4"' in to_json(views)


class FakeClient:
    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.calls = 0

    def queue(self, ids):
        from hpc.contract.slurm_parse import QueueEntry, parse_job_state
        state = self.states[min(self.calls, len(self.states) - 1)]
        self.calls += 1
        return {i: QueueEntry(i, parse_job_state(state), state, None, (), "debug", None, 0, 1, "x", None)
                for i in ids}

    def accounting(self, ids):
        return ()


def test_poller_backs_off_and_resets() -> None:
    client = FakeClient(["PENDING"] * 6 + ["RUNNING"])
    poller = Poller(client, [_rec("5")], max_interval_s=8)
    intervals = []
    for _ in range(7):
        poller.poll()
        intervals.append(poller.interval)
    assert intervals == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 1.0]


def test_rank_logs_in_life_order_and_follow(tmp_path: Path) -> None:
    for a, r in ((0, 0), (0, 1), (1, 0), (0, 10)):
        p = jobdir.rank_log(tmp_path, a, r, 0)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"a{a}r{r}\n")
    order = [(p.parent.parent.name, p.parent.name) for p in rank_logs(tmp_path)]
    assert order == [("alloc-0", "restart-0"), ("alloc-0", "restart-1"), ("alloc-0", "restart-10"),
                     ("alloc-1", "restart-0")]
    out = io.StringIO()
    f = Follower(lambda: rank_logs(tmp_path), out)
    states = iter(["RUNNING", "RUNNING", "COMPLETED"])

    def poll() -> str:
        state = next(states)
        if state == "COMPLETED":  # a new allocation's file appears at the end
            p = jobdir.rank_log(tmp_path, 2, 0, 0)
            p.parent.mkdir(parents=True)
            p.write_text("last\n")
        return state

    assert follow(_rec("1"), f, poll, lambda: None) == "COMPLETED"
    text = out.getvalue()
    assert text.count("==>") == 5 and text.index("a0r0") < text.index("a1r0") < text.index("last")


def test_batch_output_without_rank0_copy(tmp_path: Path) -> None:
    """The batch output repeats rank 0's lines (the launcher's tee); they are shown once."""
    rank0 = jobdir.rank_log(tmp_path, 0, 0, 0)
    rank0.parent.mkdir(parents=True)
    rank0.write_text("step 1\n")
    batch = tmp_path / "logs" / "slurm-7.out"
    batch.write_text("launcher up\n[rank0]: step 1\nsrun: partial")
    out = io.StringIO()
    f = Follower(lambda: log_files(tmp_path, "7"), out, drop_tee=lambda p: p == batch)
    f.step()
    assert out.getvalue().count("step 1") == 1 and "launcher up" in out.getvalue()
    assert "partial" not in out.getvalue()           # an unfinished line waits for its end
    with open(batch, "a") as fh:
        fh.write(" line\n[rank0]: step 2\n")
    f.step(final=True)
    text = out.getvalue()
    assert "srun: partial line" in text and "step 2" not in text and text.count("==>") == 2


def test_follow_waits_out_a_preemption() -> None:
    states = iter(["PREEMPTED", "PENDING", "PREEMPTED", "PREEMPTED", "PREEMPTED"])
    assert follow(_rec("1"), Follower(lambda: [], io.StringIO()), lambda: next(states),
                  lambda: None) == "PREEMPTED"


PARTS = parse_show_partitions((FIX / "scontrol_show_partition.txt").read_text())
SPEC = dict(script="/x/t.py", job_name="t", job_dir="/tmp/j")


@pytest.mark.parametrize("kw,flag,words", [
    (dict(partition="nope"), "--partition", "debug, high"),
    (dict(nodes=(5, 5)), "--nodes", "at most 3 nodes"),
    (dict(nodes=(4, 6), partition="high"), "--nodes", "partition 'high' has 3 nodes"),
    (dict(time_limit_s=7200), "--time", "MaxTime of the default partition 'debug'"),
])
def test_check_partition_refuses(kw, flag, words) -> None:
    from hpc.contract.spec_terms import cli_terms

    with pytest.raises(SpecError) as e, cli_terms():
        check_partition(JobSpec(**SPEC, **kw), PARTS)
    assert e.value.flag == flag and words in str(e.value) and "Example: --" in str(e.value)


@pytest.mark.parametrize("kw,field,example", [
    (dict(partition="nope"), "partition", "partition='debug'"),
    (dict(nodes=(5, 5)), "nodes", "nodes=3"),
    (dict(time_limit_s=7200), "time_limit_s", "time_limit_s=3600"),
])
def test_check_partition_refuses_in_python_terms_from_python(kw, field, example) -> None:
    with pytest.raises(SpecError) as e:       # hpc.submit(spec) from a notebook
        check_partition(JobSpec(**SPEC, **kw), PARTS)
    assert e.value.flag == field and str(e.value).endswith(f"Example: {example}")


def test_check_partition_accepts() -> None:
    assert check_partition(JobSpec(**SPEC, nodes=(2, 4)), PARTS).name == "debug"
    assert check_partition(JobSpec(**SPEC, partition="high", time_limit_s=3600), PARTS).name == "high"


@pytest.mark.parametrize("fixture,words", [
    ("sbatch_error_invalid_partition.txt", "partition does not exist"),
    ("sbatch_error_too_many_nodes.txt", "more nodes"),
    ("sbatch_error_time_limit.txt", "time limit"),
])
def test_explain_sbatch_rejections(fixture: str, words: str) -> None:
    msg = explain_rejection((FIX / fixture).read_text())
    assert msg and words in msg and msg.startswith("Slurm refused the job")


def test_outcome_line_tells_steps_and_work_lost():
    o = jobdir.Outcome(allocation=1, kind="node_failure", exit_code=76, step=20, start_step=10,
                       last_step=23, lost_steps=3, reason="rendezvous failed")
    assert o.describe() == "node_failure, steps 10->23, checkpoint 20, 3 steps lost: rendezvous failed"


def test_notes_on_valid_but_probably_unmeant_requests() -> None:
    from hpc.submission import notes

    spec = JobSpec(script="t.py", job_dir="/j", nodes=(2, 5), nproc_per_node=4)
    part = parse_show_partitions((FIX / "scontrol_show_partition_debug.txt").read_text())[0]
    said = notes(spec, part)
    assert any("--cpus-per-task is not set" in n and "4 workers" in n for n in said)
    assert any(f"never grow beyond {part.total_nodes}" in n for n in said)
    assert notes(JobSpec(script="t.py", job_dir="/j", nodes=(2, 2), nproc_per_node=4, cpus_per_task=32),
                 part) == []


def test_running_allocation_shows_its_stragglers_and_stalls_so_far(tmp_path: Path) -> None:
    from hpc.status import running_notes, with_running_notes

    jobdir.append_outcome(tmp_path, jobdir.Outcome(allocation=0, kind="preempted", exit_code=75))
    (tmp_path / "stragglers.jsonl").write_text(
        '{"allocation": 0, "rank": 5, "node": "old", "node_rank": 2}\n'
        '{"allocation": 1, "rank": 3, "node": "node2", "node_rank": 1}\n')
    (tmp_path / "hangs.jsonl").write_text('{"allocation": 1, "node": "node1"}\nnot json\n')
    notes = running_notes(tmp_path)
    assert notes == ("straggler: rank 3 on node2 (node rank 1); 1 stall(s) recovered so far, "
                     "last on node1")
    queue = {e.job_id: e for e in parse_squeue((FIX / "squeue_running_sacct_lagging.txt").read_text())}
    acct = parse_sacct((FIX / "sacct_lagging_pending.txt").read_text())
    view = with_running_notes(build_views([_rec("28")], queue, acct, {})[0], notes)
    assert view.allocations[-1].describe() == f"#0 RUNNING ({notes})"
    assert running_notes(tmp_path / "missing") == ""
