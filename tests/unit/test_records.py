"""Job-directory records (hpc.contract.records): one writer, one tolerant reader, every type.

A damaged line (not UTF-8, not JSON, the wrong shape) is skipped and reported with its file and
line, never raised: issue 23's probe crashed workers, the launcher, ``hpc run`` and ``hpc report``
with one bad byte.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hpc.contract import jobdir, records
from hpc.contract.jobpaths import JobPaths
from hpc.contract.records import Exclusion, HangEvent, JobRecord, Link, Outcome, Straggler

pytestmark = pytest.mark.unit

SAMPLES = [
    Outcome(allocation=2, kind="hang", exit_code=1, step=40, hangs=("stall on n1",), time=5.0),
    HangEvent(allocation=0, node="n1", node_rank=0, reason="r", suspect_rank=None, stacks="s",
              step=3, time=2.0, ranks=("rank 0: step 3",), suspect_node="n2"),
    Exclusion(node="n3", kind="lost", reason="gone", allocation=1, time=3.0),
    Straggler(allocation=0, rank=3, node="n2", node_rank=1, compute_s=0.3, median_s=0.1, step=9, time=4.0),
    Link(job_id="62", previous="61", allocation_base=3, reason="refused", time=6.0),
    JobRecord(job_id="7", job_dir="/j", name="n", backend="sbatch", submitted=1.0, cluster="c"),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_type_round_trips(tmp_path: Path, record: object) -> None:
    path = tmp_path / "r.jsonl"
    records.append(path, record)
    records.append(path, record, durable=True)
    assert records.read(path, type(record)) == [record, record]
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_time_zero_is_stamped_on_append(tmp_path: Path) -> None:
    records.append(tmp_path / "o.jsonl", Outcome(allocation=0, kind="finished", exit_code=0))
    [o] = records.read(tmp_path / "o.jsonl", Outcome)
    assert o.time > 1e9


def test_damaged_lines_are_skipped_and_reported_with_file_and_line(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    good = records.encode(SAMPLES[0])
    path = tmp_path / "outcomes.jsonl"
    path.write_bytes(good + b"\xff\xfe\n" + b"{not json\n" + b"[1, 2]\n"
                     + b'{"allocation": "x", "kind": "finished", "exit_code": 0}\n'
                     + b'{"allocation": 1, "kind": "exploded", "exit_code": 0}\n'
                     + b'{"kind": "finished", "exit_code": 0}\n' + b"\n" + good)
    with caplog.at_level(logging.WARNING, logger="hpc.records"):
        got = records.read(path, Outcome)
    assert got == [SAMPLES[0], SAMPLES[0]]
    text = caplog.text
    assert f"{path}, line 2: not UTF-8 (byte 0xff at column 1)" in text
    assert f"{path}, line 3: not JSON" in text
    assert f"{path}, line 4: not a Outcome: not an object but list" in text
    assert "line 5: not a Outcome: allocation = 'x'" in text
    assert "line 6: not a Outcome: kind 'exploded' is none of finished" in text
    assert "line 7: not a Outcome: no field 'allocation'" in text
    assert "line 8" not in text                     # an empty line is not damage


def test_each_damaged_line_is_reported_once_per_process(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "hangs.jsonl"
    path.write_bytes(b"\xff\n")
    with caplog.at_level(logging.WARNING, logger="hpc.records"):
        for _ in range(5):                          # rank 0 polls it every few seconds
            assert records.read(path, HangEvent) == []
    assert caplog.text.count("line 1: not UTF-8") == 1


def test_unreadable_file_reads_as_empty_and_is_reported(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "hangs.jsonl").mkdir()
    with caplog.at_level(logging.WARNING, logger="hpc.records"):
        assert records.read(tmp_path / "hangs.jsonl", HangEvent) == []
    assert "hangs.jsonl: unreadable" in caplog.text
    assert records.read(tmp_path / "missing.jsonl", HangEvent) == []


def test_shapes_newer_and_older_writers_still_read() -> None:
    newer = {**json.loads(records.encode(SAMPLES[1])), "added_later": 1}
    assert records.from_dict(HangEvent, newer) == SAMPLES[1]
    older = {"allocation": 0, "kind": "finished", "exit_code": 0, "hangs": None}
    assert records.from_dict(Outcome, older).hangs == ()
    with pytest.raises(ValueError, match="exit_code = True"):
        records.from_dict(Outcome, {**older, "exit_code": True})
    assert records.from_dict(Straggler, {**json.loads(records.encode(SAMPLES[3])), "step": 9}).step == 9


# --------------------------------------------------------------------------- each reader


def test_hangs_with_a_non_utf8_byte_read(tmp_path: Path) -> None:
    from runtime.liveness import hang_log

    hang_log.append(tmp_path, SAMPLES[1])
    with open(tmp_path / "hangs.jsonl", "ab") as f:
        f.write(b"\xff\n")
    hang_log.append(tmp_path, SAMPLES[1])
    assert hang_log.read(tmp_path) == [SAMPLES[1], SAMPLES[1]]
    assert len(hang_log.take_unreported(tmp_path)) == 2


def test_garbled_outcomes_read(tmp_path: Path) -> None:
    jobdir.append_outcome(tmp_path, SAMPLES[0])
    with open(tmp_path / "outcomes.jsonl", "ab") as f:
        f.write(b'[1]\n{"allocation": 0, "kind": "bogus", "exit_code": 0}\n"text"\n\xc3\n')
    assert jobdir.read_outcomes(tmp_path) == [SAMPLES[0]]


def test_exclusions_stragglers_links_and_index_with_damage(tmp_path: Path) -> None:
    from hpc.contract import index
    from hpc.contract import resubmissions
    from runtime import exclusions
    from runtime.liveness import stragglers

    paths = JobPaths(tmp_path)
    for path, record in ((paths.exclusions, SAMPLES[2]), (paths.stragglers, SAMPLES[3]),
                         (paths.resubmissions, SAMPLES[4]), (tmp_path / "jobs.jsonl", SAMPLES[5])):
        path.write_bytes(b'\xff{"node": 1}\n[]\n{"allocation": [1]}\n' + records.encode(record))
    assert exclusions.read(tmp_path) == [SAMPLES[2]]
    assert stragglers.read(tmp_path) == [SAMPLES[3]]
    assert resubmissions.read(tmp_path) == [SAMPLES[4]]
    assert index.read_index(tmp_path) == [SAMPLES[5]]


def test_status_notes_skip_records_of_the_wrong_shape(tmp_path: Path) -> None:
    from hpc.status import running_notes

    (tmp_path / "hangs.jsonl").write_bytes(b'{"allocation": "x", "node": "n9"}\n\xff\n'
                                           b'{"allocation": [0]}\n{"allocation": 0, "node": "n1"}\n')
    (tmp_path / "stragglers.jsonl").write_bytes(b'{"allocation": null}\n')
    assert running_notes(tmp_path) == "1 stall(s) recovered so far, last on n1"


def test_report_loads_a_damaged_job_directory(tmp_path: Path) -> None:
    from hpc.report.load import hang_events, load

    jobdir.append_outcome(tmp_path, Outcome(allocation=0, kind="finished", exit_code=0, time=10.0))
    (tmp_path / "hangs.jsonl").write_bytes(records.encode(SAMPLES[1]) + b'\xff\n{"time": "x"}\n')
    (tmp_path / "events.jsonl").write_bytes(b'{"t": 1, "ev": "alloc_start", "alloc": 0}\n\xff\n[]\n'
                                            b'{"t": "soon", "ev": "x"}\n'
                                            b'{"t": ' + b"9" * 400 + b', "ev": "x"}\n')   # no float holds it
    (tmp_path / "jobspec.json").write_bytes(b"[1, 2]")
    assert [h["node"] for h in hang_events(tmp_path)] == ["n1"]
    ledger = load(tmp_path)
    assert ledger is not None


def test_read_json_refuses_anything_but_an_object(tmp_path: Path) -> None:
    for content in (b"[1, 2]", b"\xff", b"3", b""):
        (tmp_path / "exit-intent.json").write_bytes(content)
        assert jobdir.read_json(tmp_path / "exit-intent.json") is None
