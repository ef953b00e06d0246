"""A failure that repeats at one step ends in-process recovery instead of looping (issue 26).

The count lives in the agreed generation record (``Members.in_row``), so every member decides
alike; the launcher-side outcome (the restart path, ``--max-restarts``) is
``tests/distributed/test_inprocess_repeats.py``.
"""

from __future__ import annotations

import pytest

from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from runtime.inprocess.protocol import Members


def test_the_count_grows_while_generations_go_on_from_one_step_and_a_completed_step_resets_it():
    g1 = Members(gen=1, uids=("a",), step=5, source=0, in_row=rules.in_row(None, 5))
    g2 = Members(gen=2, uids=("a",), step=5, source=0, in_row=rules.in_row(g1, 5))
    assert (g1.in_row, g2.in_row) == (1, 2)
    assert rules.in_row(g2, 5) == 3
    assert rules.in_row(g2, 6) == 1   # a step completed in between


def test_past_the_budget_the_reason_names_the_count_the_step_the_error_and_the_way_out():
    m = Members(gen=4, uids=("a", "b"), step=7, source=0, reason="all-reduce: boom", in_row=4)
    assert rules.repeats(m, 4) is None
    why = rules.repeats(m, 3)
    assert why is not None
    assert "4 re-forms in a row at step 7 without a step completed" in why
    assert "all-reduce: boom" in why and recovery_settings.MAX_REFORMS_ENV in why and "--max-restarts" in why


def test_the_record_carries_the_count_and_an_old_record_reads_as_one():
    m = Members(gen=3, uids=("a",), step=2, source=0, in_row=3)
    assert proto.decode_members(proto.encode(m)) == m
    assert proto.decode_members('{"gen": 1, "uids": ["a"], "step": 0, "source": 0}').in_row == 1


def test_the_budget_is_validated_naming_the_variable_and_the_bad_value():
    assert recovery_settings.parse_max_reforms("") == recovery_settings.DEFAULT_MAX_REFORMS == 3
    assert recovery_settings.parse_max_reforms("5") == 5
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError, match=f"HPC_INPROC_MAX_REFORMS='{bad}'.*integer >= 1"):
            recovery_settings.parse_max_reforms(bad)


def test_the_leader_counts_re_forms_at_one_step_in_the_store():
    import torch.distributed as dist

    from runtime.inprocess.worker.membership import Membership

    m = Membership(dist.HashStore(), "host:1", host="host", window_s=1.0, max_world=1)
    m.start(0, 1)
    assert [m.reform(5, 0, reason="boom").in_row for _ in range(3)] == [1, 2, 3]
    assert m.reform(6, 0, reason="boom").in_row == 1
    assert m.reform(6, 0, reason="boom").in_row == 2
