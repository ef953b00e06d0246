"""A Session script with DDP (gloo on CPU, NCCL on CUDA) for the in-process recovery tests.

Each rank appends one JSON line per step body it runs to ``OUT/steps-<pid>.jsonl`` (step, rank,
world size, the global batch's first index and size) and, at the end, writes
``OUT/result-<pid>.json``: its pid, final step, a digest of its weights, the sampler state and
every file it opened under the checkpoint directory while it recovered or, a joiner, restored
(a Python audit hook: the recovery must read no checkpoint).
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

from runtime.sampler import ResumableSampler, plan_batches, rank_slice
from runtime.session import Session

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--micro", type=int, default=2)
p.add_argument("--log-every", type=int, default=5)
p.add_argument("--pause", default="", help="RANK:STEP:SECONDS: that rank works this long at that step "
               "(healthy and slow, unmarked: an evaluation)")
p.add_argument("--shrunk-step-sleep", type=float, default=None, help="a survivor's step sleep while "
               "the world is smaller than at its start (holds the job open for a slow joiner under load)")
p.add_argument("--joiner-delay", type=float, default=0.0, help="a joiner (a restarted worker) starts "
               "this much slower (seconds before its Session: a GPU's CUDA and NCCL start-up)")
p.add_argument("--boundary-every", type=int, default=0, help="the Session's step-boundary "
               "agreement every N steps once calibrated, as on steps of ~0.1/N s (0: measured)")
p.add_argument("--diverge-at", type=int, default=None, help="rank 1 of the first start saves at "
               "this step and its peers do not (a decision that differed between ranks: a deadlock)")
args = p.parse_args()
if args.boundary_every:
    import runtime.session
    runtime.session.POLL_TARGET_S, runtime.session.MAX_POLL_EVERY = 1e9, args.boundary_every
if os.environ.get("HPC_INPROC_JOIN") == "1":
    time.sleep(args.joiner_delay)
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

with Session(seed=0, log_every=args.log_every) as s:
    model = s.wrap(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A decaying LR, stepped after the optimizer as scripts do: a failed step's scheduler step
    # must not leak its next-step lr into the step's redo.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.05 * k))
    sampler = ResumableSampler(len(X), global_batch=args.global_batch, seed=3)
    recovering[0] = os.environ.get("HPC_INPROC_JOIN") == "1"   # a joiner's restore is its recovery
    start = s.restore(model=model, optim=opt, sched=sched, sampler=sampler)
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
    full = s.world_size
    for step in s.steps(start, args.steps):
        accum = plan_batches(args.global_batch, s.world_size, args.micro)   # per step: the world may change
        batch = sampler.next_global_batch()
        mine = rank_slice(batch, s.rank, s.world_size)
        log.write(json.dumps({"step": step, "rank": s.rank, "world": s.world_size, "first": batch[0],
                              "n": len(batch), "t": time.time()}) + "\n")
        opt.zero_grad(set_to_none=True)
        for i in range(accum):
            idx = mine[i * args.micro:(i + 1) * args.micro]
            ctx = model.no_sync() if i < accum - 1 else torch.enable_grad()
            with ctx:
                loss = nn.functional.mse_loss(model(X[idx].to(s.device)), Y[idx].to(s.device)) / accum
                loss.backward()
        opt.step()
        sched.step()
        if step == args.diverge_at and s.rank == 1 and s.restart_count == 0 and not recovering[0] \
                and os.environ.get("HPC_INPROC_JOIN") != "1":
            (out / "diverged").write_text(repr(time.time()))
            s.save()
        if args.pause and [int(x) for x in args.pause.split(":")[:2]] == [s.rank, step]:
            time.sleep(float(args.pause.split(":")[2]))
        s.log(loss=loss.item())
        shrunk = args.shrunk_step_sleep is not None and s.world_size < full
        time.sleep(args.shrunk_step_sleep if shrunk else args.step_sleep)
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    (out / f"result-{os.getpid()}.json").write_text(json.dumps({
        "pid": os.getpid(), "rank": s.rank, "world": s.world_size, "step": s.step, "weights": digest,
        "sampler": sampler.state_dict(), "opened_while_recovering": opened}))
    s.finish()
