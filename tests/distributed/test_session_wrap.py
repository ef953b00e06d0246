"""``s.wrap(model)`` on three real gloo ranks: what bare DDP costs, with the Session's promises.

The wrapped model must keep one gradient-bucket layout for the whole run without
``find_unused_parameters`` (its graph walk and extra all-reduce cost ~1.5 ms a step): a
"resumed" wrap of the same weights then steps bit-identically to the uninterrupted one (with
three ranks a different layout rounds the sums differently, as plain DDP shows). A model that
leaves a parameter out of the loss must stop with an error that names the Session's option,
and train with it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

SCRIPT = """
import copy, json, sys, torch
from runtime.session import Session

job, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)

class Net(torch.nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                        torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
        self.spare = torch.nn.Linear(4, 4) if unused else None      # never called

    def forward(self, x):
        return self.body(x)

def step(model, opt, i, rank):
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(100 * i + rank))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

def resume_check(s, **kw):
    ref = s.wrap(Net(), **kw)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(2):
        step(ref, opt, i, s.rank)
    snap = copy.deepcopy(ref.module.state_dict())
    for i in range(2, 5):
        step(ref, opt, i, s.rank)
    model = Net()
    model.load_state_dict(snap)
    resumed = s.wrap(model, **kw)
    opt = torch.optim.SGD(resumed.parameters(), lr=0.5)
    for i in range(2, 5):
        step(resumed, opt, i, s.rank)
    a, b = ref.module.state_dict(), resumed.module.state_dict()
    return {"find_unused_parameters": ref.find_unused_parameters,
            "bit_identical": all(torch.equal(a[k], b[k]) for k in a)}

def train(s, **kw):
    model = s.wrap(Net(unused=True), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        for i in range(3):
            step(model, opt, i, s.rank)
        return {"trained": 3}
    except RuntimeError as e:
        return {"error": str(e)}

with Session(job_dir=job) as s:
    if mode == "layout":
        out = {"session": resume_check(s), "plain": resume_check(s, reproducible_resume=False)}
    else:
        out = {"option": train(s, find_unused_parameters=True), "default": train(s)}
    print(json.dumps(out))
"""


def run_ranks(tmp_path: Path, mode: str, world: int = 3) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "job"), mode],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def test_wrapped_model_resumes_bit_identical_without_find_unused_parameters(tmp_path: Path):
    """A fresh wrap of the weights after step 2 steps exactly as the first wrap did; the
    control, DDP's own rebuilt layout (``reproducible_resume=False``), does not: the check
    can fail."""
    results = run_ranks(tmp_path, "layout")
    for r in results:
        assert r["session"] == {"find_unused_parameters": False, "bit_identical": True}, results
        assert r["plain"]["bit_identical"] is False, results


def test_unused_parameter_stops_with_the_sessions_option_named_and_trains_with_it(tmp_path: Path):
    for r in run_ranks(tmp_path, "unused", world=2):
        assert r["option"] == {"trained": 3}, r
        error = r["default"].get("error", "")
        assert "s.wrap(model, find_unused_parameters=True)" in error, r
        assert "did not receive grad" in error, error     # torch's own diagnosis is kept
