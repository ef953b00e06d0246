"""Every numeric option at and past its documented bounds, and with digits that are not ASCII.

``str.isdigit`` and ``int`` accept ``'٣'`` (Arabic-Indic three), ``'３'`` (fullwidth) and
``isdigit`` even ``'²'``; none of them is a number Slurm reads. Each refusal is exit status 2 and
one line naming the flag; each accepted value is the value the spec holds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpc.cli import build_parser, build_spec, main
from hpc.contract import jobspec
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec

pytestmark = pytest.mark.unit

# flag, [(accepted text, the spec's value)], [refused texts], extra flags the case needs
NUMERIC = [
    ("--nodes", [("1", (1, 1)), ("100000", (100000, 100000)), ("1:100000", (1, 100000))],
     ["0", "100001", "1:100001", "-1", "2:1", "1.5"], []),
    ("--nproc-per-node", [("1", 1), ("1024", 1024)], ["0", "1025", "-1", "2.0"], []),
    ("--gpus-per-node", [("0", 0), ("64", 64)], ["65", "-1", "1e1"], []),
    ("--cpus-per-task", [("1", 1), ("4096", 4096)], ["0", "4097", "-1", "00"], []),
    ("--time", [("1", 60), ("365-00:00:00", 365 * 86400), ("525600", 365 * 86400)],
     ["0", "365-00:00:01", "525601", "-1", "1:60:00"], ["--signal-lead", "0"]),
    ("--signal-lead", [("0", 0), ("65535", 65535)], ["65536", "-1"], []),
    ("--max-restarts", [("0", 0), ("1000", 1000)], ["1001", "-1"], []),
    ("--max-requeues", [("0", 0), ("10000", 10000)], ["10001", "-1"], []),
    ("--rdzv-port", [("0", 0), ("1", 1), ("65535", 65535)], ["65536", "70000", "-1"], []),
    ("--checkpoint-every-steps", [("0", 0), (str(10**12), 10**12)], [str(10**12 + 1), "-1"], []),
    ("--checkpoint-every-min", [("0", 0.0), ("0.5", 0.5), ("525600", 525600.0)],
     ["525600.5", "nan", "inf", "-inf", "-0", "-0.0", "1e999", "-1", "0x10", "1_0"], []),
    ("--keep-last", [("1", 1), ("100000", 100000)], ["0", "100001"], []),
    ("--keep-every", [("0", 0), (str(10**12), 10**12)], [str(10**12 + 1)], []),
    ("--mem", [("0", "0"), ("64g", "64G"), ("999999999999", "999999999999")],
     ["1000000000000", "-1", "64X", "1.5G"], []),
]
NON_ASCII = ["٣", "²", "３", "1٣", "໓"]

ACCEPTED = [(flag, text, value, extra) for flag, ok, _, extra in NUMERIC for text, value in ok]
REFUSED = [(flag, text, extra) for flag, _, bad, extra in NUMERIC for text in bad]
REFUSED += [(flag, text, extra) for flag, _, _, extra in NUMERIC for text in NON_ASCII]
REFUSED += [("--time", "٣:00", ["--signal-lead", "0"]), ("--time", "1-٣", []),
            ("--nodes", "٢:٤", []), ("--checkpoint-every-min", "٣.5", [])]


def _field(flag: str) -> str:
    return next(f.name for f in jobspec.option_fields() if jobspec.flag_name(f.name) == flag)


@pytest.mark.parametrize(("flag", "text", "value", "extra"), ACCEPTED,
                         ids=[f"{f}={t}" for f, t, _, _ in ACCEPTED])
def test_at_the_bounds_is_accepted(script: Path, flag: str, text: str, value: object,
                                   extra: list[str]) -> None:
    args = build_parser().parse_args(["submit", str(script), f"{flag}={text}", *extra])
    args.script_args = []
    assert getattr(build_spec(args), _field(flag)) == value


@pytest.mark.parametrize(("flag", "text", "extra"), REFUSED, ids=[f"{f}={t}" for f, t, _ in REFUSED])
def test_past_the_bounds_exits_2_in_one_line(script: Path, capsys: pytest.CaptureFixture[str],
                                             flag: str, text: str, extra: list[str]) -> None:
    assert main(["render", str(script), f"{flag}={text}", *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err and repr(text) in err and "Example:" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (script.parent / "jobs").exists()


def test_help_states_the_bounds() -> None:
    helps = {f.name: f.metadata["help"] for f in jobspec.option_fields()}
    for name, bound in [("nodes", "100000"), ("gpus_per_node", "64"), ("time_limit_s", "365 days"),
                        ("nproc_per_node", "1024"), ("cpus_per_task", "4096"), ("rdzv_port", "65535"),
                        ("signal_lead_s", "65535"), ("max_restarts", "1000"),
                        ("max_requeues", "10000"), ("keep_last", "100000"),
                        ("checkpoint_every_min", "365 days")]:
        assert bound in helps[name], name


def test_explicit_cpus_per_task_0_says_to_leave_it_out(script: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(script), "--cpus-per-task", "0"]) == 2
    assert "Leave the option out" in capsys.readouterr().err
    assert JobSpec(script="s").cpus_per_task == 0          # the unset default stays valid


# --- the constructor holds the same bounds (jobspec.json, direct construction) ------------------

INT_FIELDS = [("nodes", (1, 100001)), ("nodes", (0, 1)), ("nodes", (2, 1)), ("nodes", (1,)),
              ("nodes", (True, 1)), ("nodes", (1.0, 2)), ("nodes", [1, 3, 4]),
              ("nproc_per_node", 1025), ("nproc_per_node", -1), ("gpus_per_node", 65),
              ("gpus_per_node", True), ("cpus_per_task", 4097), ("cpus_per_task", -1),
              ("time_limit_s", 365 * 86400 + 1), ("time_limit_s", -1), ("signal_lead_s", 65536),
              ("max_restarts", 1001), ("max_requeues", 10001), ("rdzv_port", 65536),
              ("rdzv_port", "29400"), ("checkpoint_every_steps", 10**12 + 1), ("keep_last", 0),
              ("keep_every", -1), ("checkpoint_every_min", math.nan),
              ("checkpoint_every_min", math.inf), ("checkpoint_every_min", -0.0),
              ("checkpoint_every_min", "30"), ("checkpoint_every_min", False),
              ("mem", "64 G"), ("mem", "٣G"), ("signal", "KILL"), ("requeue", "sometimes"),
              ("wandb_mode", "ONLINE")]


@pytest.mark.parametrize(("field", "value"), INT_FIELDS, ids=[f"{f}={v!r}" for f, v in INT_FIELDS])
def test_constructor_holds_the_bounds(field: str, value: object) -> None:
    with pytest.raises(SpecError) as e:
        JobSpec(script="s", **{field: value})
    assert e.value.flag == field                      # Python's name for it, not the flag
    assert f"Example: {field}=" in str(e.value) and "--" not in str(e.value).split("Example:")[1].split(". ")[0]


def test_constructor_accepts_an_int_number_of_minutes() -> None:
    spec = JobSpec(script="s", checkpoint_every_min=30)
    assert spec.checkpoint_every_min == 30.0 and isinstance(spec.checkpoint_every_min, float)


def test_docs_state_the_bounds() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    section = doc.split("## Configuration files and inputs", 1)[1].split("\n## ", 1)[0]
    for flag, _, _, _ in NUMERIC:
        if flag != "--mem":
            assert f"`{flag}`" in section, flag
    for bound in ("100000", "1024", "64", "4096", "365 days", "65535", "10000", "525600"):
        assert bound in section, bound


# --- issue 23's probe: accepted but out of bounds ------------------------------------------------


@pytest.mark.parametrize("throttle", ["99999999999999999999", "10001", "٣", "-1", "1e3"])
def test_sweep_throttle_beyond_the_task_limit_exits_2(script: Path, throttle: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", str(script), "--grid", "lr=1,2", "--throttle", throttle, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--throttle" in err and repr(throttle) in err and "<= 10000" in err, err
    assert len(err.strip().splitlines()) == 1
    from hpc import sweeps

    with pytest.raises(SpecError, match="--throttle"):
        sweeps.plan(JobSpec(script=str(script)), [("--a",)], throttle=10**20)


@pytest.mark.parametrize("value", ["auto:٣٦٠٠", "auto:３６００", "auto:٢h", "auto:1.٥d"])
def test_checkpoint_interval_prior_in_non_ascii_digits_exits_2(script: Path, value: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(script), "--checkpoint-interval", value]) == 2
    assert "--checkpoint-interval" in capsys.readouterr().err


@pytest.mark.parametrize("text", ['rdzv_port = "80"', 'max_restarts = "3"', 'keep_last = "5"',
                                  'cpus_per_task = "8"'])
def test_quoted_integers_in_hpc_toml_exit_2(script: Path, text: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (script.parent / "hpc.toml").write_text(f"[defaults]\n{text}\n")
    assert main(["render", str(script)]) == 2
    err = capsys.readouterr().err
    key = text.split(" ")[0]
    assert f"hpc.toml [defaults] {key}" in err and "a TOML integer, written without quotes" in err, err


def test_time_and_nodes_stay_strings_in_hpc_toml(script: Path) -> None:
    (script.parent / "hpc.toml").write_text('[defaults]\ntime = "1:00:00"\nnodes = "2:4"\nrdzv_port = 29500\n')
    assert main(["render", str(script)]) == 0
