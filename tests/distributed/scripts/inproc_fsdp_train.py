"""A Session script with an FSDP2 model (gloo) for the in-process peer-copy tests.

Each rank appends one JSON line per step body to ``OUT/steps-<pid>.jsonl`` and, at the end,
writes ``OUT/result-<pid>.json``: its pid, rank, final step, a digest of the full weights
(gathered), the sampler state, and every file it opened under the job directory while it
recovered or, a joiner, restored (a Python audit hook: the recovery must read no checkpoint).
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from runtime.sampler import ResumableSampler, rank_slice
from runtime.session import Session

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-sleep", type=float, default=0.1)
p.add_argument("--global-batch", type=int, default=16)
p.add_argument("--joiner-sleep", type=float, default=0.0,
               help="a joiner (HPC_INPROC_JOIN=1) sleeps this long first: a spare node slow to start")
args = p.parse_args()
if os.environ.get("HPC_INPROC_JOIN") == "1":
    time.sleep(args.joiner_sleep)
out = Path(args.out)
opened: list[str] = []
recovering = [False]


def audit(event: str, params: tuple) -> None:
    if event == "open" and recovering[0] and params and isinstance(params[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(params[0]))


sys.addaudithook(audit)
import faulthandler, signal  # noqa: E401 - tests: kill -USR1 prints every thread's stack
faulthandler.register(signal.SIGUSR1, all_threads=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


g = torch.Generator().manual_seed(1)
X = torch.randn(600, 8, generator=g)
Y = X.sum(dim=1, keepdim=True).sin()
log = open(out / f"steps-{os.getpid()}.jsonl", "a", buffering=1)

with Session(seed=0) as s:
    net = Net()
    model = s.wrap(net, fsdp=True, blocks=[net.a, net.b])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ResumableSampler(len(X), global_batch=args.global_batch, seed=3)
    recovering[0] = os.environ.get("HPC_INPROC_JOIN") == "1"   # a joiner's restore is its recovery
    start = s.restore(model=model, optim=opt, sampler=sampler)
    recovering[0] = False
    orig = getattr(s._recovery, "_recover", None)   # the Session's in-process part (runtime.inprocess.worker.session_part)

    def watched(*a, **k):   # instrumentation: files opened while recovering
        recovering[0] = True
        try:
            return orig(*a, **k)
        finally:
            recovering[0] = False
    if hasattr(s._recovery, "_recover"):   # the restart path's (a fallback) has none
        s._recovery._recover = watched
    for step in s.steps(start, args.steps):
        batch = sampler.next_global_batch()
        mine = rank_slice(batch, s.rank, s.world_size)
        log.write(json.dumps({"step": step, "rank": s.rank, "world": s.world_size, "first": batch[0],
                              "t": time.time()}) + "\n")
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(X[mine]), Y[mine])
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
    full = [p.full_tensor() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in full)).hexdigest()
    copies = getattr(getattr(s._recovery, "inproc", None), "copies", None)
    (out / f"result-{os.getpid()}.json").write_text(json.dumps({
        "pid": os.getpid(), "rank": s.rank, "world": s.world_size, "step": s.step, "weights": digest,
        "sampler": sampler.state_dict(), "opened_while_recovering": opened,
        "copy_bytes": copies.bytes_per_copy if copies else None,
        "held_bytes": copies.held_bytes() if copies else None,
        "copies_made": copies.copies_made if copies else None,
        "snapshot_s": copies.snapshot_s if copies else None,
        "copy_s": copies.copy_s if copies else None}))
    s.finish()
