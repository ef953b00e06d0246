"""Async-save staging: when buffers are reused or remade, which staging a state gets, and the copy itself.

Pure logic (layouts, the choice of staging) plus the CPU stager on real tensors in this process.
The pinned / side-stream path needs a GPU: tests/gpu/test_gpu_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.checkpoint.staging import CPU_BUFFERS, PINNED_SIDE_STREAM, Staging, layout_of, staging_kind

pytestmark = pytest.mark.unit


def _state(lr: float = 0.1, n: int = 4, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"model": {"w": torch.arange(n * 3, dtype=dtype).reshape(n, 3), "b": torch.ones(3, dtype=dtype)},
            "optim": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.zeros(n, 3)}},
                      "param_groups": [{"lr": lr, "betas": (0.9, 0.95), "params": ["w", "b"]}]}}


def test_values_do_not_change_the_layout_but_structure_does() -> None:
    base = layout_of(_state())
    assert layout_of(_state(lr=0.5)) == base  # a new learning rate: same buffers
    assert layout_of({**_state(), "model": {**_state()["model"], "w": torch.ones(4, 3)}}) == base
    assert layout_of(_state(n=5)) != base  # a shape
    assert layout_of(_state(dtype=torch.bfloat16)) != base  # a dtype
    assert layout_of({**_state(), "extra": torch.zeros(1)}) != base  # a new entry
    renamed = _state()
    renamed["model"]["w2"] = renamed["model"].pop("w")
    assert layout_of(renamed) != base  # a key
    strided = _state()
    strided["model"]["w"] = torch.zeros(3, 4).t()
    assert layout_of(strided) != base  # same shape, other strides
    typed = _state()
    typed["optim"]["state"]["w"]["step"] = 2.0  # a tensor became a number
    assert layout_of(typed) != base


@pytest.mark.parametrize(("devices", "accelerator", "kind"), [
    ({"cpu"}, False, CPU_BUFFERS),
    ({"cpu"}, True, CPU_BUFFERS),             # a GPU node, CPU state: pinning buys nothing
    ({"cuda", "cpu"}, True, PINNED_SIDE_STREAM),  # Adam's step counters stay on the CPU
    ({"cuda"}, True, PINNED_SIDE_STREAM),
    ({"cuda"}, False, CPU_BUFFERS),
    (set(), True, CPU_BUFFERS),               # nothing but plain values
    ({"meta", "cpu"}, True, CPU_BUFFERS),
])
def test_staging_kind(devices: set[str], accelerator: bool, kind: str) -> None:
    assert staging_kind(devices, accelerator) == kind


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for k in obj for x in _flat(obj[k])]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in _flat(v)]
    return [obj]


def _same(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(fa, fb))


def test_stage_copies_into_the_warmed_buffers_and_reuses_them() -> None:
    stager = Staging()
    state = _state()
    stager.warm_up(state)
    stager.join_warm_up()
    assert stager.warm
    staged = stager.stage(state)
    assert stager.rebuilds == 0 and stager.last_kind == CPU_BUFFERS
    assert _same(staged, state)
    w = staged["model"]["w"]
    assert w.data_ptr() != state["model"]["w"].data_ptr()  # a copy, not the live tensor
    state["model"]["w"].add_(100.0)  # training goes on
    assert not torch.equal(w, state["model"]["w"])
    state["optim"]["param_groups"][0]["lr"] = 0.01
    again = stager.stage(state)
    assert again["model"]["w"].data_ptr() == w.data_ptr()  # the same buffer, refilled
    assert _same(again, state) and again["optim"]["param_groups"][0]["lr"] == 0.01
    assert stager.rebuilds == 0


def test_a_structure_change_remakes_the_buffers_in_the_save() -> None:
    stager = Staging()
    staged = stager.stage(_state())
    assert stager.rebuilds == 1  # no warm-up: the first save made them
    old = staged["model"]["w"].data_ptr()
    bigger = _state(n=6)
    staged = stager.stage(bigger)
    assert stager.rebuilds == 2 and _same(staged, bigger)
    assert tuple(staged["model"]["w"].shape) == (6, 3)
    staged = stager.stage(bigger)
    assert stager.rebuilds == 2 and staged["model"]["w"].data_ptr() != old


def test_a_warm_up_for_the_current_layout_is_a_no_op_and_close_frees() -> None:
    stager = Staging()
    state = _state()
    stager.stage(state)
    stager.warm_up(state)  # buffers of this layout exist: nothing to do
    assert stager.join_warm_up() is None and stager.rebuilds == 1
    stager.close()
    assert not stager.warm


def test_flatten_and_unflatten_round_trip_every_container_a_state_dict_holds() -> None:
    from collections import OrderedDict, namedtuple

    from runtime.checkpoint.staging import flatten, unflatten

    Pair = namedtuple("Pair", "a b")
    state = {"od": OrderedDict(x=torch.ones(2), y=3), "pair": Pair(torch.zeros(1), "s"),
             "tup": (1, [2.0, {"z": None}]), "empty": {}, "nested": [[], ()]}
    leaves: list[Any] = []
    tree = flatten(state, leaves)
    assert len(leaves) == 7  # ones, 3, zeros, "s", 1, 2.0, None
    back = unflatten(tree, leaves)
    assert isinstance(back["pair"], Pair) and back["pair"].b == "s"
    assert back["tup"] == (1, [2.0, {"z": None}]) and back["empty"] == {} and back["nested"] == [[], ()]
    assert torch.equal(back["od"]["x"], torch.ones(2)) and back["od"]["y"] == 3
    other: list[Any] = []
    assert flatten({**state, "tup": (1, [2.0, {"w": None}])}, other) != tree  # a key deep down


def test_views_with_odd_strides_are_staged_by_value() -> None:
    base = torch.arange(12.0)
    state = {"expanded": torch.ones(3, 1).expand(3, 4), "strided": base[::3], "t": torch.ones(2, 3).t()}
    stager = Staging()
    staged = stager.stage(state)
    base.add_(100.0)
    again = stager.stage(state)
    assert _same(again, state) and stager.rebuilds == 1
    assert torch.equal(staged["strided"], base[::3])  # the same buffers, refilled


def test_the_kept_inner_stager_survives_the_close_torch_2_11_calls_after_every_staging() -> None:
    """torch 2.11's DefaultStager closes its StateDictStager at the end of every staging
    (pytorch#183413): the next one failed with ``KeyError: <class 'type'>`` on an H200. Staging's
    inner stager ignores that close, keeps its buffers, and is freed by Staging.close alone. The
    close is called here as 2.11 calls it (2.13, installed here, no longer does); the real proof
    on torch 2.11 is tests/gpu/test_gpu_checkpoint.py."""
    from runtime.checkpoint.staging import _KeptStateDictStager

    inner = _KeptStateDictStager(pin_memory=False, share_memory=False)
    state = _state()
    first = inner.stage(state)
    inner.close()   # what DefaultStager._stage does in torch 2.11
    state["model"]["w"].add_(1.0)
    second = inner.stage(state)   # a type in the tree (the tuples' reconstruction) needs the table
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()   # the same buffer
    inner.release()
    assert not inner._cached_storage_mapping
