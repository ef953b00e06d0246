"""Rendering: golden scripts for each variant, quoting for sbatch and the shell, secrets refused.

Golden files in tests/golden/ change only with ``HPC_UPDATE_GOLDEN=1``; a mismatch shows a
line-by-line diff. Hostile paths are checked by parsing the rendered script back: bash must
see the exact job directory, and sbatch's #SBATCH parser (re-implemented from Slurm's source
in :func:`sbatch_parse_argument`) must see the exact output path.
"""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path

import pytest

from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.render import render_sbatch, sbatch_quote
from hpc.secrets import check_no_secrets, is_secret_name
from tests.unit.support import sbatch_parse_argument

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1",
            python="/opt/venv/bin/python")

VARIANTS = {
    "minimal": {},
    "full_options": dict(nodes=(4, 4), gpus_per_node=8, cpus_per_task=32, mem="256G",
                         time_limit_s=4 * 3600, partition="gpu", account="proj123", qos="high",
                         constraint="a100&ib", exclude="node[3-4]", signal="USR1",
                         signal_lead_s=300, max_requeues=5, rdzv_port=29500),
    "elastic": dict(nodes=(2, 4), nproc_per_node=2),
    "requeue_never": dict(requeue="never"),
    "hostile_job_dir": dict(job_dir="/tmp/semi;colon $HOME `x`/quote's \"dq\" #hash",
                            job_name="my job #1"),
    # issue 16: site options, --setup and containers (each its own file; the others unchanged)
    "site_options": dict(nodes=(2, 4), gpus_per_node=8, gpu_type="a100", exclusive=True,
                         reservation="maint", nodelist="node[1-2]", mail_type="END,FAIL",
                         mail_user="me@example.org",
                         sbatch=(("gres-flags", "enforce-binding"), ("overcommit", ""))),
    "setup": dict(setup=("module load cuda/12.4",
                         "source '/shared/my venv/bin/activate'  # the job's venv",
                         "export HF_HOME=/scratch/$USER/hf")),
    "pyxis": dict(nodes=(2, 2), gpus_per_node=8, container_image="nvcr.io#nvidia/pytorch:24.05-py3",
                  container_mounts=("/datasets:/data:ro",), checkpoint_dir="/ckpt/gpt-1",
                  setup=("export NCCL_DEBUG=WARN",)),
    "apptainer": dict(nodes=(2, 2), gpus_per_node=8, container_image="/images/pytorch.sif",
                      container_runtime="apptainer", container_mounts=("/datasets:/data:ro",),
                      setup=("module load apptainer",)),
}


def _diff(expected: str, actual: str, name: str) -> str:
    return "\n".join(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                          f"golden/{name}", "rendered", lineterm=""))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_golden(name: str) -> None:
    text = render_sbatch(JobSpec(**{**BASE, **VARIANTS[name]}))
    path = GOLDEN / f"sbatch_{name}.sh"
    if os.environ.get("HPC_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with HPC_UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    assert text == expected, "rendered script differs from the golden file:\n" + _diff(expected, text, path.name)


def test_sbatch_quote_round_trips(hostile_dir: Path) -> None:
    for value in (str(hostile_dir), "a\\b", "x#y", "plain-1.2"):
        assert sbatch_parse_argument(f"--output={sbatch_quote(value)}") == [f"--output={value}"]


def test_hostile_job_dir_reaches_bash_and_sbatch_exactly(hostile_dir: Path) -> None:
    job_dir = str(hostile_dir / "job")
    text = render_sbatch(JobSpec(**{**BASE, "job_dir": job_dir, "job_name": hostile_dir.name}))
    output = [ln for ln in text.splitlines() if ln.startswith("#SBATCH --output=")][0]
    assert sbatch_parse_argument(output[len("#SBATCH "):]) == [f"--output={job_dir}/logs/slurm-%j.out"]
    name = [ln for ln in text.splitlines() if ln.startswith("#SBATCH --job-name=")][0]
    assert sbatch_parse_argument(name[len("#SBATCH "):]) == [f"--job-name={hostile_dir.name}"]
    # Run the script's variable block in bash: JOB_DIR must come out byte for byte.
    block = text.split("set -u\n", 1)[1].split("\n\n", 1)[0]
    out = subprocess.run(["bash", "-c", block + '\nprintf %s "$JOB_DIR"'], capture_output=True,
                         text=True, check=True)
    assert out.stdout == job_dir
    assert not (hostile_dir / "x").exists()  # no backtick or ; ran


def test_requeue_flags() -> None:
    assert "#SBATCH --requeue\n" in render_sbatch(JobSpec(**BASE))
    never = render_sbatch(JobSpec(**BASE, requeue="never"))
    assert "#SBATCH --no-requeue\n" in never and "#SBATCH --requeue\n" not in never


def test_signal_goes_to_steps_not_batch_shell() -> None:
    text = render_sbatch(JobSpec(**BASE, signal="USR1", signal_lead_s=90))
    assert "#SBATCH --signal=USR1@90\n" in text and "B:" not in text


def test_elastic_nodes_use_slurm_range() -> None:
    assert "#SBATCH --nodes=2-4\n" in render_sbatch(JobSpec(**BASE, nodes=(2, 4)))


def test_unset_options_are_absent() -> None:
    text = render_sbatch(JobSpec(**BASE))
    for opt in ("--partition", "--account", "--qos", "--constraint", "--exclude", "--mem",
                "--cpus-per-task", "--gres", "--time"):
        assert f"#SBATCH {opt}" not in text


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
                                  "DB_PASSWORD", "MY_SECRET", "GITHUB_TOKEN"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)
    with pytest.raises(SpecError, match=f"Export {name}"):
        check_no_secrets(JobSpec(**BASE, env=(( name, "s3cr3t"),)))


