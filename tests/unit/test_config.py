from pathlib import Path

import pytest

from hpc.config import find_config, parse_config
from hpc.contract.errors import SpecError

pytestmark = pytest.mark.unit


def test_profile_overlays_defaults():
    cfg = parse_config({"defaults": {"partition": "cpu", "qos": "low"},
                        "profiles": {"big": {"partition": "gpu", "signal-lead": 300}}})
    raw, where = cfg.options_for("big")
    assert raw["partition"] == "gpu" and raw["qos"] == "low" and raw["signal_lead_s"] == 300
    assert "[profiles.big]" in where["partition"] and "[defaults]" in where["qos"]


def test_unknown_key_lists_valid_keys():
    with pytest.raises(SpecError) as e:
        parse_config({"profiles": {"x": {"partiton": "gpu"}}})
    assert "'partiton'" in str(e.value) and "partition" in str(e.value) and "account" in str(e.value)


def test_unknown_top_level_key():
    with pytest.raises(SpecError, match="default_profile, defaults, profiles"):
        parse_config({"partition": "gpu"})


def test_unknown_profile_names_the_defined_ones():
    cfg = parse_config({"profiles": {"a": {}, "b": {}}})
    with pytest.raises(SpecError, match=r"--profile 'c'.*defined: a, b"):
        cfg.options_for("c")


def test_pyproject_tool_hpc_is_found(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text('[tool.hpc.profiles.c]\naccount = "p1"\n')
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    assert cfg.options_for("c")[0]["account"] == "p1"


def test_hpc_toml_wins_over_pyproject(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text('[tool.hpc.profiles.c]\naccount = "p1"\n')
    (tmp_path / "hpc.toml").write_text('default_profile = "c"\n[profiles.c]\naccount = "p2"\n')
    cfg = find_config(cwd=tmp_path, environ={"HOME": str(tmp_path)})
    assert cfg.options_for("")[0]["account"] == "p2"


def test_docs_list_every_option():
    from hpc.contract.jobspec import flag_name, option_fields
    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    for f in option_fields():
        assert f"`{flag_name(f.name)}`" in doc, f"docs/config.md misses {flag_name(f.name)}"
