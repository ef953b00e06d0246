"""Job ids are unique per cluster only: the index names each job's cluster, ids resolve to this
cluster's job, and ``hpc status`` never merges two clusters' jobs that share an id. Also
``hpc status JOB_DIR`` for a job directory made by ``hpc run`` (no Slurm id)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hpc import status
from hpc.contract import index
from hpc.cli import main
from hpc.contract import jobdir
from hpc.contract.errors import SpecError, UsageError
from hpc.contract.slurm_parse import parse_cluster_name, parse_sacct
from hpc.contract.index import JobRecord, read_index, record_job, resolve
from hpc.status import build_views, format_table

pytestmark = pytest.mark.unit

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def test_cluster_name_from_scontrol_show_config() -> None:
    # The head of `scontrol show config` as Slurm 22.05 prints it (the slurm tier checks the
    # parser against the live test cluster too).
    assert parse_cluster_name((FIX / "scontrol_show_config_head.txt").read_text()) == "hpctest"
    assert parse_cluster_name("SlurmctldHost = x\n") == ""


def test_current_cluster_from_the_job_environment_first() -> None:
    assert index.current_cluster(env={"SLURM_CLUSTER_NAME": "alps"}) == "alps"


def _index(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for rec in (JobRecord("5", "/old/5", "old", "sbatch", 1.0),               # before clusters
                JobRecord("5", "/a/5", "on-a", "sbatch", 2.0, "a"),
                JobRecord("5", "/b/5", "on-b", "sbatch", 3.0, "b"),
                JobRecord("6", "/b/6", "only-b", "sbatch", 4.0, "b")):
        record_job(rec, home)
    return home


def test_an_id_resolves_to_this_clusters_job(tmp_path: Path) -> None:
    home = _index(tmp_path)
    assert resolve("5", home, cluster="a").job_dir == "/a/5"
    assert resolve("5", home, cluster="b").job_dir == "/b/5"
    assert resolve("5", home, cluster="c").job_dir == "/old/5"   # no cluster recorded: maybe ours
    other = resolve("6", home, cluster="a")
    assert other.job_dir == "/b/6" and other.elsewhere("a")
    assert [r.cluster for r in read_index(home)] == ["", "a", "b", "b"]


def test_jobs_sharing_an_id_never_merge_in_status(tmp_path: Path) -> None:
    a, b = JobRecord("4", str(tmp_path / "a"), "on-a", "sbatch", 0.0, "a"), \
        JobRecord("4", str(tmp_path / "b"), "on-b", "sbatch", 0.0, "b")
    acct = parse_sacct((FIX / "sacct_duplicates.txt").read_text())   # cluster a's job 4
    outcomes = {a.key: [jobdir.Outcome(allocation=0, kind="preempted", exit_code=75, step=12)],
                b.key: [jobdir.Outcome(allocation=0, kind="finished", exit_code=0, step=40)]}
    va, vb = build_views([a, b], {}, acct, outcomes, cluster="a")
    assert va.requeues == 1 and va.allocations[0].outcome == "preempted"
    assert vb.state == "on b: finished" and vb.requeues == 0    # nothing of a's job 4
    assert [x.outcome for x in vb.allocations] == ["finished"]
    table = format_table([va, vb])
    assert "4@a" in table and "4@b" in table


def test_collect_asks_slurm_only_about_this_clusters_jobs(tmp_path: Path) -> None:
    class Client:
        asked: list = []

        def queue(self, ids):
            self.asked.append(list(ids))
            return {}

        def accounting(self, ids):
            return ()

    client = Client()
    jobs = [JobRecord("4", "", "x", "sbatch", 0.0, "a"), JobRecord("4", "", "y", "sbatch", 0.0, "b"),
            JobRecord("", str(tmp_path), "local", "local", 0.0)]
    views = status.collect(client, jobs, cluster="a")
    assert client.asked == [["4"]] and len(views) == 3


def _local_job(tmp_path: Path) -> Path:
    job = tmp_path / "hpc run job"
    jobdir.create(job)
    jobdir.write_atomic(job / jobdir.JOBSPEC, "{}")
    jobdir.append_outcome(job, jobdir.Outcome(allocation=0, kind="preempted", exit_code=75, step=8))
    jobdir.append_outcome(job, jobdir.Outcome(allocation=1, kind="finished", exit_code=0, step=20))
    return job


def test_status_of_an_hpc_run_job_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    job = _local_job(tmp_path)
    rec = resolve(str(job))
    assert rec.job_id == "" and rec.job_dir == str(job)
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    assert main(["status", str(job)]) == 0      # no Slurm call: nothing to ask Slurm
    out = capsys.readouterr().out
    assert "local: finished" in out and "#1" in out and "preempted" in out
    assert main(["status", "--json", str(job)]) == 0
    assert '"state": "local: finished"' in capsys.readouterr().out


def test_cancel_refuses_an_hpc_run_job_and_another_clusters(tmp_path: Path, monkeypatch) -> None:
    job = _local_job(tmp_path)
    monkeypatch.setattr(status, "current_cluster", lambda client=None: "a")
    with pytest.raises(UsageError, match="hpc run"):
        status.cancel(argparse.Namespace(job=[str(job)]))
    home = _index(tmp_path)
    monkeypatch.setenv("HPC_HOME", str(home))
    with pytest.raises(UsageError, match="cluster b"):
        status.cancel(argparse.Namespace(job=["6"]))


def test_unknown_reference_names_every_accepted_form(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="hpc run"):
        resolve(str(tmp_path / "nothing-here"), tmp_path / "home")
