"""``hpc report`` and every reader of ``events.jsonl`` skip a hostile line and read the rest:
1,000 generated lines (the fixture's events with fields of the wrong type, out of range,
infinite, NaN, huge, or escape sequences; lines that are no object; lines nested deeper than
the stack) mixed into a real job's events, 20 per job directory; none may raise."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from hpc.contract import records
from hpc.contract.events import read_events
from hpc.report import inproc
from hpc.report.load import load
from hpc.report.table import format_table, to_json

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "events" / "preempt_node_crash"
HOSTILE = [None, True, -1, 0, 1e308, -1e308, float("nan"), float("inf"), "x", "", [], [1], {},
           {"a": 1}, 2**70, "1e999", "\x1b[31mred", 1.5]


def hostile_lines(rng: random.Random, base: list[dict], n: int) -> list[str]:
    out = []
    for _ in range(n):
        e: object = dict(rng.choice(base))
        for k in rng.sample(list(e), k=min(len(e), rng.randint(1, 3))):   # type: ignore[arg-type]
            e[k] = rng.choice(HOSTILE)                                     # type: ignore[index]
        if rng.random() < 0.1:
            e = rng.choice(HOSTILE)
        out.append(json.dumps(e))
    return out


def test_a_thousand_hostile_lines_are_skipped_and_the_ledger_is_still_made(tmp_path: Path,
                                                                           caplog) -> None:
    good = [x for x in (FIXTURE / "events.jsonl").read_text().splitlines() if x.strip()]
    base = [json.loads(x) for x in good]
    rng = random.Random(1)
    nested = "[" * 100_000 + "]" * 100_000
    for trial in range(50):
        job = tmp_path / f"job{trial}"
        shutil.copytree(FIXTURE, job)
        lines = good + hostile_lines(rng, base, 20) + ([nested] if trial % 10 == 0 else [])
        rng.shuffle(lines)
        (job / "events.jsonl").write_text("\n".join(lines) + "\n")
        with caplog.at_level(logging.WARNING):
            ledger = load(job, "")
            inproc.story(read_events(job))
            format_table(ledger, str(job))
            to_json(ledger)
        kept = read_events(job)
        assert len(kept) >= len(good), (trial, len(kept))   # every good line is still read
    assert "skipped a damaged record" in caplog.text


@pytest.mark.parametrize("line, why", [
    ('{"t": 1e400, "ev": "x"}', "no time"), ('{"t": NaN, "ev": "x"}', "no time"),
    ('{"t": -5, "ev": "x"}', "no time"), ('{"t": 1, "ev": 3}', "no name"),
    ('{"t": 1, "ev": "x", "step": "7"}', "'step' is not a whole number"),
    ('{"t": 1, "ev": "x", "alloc": null}', "'alloc' is not a whole number"),
    ('{"t": 1, "ev": "x", "block_s": Infinity}', "'block_s' is not a finite number"),
    ('{"t": 1, "ev": "x", "reason": ["a"]}', "'reason' is not text"),
])
def test_each_hostile_field_is_named(line: str, why: str) -> None:
    kept, bad = records.parse(line.encode(), records.event)
    assert not kept and len(bad) == 1 and why in bad[0].why, bad


def test_a_line_nested_deeper_than_the_stack_is_skipped_by_any_reader() -> None:
    data = b'{"t": 1, "ev": "a"}\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n{"t": 2, "ev": "b"}\n'
    kept, bad = records.parse(data, records.event)
    assert [e["ev"] for e in kept] == ["a", "b"] and len(bad) == 1 and "not JSON" in bad[0].why


def test_escape_sequences_in_records_reach_the_terminal_as_text(tmp_path: Path, capsys) -> None:
    """A record's text with ANSI escapes, a carriage return and a bidi override: ``hpc report``
    prints it, but as escapes (``\\x1b``), so it cannot recolour, move the cursor or hide text."""
    import argparse

    from hpc.contract.values import printable
    from hpc.report.command import main as report

    job = tmp_path / "job"
    shutil.copytree(FIXTURE, job)
    hostile = "\x1b[2J\x1b[31mpwned\rfake\u202e"
    for name in ("events.jsonl", "outcomes.jsonl"):   # the allocations' kinds are printed
        recs = [json.loads(x) for x in (job / name).read_text().splitlines() if x.strip()]
        for e in recs:
            if isinstance(e.get("kind"), str):
                e["kind"] = hostile + e["kind"]
        (job / name).write_text("".join(json.dumps(e) + "\n" for e in recs))
    assert report(argparse.Namespace(job=str(job), json=False, png=None, html=None)) == 0
    out = capsys.readouterr().out
    assert "pwned" in out and "\\x1b[31mpwned\\x0dfake\\u202e" in out, out   # shown, escaped
    assert not any(c in out for c in "\x1b\r\u202e"), out
    assert printable("a\tb\nc") == "a\tb\nc"
