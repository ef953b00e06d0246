"""Hostile input (issue 19): no value from any source becomes a shell line or an extra Slurm option.

Every string field is checked once, where a :class:`JobSpec` is built, so the same table of
hostile values is refused from the constructor (and ``spec.replace``), from the CLI and from
``hpc.toml`` / ``[tool.hpc]``: exit status 2 and one line naming the flag, before anything is
created. Values that are allowed although they look hostile (quotes, ``$(...)``, ``;`` in a job
name or a job directory) are run through every backend's dry run: each ``#SBATCH`` line must
parse back to exactly one option, and the scripts and commands, executed by bash with stub
``sbatch``/``srun``/``scontrol``/``torchx``, must hand over the exact values and run nothing else.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from hpc.backends import sbatch, submitit_backend, torchx_component
from hpc.cli import main
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import CONFIG_KEYS, JobSpec, flag_name

pytestmark = pytest.mark.unit

BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1",
            python="/opt/venv/bin/python")

HOSTILE = {
    "newline": "gpu\necho INJECTED",
    "cr": "gpu\recho INJECTED",
    "semicolon": "gpu; rm -rf ~",
    "subshell": "$(touch INJECTED)",
    "backticks": "`touch INJECTED`",
    "leading_option": " --account=INJECTED",
    "smuggled_options": "gpu --account=INJECTED --qos=high",
    "single_quote": "gpu'x",
    "double_quote": 'gpu"x',
    "nul": "gpu\x00x",
    "tab": "gpu\tx",
    "u2028": "gpu\u2028echo INJECTED",
    "nel": "gpu\x85echo INJECTED",
    "bidi": "gpu\u202eDETCEJNI",
    "backslash": "gpu\\' --account=INJECTED '",
    "long": "g" * 5000,
}
# One line of text, refused in every string field whatever the field allows.
ONE_LINE = ("newline", "cr", "nul", "tab", "u2028", "nel", "bidi", "backslash", "long")

SLURM_NAMES = ("partition", "account", "qos", "constraint", "exclude", "mem")
TEXT = ("job_name", "wandb_project", "wandb_entity", "profile")
PATHS = ("job_dir", "checkpoint_dir", "python")

REFUSED = ([(f, k) for f in SLURM_NAMES for k in HOSTILE]
           + [(f, k) for f in TEXT for k in (*ONE_LINE, "leading_option")]
           + [(f, k) for f in PATHS for k in ONE_LINE])


def _ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{f}-{k}" for f, k in cases]


# --- the constructor ---------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "kind"), REFUSED, ids=_ids(REFUSED))
def test_constructor_refuses(field: str, kind: str) -> None:
    with pytest.raises(SpecError) as e:
        JobSpec(**{**BASE, field: HOSTILE[kind]})
    assert e.value.flag == field                      # Python's name for it, not the flag
    assert f"Example: {field}=" in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(("field", "kind"), REFUSED[::7], ids=_ids(REFUSED[::7]))
def test_replace_refuses_too(field: str, kind: str) -> None:
    with pytest.raises(SpecError):
        JobSpec(**BASE).replace(**{field: HOSTILE[kind]})


@pytest.mark.parametrize("kind", ["newline", "cr", "nul", "tab", "u2028", "nel"])
def test_env_values_are_one_line(kind: str) -> None:
    with pytest.raises(SpecError, match="^env "):
        JobSpec(**BASE, env=(("X", HOSTILE[kind]),))


def test_script_args_refuse_only_nul() -> None:
    with pytest.raises(SpecError, match="^script_args "):
        JobSpec(**BASE, script_args=("--x", "a\x00b"))
    # A line break in an argument is fine: every backend shell-quotes arguments.
    assert JobSpec(**BASE, script_args=("--prompt", "a\nb; $(x)")).script_args[1] == "a\nb; $(x)"


@pytest.mark.parametrize("field", [*SLURM_NAMES, *TEXT, *PATHS])
@pytest.mark.parametrize("value", [5, True, None, ["gpu"]], ids=["int", "bool", "none", "list"])
def test_constructor_refuses_non_strings(field: str, value: object) -> None:
    with pytest.raises(SpecError):
        JobSpec(**{**BASE, field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("partition", "gpu,debug"), ("partition", "gpu-a100.v2"), ("account", "proj_123+x"),
    ("constraint", "[rack1*2&rack2*4]"), ("constraint", "(a100|h100)&ib"),
    ("constraint", "!slow"), ("exclude", "node[3-4,7],gpu01"), ("mem", "64G"),
    ("job_name", "my job #1"), ("job_name", "quote's \"dq\" $(x) `y`; z"),
    ("job_dir", "/tmp/semi;colon $HOME `x`/quote's \"dq\" #hash"), ("python", "/opt/py thon/bin/python"),
    ("wandb_project", "gpt small"), ("profile", "my cluster"),
])
def test_slurm_syntax_and_quoted_values_are_accepted(field: str, value: str) -> None:
    assert getattr(JobSpec(**{**BASE, field: value}), field) == value


# --- the CLI and hpc.toml ---------------------------------------------------------------------

def _refused(script: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
             names: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert names in err and "Example:" in err and len(err.strip().splitlines()) == 1, err
    assert "INJECTED" not in out
    assert not (script.parent / "jobs").exists() and not (script.parent / "INJECTED").exists()
    return err


@pytest.mark.parametrize(("field", "kind"), REFUSED, ids=_ids(REFUSED))
def test_cli_refuses(script: Path, capsys: pytest.CaptureFixture[str], field: str, kind: str) -> None:
    flag = flag_name(field)
    _refused(script, capsys, ["render", str(script), f"{flag}={HOSTILE[kind]}"], flag)


@pytest.mark.parametrize("backend", ["submitit", "torchx"])
@pytest.mark.parametrize("field", ["partition", "constraint", "job_name", "mem"])
def test_cli_refuses_with_every_backend(script: Path, capsys: pytest.CaptureFixture[str],
                                        backend: str, field: str) -> None:
    flag = flag_name(field)
    _refused(script, capsys, ["render", str(script), "--backend", backend,
                              f"{flag}={HOSTILE['newline']}"], flag)


def toml_str(value: str) -> str:
    """A TOML basic string holding exactly ``value`` (every unusual character escaped)."""
    out = []
    for c in value:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isascii() and c.isprintable():
            out.append(c)
        else:
            out.append(f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def _key(field: str) -> str:
    return next(k for k, v in CONFIG_KEYS.items() if v == field)


@pytest.mark.parametrize(("field", "kind"), REFUSED, ids=_ids(REFUSED))
def test_hpc_toml_refuses(script: Path, capsys: pytest.CaptureFixture[str], field: str,
                          kind: str) -> None:
    key = _key(field)
    table = "[defaults]" if field == "profile" else 'default_profile = "h"\n[profiles.h]'
    (script.parent / "hpc.toml").write_text(f"{table}\n{key} = {toml_str(HOSTILE[kind])}\n")
    where = "[defaults]" if field == "profile" else "[profiles.h]"
    _refused(script, capsys, ["render", str(script)], f"hpc.toml {where} {key}")


@pytest.mark.parametrize("kind", ["newline", "smuggled_options", "subshell"])
def test_pyproject_tool_hpc_refuses(script: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    (script.parent / "pyproject.toml").write_text(
        f'[tool.hpc]\ndefault_profile = "c"\n[tool.hpc.profiles.c]\npartition = {toml_str(HOSTILE[kind])}\n')
    _refused(script, capsys, ["render", str(script), "--backend", "torchx"],
             "pyproject.toml [tool.hpc.profiles.c] partition = ")


@pytest.mark.parametrize(("text", "names"), [
    ("partition = true", "partition"), ("account = 123", "account"), ("env = 5", "env"),
    ('env = ["A=1", 5]', "env"), ("env = { A = true }", "[profiles.c] env.A = true"), ('env = { A = "x\\ny" }', "env"),
    ("nodes = true", "nodes"), ("rdzv_port = 70000", "rdzv_port"), ("signal_lead = true", "signal_lead"),
    ("checkpoint_every_min = nan", "checkpoint_every_min"), ("keep_last = 3.0", "keep_last"),
    ("checkpoint_every_min = inf", "checkpoint_every_min"), ("time = -5", "time"),
    ("cpus_per_task = 0", "cpus_per_task"), ('requeue = ["auto"]', "requeue"),
])
def test_hpc_toml_wrong_types_exit_2(script: Path, capsys: pytest.CaptureFixture[str], text: str,
                                     names: str) -> None:
    (script.parent / "hpc.toml").write_text(f'default_profile = "c"\n[profiles.c]\n{text}\n')
    _refused(script, capsys, ["render", str(script)], names)


@pytest.mark.parametrize("text", ["default_profile = 5\n", "tool = 5\n"])
def test_malformed_config_tables_exit_2(script: Path, capsys: pytest.CaptureFixture[str],
                                        text: str) -> None:
    name = "pyproject.toml" if text.startswith("tool") else "hpc.toml"
    (script.parent / name).write_text(text if name == "hpc.toml" else "[tool]\nhpc = 5\n")
    _refused(script, capsys, ["render", str(script)], name)


def test_binary_hpc_toml_exit_2(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (script.parent / "hpc.toml").write_bytes(b"partition = \"\xff\xfe\"\n")
    _refused(script, capsys, ["render", str(script)], "hpc.toml")


# --- what the backends hand over ---------------------------------------------------------------

def _sbatch_parser():  # type: ignore[no-untyped-def]
    """The suite's re-implementation of sbatch's #SBATCH argument parser (Slurm 22.05)."""
    from tests.unit.support import sbatch_parse_argument

    return sbatch_parse_argument


