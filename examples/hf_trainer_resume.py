"""A Hugging Face Trainer script that survives requeues: two lines from hpc-elastic.

Copy it as a starting point; it runs unchanged under torchrun, `hpc run` and `hpc submit`:

    hpc run    examples/hf_trainer_resume.py --nproc-per-node 2 -- --steps 40
    hpc submit examples/hf_trainer_resume.py --nodes 2 --nproc-per-node 1 --partition debug -- --steps 40

It is an ordinary Trainer script (a 2-layer GPT-2 built from its config, a small in-memory
dataset, no downloads); what hpc-elastic adds are the two lines marked ``# hpc``
(docs/own-script.md, "Hugging Face Trainer"):

* ``callbacks=[HPCCallback()]``: on the job's warning signal the ranks agree at a step end,
  the Trainer saves ``checkpoint-N`` and stops, and the script exits with status 75 ("not
  done, requeue me"). Without it the warning is ignored and the work since the last
  ``save_steps`` checkpoint is lost at the SIGTERM.
* ``resume_from_checkpoint=last_checkpoint(output_dir)``: the newest *complete* checkpoint
  (None on a fresh start); transformers' own ``get_last_checkpoint`` would also pick one that
  a SIGTERM cut short.

``output_dir`` defaults to ``HPC_CHECKPOINT_DIR`` (it survives requeues). ``--wandb`` sets
``report_to="wandb"``: the Trainer's own ``wandb.init`` (no id) continues the job's one W&B
run through hpc's ``WANDB_RUN_ID``/``WANDB_RESUME``; its x-axis is ``train/global_step``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from runtime.integrations.hf import HPCCallback, last_checkpoint   # hpc

VOCAB, CONTEXT = 64, 32


class Tokens(torch.utils.data.Dataset):
    """Character-level windows over a text that ships with Python (argparse's docstring)."""

    def __init__(self, n: int) -> None:
        import argparse

        text = argparse.__doc__ or ""
        ids = torch.tensor([ord(c) % VOCAB for c in text])
        starts = torch.randint(0, len(ids) - CONTEXT, (n,), generator=torch.Generator().manual_seed(1))
        self.windows = [ids[s:s + CONTEXT] for s in starts.tolist()]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class SlowSteps(TrainerCallback):
    """Stands in for real work (tests preempt the job mid-run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, *args: object, **kwargs: object) -> None:
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--output-dir", default=os.environ.get("HPC_CHECKPOINT_DIR", "hf-output"))
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="", help="rank 0 writes the final weights and loss here (JSON)")
    p.add_argument("--wandb", action="store_true", help="report to W&B: one run for the whole job")
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=3e-3, save_steps=args.save_steps, save_total_limit=2, logging_steps=1,
        report_to=["wandb"] if args.wandb else [], run_name="hf_trainer_resume", use_cpu=True,
        seed=0, disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False)
    callbacks: list[TrainerCallback] = [HPCCallback()]                  # hpc
    if args.step_sleep:
        callbacks.append(SlowSteps(args.step_sleep))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(args.steps * args.batch * world),
                      callbacks=callbacks)
    resume = last_checkpoint(args.output_dir)                            # hpc
    if trainer.is_world_process_zero():
        print(f"hf_trainer_resume: world {world}, "
              f"{'resuming from ' + resume if resume else 'fresh start'}", flush=True)
    result = trainer.train(resume_from_checkpoint=resume)

    if trainer.is_world_process_zero():
        print(f"hf_trainer_resume: done {trainer.state.global_step} steps, loss "
              f"{result.training_loss:.6f}", flush=True)
        if args.out:
            weights = [v.flatten().tolist() for v in trainer.model.state_dict().values()]
            with open(args.out, "w") as f:
                json.dump({"steps": trainer.state.global_step, "weights": weights}, f)


if __name__ == "__main__":
    main()
