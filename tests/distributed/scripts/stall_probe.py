"""A small Session training loop for the liveness tests: it can hang, pause and jitter on cue.

Every rank records its pid (``pid-<rank>-<restart>``) so a test can freeze one. At the end
rank 0 writes ``result.json`` with the final step and each step's world size. Injections
happen only in the first run (restart 0) so that the restarted workers can finish:

- ``--hang-in-data STEP``: rank 1 sleeps forever inside ``load_batch`` at STEP;
- ``--slow-first-step S``: every rank's first step takes S seconds longer;
- ``--eval-every N --eval-s S``: rank 0 evaluates for S seconds (``session.phase("eval")``)
  every N steps while the others wait for it in the next all-reduce;
- ``--diverge-at STEP``: rank 1 saves a checkpoint at STEP that its peers skip (``s.save()``
  on one rank: a decision that differed between ranks), so it waits in the save's collectives
  while they wait in the next step's all-reduce: a deadlock. It writes ``diverged`` (the time);
- ``--split-at STEP``: at STEP rank 0 all-reduces over a second group of every rank and the
  others over the default group: one collective, two groups, and every rank waits for ever
  (in the first run, or in the second after a ``--diverge-at`` one; writes ``split``);
- ``--jitter S``: each step sleeps a random 0..S seconds more (heavy jitter);
- ``--pause-at STEP --pause-s S``: rank 0 works S seconds in its own code at STEP, unmarked
  (no ``session.phase``: an evaluation or a ``torch.save`` of the user's own), in every run;
  with ``--pause-holds-gil`` that work is one C call that never lets go of the interpreter's
  lock (as a ``json.dumps`` of a huge object does), which silences the Session's alive beat.

``result.json`` also holds the final weights, to compare runs with and without a pause.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from runtime.session import Session

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--step-s", type=float, default=0.1)
p.add_argument("--hang-in-data", type=int, default=None)
p.add_argument("--slow-first-step", type=float, default=0.0)
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--eval-s", type=float, default=0.0)
p.add_argument("--jitter", type=float, default=0.0)
p.add_argument("--diverge-at", type=int, default=None)
p.add_argument("--split-at", type=int, default=None)
p.add_argument("--pause-at", type=int, default=None)
p.add_argument("--pause-s", type=float, default=0.0)
p.add_argument("--pause-holds-gil", action="store_true")
args = p.parse_args()
out = Path(args.out)


class Counter:
    def __init__(self) -> None:
        self.worlds: list[int] = []

    def state_dict(self) -> dict:
        return {"worlds": list(self.worlds)}

    def load_state_dict(self, state: dict) -> None:
        self.worlds = list(state["worlds"])


def load_batch(step: int, rank: int, first_run: bool) -> torch.Tensor:
    if first_run and rank == 1 and step == args.hang_in_data:
        while True:          # a data loader that never returns (a dead NFS mount, a deadlock)
            time.sleep(3600)
    return torch.full((4, 8), float(step % 10) / 10)


def unmarked_evaluation(seconds: float) -> None:
    """Long work in the user's own code, alive and outside any collective."""
    if args.pause_holds_gil:
        # Calibrated on CPU time, not the wall clock: under load the calibration shares a core
        # and a wall-clock rate would make the call as much shorter as the load was high.
        t = time.process_time()
        sum(range(10**7))
        per_item = max(1e-10, (time.process_time() - t) / 10**7)
        sum(range(min(int(seconds / per_item), 4 * 10**9)))   # one C call: the lock is held
        return
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(0.2)


with Session(seed=0, log_every=5) as s:
    first_run = s.restart_count == 0
    # Written whole, then renamed: the tests poll for the name and read it at once.
    (out / f".pid-{s.rank}-{s.restart_count}").write_text(str(os.getpid()))
    os.replace(out / f".pid-{s.rank}-{s.restart_count}", out / f"pid-{s.rank}-{s.restart_count}")
    model = s.wrap(torch.nn.Linear(8, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = Counter()
    second = torch.distributed.new_group() if args.split_at is not None else None
    start = s.restore(model=model, optim=optim, counter=counter)
    rng = random.Random(s.rank)
    for step in s.steps(start, args.steps):
        if first_run and step == start and args.slow_first_step:
            time.sleep(args.slow_first_step)
        x = load_batch(step, s.rank, first_run)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        counter.worlds.append(s.world_size)
        if first_run and step == args.diverge_at and s.rank == 1:
            (out / "diverged").write_text(repr(time.time()))
            s.save()   # its peers do not: they go on into the next step's all-reduce
        if step == args.split_at and s.restart_count == int(args.diverge_at is not None):
            (out / "split").write_text(repr(time.time()))
            torch.distributed.all_reduce(torch.ones(1), group=second if s.rank == 0 else None)
        time.sleep(args.step_s + (rng.uniform(0, args.jitter) if args.jitter else 0.0))
        if step == args.pause_at and s.rank == 0:
            t0 = time.time()
            unmarked_evaluation(args.pause_s)
            (out / "pause_s").write_text(f"{time.time() - t0:.1f}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and s.rank == 0:
            with s.phase("eval"):
                time.sleep(args.eval_s)
        s.log(loss=loss.item())
    if s.is_rank0 and s.stopped is None:
        (s.job_dir / "result.json").write_text(json.dumps(
            {"final_step": s.step, "steps": len(counter.worlds), "worlds": counter.worlds,
             "weights": [p.detach().flatten().tolist() for p in model.parameters()]}))
    s.finish()
print(f"stall probe rank {s.rank} done at step {s.step}", file=sys.stderr, flush=True)
