"""Issue 16 on the real cluster: setup lines on every node, sbatch options Slurm really takes, and
the container design (the requeue done by the batch shell, outside the container).

No container runtime runs on this machine. The container test uses a stand-in ``apptainer`` that
does what matters here: it runs the launcher in an environment where Slurm's commands are not
there (each one records that it was called and fails), so the test shows that nothing inside
the "container" needs Slurm and that the requeue is done from outside.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import sacct_rows, squeue_state, wait_until

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_gpt.py"


def hpc(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def squeue(env: dict[str, str], job_id: str) -> str:
    """The job's state, "" once it left the queue ("UNKNOWN" when squeue failed: not gone)."""
    state = squeue_state(env, job_id)
    return "" if state == "GONE" else state


def outcomes(job: Path) -> list[dict]:
    path = job / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def batch_log(job: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((job / "logs").glob("slurm-*.out")))


RANK_SCRIPT = """\
import json, os, socket
from pathlib import Path
out = Path(os.environ["HPC_JOB_DIR"]) / f"rank-{os.environ['RANK']}.json"
out.write_text(json.dumps({"host": socket.gethostname(), "count": os.environ.get("HPC_TEST_SETUPS"),
                           "venv": os.environ.get("HPC_TEST_VENV")}))
"""


def test_setup_lines_run_on_every_node_before_the_launcher(env, tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    job = tmp_path / "setup job"
    r = hpc(env, "submit", str(script), "-N", "2", "-t", "5", "--job-dir", str(job),
            "--setup", 'echo "${HPC_TEST_SETUPS:-0}" >> "$HPC_JOB_DIR/setup-$(hostname).txt"',
            "--setup", "export HPC_TEST_SETUPS=$(( ${HPC_TEST_SETUPS:-0} + 1 ))",
            "--setup", "export HPC_TEST_VENV=activated  # like 'source venv/bin/activate'")
    assert r.returncode == 0, r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    wait_until(lambda: squeue(env, job_id) in ("", "COMPLETED"), 180, f"job {job_id} to end")
    assert outcomes(job) and outcomes(job)[-1]["kind"] == "finished", (outcomes(job), batch_log(job))
    lines = {p.name: p.read_text().split("\n")[:-1] for p in job.glob("setup-*.txt")}
    # The batch shell ran the lines on the first node (count 0 then), then every node ran them
    # in the step (count 1: the batch shell's export came with srun's environment).
    assert lines == {"setup-node1.txt": ["0", "1"], "setup-node2.txt": ["1"]}, lines
    ranks = [json.loads((job / f"rank-{r}.json").read_text()) for r in range(2)]
    assert sorted(x["host"] for x in ranks) == ["node1", "node2"]
    # Each worker saw both parts: the batch shell's export reached every node through srun (1),
    # and the node's own run added to it (2) before the launcher started.
    assert [x["count"] for x in ranks] == ["2", "2"] and {x["venv"] for x in ranks} == {"activated"}


def test_sbatch_options_and_common_flags_reach_slurm(env, tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    job = tmp_path / "held"
    r = hpc(env, "submit", str(script), "--nodes", "1-2", "-t", "7", "-J", "site-opts",
            "--exclusive", "--mail-type", "end,fail", "--sbatch", "nice=5", "--sbatch", "hold",
            "--job-dir", str(job))
    assert r.returncode == 0, r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    try:
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                              text=True).stdout
        fields = dict(kv.split("=", 1) for kv in show.split() if "=" in kv)
        assert fields["JobName"] == "site-opts" and fields["TimeLimit"] == "00:07:00"
        assert fields["NumNodes"].startswith("1-2"), fields["NumNodes"]
        assert fields["Nice"] == "5" and fields["OverSubscribe"] == "NO"
        assert fields["MailType"] == "END,FAIL" and fields["Priority"] == "0"   # held
        # The index names the job's cluster, as scontrol says it (the parser on live output).
        from hpc.contract.slurm_parse import parse_cluster_name
        config = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True,
                                text=True).stdout
        record = json.loads((Path(env["HPC_HOME"]) / "jobs.jsonl").read_text().splitlines()[-1])
        assert record["job_id"] == job_id and record["cluster"] == parse_cluster_name(config) != ""
        st = hpc(env, "status", job_id)
        assert st.returncode == 0 and job_id in st.stdout and "PENDING" in st.stdout, st.stdout
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
    r = hpc(env, "submit", str(script), "--sbatch", "part=debug", "--job-dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "--partition" in r.stderr and not (tmp_path / "x").exists()


# A stand-in for `apptainer exec [--nv] --bind MOUNTS IMAGE CMD...`: runs CMD with Slurm's
# commands replaced by ones that record the call and fail, as in a container without Slurm.
FAKE_APPTAINER = """#!/bin/bash
[ "$1" = exec ] || exit 64
shift
while [ $# -gt 0 ]; do
    case "$1" in --nv) shift;; --bind) shift 2;; *) break;; esac
done
shift   # the image
hide="$(mktemp -d)"
for c in scontrol squeue sbatch sacct scancel srun sinfo; do
    printf '#!/bin/sh\\necho "$(hostname) %s $*" >> "$HPC_JOB_DIR/slurm-calls-in-container"\\necho "%s: not in this container" >&2\\nexit 127\\n' "$c" "$c" > "$hide/$c"
    chmod +x "$hide/$c"
done
echo "$(hostname) ${HPC_JOB_END_TIME:-none} ${HPC_GRACE_S:-none}" >> "$HPC_JOB_DIR/container-deadlines"
PATH="$hide:$PATH" exec "$@"
"""


def _submit_contained(env: dict[str, str], tmp_path: Path) -> tuple[Path, str]:
    """A 2-node job under the stand-in apptainer (its own HPC_HOME): its job dir and id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', os.defpath)}",
               "HPC_HOME": str(tmp_path / "hpc-home-contained")}
    job = tmp_path / "contained"
    r = hpc(run_env, "submit", str(TRAIN), "--nodes", "2", "--nproc-per-node", "2", "--time", "10",
            "--job-dir", str(job), "--checkpoint-every-steps", "2", "--container-runtime", "apptainer",
            "--container-image", str(tmp_path / "pytorch.sif"),
            "--", "--preset", "tiny", "--step-sleep", "0.3")
    assert r.returncode == 0, r.stderr
    return job, (job / "slurm_job_id").read_text().strip()


def _check_contained(env: dict[str, str], job: Path, job_id: str) -> None:
    """Stopped by the warning, requeued by the batch shell (outside the container), finished;
    nothing inside the "container" called Slurm, the batch shell gave it the deadlines."""
    kinds = [(o["allocation"], o["kind"]) for o in outcomes(job)]
    assert kinds[0] in ((0, "time_limit"), (0, "preempted")), (kinds, batch_log(job))
    assert kinds[-1][1] == "finished", (kinds, batch_log(job))
    assert (job / "requeue-request-alloc-0").exists()
    log = batch_log(job)
    assert f"hpc: requeued job {job_id}: " in log, log
    show = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                          text=True).stdout
    assert "Restarts=1" in show or not show, show
    result = json.loads((job / "result.json").read_text())
    assert result["final_step"] == 40, result
    assert outcomes(job)[0]["step"] >= 6, outcomes(job)   # saved on the warning, resumed there
    # Nothing in the "container" called Slurm; the batch shell gave it the deadlines.
    calls = job / "slurm-calls-in-container"
    assert not calls.exists(), calls.read_text()
    deadlines = (job / "container-deadlines").read_text().split("\n")[:-1]
    assert len(deadlines) == 4 and all(d.split()[1].isdigit() for d in deadlines), deadlines
    end = int(deadlines[0].split()[1])
    assert abs(end - time.time()) < 15 * 60, deadlines


def test_an_elastic_container_job_gives_an_excluded_node_back_from_outside(env, tmp_path: Path) -> None:
    """An elastic container job (``--nodes 2:3``, the stand-in apptainer: no Slurm command
    inside) resumed in a job directory that already excludes node3: one task in the
    "container" decides (runtime.exclusions --plan), the batch shell gives node3 back to Slurm
    before srun, and the all-reduce runs on node1 and node2 only. Before, an elastic container
    job skipped the step and ran on node3 again."""
    from hpc.contract.jobspec import JobSpec
    from runtime.exclusions import add

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', os.defpath)}"}
    job = tmp_path / "contained elastic"
    job.mkdir(mode=0o700)
    check = REPO / "tests" / "slurm" / "allreduce_check.py"
    (job / "jobspec.json").write_text(JobSpec(script=str(check), job_dir=str(job)).to_json())
    assert add(job, "node3", "stall", "no progress for 300 s", 0)
    r = hpc(run_env, "submit", str(check), "--nodes", "2:3", "--nproc-per-node", "2", "--time", "10",
            "--job-dir", str(job), "--container-runtime", "apptainer",
            "--container-image", str(tmp_path / "pytorch.sif"))
    assert r.returncode == 0, r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    wait_until(lambda: squeue(env, job_id) in ("", "COMPLETED", "FAILED", "CANCELLED"), 240,
               f"job {job_id} to end; outcomes {outcomes(job)}")
    log = batch_log(job)
    assert "hpc: gave back excluded node(s) node3; running on node1,node2" in log, log[-3000:]
    result = json.loads((job / "allreduce.json").read_text())
    assert result["world_size"] == 4 and sorted(set(result["hosts"])) == ["node1", "node2"], result
    assert [o["kind"] for o in outcomes(job)] == ["finished"], outcomes(job)
    calls = job / "slurm-calls-in-container"
    assert not calls.exists(), calls.read_text()


def sacct_times(env: dict[str, str], *job_ids: str) -> dict[str, tuple[str, str]]:
    """(Start, End) of each job's last run, once slurmdbd has the end of every one of them."""
    def ended(rows: list[list[str]]) -> bool:
        last = {r[0]: r for r in rows}
        return set(last) >= set(job_ids) and all(last[j][2] not in ("", "Unknown") for j in job_ids)

    rows = sacct_rows(env, ",".join(job_ids), "JobID,Start,End", until=ended)
    return {r[0]: (r[1], r[2]) for r in rows}


def test_a_container_job_and_a_job_slurm_will_not_requeue_both_stopped_go_on(env, tmp_path: Path,
                                                                            baseline) -> None:
    """Two 2-node jobs at once (sharing nodes), each sent the warning signal at step 6:

    * a container job (the stand-in apptainer): the workers save, node 0 decides to requeue, and
      the batch shell does it, outside the container (issue 16);
    * a job with Requeue=0 (what JobRequeue=0 or a site's forced --no-requeue give): the stopped
      job is continued once, as a new job chained after it, from its checkpoint, with the same
      W&B run and the same sample order as an uninterrupted run.
    """
    from tests.slurm.support import assert_same_as_baseline

    contained, contained_id = _submit_contained(env, tmp_path)
    job = tmp_path / "no requeue"
    r = hpc(env, "submit", str(TRAIN), "--nodes", "2", "--nproc-per-node", "2", "--time", "10",
            "--job-dir", str(job), "--checkpoint-every-steps", "2",
            "--", "--preset", "tiny", "--step-sleep", "0.3")
    assert r.returncode == 0, r.stderr
    old = (job / "slurm_job_id").read_text().strip()
    subprocess.run(["scontrol", "update", f"JobId={old}", "Requeue=0"], env=env, check=True)

    def at_step_6(j: Path) -> bool:
        return ((j / "progress.json").exists()
                and json.loads((j / "progress.json").read_text()).get("step", 0) >= 6)

    wait_until(lambda: at_step_6(contained) and at_step_6(job), 240, "both jobs training to step 6")
    wandb_id = (job / "wandb_run_id").read_text()
    # The warning signal to every step process: the workers save, node 0 decides to requeue.
    subprocess.run(["scancel", "--signal=USR2", contained_id], env=env, check=True)
    subprocess.run(["scancel", "--signal=USR2", old], env=env, check=True)
    # The link is recorded first, then slurm_job_id moves to the new job: wait for both.
    wait_until(lambda: ((job / "resubmissions.jsonl").exists()
                        and (job / "slurm_job_id").read_text().strip() != old), 120,
               f"the continuation; outcomes {outcomes(job)}; {batch_log(job)[-2000:]}")
    new = (job / "slurm_job_id").read_text().strip()
    wait_until(lambda: len(outcomes(contained)) >= 2 and squeue(env, contained_id) in ("", "COMPLETED"), 300,
               f"the requeued container job to finish; outcomes {outcomes(contained)}")
    wait_until(lambda: squeue(env, new) in ("", "COMPLETED") and squeue(env, old) in ("", "FAILED", "COMPLETED"),
               300, f"job {new} to finish; outcomes {outcomes(job)}")

    _check_contained(env, contained, contained_id)

    links = [json.loads(x) for x in (job / "resubmissions.jsonl").read_text().splitlines()]
    assert [(x["previous"], x["job_id"], x["allocation_base"]) for x in links] == [(old, new, 1)]
    assert new != old
    done = [(o["allocation"], o["kind"], o["slurm_job_id"]) for o in outcomes(job)]
    assert done[0][0] == 0 and done[0][1] in ("preempted", "time_limit") and done[0][2] == old, done
    assert done[-1] == (1, "finished", new), done
    assert (job / "wandb_run_id").read_text() == wandb_id
    assert_same_as_baseline(job, baseline)            # same W&B run, same samples and weights
    times = sacct_times(env, old, new)
    assert times[new][0] >= times[old][1], times   # chained: never both running
    index = [json.loads(x) for x in (Path(env["HPC_HOME"]) / "jobs.jsonl").read_text().splitlines()]
    assert [x["job_id"] for x in index] == [old, new]    # one continuation, recorded once
    st = hpc(env, "status", old, new)
    assert f"continued as job {new}" in st.stdout and f"continues job {old}" in st.stdout, st.stdout
