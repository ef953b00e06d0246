"""A memory of bad nodes across jobs: a history of jobs played through the rule, the job
directories it is read from, ``hpc nodes``, and the ``--exclude`` that ``hpc render`` adds.

The rule: a node is avoided when it faulted in N of the last M jobs that ran on it (2 of 5 by
default). Never: a busy node, the nodes of a job that failed by the user's error, or what
happened while a preemption, a time limit or a cancel stopped an allocation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc import bad_nodes, node_history, nodes
from hpc.bad_nodes import Allocation, Fault, JobNodes, Policy, counted_faults, node_records, to_avoid
from hpc.cli import main
from hpc.contract import records
from hpc.contract.index import record_job
from hpc.contract.jobpaths import JobPaths
from hpc.contract.jobspec import JobSpec
from hpc.contract.records import Exclusion, JobRecord, Outcome

pytestmark = pytest.mark.unit

T0 = time.time() - 3600.0   # the job directories' faults: an hour ago, so none has lapsed


def job(key: str, t: float, nodes: tuple[str, ...], *faults: tuple[str, str], ending: str = "node_failure",
        stopping_since: float | None = None) -> JobNodes:
    """A one-allocation job on ``nodes`` with ``faults`` (node, kind) recorded at time ``t``."""
    return JobNodes(key, t, (Allocation(nodes, tuple(Fault(n, k, t) for n, k in faults), ending,
                                        stopping_since),))


def avoided(jobs: list[JobNodes], policy: Policy = Policy()) -> list[str]:
    return [r.node for r in node_records(jobs, policy) if r.avoid]


# --------------------------------------------------------------------------- the rule


def test_two_faulty_jobs_of_the_last_five_avoid_a_node_one_does_not():
    once = [job("1", 1, ("n1", "n2"), ("n2", "lost")), job("2", 2, ("n1", "n2"), ending="finished")]
    assert avoided(once) == []
    twice = once + [job("3", 3, ("n2", "n3"), ("n2", "stall"))]
    assert avoided(twice) == ["n2"]
    r = {r.node: r for r in node_records(twice)}["n2"]
    assert (r.jobs, r.faulted, r.kinds, r.recent_faulted, r.recent_jobs) == \
        (3, 2, (("lost", 1), ("stall", 1)), 2, 3)
    assert r.last_fault == 3


def test_a_node_is_trusted_again_after_m_clean_jobs():
    history = [job("1", 1, ("n1",), ("n1", "lost")), job("2", 2, ("n1",), ("n1", "health"))]
    assert avoided(history) == ["n1"]
    clean = [job(str(i), i, ("n1",), ending="finished") for i in range(3, 7)]
    assert avoided(history + clean[:3]) == ["n1"]      # 1,2 still among its last 5
    assert avoided(history + clean) == []              # job 1 fell out: 1 of the last 5


def test_an_avoided_node_is_forgiven_after_a_week_without_your_jobs():
    week = bad_nodes.FORGET_AFTER_S
    history = [job("1", 1000, ("n1",), ("n1", "lost")), job("2", 2000, ("n1",), ("n1", "lost"))]
    assert avoided(history) == ["n1"]
    assert [r.node for r in node_records(history, Policy(), now=1000 + week - 1) if r.avoid] == ["n1"]
    assert [r.node for r in node_records(history, Policy(), now=1000 + week + 1) if r.avoid] == []
    late = node_records(history, Policy(), now=1000 + week + 1)[0]
    assert (late.faulted, late.kinds) == (2, (("lost", 2),))    # the history stays


@pytest.mark.parametrize("faults,jobs,want", [(1, 1, ["n1"]), (2, 2, []), (3, 5, []), (1, 5, ["n1", "n2"])])
def test_n_of_m_is_configurable(faults, jobs, want):
    history = [job("1", 1, ("n1", "n2"), ("n2", "lost")), job("2", 2, ("n1", "n2"), ("n1", "stall"))]
    assert avoided(history, Policy(faults=faults, jobs=jobs)) == want


def test_a_busy_healthy_node_is_never_avoided():
    """A node that only ran jobs (busy, its ranks slow or in long phases) has no fault record:
    the watchdog records a stall against a node only on hardware-like evidence."""
    history = [job(str(i), i, ("busy1", "n2"), ending=kind)
               for i, kind in enumerate(("finished", "hang", "app_error", "finished", "preempted"))]
    assert avoided(history, Policy(faults=1, jobs=5)) == []


def test_the_nodes_of_a_job_that_failed_by_the_users_error_are_never_avoided():
    history = [job(str(i), i, ("n1", "n2"), ("n1", "stall"), ("n2", "lost"), ending="app_error")
               for i in range(5)]
    assert counted_faults(history[0]) == []
    assert avoided(history, Policy(faults=1, jobs=5)) == []


@pytest.mark.parametrize("ending", ["preempted", "time_limit", "cancelled"])
def test_what_happens_while_an_allocation_is_stopped_never_counts(ending):
    """Nodes leave a stopped allocation at different times; a peer may see one go silent. A
    fault before the stop began is the node's all the same."""
    during = [job(str(i), 10.0 * i, ("n1", "n2"), ("n2", "stall"), ending=ending,
                  stopping_since=10.0 * i - 1) for i in range(1, 6)]
    assert avoided(during, Policy(faults=1, jobs=5)) == []
    before = [job(str(i), 10.0 * i, ("n1", "n2"), ("n2", "lost"), ending=ending,
                  stopping_since=10.0 * i + 1) for i in range(1, 3)]
    assert avoided(before) == ["n2"]


