"""A failed step's rollback (``StepGuard.rollback``) puts everything the step touched back,
the optimizer's parameter groups included: the LR scheduler a script steps after a skipped
optimizer step writes the next step's ``lr`` into them, and the step's redo must run with its
own (found by the fault campaign: train_gpt ended ~1e-4 off the uninterrupted weights)."""

from __future__ import annotations

import pytest
import torch

from runtime.inprocess.worker.guard import StepGuard


def test_a_failed_steps_scheduler_step_does_not_leak_its_lr_into_the_redo():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + k))
    g = StepGuard({"sched": sched}, timeout_s=lambda: 60.0, rank=0)
    g.guard_optimizer(opt)
    g.begin(0)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()                                   # a whole step: the lr for step 1 is 1e-2 / 2
    before = [dict(p, params=None) for p in opt.param_groups]
    weights = [p.detach().clone() for p in model.parameters()]
    g.begin(1)
    g.fail("all-reduce: connection reset")
    opt.step()                                     # skipped: the step failed
    sched.step()                                   # the script goes on to its scheduler
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)   # the leak, before the rollback
    g.rollback()
    assert [dict(p, params=None) for p in opt.param_groups] == before
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 2) and sched.last_epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