STUB = """#!/bin/sh
for a in "$@"; do printf '%s\\0' "$a"; done > "$RECORD/$(basename "$0").argv"
[ "$(basename "$0")" = scontrol ] && echo node1
exit 0
"""


def _run_with_stubs(text: str, cwd: Path) -> dict[str, list[str]]:
    """Runs a dry run's text in bash with stub Slurm and TorchX commands; returns their argv."""
    bin_dir, record = cwd / "bin", cwd / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name in ("sbatch", "srun", "scontrol", "torchx"):
        p = bin_dir / name
        p.write_text(STUB)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(cwd),
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}
    subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, timeout=30, check=True)
    return {p.name.removesuffix(".argv"): [a.decode() for a in p.read_bytes().split(b"\0")[:-1]]
            for p in record.iterdir()}


ACCEPTED_HOSTILE = dict(
    job_name="my `touch INJECTED` $(touch INJECTED) 'q' \"dq\" ; touch INJECTED --account=INJECTED #x",
    script_args=("--prompt", "a\nb; touch INJECTED", "$(touch INJECTED)", "`touch INJECTED`"),
    env=(("X", "$(touch INJECTED); `touch INJECTED`"),),
    python="/opt/py thon/bin/python",
    partition="gpu,debug", constraint="[a100&ib|h100]", time_limit_s=3600, cpus_per_task=4,
)
PLANS = {"sbatch": sbatch.plan, "submitit": submitit_backend.plan, "torchx": torchx_component.plan}