def test_a_health_check_every_node_failed_is_the_jobs_not_the_nodes():
    all_failed = [job(str(i), i, ("n1", "n2"), ("n1", "health"), ("n2", "health")) for i in range(3)]
    assert avoided(all_failed) == []
    one_failed = [job(str(i), i, ("n1", "n2"), ("n1", "health")) for i in range(2)]
    assert avoided(one_failed) == ["n1"]


def test_a_fault_of_an_unknown_kind_never_counts():
    assert counted_faults(job("1", 1, ("n1",), ("n1", "slow"))) == []


def test_the_partition_caps_what_is_avoided_oldest_fault_lapsing_first():
    history = [job(str(i), i, ("a", "b", "c"), ("a", "lost"), ("b", "lost")) for i in (1, 2)] + \
        [job(str(i), i, ("c", "d"), ("c", "stall")) for i in (3, 4)]
    records_ = node_records(history)
    assert [r.node for r in records_ if r.avoid] == ["a", "b", "c"]
    got = to_avoid(records_, partition_nodes=["a", "b", "c", "d", "e"], needed=3)
    assert got.nodes == ("b", "c") and [r.node for r in got.kept] == ["a"]   # a, b tie: a first
    assert "a faulted in 2 of its last 2 jobs but is kept: the job needs 3" in got.notes[0]
    assert to_avoid(records_, partition_nodes=["c", "x"], needed=1).nodes == ("c",)   # a, b elsewhere
    assert to_avoid(records_, partition_nodes=["c", "x"], needed=2).nodes == ()
    assert to_avoid(records_, excluded=["a"]).nodes == ("b", "c")   # the user's already


def test_the_line_names_each_node_its_faults_and_the_way_out():
    history = [job(str(i), i, ("n7",), ("n7", "lost")) for i in (1, 2)]
    line = bad_nodes.describe(to_avoid(node_records(history)), Policy())
    assert line.startswith("avoiding 1 node(s) that faulted in 2 or more of the last 5 jobs")
    assert "n7: 2 of its last 2 jobs (lost x2)" in line and "--no-avoid-bad-nodes" in line
    assert bad_nodes.describe(to_avoid([]), Policy()) == ""


# --------------------------------------------------------------------------- the job directories


def faulty_job_dir(root: Path, name: str, job_id: str, t: float, *, node: str = "gpu07",
                   kind: str = "lost", ending: str = "node_failure", home: Path | None = None,
                   cluster: str = "") -> Path:
    """A job directory as the runtime leaves it: node logs, an exclusion, an outcome."""
    d = root / name
    paths = JobPaths(d)
    for host in ("gpu01", node):
        paths.alloc_logs(0).mkdir(parents=True, exist_ok=True)
        paths.node_log(0, host).write_text("log\n")
    records.append(paths.exclusions, Exclusion(node=node, kind=kind, reason="why", allocation=0, time=t))
    records.append(paths.outcomes, Outcome(allocation=0, kind=ending, exit_code=1, time=t + 5))
    if home is not None:
        record_job(JobRecord(job_id, str(d), name, "sbatch", t, cluster), home)
    return d


