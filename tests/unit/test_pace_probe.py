"""The straggler watch's pace probe (runtime.worker.ddp.PaceProbe) on a real autograd graph.

It must time a sampled step up to the end of its backward pass (the rank's own work before
DDP's reduction waits on the others), time nothing on the steps between samples, and leave
no hook behind on the parameters once a sample is taken.
"""

from __future__ import annotations

import time

import torch

from runtime.worker.ddp import PaceProbe


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_a_sampled_step_is_timed_to_the_end_of_its_backward_pass():
    model = _model()
    probe = PaceProbe(list(model.parameters()), every_s=0.0)
    t0 = time.perf_counter()
    assert probe.arm(t0)
    loss = model(torch.randn(4, 8)).sum()
    before_backward = time.perf_counter()
    loss.backward()
    after_backward = time.perf_counter()
    done = probe.take()
    assert done is not None and before_backward <= done <= after_backward


def test_steps_between_samples_are_not_timed_and_no_hook_is_left_behind():
    model = _model()
    probe = PaceProbe(list(model.parameters()), every_s=3600.0)
    assert probe.arm(time.perf_counter())
    model(torch.randn(4, 8)).sum().backward()
    assert probe.take() is not None
    assert not probe.arm(time.perf_counter())           # within every_s: not sampled
    model(torch.randn(4, 8)).sum().backward()
    assert probe.done is None and probe.take() is None  # the hooks were removed


def test_a_step_without_a_backward_pass_gives_no_sample():
    model = _model()
    probe = PaceProbe(list(model.parameters()), every_s=0.0)
    assert probe.arm(time.perf_counter())
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert probe.take() is None


def test_a_parameter_left_out_of_the_loss_does_not_stop_the_timing():
    model = _model()
    spare = torch.nn.Parameter(torch.zeros(3))
    probe = PaceProbe([*model.parameters(), spare], every_s=0.0)
    assert probe.arm(time.perf_counter())
    model(torch.randn(4, 8)).sum().backward()
    assert probe.take() is not None
