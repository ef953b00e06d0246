"""Fitting real clusters (issue 16): any sbatch option, typed GPUs and the common resource flags,
sbatch's own spellings, setup lines and containers, in every backend that can carry them.

Scripts are checked the way they will be read: ``#SBATCH`` lines through sbatch's own argument
parser (re-implemented in tests/unit/support.py), the shell parts by running them in bash with stand-in
Slurm commands (no container runtime runs on this machine: see docs/config.md#containers).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc.backends import slurm_options, submitit_backend, torchx_component
from hpc.cli import main
from hpc.contract import jobdir, values
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.render import render_sbatch
from runtime.ending.requeue import request_batch_requeue
from tests.unit.support import SRUN, _run_script, _stub_bin, sbatch_parse_argument

pytestmark = pytest.mark.unit

BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1",
            python="/opt/venv/bin/python")


def spec(**kw) -> JobSpec:
    return JobSpec(**{**BASE, **kw})


def sbatch_args(text: str) -> list[str]:
    """Every #SBATCH line's arguments, as sbatch's parser reads them."""
    out = []
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            out += sbatch_parse_argument(line[len("#SBATCH "):])
    return out


def render_cli(capsys, script: Path, *argv: str) -> tuple[int, str, str]:
    code = main(["render", str(script), "--job-dir", str(script.parent / "job"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- --sbatch passthrough --------------------------------------------------------------------


def test_sbatch_passthrough_is_written_as_sbatch_lines(script, capsys) -> None:
    code, out, _ = render_cli(capsys, script, "--sbatch", "gres-flags=enforce-binding",
                              "--sbatch", "overcommit", "--sbatch=--begin=now+1hour")
    assert code == 0
    args = sbatch_args(out)
    assert "--gres-flags=enforce-binding" in args and "--overcommit" in args
    assert "--begin=now+1hour" in args


def test_sbatch_passthrough_in_submitit_and_refused_by_torchx() -> None:
    s = spec(sbatch=(("gres-flags", "enforce-binding"), ("overcommit", "")))
    params = submitit_backend.executor_parameters(s)
    assert params["additional_parameters"]["gres-flags"] == "enforce-binding"
    assert params["additional_parameters"]["overcommit"] is True
    text = submitit_backend.plan(s).describe()
    assert "#SBATCH --gres-flags=enforce-binding" in text and "#SBATCH --overcommit" in text
    with pytest.raises(SpecError) as e:
        torchx_component.plan(s)
    assert "--sbatch gres-flags" in str(e.value) and "--sbatch overcommit" in str(e.value)


def test_torchx_refusal_exits_2_naming_the_option(script, capsys) -> None:
    code, _, err = render_cli(capsys, script, "--backend", "torchx", "--sbatch", "overcommit")
    assert code == 2 and "--sbatch overcommit" in err


@pytest.mark.parametrize("key", sorted(values.OWNED_SBATCH))
def test_every_owned_option_is_refused_naming_what_to_use(script, capsys, key: str) -> None:
    code, _, err = render_cli(capsys, script, f"--sbatch={key}=1")
    assert code == 2
    assert "--sbatch" in err and values.OWNED_SBATCH[key].split(" ")[0] in err


@pytest.mark.parametrize("raw,hint", [
    ("N=2", "--nodes"), ("t=10", "--time"), ("p=debug", "--partition"), ("A=acc", "--account"),
    ("J=x", "--job-name"), ("c=8", "--cpus-per-task"), ("G=2", "--gpus-per-node"),
    ("part=debug", "--partition"), ("acc=x", "--account"), ("no=1", "sbatch reads"),
    ("gpu=2", "--gpus-per-node"), ("--time=10", "--time"), ("mail=ALL", "--mail-"),
    ("signal=USR1@60", "--signal-lead"), ("output=/tmp/x", "--job-dir"), ("array=0-3", "hpc sweep"),
])
def test_short_forms_and_prefixes_of_owned_options_are_refused(raw: str, hint: str) -> None:
    with pytest.raises(SpecError) as e:
        values.parse_sbatch_pair(raw)
    assert hint in str(e.value)


@pytest.mark.parametrize("raw", [
    "begin=now --partition=x", "begin=now\n#SBATCH --partition=x", "begin='x'", 'begin="x"',
    "begin=a\\ b", "begin=x;touch INJECTED", "begin=$(touch INJECTED)", "begin=a#b", "begin=",
    "x=1", "Begin=now", "-begin=now", "be_gin=now", "begin=\u2028", "begin=a\tb", "=x", "",
])
def test_passthrough_cannot_smuggle_anything(raw: str) -> None:
    with pytest.raises(SpecError):
        values.parse_sbatch_pair(raw)


def test_passthrough_values_reach_sbatch_as_one_argument_in_both_backends() -> None:
    value = "node[1-3]:gpu/a@b%c+d=e,f.g_h"
    s = spec(sbatch=(("licenses", value),))
    assert f"--licenses={value}" in sbatch_args(render_sbatch(s))
    assert f"--licenses={value}" in sbatch_args(submitit_backend.plan(s).describe())


def test_passthrough_from_profiles_table_or_list(script, capsys) -> None:
    (script.parent / "hpc.toml").write_text(
        'default_profile = "c"\n[profiles.c]\nsbatch = { gres-flags = "enforce-binding", '
        'overcommit = true }\n[profiles.d]\nsbatch = ["overcommit", "licenses=fs:1"]\n'
        '[profiles.bad]\nsbatch = { partition = "x" }\n')
    code, out, _ = render_cli(capsys, script, "--sbatch", "gres-flags=disable-binding")
    args = sbatch_args(out)
    assert code == 0 and "--overcommit" in args and "--gres-flags=disable-binding" in args
    assert "--gres-flags=enforce-binding" not in args   # the CLI's value replaces the profile's
    code, out, _ = render_cli(capsys, script, "--profile", "d")
    assert code == 0 and {"--overcommit", "--licenses=fs:1"} <= set(sbatch_args(out))
    code, _, err = render_cli(capsys, script, "--profile", "bad")
    assert code == 2 and "[profiles.bad] sbatch" in err and "--partition" in err


def test_spec_with_new_fields_round_trips_through_jobspec_json() -> None:
    s = spec(sbatch=(("overcommit", ""),), setup=("module load x",), gpus_per_node=2,
             gpu_type="a100", exclusive=True, container_image="/i.sif",
             container_mounts=("/d:/d",), container_runtime="apptainer", mail_type="END")
    assert JobSpec.from_json(s.to_json()) == s
    with pytest.raises(SpecError):
        JobSpec.from_json(s.to_json().replace('"overcommit"', '"partition"'))


# --- typed GPUs and the common flags -------------------------------------------------------


def test_typed_gpus_and_common_flags_in_sbatch_and_submitit() -> None:
    s = spec(gpus_per_node=8, gpu_type="a100", exclusive=True, reservation="maint",
             nodelist="node[1-2]", mail_type="END,FAIL", mail_user="me@example.org")
    args = sbatch_args(render_sbatch(s))
    for want in ("--gres=gpu:a100:8", "--exclusive", "--reservation=maint", "--nodelist=node[1-2]",
                 "--mail-type=END,FAIL", "--mail-user=me@example.org"):
        assert want in args
    sub = sbatch_args(submitit_backend.plan(s).describe())
    for want in ("--gres=gpu:a100:8", "--exclusive", "--reservation=maint", "--nodelist=node[1-2]",
                 "--mail-type=END,FAIL", "--mail-user=me@example.org"):
        assert want in sub
    assert not any(a.startswith("--gpus-per-node") for a in sub)   # not two GPU requests


def test_torchx_carries_mail_and_refuses_the_rest() -> None:
    cfg = torchx_component.scheduler_cfg(spec(mail_type="END", mail_user="me@example.org"))
    assert cfg["mail-type"] == "END" and cfg["mail-user"] == "me@example.org"
    with pytest.raises(SpecError) as e:
        torchx_component.plan(spec(gpus_per_node=1, gpu_type="a100", exclusive=True,
                                   reservation="r", nodelist="n1"))
    for flag in ("--gpu-type", "--exclusive", "--reservation", "--nodelist"):
        assert flag in str(e.value)


def test_gpu_type_needs_gpus(script, capsys) -> None:
    code, _, err = render_cli(capsys, script, "--gpu-type", "a100")
    assert code == 2 and "--gpu-type" in err and "--gpus-per-node" in err


@pytest.mark.parametrize("argv,flag", [
    (["--mail-type", "sometimes"], "--mail-type"), (["--mail-user", "a b@c"], "--mail-user"),
    (["--reservation", "r;x"], "--reservation"), (["--nodelist", "n\n1"], "--nodelist"),
    (["--gpu-type", "a100:2"], "--gpu-type"),
])
def test_bad_common_flags_exit_2(script, capsys, argv, flag) -> None:
    code, _, err = render_cli(capsys, script, "--gpus-per-node", "1", *argv)
    assert code == 2 and flag in err


def test_exclusive_is_a_flag_pair_and_a_profile_boolean(script, capsys) -> None:
    (script.parent / "hpc.toml").write_text('[defaults]\nexclusive = true\n')
    assert "--exclusive" in sbatch_args(render_cli(capsys, script)[1])
    assert "--exclusive" not in sbatch_args(render_cli(capsys, script, "--no-exclusive")[1])
    (script.parent / "hpc.toml").write_text('[defaults]\nexclusive = "maybe"\n')
    code, _, err = render_cli(capsys, script)
    assert code == 2 and "exclusive" in err and "true or false" in err


# --- sbatch's own forms ----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--nodes", "2-4"], ["-N", "2-4"], ["-N2-4"], ["-N", "2:4"]])
def test_nodes_sbatch_range_and_short_flag_mean_min_max(script, capsys, argv) -> None:
    code, out, _ = render_cli(capsys, script, *argv)
    assert code == 0 and "--nodes=2-4" in sbatch_args(out)
    _, same, _ = render_cli(capsys, script, "--nodes", "2:4")
    assert out.split("# -----")[1] == same.split("# -----")[1]


def test_short_flags(script, capsys) -> None:
    code, out, _ = render_cli(capsys, script, "-t", "1:00:00", "-p", "debug", "-A", "proj",
                              "-q", "high", "-J", "my-job")
    args = sbatch_args(out)
    assert code == 0
    for want in ("--time=01:00:00", "--partition=debug", "--account=proj", "--qos=high",
                 "--job-name=my-job"):
        assert want in args


@pytest.mark.parametrize("argv,flag", [
    (["-N", "4-2"], "--nodes"), (["-N", "0"], "--nodes"), (["--nodes", "2-"], "--nodes"),
    (["--nodes", "-2"], "--nodes"), (["-t", "4h"], "--time"), (["-p", "a b"], "--partition"),
    (["-A", "x;y"], "--account"), (["-q", "'q'"], "--qos"), (["-J", "a\nb"], "--job-name"),
])
def test_bad_short_or_range_values_exit_2_naming_the_flag(script, capsys, argv, flag) -> None:
    code, _, err = render_cli(capsys, script, *argv)
    assert code == 2 and flag in err and "Example:" in err


def test_checkpoint_every_steps_metavar(script, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    out = capsys.readouterr().out
    assert "--checkpoint-every-steps N" in out and "EVERYTEPS" not in out


# --- --setup -----------------------------------------------------------------------------------


def _bash(script: str, *args: str, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script, *args], capture_output=True, text=True,
                          timeout=30, env=env, cwd=cwd)


def test_node_setup_runs_the_lines_then_execs_the_launcher(tmp_path: Path) -> None:
    s = spec(setup=(f"export HPC_TEST_SETUP=done; echo one > {tmp_path}/a &", "wait  # comment",
                    "cd /"))
    argv = slurm_options.with_node_setup(s, ["bash", "-c", 'echo "$HPC_TEST_SETUP $PWD $1"', "x",
                                             "arg with space"])
    assert argv[:2] == ["bash", "-c"] and argv[3] == slurm_options.SETUP_ARGV0
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "done / arg with space\n"
    assert (tmp_path / "a").read_text() == "one\n"


def test_a_failing_setup_line_ends_the_node_with_its_name(tmp_path: Path) -> None:
    s = spec(setup=("true", "false  # this one", f"touch {tmp_path}/after"))
    proc = subprocess.run(slurm_options.with_node_setup(s, ["touch", str(tmp_path / "ran")]),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "--setup line 2 failed on" in proc.stderr
    assert "false  # this one" in proc.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "after").exists()


def test_without_setup_the_launcher_runs_directly() -> None:
    assert slurm_options.with_node_setup(spec(), ["python", "-m", "x"]) == ["python", "-m", "x"]


def test_setup_runs_in_the_batch_shell_before_srun_and_on_the_node(tmp_path: Path) -> None:
    job = tmp_path / "job dir"
    job.mkdir()
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/bash\necho "launcher sees $FROM_BATCH $FROM_NODE $UNSET_OK" '
                           '> "$HPC_JOB_DIR/launcher"\n')
    fake_python.chmod(0o755)
    s = JobSpec(script=str(tmp_path / "t.py"), job_dir=str(job), python=str(fake_python),
                setup=('export FROM_BATCH=${FROM_BATCH:-batch}', 'echo "$UNSET_VAR" > /dev/null',
                       'export FROM_NODE="node-$((${NODE_SETUPS:-0} + 1))"',
                       'export NODE_SETUPS=1; echo "ran on $(hostname)" >> "$HPC_JOB_DIR/setup.log"'))
    proc = _run_script(render_sbatch(s), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (job / "launcher").read_text() == "launcher sees batch node-2 \n"
    assert len((job / "setup.log").read_text().splitlines()) == 2   # batch shell, then the node
    srun_argv = (tmp_path / "record" / "srun.argv").read_text().splitlines()
    assert srun_argv[srun_argv.index("bash"):srun_argv.index("bash") + 2] == ["bash", "-c"]


def test_a_failing_setup_line_in_the_batch_shell_ends_the_job_before_srun(tmp_path: Path) -> None:
    s = spec(job_dir=str(tmp_path / "job"), setup=("false",))
    proc = _run_script(render_sbatch(s), tmp_path)
    assert proc.returncode == 1 and "--setup line 1 failed in the batch shell" in proc.stderr
    assert not (tmp_path / "record" / "srun.argv").exists()


@pytest.mark.parametrize("line", ["a\nb", "a\rb", "", "  ", values.SETUP_EOF, "a\x00b", "a\u2028b"])
def test_bad_setup_lines_are_refused(line: str) -> None:
    with pytest.raises(SpecError):
        spec(setup=(line,))


def test_setup_from_profiles_then_cli_in_order(script, capsys) -> None:
    (script.parent / "hpc.toml").write_text('[defaults]\nsetup = ["module load a", "module load b"]\n')
    _, out, _ = render_cli(capsys, script)
    assert out.index("module load a") < out.index("module load b")
    _, out, _ = render_cli(capsys, script, "--setup", "module load c")
    assert out.index("module load a") < out.index("module load b") < out.index("module load c")


def test_submitit_carries_both_parts_and_torchx_the_node_part(monkeypatch) -> None:
    s = spec(setup=("module load cuda",))
    params = submitit_backend.executor_parameters(s)
    assert any("module load cuda" in line for line in params["setup"])
    assert "set -u" not in params["setup"]
    role = torchx_component.elastic_role(s)
    assert role.entrypoint == "bash" and role.args[0] == "-c" and "module load cuda" in role.args[1]
    assert role.args[3] == s.python
    seen = []
    monkeypatch.setattr(JobSpec, "load", classmethod(lambda cls, d: s))
    monkeypatch.setattr(os, "execvp", lambda f, argv: seen.append(argv) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        submitit_backend.run_node("/x")
    assert seen[0][:2] == ["bash", "-c"] and seen[0][4:6] == [s.python, "-m"]


# --- containers --------------------------------------------------------------------------------


def test_pyxis_mounts_job_checkpoint_and_script_dirs() -> None:
    s = spec(container_image="nvcr.io#nvidia/pytorch:24.05-py3", checkpoint_dir="/ckpt/a",
             container_mounts=("/data:/data:ro",))
    text = render_sbatch(s)
    assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in text
    assert ("--container-mounts=/scratch/me/jobs/gpt-1:/scratch/me/jobs/gpt-1,/ckpt/a:/ckpt/a,"
            "/home/me:/home/me,/data:/data:ro") in text


def test_mounts_skip_directories_inside_another() -> None:
    s = spec(script="/scratch/me/train.py", container_image="x.sqsh")
    assert slurm_options.container_mounts(s) == ["/scratch/me:/scratch/me"]


def test_apptainer_exec_wraps_the_launcher_with_nv_only_with_gpus() -> None:
    text = render_sbatch(spec(container_image="/i/pt.sif", container_runtime="apptainer"))
    assert "apptainer exec --bind /scratch/me/jobs/gpt-1:/scratch/me/jobs/gpt-1,/home/me:/home/me" \
        " /i/pt.sif" in text and "--nv" not in text
    assert "apptainer exec --nv" in render_sbatch(spec(container_image="/i/pt.sif", gpus_per_node=1,
                                                       container_runtime="apptainer"))


@pytest.mark.parametrize("kw,flag", [
    (dict(job_dir="/scratch/a,b"), "--job-dir"), (dict(checkpoint_dir="/c:d"), "--checkpoint-dir"),
])
def test_paths_the_mount_syntax_cannot_carry_are_refused(kw, flag) -> None:
    with pytest.raises(SpecError) as e:
        render_sbatch(spec(container_image="x.sqsh", **kw))
    assert e.value.flag == flag


@pytest.mark.parametrize("mount", ["data", "/a,/b", "/a b", "/a:/b:ro:x", "/a\n"])
def test_bad_mounts_are_refused(mount: str) -> None:
    with pytest.raises(SpecError):
        spec(container_image="x.sqsh", container_mounts=(mount,))


def test_submitit_and_torchx_refuse_containers(script, capsys) -> None:
    for backend in ("submitit", "torchx"):
        code, _, err = render_cli(capsys, script, "--backend", backend, "--container-image", "x.sif")
        assert code == 2 and "--container-image" in err


def test_without_container_the_requeue_stays_with_the_launcher() -> None:
    text = render_sbatch(spec())
    assert "scontrol requeue" not in text and "HPC_JOB_END_TIME" not in text


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_container_requeue_runs_in_the_batch_shell_after_srun(tmp_path: Path, runtime: str) -> None:
    """The render test of the design: the launcher, in the container, only leaves a request;
    the batch shell, outside it, exports the deadlines before srun and requeues after it."""
    job = tmp_path / "job"
    job.mkdir()
    s = spec(job_dir=str(job), container_image="img", container_runtime=runtime)
    text = render_sbatch(s)
    srun_at = text.index("\nsrun ")
    assert text.index("scontrol requeue") > srun_at
    assert text.index("export HPC_JOB_END_TIME HPC_GRACE_S") < srun_at
    # The "container": node 0's launcher decides to requeue and, with no scontrol, asks for it.
    launcher = ('echo "$HPC_JOB_END_TIME $HPC_GRACE_S" > "$HPC_JOB_DIR/deadlines"; '
                'printf "%s\\n" "time_limit: requeue 1 of at most 20" > '
                f'"$HPC_JOB_DIR/{jobdir.REQUEUE_REQUEST_PREFIX}${{SLURM_RESTART_COUNT:-0}}"; exit 75')
    stubs = {"apptainer": 'while [ "$1" != img ]; do shift; done; shift\n' + SRUN.split("\n", 1)[1],
             s.python.rsplit("/", 1)[-1]: ""}
    text = text.replace('PYTHON=/opt/venv/bin/python', f'PYTHON={tmp_path}/bin/launcher')
    _stub_bin(tmp_path, {"launcher": launcher + "\n", "apptainer": stubs["apptainer"]})
    proc = _run_script(text, tmp_path)
    assert proc.returncode == 75, proc.stderr
    calls = (tmp_path / "record" / "scontrol").read_text().splitlines()
    assert "requeue 7" in calls
    end = subprocess.run(["date", "-d", "2030-01-01T00:00:00", "+%s"], capture_output=True,
                         text=True).stdout.strip()
    assert (job / "deadlines").read_text() == f"{end} 10\n"
    assert "hpc: requeued job 7: time_limit" in proc.stdout
    if runtime == "pyxis":
        assert "--container-image=img" in (tmp_path / "record" / "srun.argv").read_text()


def test_container_without_a_request_is_not_requeued(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    text = render_sbatch(spec(job_dir=str(job), container_image="img")).replace(
        "PYTHON=/opt/venv/bin/python", f"PYTHON={tmp_path}/bin/launcher")
    _stub_bin(tmp_path, {"launcher": "exit 0\n"})
    proc = _run_script(text, tmp_path)
    assert proc.returncode == 0
    assert "requeue" not in (tmp_path / "record" / "scontrol").read_text()


def test_launcher_request_is_what_the_batch_shell_reads(tmp_path: Path) -> None:
    path = request_batch_requeue(tmp_path, 3, "preempted: requeue 4 of at most 20")
    assert path == tmp_path / f"{jobdir.REQUEUE_REQUEST_PREFIX}3"
    assert path.read_text() == "preempted: requeue 4 of at most 20\n"
    assert jobdir.REQUEUE_REQUEST_PREFIX + "${ALLOCATION}" in render_sbatch(spec(container_image="i"))


# --- --after -----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,want", [("1234", "afterok:1234"), ("1234:ok", "afterok:1234"),
                                      ("1234:any", "afterany:1234"), ("1234:NotOK", "afternotok:1234"),
                                      ("1234:failed", "afternotok:1234"), ("12_3:start", "after:12_3"),
                                      (1234, "afterok:1234")])
def test_after_forms(raw, want) -> None:
    assert values.parse_after(raw) == want


@pytest.mark.parametrize("raw", ["", "x", "12:later", "12:ok:any", "-12", "12 ok", "12,13", True])
def test_bad_after_is_refused(raw) -> None:
    with pytest.raises(SpecError):
        values.parse_after(raw)


def test_after_in_each_backend(script, capsys) -> None:
    code, out, _ = render_cli(capsys, script, "--after", "12", "--after", "13:any")
    assert code == 0 and "--dependency=afterok:12,afterany:13" in sbatch_args(out)
    s = spec(after=("afterok:12",))
    assert "--dependency=afterok:12" in sbatch_args(submitit_backend.plan(s).describe())
    with pytest.raises(SpecError, match="--after"):
        torchx_component.plan(s)
    with pytest.raises(SpecError):
        spec(after=("afterok:x",))
    assert JobSpec.from_json(s.to_json()) == s