def test_history_is_read_from_the_job_directories_of_the_index(tmp_path: Path):
    home = tmp_path / "home"
    for i in (1, 2):
        faulty_job_dir(tmp_path, f"job {i}; echo", str(i), T0 + 100.0 * i, home=home)
    d = faulty_job_dir(tmp_path, "user-error", "3", T0 + 300, ending="app_error", home=home)
    record_job(JobRecord("4", str(d), "requeued", "sbatch", T0 + 400), home)   # the same job again
    record_job(JobRecord("", str(tmp_path / "local"), "local", "local", T0 + 500), home)
    history = node_history.read_history(home)
    assert [j.key for j in history] == ["1", "2", "3"]
    assert history[0].allocations[0].nodes == ("gpu01", "gpu07")
    by_node = {r.node: r for r in node_history.records_for(home)}
    assert (by_node["gpu07"].jobs, by_node["gpu07"].faulted, by_node["gpu07"].avoid) == (3, 2, True)
    assert (by_node["gpu01"].faulted, by_node["gpu01"].avoid) == (0, False)


def test_a_stop_notice_dates_the_stop_and_other_clusters_are_left_out(tmp_path: Path):
    home = tmp_path / "home"
    for i in (1, 2):
        d = faulty_job_dir(tmp_path, f"j{i}", str(i), T0 + 100.0 * i, ending="preempted", home=home,
                           cluster="alps")
        (JobPaths(d).stop_notice(0)).write_text(json.dumps({"received_at": T0 + 100.0 * i - 1}))
    assert node_history.records_for(home, "alps")[1].faulted == 0       # after the stop began
    for i in (3, 4):
        faulty_job_dir(tmp_path, f"j{i}", str(i), T0 + 100.0 * i, home=home, cluster="other")
    assert [r.avoid for r in node_history.records_for(home, "alps")] == [False, False]
    assert [r.avoid for r in node_history.records_for(home, "")] == [False, True]


def test_avoid_merges_the_users_exclude_and_can_be_switched_off(tmp_path: Path):
    home = tmp_path / "home"
    for i in (1, 2):
        faulty_job_dir(tmp_path, f"j{i}", str(i), T0 + 100.0 * i, home=home)
    spec = JobSpec(script=str(tmp_path / "t.py"), job_dir=str(tmp_path / "new"), exclude="node[3-4]")
    got = node_history.avoid(spec, home=home)
    assert got.spec.exclude == "node[3-4],gpu07" and "gpu07" in got.line
    assert node_history.avoid(spec.replace(exclude="gpu07"), home=home).spec.exclude == "gpu07"
    off = spec.replace(avoid_bad_nodes=False)
    assert node_history.avoid(off, home=home).spec is off


def test_a_name_that_is_no_node_never_reaches_the_exclude(tmp_path: Path):
    home = tmp_path / "home"
    for i in (1, 2):
        d = faulty_job_dir(tmp_path, f"j{i}", str(i), T0 + 100.0 * i, node="gpu07", home=home)
        records.append(JobPaths(d).exclusions, Exclusion(node="n1;echo x", kind="lost", reason="",
                                                         allocation=0, time=1.0))
        JobPaths(d).node_log(0, "$(id)").write_text("")
    assert [r.node for r in node_history.records_for(home)] == ["gpu01", "gpu07"]


def test_jobspec_refuses_more_faults_than_jobs_naming_both():
    with pytest.raises(ValueError, match=r"bad_node_faults 6 is invalid: at most bad_node_jobs \(5\)"):
        JobSpec(script="/t.py", job_dir="/tmp/j", bad_node_faults=6)


