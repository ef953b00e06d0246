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