@pytest.mark.parametrize("backend", sorted(PLANS))
def test_allowed_hostile_values_reach_every_backend_exactly(backend: str, hostile_dir: Path) -> None:
    job_dir = str(hostile_dir / "job $(touch INJECTED) `touch INJECTED`")
    spec = JobSpec(**{**BASE, **ACCEPTED_HOSTILE, "job_dir": job_dir})
    text = PLANS[backend](spec).describe()
    parse = _sbatch_parser()
    allowed = {"--job-name", "--nodes", "--cpus-per-task", "--time", "--partition", "--constraint",
               "--output", "--open-mode", "--export", "--no-kill", "--signal", "--requeue",
               "--ntasks-per-node", "--wckey", "--error"}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            args = parse(line[len("#SBATCH "):])
            assert len(args) == 1 and args[0].split("=")[0] in allowed, line
            if args[0].startswith("--job-name="):
                assert args[0] == f"--job-name={spec.job_name}"
            if args[0].startswith("--output="):
                assert args[0].startswith(f"--output={job_dir}/"), line
    calls = _run_with_stubs(text, hostile_dir)
    assert not (hostile_dir / "INJECTED").exists()
    if backend == "sbatch":
        assert calls["sbatch"][-1] == f"{job_dir}/job.sbatch"
        srun = calls["srun"]
        assert srun[srun.index("--job-dir") + 1] == job_dir and spec.python in srun
    elif backend == "submitit":
        assert calls["srun"][-1] == f"{job_dir}/submitit" and spec.python in calls["srun"]
    else:
        argv = calls["torchx"]
        assert f"--job_dir={job_dir}" in argv and f"--script={spec.script}" in argv
        assert tuple(argv[argv.index("--") + 1:]) == spec.script_args
        assert "-cfg" in argv and "INJECTED" not in argv[argv.index("-cfg") + 1]


def test_bash_would_have_run_the_payload(tmp_path: Path) -> None:
    """The stub runner does detect an injection (a test of the test)."""
    _run_with_stubs("echo hi\ntouch INJECTED\n", tmp_path)
    assert (tmp_path / "INJECTED").exists()
    os.remove(tmp_path / "INJECTED")


@pytest.mark.parametrize("name", ["tr\nain.py", "tr\u2028ain.py", "tr\\ain.py"])
def test_script_path_with_a_line_break_exits_2(script: Path, capsys: pytest.CaptureFixture[str],
                                               name: str) -> None:
    (script.parent / name).write_text("print('hi')\n")
    _refused(script, capsys, ["render", str(script.parent / name)], "SCRIPT")


def test_hostile_looking_script_path_is_accepted(script: Path) -> None:
    odd = script.parent / "semi;colon $(touch INJECTED) 'q'.py"
    odd.write_text("print('hi')\n")
    from hpc.cli import build_parser, build_spec

    args = build_parser().parse_args(["render", str(odd)])
    args.script_args = []
    spec = build_spec(args)
    assert spec.script == str(odd) and spec.job_name == odd.stem


def test_every_field_is_checked_by_the_constructor() -> None:
    """A field added later without a check would let unchecked values reach the backends."""
    import dataclasses

    assert [f.name for f in dataclasses.fields(JobSpec) if f.metadata.get("check") is None] == []


def _string_fields() -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(JobSpec) if f.type == "str"]


@pytest.mark.parametrize("kind", ["newline", "cr", "nul", "u2028", "nel"])
@pytest.mark.parametrize("field", _string_fields())
def test_every_string_field_refuses_line_breaks(field: str, kind: str) -> None:
    with pytest.raises(SpecError):
        JobSpec(**{**BASE, field: HOSTILE[kind]})