# --------------------------------------------------------------------------- the commands


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two jobs in which gpu07 was lost, in the index of ``$HPC_HOME``; no Slurm to ask."""
    home = tmp_path / "hpc home"
    monkeypatch.setenv("HPC_HOME", str(home))
    monkeypatch.setattr(nodes, "current_cluster", lambda: "")
    for i in (1, 2):
        faulty_job_dir(tmp_path / "jobs", f"j{i}", str(i), T0 + i, home=home)
    return home


def test_hpc_nodes_table_and_json(history, capsys):
    assert main(["nodes"]) == 0
    out = capsys.readouterr().out
    for word in ("NODE", "JOBS", "FAULTED", "KINDS", "LAST FAULT", "NEXT SUBMIT", "gpu07", "lost x2",
                 "2 faulted of 2", "avoid", "gpu01", "use"):
        assert word in out, out
    assert "the next hpc submit excludes gpu07 unless --no-avoid-bad-nodes" in out
    assert main(["nodes", "--json"]) == 0
    rows = {r["node"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gpu07"]["next_submit"] == "avoid" and rows["gpu07"]["kinds"] == {"lost": 2}
    assert rows["gpu01"]["next_submit"] == "use" and rows["gpu01"]["last_fault"] is None
    assert main(["nodes", "--bad-node-faults", "6"]) == 2
    err = capsys.readouterr().err
    assert "--bad-node-faults 6 is invalid: at most --bad-node-jobs (5)" in err


def test_hpc_render_excludes_the_bad_node_and_says_why(history, script, capsys, monkeypatch):
    monkeypatch.setenv("HPC_HOME", str(history))      # script's fixture moved $HOME
    assert main(["render", str(script), "--nodes", "2", "--exclude", "node3"]) == 0
    out, err = capsys.readouterr()
    assert '#SBATCH --exclude=node3,gpu07' in out, out
    line = [x for x in err.splitlines() if "avoiding" in x]
    assert len(line) == 1 and "gpu07: 2 of its last 2 jobs (lost x2)" in line[0], err
    assert main(["render", str(script), "--nodes", "2", "--no-avoid-bad-nodes"]) == 0
    out, err = capsys.readouterr()
    assert "--exclude" not in out and "avoiding" not in err


def test_render_without_history_adds_nothing(script, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "empty"))
    assert main(["render", str(script)]) == 0
    out, err = capsys.readouterr()
    assert "--exclude" not in out and "avoiding" not in err


def _fake_slurm(bin_dir: Path, monkeypatch) -> None:
    """A fake sbatch and scontrol (real processes): partition gpu holds gpu01, gpu07 and gpu09."""
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 42\n")
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$2" in\n'
        '  partition) echo "PartitionName=gpu Default=YES State=UP TotalNodes=3 TotalCPUs=12 '
        'Nodes=gpu[01,07,09] MaxNodes=UNLIMITED MaxTime=UNLIMITED" ;;\n'
        '  config) echo "ClusterName = alps" ;;\nesac\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")


def test_hpc_submit_avoids_the_bad_node_of_this_cluster_and_its_partition(history, script, capsys,
                                                                         monkeypatch, tmp_path):
    """The line is printed once, the submitted script and jobspec.json carry the exclusion."""
    monkeypatch.setenv("HPC_HOME", str(history))
    _fake_slurm(tmp_path / "bin", monkeypatch)
    job_dir = tmp_path / "new job"
    assert main(["submit", str(script), "--nodes", "2", "--job-dir", str(job_dir)]) == 0
    out, err = capsys.readouterr()
    assert "Submitted job 42" in out
    assert len([x for x in err.splitlines() if "avoiding" in x]) == 1, err
    assert '#SBATCH --exclude=gpu07' in JobPaths(job_dir).sbatch.read_text()
    assert JobSpec.load(job_dir).exclude == "gpu07"
    # --nodes 3 needs every node of the partition: gpu07 is kept, and the line says why
    assert main(["submit", str(script), "--nodes", "3", "--job-dir", str(tmp_path / "j3")]) == 0
    err = capsys.readouterr().err
    assert "gpu07 faulted in 2 of its last 2 jobs but is kept: the job needs 3" in err, err
    assert "--exclude" not in JobPaths(tmp_path / "j3").sbatch.read_text()


def test_hpc_sweep_keeps_the_bad_node_out_of_every_task(history, script, capsys, monkeypatch, tmp_path):
    """A job array is as many jobs on the same nodes: its script and every task's spec carry the
    exclusion, and the line is printed once."""
    monkeypatch.setenv("HPC_HOME", str(history))
    _fake_slurm(tmp_path / "bin", monkeypatch)
    root = tmp_path / "sweep"
    assert main(["sweep", str(script), "--nodes", "2", "--job-dir", str(root), "--grid", "lr=1,2"]) == 0
    err = capsys.readouterr().err
    assert len([x for x in err.splitlines() if "avoiding" in x]) == 1, err
    [array] = [p for p in root.glob("*.sbatch")] or [p for p in root.rglob("*.sh")]
    assert "#SBATCH --exclude=gpu07" in array.read_text(), array.read_text()
    tasks = sorted(p.parent for p in root.rglob("jobspec.json"))
    assert len(tasks) == 2 and {JobSpec.load(t).exclude for t in tasks} == {"gpu07"}
