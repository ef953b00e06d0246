"""Where Slurm refuses a requeue, the job continues as a new submission into the same job
directory, exactly once per allocation, chained after the old job (runtime/ending/resubmit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.contract import jobdir, resubmissions
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmError
from hpc.contract.index import JobRecord, read_index
from hpc.status import build_views, read_outcomes, _with_chain
from runtime.ending.resubmit import continue_as_new_job, submission_args, submission_env, tag

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, new_id: str = "62", fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.new_id, self.fail = new_id, fail

    cancelled = False

    def accounting(self, ids):
        from hpc.contract.slurm_parse import parse_sacct
        if not self.cancelled:
            raise SlurmError("sacct failed: no accounting storage", ["sacct"], 1, "")
        # what sacct says while the cancelled job's processes are still ending (COMPLETING)
        return parse_sacct("61|61|sleeper|debug|CANCELLED by 0|0:0|00:01:02|node[1-2]|"
                           "2026-11-24T22:57:46|2026-11-24T22:57:48|2026-11-24T22:57:40|None|\n")

    def submit(self, script, args, tag=None):
        self.calls.append((script, list(args), tag))
        if self.fail:
            raise SlurmError("sbatch rejected the job: QOSMaxSubmitJobPerUserLimit", ["sbatch"], 1, "")
        return self.new_id


def _job(tmp_path: Path, script: bool = True) -> tuple[Path, JobSpec]:
    job = tmp_path / "job dir"
    jobdir.create(job)
    spec = JobSpec(script="/x/t.py", job_dir=str(job), job_name="gpt")
    if script:
        jobdir.write_atomic(job / jobdir.SBATCH, "#!/bin/bash\n")
    jobdir.write_atomic(job / jobdir.SLURM_JOB_ID, "61\n")
    return job, spec


def test_chained_after_the_old_job_with_a_stable_tag() -> None:
    assert submission_args("61") == ["--export=ALL", "--dependency=afterany:61"]
    assert tag("61", 3) == tag("61", 3) != tag("61", 4)


def test_the_continuation_does_not_inherit_this_jobs_variables() -> None:
    env = {"PATH": "/bin", "SLURM_CONF": "/etc/slurm.conf", "SLURM_RESTART_COUNT": "2",
           "SLURM_JOB_ID": "61", "HPC_ALLOCATION": "2", "SBATCH_SIGNAL": "USR2@1",
           "NCCL_SOCKET_IFNAME": "=eth0", "WANDB_API_KEY": "k", "TORCHELASTIC_RUN_ID": "x"}
    assert submission_env(env, ["NCCL_SOCKET_IFNAME"]) == {
        "PATH": "/bin", "SLURM_CONF": "/etc/slurm.conf", "WANDB_API_KEY": "k"}


def test_continues_once_records_the_link_and_moves_the_job_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    job, spec = _job(tmp_path)
    client = FakeClient()
    env = {"SLURM_CLUSTER_NAME": "c1"}
    new = continue_as_new_job(job, spec, job_id="61", allocation=2, reason="preempted",
                              client=client, env=env)
    assert new == "62"
    assert client.calls == [(job / jobdir.SBATCH, ["--export=ALL", "--dependency=afterany:61"],
                             "continue-61-alloc-2")]
    assert (job / jobdir.SLURM_JOB_ID).read_text() == "62\n"
    links = resubmissions.read(job)
    assert [(x.job_id, x.previous, x.allocation_base) for x in links] == [("62", "61", 3)]
    assert [(r.job_id, r.job_dir, r.cluster) for r in read_index()] == [("62", str(job), "c1")]
    # Another node (or a second try) for the same allocation submits nothing.
    assert continue_as_new_job(job, spec, job_id="61", allocation=2, reason="x",
                               client=client, env=env) is None
    assert len(client.calls) == 1


def test_without_a_batch_script_or_when_sbatch_fails_it_ends_as_before(tmp_path: Path) -> None:
    job, spec = _job(tmp_path, script=False)
    client = FakeClient()
    assert continue_as_new_job(job, spec, job_id="61", allocation=0, reason="x", client=client) is None
    assert client.calls == [] and not (job / resubmissions.FILE).exists()
    jobdir.write_atomic(job / jobdir.SBATCH, "#!/bin/bash\n")
    assert continue_as_new_job(job, spec, job_id="61", allocation=0, reason="x",
                               client=FakeClient(fail=True)) is None
    assert (job / jobdir.SLURM_JOB_ID).read_text() == "61\n"


def test_allocations_go_on_across_the_chain() -> None:
    links = resubmissions.parse("".join(x.to_line() for x in (
        resubmissions.Link("62", "61", 3), resubmissions.Link("70", "62", 5))) + "garbage\n")
    assert resubmissions.allocation_base(links, "61") == 0
    assert resubmissions.allocation_base(links, "70") == 5
    assert resubmissions.allocation_range(links, "61") == (0, 3)
    assert resubmissions.allocation_range(links, "62") == (3, 5)
    assert resubmissions.allocation_range(links, "70") == (5, None)
    assert resubmissions.continued_as(links, "62") == "70" and resubmissions.continued_as(links, "70") == ""


def test_status_shows_each_job_its_own_allocations_and_the_chain(tmp_path: Path) -> None:
    job = tmp_path / "job"
    jobdir.create(job)
    for alloc, kind, jid in ((0, "time_limit", "61"), (1, "preempted", "61"), (2, "finished", "62")):
        jobdir.append_outcome(job, jobdir.Outcome(allocation=alloc, kind=kind, exit_code=0,
                                                  slurm_job_id=jid))
    (job / resubmissions.FILE).write_text(resubmissions.Link("62", "61", 2).to_line())
    old, new = JobRecord("61", str(job), "gpt", "sbatch", 0.0), JobRecord("62", str(job), "gpt", "sbatch", 0.0)
    outs = read_outcomes([old, new])
    assert [(o.allocation, o.kind) for o in outs["61"]] == [(0, "time_limit"), (1, "preempted")]
    assert [(o.allocation, o.kind) for o in outs["62"]] == [(0, "finished")]
    views = [_with_chain(v) for v in build_views([old, new], {}, (), outs)]
    assert views[0].chain == "continued as job 62" and views[1].chain == "continues job 61"


def test_a_cancelled_job_is_not_continued(tmp_path: Path) -> None:
    job, spec = _job(tmp_path)
    client = FakeClient()
    client.cancelled = True
    assert continue_as_new_job(job, spec, job_id="61", allocation=0, reason="x", client=client) is None
    assert client.calls == [] and (job / jobdir.SLURM_JOB_ID).read_text() == "61\n"
