import pytest

from hpc.contract.errors import SpecError
from hpc.contract.values import format_time, parse_mem, parse_nodes, parse_signal, parse_time

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,seconds", [
    ("30", 30 * 60), ("30:15", 30 * 60 + 15), ("4:00:00", 4 * 3600), ("1-12", 36 * 3600),
    ("2-03:04", (51 * 60 + 4) * 60), ("1-00:00:05", 86405), ("90", 5400), ("0:30", 30),
])
def test_parse_time_accepts_every_slurm_format(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "1-", "-5", "1-25", "10:75:00", "0", "1h"])
def test_parse_time_rejects_with_flag_and_example(text):
    with pytest.raises(SpecError) as e:
        parse_time(text)
    msg = str(e.value)
    assert "--time" in msg and repr(text) in msg and "HH:MM:SS" in msg and "Example" in msg


def test_format_time_round_trips():
    for s in (59, 3600, 86405, 3 * 86400 + 7):
        assert parse_time(format_time(s)) == s


@pytest.mark.parametrize("text,expected", [("2", (2, 2)), ("2:4", (2, 4)), (" 1:1 ", (1, 1))])
def test_parse_nodes(text, expected):
    assert parse_nodes(text) == expected


@pytest.mark.parametrize("text,why", [("4:2", "larger than MAX"), ("0", "at least one"),
                                       ("x", "MIN:MAX"), ("1:", "MIN:MAX"), ("-1", "MIN:MAX")])
def test_parse_nodes_rejects(text, why):
    with pytest.raises(SpecError, match=why):
        parse_nodes(text)


def test_mem_and_signal():
    assert parse_mem("64g") == "64G"
    assert parse_signal("sigusr2") == "USR2"
    with pytest.raises(SpecError, match="USR1, USR2"):
        parse_signal("KILL")
    with pytest.raises(SpecError, match="--mem"):
        parse_mem("lots")


# --- issue 19: ASCII digits, bounds, and the string checks ---------------------------------------

@pytest.mark.parametrize("text", ["٣", "²", "３", "1٣", "٣:00", "1-٣", "1-00:٣"])
def test_parse_time_refuses_non_ascii_digits(text):
    with pytest.raises(SpecError, match="ASCII digits"):
        parse_time(text)


def test_parse_time_bound_is_365_days():
    assert parse_time("365-00:00:00") == 365 * 86400
    with pytest.raises(SpecError, match="365 days"):
        parse_time("365-00:00:01")


@pytest.mark.parametrize("text", ["٣", "３:４", "1:٣", "1e2", " 2 :3", "+1"])
def test_parse_nodes_refuses_non_ascii_and_odd_forms(text):
    with pytest.raises(SpecError, match="MIN:MAX"):
        parse_nodes(text)


def test_parse_int_and_float_bounds_and_digits():
    from hpc.contract.values import parse_float, parse_int

    assert parse_int("65535", "--rdzv-port", maximum=65535) == 65535
    for bad in ("65536", "٣", "²", "1_0", "0x1", "", "+1", True):
        with pytest.raises(SpecError, match="--rdzv-port"):
            parse_int(bad, "--rdzv-port", maximum=65535)
    assert parse_float("1.5e1", "--m") == 15.0 and parse_float(3, "--m") == 3.0
    for bad in ("nan", "inf", "-0", "-0.0", "1e999", "٣", "1_0", "-1", float("nan"), -0.0, True):
        with pytest.raises(SpecError, match="no sign, nan or inf"):
            parse_float(bad, "--m")


def test_parse_mem_is_ascii():
    with pytest.raises(SpecError, match="ASCII"):
        parse_mem("٦٤G")


@pytest.mark.parametrize(("check", "value", "ok"), [
    ("name", "gpu", True), ("name", "gpu,debug", False), ("name", "-gpu", False),
    ("name", "gpu x", False), ("name", "gpü", False), ("name", "g" * 201, False),
    ("text", "my job's \"name\" $(x)", True), ("text", "a\u2028b", False), ("text", "a\u00a0b", False),
    ("text", " a", False), ("text", "a\\b", False), ("text", "-a", False),
    ("path", "/a b/'c'/$d", True), ("path", "/a\nb", False), ("path", "/a\x00b", False),
    ("path", "/a\\b", False), ("path", "/" + "a" * 4096, False),
])
def test_string_checks(check, value, ok):
    from hpc.contract import values

    run = {"name": lambda v: values.check_slurm_name(v, "--x", example="--x gpu"),
           "text": lambda v: values.check_text(v, "--x", example="--x gpt"),
           "path": lambda v: values.check_path(v, "--x", example="--x /a")}[check]
    if ok:
        run(value)
    else:
        with pytest.raises(SpecError, match="--x"):
            run(value)
