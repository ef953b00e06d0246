"""The pinned-memory async save on a CUDA device (one process, no process group).

The staging of a CUDA state goes through torch's DefaultStager: pinned host buffers, made by
the warm-up and reused by every save, filled by non-blocking copies on a side stream that
starts after the compute stream's last writes. A save returns only once the copy is complete,
so a change to the parameters right after ``save()`` must not reach the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import Checkpointer
from runtime.checkpoint.staging import PINNED_SIDE_STREAM, Staging

pytestmark = pytest.mark.gpu


def _cuda_state() -> dict[str, Any]:
    return {"model": {"w": torch.randn(256, 256, device="cuda"), "b": torch.randn(256, device="cuda")},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(256, 256, device="cuda")}},
                      "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}}


def test_cuda_state_is_staged_into_pinned_buffers_made_by_the_warm_up_and_reused() -> None:
    stager = Staging()
    state = _cuda_state()
    stager.warm_up(state)
    stager.join_warm_up()
    assert stager.warm
    state["model"]["w"].add_(1.0)  # after the warm-up: the save must copy the values of now
    first = stager.stage(state)
    assert stager.last_kind == PINNED_SIDE_STREAM
    w = first["model"]["w"]
    assert w.device.type == "cpu" and w.is_pinned()
    assert torch.equal(w, state["model"]["w"].cpu())
    assert first["optim"]["state"]["w"]["step"].item() == 3.0  # a CPU tensor in a CUDA state
    ptr = w.data_ptr()
    state["model"]["w"].mul_(2.0)
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == ptr  # the same pinned buffer, refilled
    assert torch.equal(second["model"]["w"], state["model"]["w"].cpu())
    stager.close()


def test_async_save_of_a_cuda_model_holds_the_state_at_save_time(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpc.checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.load_latest(state) is None
    for step in range(1, 4):
        model(torch.randn(16, 128, device="cuda")).sum().backward()
        optim.step()
        optim.zero_grad()
        ckpt.should_save(step)  # the first complete state starts the warm-up
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt.save(3, state, blocking=False)
    with torch.no_grad():  # queued on the compute stream right after save() returns
        for p in model.parameters():
            p.add_(1000.0)
    ckpt.close()
    assert "async staging: pinned host buffers" in caplog.text
    assert "made in the save" not in caplog.text  # the warm-up made them
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).cuda()
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    manifest = Checkpointer(tmp_path / "ckpt").load_latest({"model": fresh, "optim": fresh_optim})
    assert manifest is not None and manifest.step == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), expected[k]), k
