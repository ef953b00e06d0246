"""The secrets policy (hpc/secrets.py): nothing secret is written into jobspec.json or a script.

Covers what issue 19 added: ``--env`` values holding a secret of the environment, and
secret-named script flags whatever their value, except numbers (``--key 3``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli import main
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.secrets import check_no_secrets, secret_in_args, secret_in_env

pytestmark = pytest.mark.unit

KEY = "0123456789abcdef0123456789abcdef01234567"
BASE = dict(script="/home/me/train.py", job_name="gpt", job_dir="/scratch/me/jobs/gpt-1")


@pytest.mark.parametrize("value", [KEY, f"Bearer {KEY}", f"prefix-{KEY}-suffix"])
def test_env_value_holding_a_secret_is_refused_without_printing_it(value: str) -> None:
    spec = JobSpec(**BASE, env=(("NCCL_DEBUG", "INFO"), ("X", value)))
    with pytest.raises(SpecError) as e:
        check_no_secrets(spec, environ={"WANDB_API_KEY": KEY})
    msg = str(e.value)
    assert "--env X holds the value of $WANDB_API_KEY" in msg and KEY not in msg


def test_env_values_are_compared_only_with_secret_named_variables() -> None:
    environ = {"HOME": "/home/me/long-enough", "SHORT_TOKEN": "abc", "HF_TOKEN": KEY}
    assert secret_in_env((("X", "/home/me/long-enough"), ("Y", "abc")), environ) is None
    check_no_secrets(JobSpec(**BASE, env=(("X", "/home/me/long-enough"),)), environ=environ)


@pytest.mark.parametrize("args", [
    ["--api-key", "hunter2"], ["--hf-token=hf_short"], ["--password", "correct horse"],
    ["--db-password", "swordfish"], ["--secret", "xyzzy"], ["--lr", "1", "--wandb-key", "mykey"],
    ["--aws-secret-access-key=AKIA"], ["--key", "image"], ["--token", "open sesame"], ["--pass", "hunter3"],
    ["--github-token", "ghp_short"], ["--client-secret", "opensesame"],
])
def test_credential_flags_with_any_word_are_refused(args: list[str]) -> None:
    found = secret_in_args(args, {})
    assert found and "secret-like" in found
    with pytest.raises(SpecError, match="^script_args ") as e:     # from Python: the field
        check_no_secrets(JobSpec(**BASE, script_args=tuple(args)), environ={})
    assert all(a not in str(e.value) for a in args if not a.startswith("-"))


@pytest.mark.parametrize("args", [
    ["--key", "3"], ["--pass", "-1"], ["--token", "0.5"], ["--max-tokens", "4096"],
    ["--api-key="], ["--use-token", "--lr", "3e-4"], ["--token"], ["--password-file", "/run/s/db"],
    ["--tokenizer", "gpt2"], ["--keyboard", "us"], ["-k", "v"],
    ["--pad-token", "<pad>"], ["--bos-token=<s>"], ["--eos-token", "</s>"], ["--sort-key", "loss"],
    ["--first-pass", "full"], ["--mask-token", "[MASK]"],
])
def test_numbers_switches_and_lookalike_flags_pass(args: list[str]) -> None:
    assert secret_in_args(args, {"WANDB_API_KEY": KEY}) is None


@pytest.mark.parametrize("args", [["--pad-token", "hf_AbCdEfGh1234567890"],
                                  ["--sort-key=sk-live-4f9a8b7c6d5e4f3a2b1c"]])
def test_lookalike_flags_still_refuse_credential_like_values(args: list[str]) -> None:
    assert "credential-like" in (secret_in_args(args, {}) or "")


@pytest.mark.parametrize("argv", [["run"], *([c, "--backend", b] for c in ("render", "submit")
                                               for b in ("sbatch", "submitit", "torchx"))],
                         ids=lambda a: "-".join(a[::2]))
def test_env_secret_exits_2_creating_nothing(script: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    job_dir = script.parent / "job"
    assert main([argv[0], str(script), "--job-dir", str(job_dir), *argv[1:],
                 "--env", f"WB={KEY}"]) == 2
    err = capsys.readouterr().err
    assert "$WANDB_API_KEY" in err and KEY not in err and len(err.strip().splitlines()) == 1
    assert not job_dir.exists()


def test_secret_named_flag_exits_2(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(script), "--", "--hf-token", "hf_abc"]) == 2
    err = capsys.readouterr().err
    assert "--hf-token" in err and "hf_abc" not in err and "Export" in err


# Issue 23's probe: accepted into jobspec.json before.
SK = "sk-proj-AbCdEf0123456789GhIjKlMnOp"


@pytest.mark.parametrize("args", [["-p", SK], [SK], ["--model", "gpt", "--openai=" + SK],
                                  ["ghp_AbCdEf0123456789AbCdEf0123456789abcd"],
                                  ["--db", "postgres://train:hunter2@db.internal:5432/runs"],
                                  ["-u", "AKIAIOSFODNN7EXAMPLE"]],
                         ids=["short-flag-sk-proj", "bare-sk", "inline", "github-pat", "db-url", "aws-id"])
def test_credentials_in_their_own_format_are_refused_after_any_flag(args: list[str]) -> None:
    found = secret_in_args(args, {})
    assert found and ("a credential (by its format)" in found or "a URL with a password" in found), found
    with pytest.raises(SpecError) as e:
        check_no_secrets(JobSpec(**BASE, script_args=tuple(args)), environ={})
    assert all(a not in str(e.value) for a in args if not a.startswith("-"))


@pytest.mark.parametrize("name,value", [("GH_PAT", "github_pat_11ABCDEFG0123456789_abcdefghij"),
                                        ("GH_PAT", "plainish-token-value-42"),
                                        ("DATABASE_URL", "postgresql://ml:s3cr3t@db/train")])
def test_values_of_pat_and_password_url_variables_are_refused(name: str, value: str) -> None:
    assert secret_in_args(["--anything", value], {name: value}) == f"script argument 2 holds the value of ${name}"
    assert secret_in_env((("X", value),), {name: value}) == f"--env X holds the value of ${name}"
    with pytest.raises(SpecError, match=rf"\${name}"):
        check_no_secrets(JobSpec(**BASE, env=(("X", value),)), environ={name: value})


def test_env_value_holding_a_password_url_is_refused() -> None:
    assert secret_in_env((("DATABASE_URL", "mysql://u:pw@h/db"),), {}) == "--env DATABASE_URL holds a URL with a password"


@pytest.mark.parametrize("args", [["--url", "https://example.com:8443/path"], ["--user", "ssh://git@host/repo"],
                                  ["--run-name", "sk-learn-baseline"], ["--lr", "3e-4"],
                                  ["--data", "hf://datasets/user/name"], ["--task", "ask-questions-1234567890abcdef"]])
def test_ordinary_arguments_still_pass(args: list[str]) -> None:
    assert secret_in_args(args, {}) is None


def test_a_long_sk_name_without_digits_is_not_a_key() -> None:
    assert secret_in_args(["--run", "sk-learn-baseline-with-long-name"], {}) is None
