"""A DeepSpeed (ZeRO 2 or 3) script that survives requeues: ``save_checkpoint``/``load_checkpoint``
plus a clean stop on the warning signal.

An ordinary DeepSpeed training script, launched by torchrun rather than the ``deepspeed``
launcher (hpc's launcher is that torchrun); it runs unchanged under torchrun, ``hpc run`` and
``hpc submit``, on CPU with gloo as on GPUs with NCCL:

    hpc run    examples/deepspeed_resume.py --nproc-per-node 2 -- --zero 3 --steps 30
    hpc submit examples/deepspeed_resume.py --nodes 2 --gpus-per-node 8 -- --zero 2

What it takes from hpc-elastic (docs/own-script.md), all through environment variables:

* ``HPC_CHECKPOINT_DIR``: ``engine.save_checkpoint`` writes tag ``step-000012`` there (every
  rank its ZeRO partitions; DeepSpeed's ``latest`` file names the newest complete one);
* ``HPC_RESUMED=1``: ``engine.load_checkpoint`` of the newest, and the step from its client state;
* ``HPC_WARNING_SIGNAL``: the warning before a stop; the handler only records it, the ranks
  agree at a step boundary (one all-reduce), save, and the script exits with status 75 ("not
  done, requeue me"). Exit 0 means done.

On CPU, DeepSpeed's own optimizers (``"optimizer": {"type": "AdamW"}`` in the config) are C++
ops it compiles on first use (a toolchain and ninja; minutes); a torch optimizer passed to
``deepspeed.initialize`` needs none, and ZeRO 2 and 3 partition it all the same (the default;
``--optimizer deepspeed`` takes the config's AdamW: FusedAdam on GPUs, tests/gpu). The data of
step ``k`` is a pure function of ``(k, rank)``, so a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

STOPPED_EXIT = 75   # EX_TEMPFAIL: stopped for the warning, the job must go on

warned = bool(os.environ.get("HPC_PENDING_WARNING"))   # warned before the handler existed


def record_warning(signum: int, frame: object) -> None:
    global warned
    warned = True   # only record: the step loop decides, on every rank alike


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 16, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def weights_digest(engine: deepspeed.DeepSpeedEngine) -> str:
    """SHA-256 of the whole weights (ZeRO 3 gathers its partitions; a collective)."""
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        h = hashlib.sha256()
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--zero", type=int, choices=(2, 3), default=2, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--optimizer", choices=("torch", "deepspeed"), default="torch",
                   help="torch's AdamW passed in (no compile), or DeepSpeed's own AdamW from the "
                        "config (FusedAdam on GPUs, cpu_adam on CPU: C++ ops compiled on first use)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    name = os.environ.get("HPC_WARNING_SIGNAL", "")
    if hasattr(signal, name) and name not in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), record_warning)
    ckpt_dir = Path(os.environ.get("HPC_CHECKPOINT_DIR", "checkpoints"))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.zero}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 1.0, "steps_per_print": 10**9}
    if args.optimizer == "deepspeed":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)

    step = 0
    if os.environ.get("HPC_RESUMED") == "1" and (ckpt_dir / "latest").exists():
        path, client = engine.load_checkpoint(str(ckpt_dir))
        step = int(client["step"]) if path else 0
    if rank == 0:
        print(f"deepspeed_resume: world {world}, ZeRO {args.zero}, "
              f"{'resumed at step %d' % step if step else 'fresh start'}", flush=True)

    loss = torch.zeros(())
    while step < args.steps:
        x, y = batch(step, rank, args.batch)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)   # stands in for real work (tests stop it)
        flag = torch.tensor([float(warned)], device=engine.device)
        dist.all_reduce(flag)             # every rank decides alike: a save is a collective
        stop = flag.item() > 0 and step < args.steps
        if stop or step % args.ckpt_every == 0 or step == args.steps:
            engine.save_checkpoint(str(ckpt_dir), tag=f"step-{step:06d}", client_state={"step": step})
        if stop:
            if rank == 0:
                print(f"deepspeed_resume: warning at step {step}: saved, stopping", flush=True)
            sys.exit(STOPPED_EXIT)

    final = loss.detach().clone()
    dist.all_reduce(final)
    digest = weights_digest(engine)
    if rank == 0:
        result = {"steps": step, "loss": final.item() / world, "weights_sha256": digest,
                  "zero": args.zero, "world_size": world, "optimizer": type(engine.basic_optimizer).__name__}
        job_dir = Path(os.environ.get("HPC_JOB_DIR", "."))
        (job_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"deepspeed_resume: done {step} steps, loss {result['loss']:.6f}, weights {digest[:16]}",
              flush=True)


if __name__ == "__main__":
    main()