@pytest.mark.parametrize("name", ["NCCL_DEBUG", "OMP_NUM_THREADS", "KEYBOARD", "TOKENIZERS_PARALLELISM"])
def test_not_secret_names(name: str) -> None:
    assert not is_secret_name(name)


def test_secret_in_env_refused_before_rendering() -> None:
    with pytest.raises(SpecError, match="WANDB_API_KEY"):
        render_sbatch(JobSpec(**BASE, env=(("WANDB_API_KEY", "abc123"),)))


def test_percent_in_job_dir_refused() -> None:
    with pytest.raises(SpecError, match="%"):
        render_sbatch(JobSpec(**{**BASE, "job_dir": "/tmp/a%jb"}))


def test_script_is_valid_bash() -> None:
    for variant in VARIANTS.values():
        text = render_sbatch(JobSpec(**{**BASE, **variant}))
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(("args", "environ", "found"), [
    (["--lr", "3e-4", "--wandb-key", KEY], {"WANDB_API_KEY": KEY}, "argument 4 holds the value of $WANDB_API_KEY"),
    (["--auth=Bearer-" + KEY], {"HF_TOKEN": KEY}, "argument 1 holds the value of $HF_TOKEN"),
    (["--api-key", "sk-live-4f9a8b7c6d5e4f3a2b1c"], {}, "--api-key is given a credential-like value"),
    (["--hf-token=hf_AbCdEfGh1234567890"], {}, "--hf-token is given a credential-like value"),
])
def test_secrets_in_script_args_are_found(args: list[str], environ: dict, found: str) -> None:
    from hpc.secrets import secret_in_args

    assert found in (secret_in_args(args, environ) or "")


@pytest.mark.parametrize("args", [
    ["--key", "3"], ["--max-tokens", "4096"], ["--tokenizer", "gpt2-0123456789abcdefgh"],
    ["--password-file", "/run/secrets/db"], ["--pass", "2"], ["--lr", "3e-4"],
])
def test_ordinary_script_args_are_not_secrets(args: list[str]) -> None:
    from hpc.secrets import secret_in_args

    assert secret_in_args(args, {"WANDB_API_KEY": KEY, "SHORT_TOKEN": "abc"}) is None


def test_secret_in_script_args_refused_without_printing_it() -> None:
    with pytest.raises(SpecError) as e:
        check_no_secrets(JobSpec(**{**BASE, "script_args": ("--key", KEY)}), environ={"WANDB_API_KEY": KEY})
    assert "$WANDB_API_KEY" in str(e.value) and "Export" in str(e.value) and KEY not in str(e.value)


@pytest.mark.parametrize("extra", [{}, {"nodes": (2, 3)}, {"container_image": "/i/pytorch.sif"}])
def test_the_rendezvous_host_has_one_source_in_the_batch_script(extra: dict) -> None:
    """The batch shell exports HPC_RDZV_HOST (the first node) and the launchers read it; the
    launcher command line no longer repeats it as ``--rdzv-host`` (two sources that could
    disagree: whichever a later edit changed, the other would win in the launcher)."""
    from runtime.env import rendezvous_host

    text = render_sbatch(JobSpec(**{**BASE, **extra}))
    assert "--rdzv-host" not in text
    assert text.count("HPC_RDZV_HOST=") == 1 and "export HPC_RDZV_HOST\n" in text
    launcher = [ln for ln in text.splitlines() if "-m runtime.launch" in ln]
    assert len(launcher) == 1
    env = {"HPC_RDZV_HOST": "node1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]"}
    assert rendezvous_host(env) == "node1"


def test_the_batch_shell_finds_its_allocations_outcome_as_the_launcher_writes_it(tmp_path: Path) -> None:
    """After a stop's SIGTERM the batch shell waits for Slurm unless its allocation's outcome
    is recorded: its grep (run by bash, as rendered) finds the line append_outcome writes for
    that allocation, and not another allocation's (11 is not 1)."""
    from hpc.contract import jobdir
    from hpc.contract.records import Outcome

    script = render_sbatch(JobSpec(**{**BASE, "job_dir": str(tmp_path)}))
    [check] = [x for x in script.splitlines() if x.startswith('if [ "$STOP_SEEN" = 1 ] && ! grep')]
    probe = check.replace('if [ "$STOP_SEEN" = 1 ] && ! ', "").replace("; then", "")
    jobdir.append_outcome(tmp_path, Outcome(allocation=11, kind="preempted", exit_code=75, step=4))

    def found(allocation: int) -> bool:
        r = subprocess.run(["bash", "-c", f"JOB_DIR={tmp_path}; ALLOCATION={allocation}; {probe}"])
        return r.returncode == 0

    assert not found(1) and found(11)
    jobdir.append_outcome(tmp_path, Outcome(allocation=1, kind="preempted", exit_code=75, step=6))
    assert found(1) and not found(0)
