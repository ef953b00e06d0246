"""The CLI's contract with users: bad input exits 2 with one clear message, creating nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.cli import build_parser, build_spec, main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv,flag,fragment", [
    (["--time", "4h"], "--time", "HH:MM:SS"),
    (["--nodes", "4:2"], "--nodes", "MIN 4 is larger than MAX 2"),
    (["--nodes", "0"], "--nodes", "at least one"),
    (["--signal-lead", "-5"], "--signal-lead", "integer >= 0"),
    (["--profile", "nope"], "--profile", "defined: none defined"),
    (["--gpus-per-node", "8", "--nproc-per-node", "4"], "--nproc-per-node", "one worker per GPU"),
    (["--mem", "lots"], "--mem", "K, M, G or T"),
    (["--requeue", "sometimes"], "--requeue", "auto, never"),
    (["--time", "1:00", "--signal-lead", "120"], "--signal-lead", "shorter than the time limit"),
])
def test_bad_flags_exit_2_naming_flag_value_and_example(script, capsys, argv, flag, fragment):
    code = main(["render", str(script), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert flag in err and fragment in err and "Example:" in err
    assert len(err.strip().splitlines()) == 1
    assert not (script.parent / "jobs").exists()


def test_missing_script(script, capsys):
    assert main(["run", "missing.py"]) == 2
    err = capsys.readouterr().err
    assert "'missing.py'" in err and "existing Python file" in err
    assert not (script.parent / "jobs").exists()


@pytest.mark.parametrize("command", ["run", "render", "submit"])
def test_secret_in_script_args_exits_2_creating_nothing(script, capsys, monkeypatch, command):
    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)
    job_dir = script.parent / "job"
    assert main([command, str(script), "--job-dir", str(job_dir), "--", "--wandb-key", key]) == 2
    err = capsys.readouterr().err
    assert "$WANDB_API_KEY" in err and "Export" in err and key not in err
    assert not job_dir.exists() and not (script.parent / "jobs").exists()


def test_unknown_config_key_exits_2(script, capsys):
    (script.parent / "hpc.toml").write_text('[profiles.c]\npartiton = "gpu"\n')
    assert main(["render", str(script), "--profile", "c"]) == 2
    err = capsys.readouterr().err
    assert "'partiton'" in err and "partition" in err


def test_unknown_flag_is_argparse_exit_2(script):
    with pytest.raises(SystemExit) as e:
        main(["run", str(script), "--nodez", "2"])
    assert e.value.code == 2


def test_precedence_cli_over_profile_over_defaults(script):
    (script.parent / "hpc.toml").write_text(
        'default_profile = "c"\n[defaults]\nqos = "low"\naccount = "d"\n'
        '[profiles.c]\naccount = "p"\npartition = "gpu"\ntime = "2:00:00"\n')
    args = build_parser().parse_args(["submit", str(script), "--partition", "debug"])
    args.script_args = ["--lr", "1"]
    spec = build_spec(args)
    assert (spec.partition, spec.account, spec.qos) == ("debug", "p", "low")
    assert spec.time_limit_s == 7200 and spec.profile == "c"
    assert spec.signal_lead_s == 120                   # built-in default
    assert spec.script_args == ("--lr", "1")
    assert Path(spec.job_dir).is_absolute() and Path(spec.script).is_absolute()


def test_help_lists_every_issue_flag():
    out = subprocess.run([sys.executable, "-m", "hpc", "submit", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--nodes", "--gpus-per-node", "--nproc-per-node", "--time", "--partition", "--account",
                 "--qos", "--mem", "--cpus-per-task", "--signal-lead", "--max-restarts", "--profile",
                 "--job-dir", "--dry-run"):
        assert flag in out, flag


# --------------------------------------------------------------------------- argument errors


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_typo_in_an_option_gets_the_subcommands_usage_and_did_you_mean(script, capsys):
    err = _usage_error(["run", "--nprocs-per-node", "2", str(script)], capsys)
    assert err.startswith("usage: hpc run ")          # the subcommand's usage, not hpc's
    assert "--nprocs-per-node: did you mean --nproc-per-node?" in err
    assert not (script.parent / "jobs").exists()


def test_a_prefix_of_an_option_is_not_accepted_and_runs_nothing(script, capsys):
    err = _usage_error(["run", str(script), "--nproc-per-nod", "2"], capsys)
    assert "did you mean --nproc-per-node?" in err
    assert not (script.parent / "jobs").exists()
    parser = build_parser()
    _, extras = parser.parse_known_args(["submit", str(script), "--part", "gpu"])
    assert extras == ["--part", "gpu"]                 # no abbreviation in any subcommand


def test_every_parser_refuses_abbreviations():
    from hpc.parser import subparser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert not parser.allow_abbrev
    assert commands and all(not subparser(parser, c).allow_abbrev for c in commands)


def test_script_argument_before_the_dashes_gets_the_command_rewritten_with_them_after(script, capsys):
    err = _usage_error(["run", str(script), "--nproc-per-node", "2", "--lr", "3e-4"], capsys)
    assert err.startswith("usage: hpc run ")
    assert "did you mean" not in err
    assert "put the script's arguments after --" in err
    assert f"hpc run {script} --nproc-per-node 2 -- --lr 3e-4" in err
    assert not (script.parent / "jobs").exists()


def test_typo_and_script_argument_together(script, capsys):
    err = _usage_error(["run", str(script), "--max-steps", "3", "--nodez", "2", "--", "--x"], capsys)
    assert "--nodez: did you mean --nodes?" in err
    assert "does not take --max-steps" in err
    assert f"hpc run {script} --nodes 2 -- --max-steps 3 --x" in err


def test_typo_in_a_command_without_a_script_has_no_dashes_hint(capsys):
    err = _usage_error(["status", "--jsn"], capsys)
    assert err.startswith("usage: hpc status ")
    assert "did you mean --json?" in err and "after --" not in err


@pytest.mark.parametrize("argv,suggestion", [(["sumbit", "train.py"], "'submit'"),
                                             (["stauts"], "'status'"),
                                             (["submit", "x.py", "--backend", "sbtach"], "'sbatch'")])
def test_unknown_command_or_choice_suggests_the_closest(capsys, argv, suggestion):
    err = _usage_error(argv, capsys)
    assert f"did you mean {suggestion}?" in err


@pytest.mark.parametrize("argv,suggestion", [
    (["report", "--pgn", "x.png", "12"], "--pgn: did you mean --png?"),     # two letters swapped
    (["run", "train.py", "--job_dir", "x"], "--job_dir: did you mean --job-dir?"),
    (["run", "train.py", "--nproc_per_node", "2"], "did you mean --nproc-per-node?"),
])
def test_swapped_letters_and_underscores_are_typos_too(script, capsys, argv, suggestion):
    assert suggestion in _usage_error(argv, capsys)


@pytest.mark.parametrize("word", ["--preset", "--lr", "--epochs", "--max-steps", "--batch-size",
                                  "--seed", "--log-every", "--eval-every", "--warmup", "--resume"])
def test_a_scripts_usual_arguments_are_not_taken_for_typos(script, capsys, word):
    err = _usage_error(["run", str(script), word, "1"], capsys)
    assert "did you mean" not in err and "after --" in err


def test_options_before_the_command_are_moved_after_it(script, capsys):
    err = _usage_error(["--nproc-per-node", "2", "run", "train.py"], capsys)
    assert "options go after the command (run)" in err
    assert "hpc run --nproc-per-node 2 train.py" in err


def test_every_argument_parser_in_the_project_refuses_abbreviations():
    """Our own parsers (the launcher's, the doctor's, the examples', the benchmarks'): a prefix
    of an option is a typo there too (tests/ holds stand-ins for users' scripts, left as is)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    missing = []
    for folder in ("hpc", "runtime", "examples", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ArgumentParser":
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False):
                        missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert missing == []


def test_the_resume_command_is_the_users_own_with_the_job_dir():
    from pathlib import Path

    from hpc.backends.local import resume_command

    job = Path("/tmp/my jobs/train_gpt-1")
    assert resume_command(["run", "train.py", "--nproc-per-node", "2", "--", "--preset", "tiny"], job) == \
        "hpc run train.py --nproc-per-node 2 --job-dir '/tmp/my jobs/train_gpt-1' -- --preset tiny"
    given = ["run", "train.py", "--job-dir", "j", "--", "--lr", "3e-4"]
    assert resume_command(given, job) == "hpc run train.py --job-dir j -- --lr 3e-4"
    assert resume_command(["run", "t.py", "--job-dir=j"], job) == "hpc run t.py --job-dir=j"
    assert "job_dir='/tmp/my jobs/train_gpt-1'" in resume_command(None, job)


def test_the_same_command_on_a_finished_job_dir_is_already_finished(tmp_path: Path):
    from hpc.backends.local import already_finished
    from hpc.contract import jobdir
    from hpc.contract.jobspec import JobSpec

    spec = JobSpec(script="/x/train.py", script_args=("--preset", "tiny"), job_dir=str(tmp_path))
    (tmp_path / jobdir.JOBSPEC).write_text(spec.to_json())
    assert already_finished(spec) is None                          # never ran
    jobdir.append_outcome(tmp_path, jobdir.Outcome(allocation=0, kind="preempted", exit_code=75))
    assert already_finished(spec) is None                          # stopped: resume it
    jobdir.append_outcome(tmp_path, jobdir.Outcome(allocation=1, kind="finished", exit_code=0,
                                                   last_step=40))
    assert already_finished(spec).last_step == 40
    assert already_finished(spec.replace(script_args=("--preset", "tiny", "--max-steps", "80"))) is None
    assert already_finished(spec.replace(nproc_per_node=2)) is None
