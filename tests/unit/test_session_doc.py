"""docs/session.md is the Session's reference: every name it documents exists on the class,
and every public name of the class (methods, properties, attributes, constructor arguments)
is documented there."""

from __future__ import annotations

import inspect
import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit
DOC = REPO / "docs" / "session.md"


def documented() -> tuple[set[str], set[str]]:
    """(members, constructor arguments) the page documents: bullets that open with a code
    name (``- `steps(...)` ``), first cells of the tables (``| `rank` |``), by section."""
    members, args = set(), set()
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        bullet = re.match(r"^- `(\w+)[(`]", line)
        cell = re.match(r"^\| ((?:`\w+`(?:, )?)+) \|", line)
        if bullet:
            members.add(bullet.group(1))
        elif cell:
            names = set(re.findall(r"`(\w+)`", cell.group(1)))
            (args if section == "Constructor" else members).update(names)
    return members, args


def public_names() -> set[str]:
    from runtime.session import Session

    instance = Session(env={})             # no process group: start() is not called
    return {n for n in dir(Session) if not n.startswith("_")} | \
        {n for n in vars(instance) if not n.startswith("_")}


def test_every_documented_name_exists_on_the_session():
    from runtime.session import Session

    members, args = documented()
    assert len(members) > 20, members        # the parser found the page's names
    assert members - public_names() == set(), "documented but not on Session"
    assert args == set(inspect.signature(Session.__init__).parameters) - {"self"}


def test_every_public_name_of_the_session_is_documented():
    members, _ = documented()
    assert public_names() - members == set(), "on Session but not in docs/session.md"


def test_the_readme_links_the_reference():
    assert "docs/session.md" in (REPO / "README.md").read_text()
