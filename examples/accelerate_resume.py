"""An Accelerate script that survives requeues: ``save_state``/``load_state`` plus a clean stop.

Copy it as a starting point; it runs unchanged under torchrun, `hpc run` and `hpc submit` (not
under `accelerate launch`: hpc's launcher already is the torchrun that Accelerate reads):

    hpc run    examples/accelerate_resume.py --nproc-per-node 2 -- --steps 30
    hpc submit examples/accelerate_resume.py --nodes 2 --nproc-per-node 1 --partition debug -- --steps 30

What it takes from hpc-elastic (docs/own-script.md), all through environment variables:

* ``HPC_CHECKPOINT_DIR``: ``accelerator.save_state`` writes ``step-000012/`` there every
  ``--ckpt-every`` steps, and rank 0 marks a complete one with a ``done`` file;
* ``HPC_RESUMED=1``: load the newest complete state and skip the batches already seen;
* ``HPC_WARNING_SIGNAL``: the warning before a stop; the ranks agree on it at a step boundary,
  save, and the script exits with status 75 ("not done, requeue me"). Exit 0 means done.

Accelerate has no Slurm logic of its own at run time (no signal handlers, no requeue): it
reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` and uses gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

STOPPED_EXIT = 75   # EX_TEMPFAIL: stopped for the warning, the job must go on

warned = bool(os.environ.get("HPC_PENDING_WARNING"))   # warned before the handler existed


def record_warning(signum: int, frame: object) -> None:
    global warned
    warned = True   # only record: the step loop decides, on every rank alike


def latest_complete(ckpt_dir: Path) -> tuple[int, Path] | None:
    """The newest ``step-N/`` that rank 0 marked complete (a save cut short has no mark)."""
    done = [(int(m.group(1)), p) for p in ckpt_dir.glob("step-*")
            if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / "done").exists()]
    return max(done) if done else None


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="", help="rank 0 writes the final weights and loss here (JSON)")
    args = p.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    name = os.environ.get("HPC_WARNING_SIGNAL", "")
    if hasattr(signal, name) and name not in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), record_warning)
    ckpt_dir = Path(os.environ.get("HPC_CHECKPOINT_DIR", "checkpoints"))

    set_seed(0)
    world = accelerator.num_processes
    x = torch.randn(64 * world, 8, generator=torch.Generator().manual_seed(1))
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model, opt, data = accelerator.prepare(model, opt, data)

    step = 0
    found = latest_complete(ckpt_dir) if os.environ.get("HPC_RESUMED") == "1" else None
    if found:
        step, path = found
        accelerator.load_state(str(path))
    accelerator.print(f"accelerate_resume: world {world}, {accelerator.distributed_type}, "
                      f"{'resumed at step %d' % step if found else 'fresh start'}")

    def save(at: int) -> None:
        path = ckpt_dir / f"step-{at:06d}"
        accelerator.save_state(str(path))   # every rank: model, optimizer, its RNG state
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (path / "done").touch()

    per_epoch = len(data)
    loss = torch.zeros(())
    while step < args.steps:
        skip = step % per_epoch
        batches = accelerator.skip_first_batches(data, skip) if skip else data
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)   # stands in for real work (tests preempt it)
            stop = accelerator.reduce(torch.tensor(float(warned)), reduction="sum").item() > 0
            if stop or step % args.ckpt_every == 0:
                save(step)
            if stop:
                accelerator.print(f"accelerate_resume: warning at step {step}: saved, stopping")
                sys.exit(STOPPED_EXIT)
            if step >= args.steps:
                break

    final = accelerator.reduce(loss.detach(), reduction="mean").item()
    accelerator.print(f"accelerate_resume: done {step} steps, loss {final:.6f}")
    if accelerator.is_main_process and args.out:
        weights = [v.flatten().tolist() for v in accelerator.unwrap_model(model).state_dict().values()]
        Path(args.out).write_text(json.dumps({"steps": step, "loss": final, "weights": weights}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
