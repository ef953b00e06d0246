"""A char-level GPT trained with DDP (default), FSDP2 (``--fsdp``) or FSDP2 x tensor parallel
(``--tp N``) on hpc-elastic's Session.

Copy this file to start your own job. It needs no download: the text is the Python
standard library's own source code, read as bytes (a 256-symbol vocabulary).

    hpc run examples/train_gpt.py --nproc-per-node 2 -- --preset tiny
    hpc submit examples/train_gpt.py --nodes 2:4 --gpus-per-node 8 --time 4:00:00 -- --preset default
    hpc run examples/train_gpt.py --nproc-per-node 4 -- --preset tiny --tp 2     # FSDP 2 x TP 2

What it shows: a fixed global batch whatever the world size (gradient accumulation adapts,
with ``no_sync`` / FSDP2's ``set_requires_gradient_sync``), gradient clipping, warmup then
cosine LR, optional activation checkpointing, an exactly-once resumable sampler that
reshuffles every epoch, and checkpoints/preemption/W&B handled by the Session. At the end it
writes ``result.json`` in the job directory: final step and loss, a SHA-256 of the final
weights, and a digest of the ordered sample indices consumed, so an interrupted run can be
compared with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpc.contract.parallel import ParallelDims
from runtime.parallel.grads import clip_grad_norm_
from runtime.sampler import ResumableSampler, plan_batches, rank_slice
from runtime.session import Session


# --- model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    vocab_size: int = 256
    dropout: float = 0.0


PRESETS = {
    # name: (model, global batch, micro batch per rank, steps, lr, data bytes)
    "tiny": (GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64), 16, 4, 40, 3e-3, 400_000),
    "small": (GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=128), 32, 8, 500, 1e-3, 4_000_000),
    "default": (GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=256), 64, 16, 5000, 6e-4, 16_000_000),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)      # three layers, not one fused: tensor
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)      # parallel splits each by heads
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        # Under tensor parallel each rank holds some of the heads: -1, not n_head.
        q, k, v = (z.view(b, t, -1, c // self.n_head).transpose(1, 2)
                   for z in (self.q(h), self.k(h), self.v(h)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        # A dict named "0", "1"...: a pipeline stage drops the others' blocks and keeps the
        # names (blocks.3 stays blocks.3), so checkpoints of any number of stages match.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.n_embd)
        self.head: nn.Module | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss (with ``targets``), else the logits; a pipeline stage without the embedding
        takes the previous stage's activations, one without the head returns its own."""
        if self.tok is not None:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        else:
            x = idx
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training:
                from torch.utils.checkpoint import checkpoint
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.ln_f(x)).float()
        return logits if targets is None else loss_fn(logits, targets)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def pipeline_stage(model: GPT, stage: int, stages: int) -> GPT:
    """Stage ``stage`` of ``stages``: its share of the blocks; the first keeps the embeddings,
    the last the final norm and the head."""
    n = len(model.blocks)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} blocks: at most one stage per block")
    mine = range(stage * n // stages, (stage + 1) * n // stages)
    for name in [k for k in model.blocks if int(k) not in mine]:
        del model.blocks[name]
    if stage > 0:
        model.tok = model.pos = None
    if stage < stages - 1:
        model.ln_f = model.head = None
    return model


# Tensor parallel (Megatron's pairing): q, k, v and the MLP's first layer split their outputs
# (heads, hidden units) over the TP ranks, proj and the MLP's last layer their inputs, so each
# block all-reduces twice forward and twice backward. Embeddings, norms and the head stay whole.
TP_PLAN = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
           "blocks.*.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


# --- data --------------------------------------------------------------------------------
def load_text(max_bytes: int) -> torch.Tensor:
    """The standard library's sources, in a fixed order, as a byte tensor (no download)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(lib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Blocks:
    """Sample ``i`` is the ``i``-th non-overlapping window of ``block_size + 1`` bytes."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.data[i * self.block_size: i * self.block_size + self.block_size + 1]
                            for i in indices])
        return rows[:, :-1], rows[:, 1:]


class TrainState:
    """What the loop needs besides model/optimizer: the sample-order digest chain."""

    def __init__(self) -> None:
        self.sample_digest = hashlib.sha256(b"").hexdigest()
        self.loss = float("nan")

    def consume(self, global_indices: list[int]) -> None:
        self.sample_digest = hashlib.sha256(
            (self.sample_digest + ",".join(map(str, global_indices))).encode()).hexdigest()

    def state_dict(self) -> dict:
        return {"sample_digest": self.sample_digest, "loss": self.loss}

    def load_state_dict(self, state: dict) -> None:
        self.sample_digest, self.loss = state["sample_digest"], state["loss"]


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of the whole model's weights, gathered over every rank (a pipeline stage holds
    only its layers; FSDP2 and TP shards are made whole): a collective, call on all ranks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {name: hashlib.sha256(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
            for name, t in sd.items()}
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    every = {name: d for part in parts for name, d in part.items()}
    h = hashlib.sha256()
    for name in sorted(every):
        h.update(name.encode())
        h.update(every[name].encode())
    return h.hexdigest()


# --- main --------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per forward")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of steps)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree (FSDP2 over the rest; default: the job's --tp, else 1)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: the job's --pp, else 1); micro-batches replace "
                        "gradient accumulation")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--log-every", type=int, default=5,
                   help="reduce, log (W&B) and print a progress line every N steps (lines at most "
                        "one a second)")
    p.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fail-once", action="store_true", help=argparse.SUPPRESS)  # restarted workers go on
    p.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg, global_batch, micro, steps, lr, data_bytes = PRESETS[args.preset]
    global_batch = args.global_batch or global_batch
    micro = args.micro_batch or micro
    max_steps = args.max_steps or steps
    lr = args.lr or lr

    parallel = ParallelDims(tp=args.tp or 1, pp=args.pp or 1) if args.tp or args.pp else None
    with Session(seed=args.seed, log_every=args.log_every, parallel=parallel) as s:
        # The ranks of one TP group read the same batch: the data-parallel width counts.
        accum = plan_batches(global_batch, s.dp_size, micro)
        data = Blocks(load_text(data_bytes), cfg.block_size)
        sampler = ResumableSampler(len(data), global_batch=global_batch, seed=args.seed)
        model = GPT(cfg, args.activation_checkpointing)
        blocks = list(model.blocks.values())
        pipe = None
        if s.mesh is not None and s.mesh.mesh.pp > 1:
            pipe = s.pipeline(model, split=pipeline_stage, loss_fn=loss_fn, microbatches=accum,
                              schedule=args.pp_schedule, blocks=blocks, tp_plan=TP_PLAN)
            model = pipe.module
        else:
            model = s.wrap(model, fsdp=args.fsdp, blocks=blocks, tp_plan=TP_PLAN)
        optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(args.warmup or max(1, max_steps // 10), max_steps))
        train = TrainState()
        start = s.restore(model=model, optim=optim, sched=sched, sampler=sampler, train=train)
        if start >= max_steps and (s.job_dir / "result.json").exists():   # a finished job dir run again
            if s.is_rank0:
                print(f"train_gpt: already finished at step {start} (of {max_steps}); "
                      f"{s.job_dir / 'result.json'} is kept", flush=True)
            s.finish()
            return
        if s.is_rank0:
            mesh = f" ({s.mesh.mesh.describe()})" if s.mesh is not None else ""
            print(f"train_gpt: preset {args.preset}, {sum(p.numel() for p in model.parameters())} "
                  f"params/rank, world {s.world_size}{mesh}, global batch {global_batch} = {s.dp_size} "
                  f"x {micro} x {accum} accumulation, {len(data)} samples, start step {start}",
                  flush=True)

        for step in s.steps(start, max_steps):
            if args.fail_at_step is not None and step == args.fail_at_step and s.rank == 0 \
                    and not (args.fail_once and s.restart_count):
                raise RuntimeError(f"injected failure at step {step} (--fail-at-step)")
            # Per step: with --recovery inprocess the world can shrink or grow between steps.
            accum = plan_batches(global_batch, s.dp_size, micro)
            global_indices = sampler.next_global_batch()
            mine = rank_slice(global_indices, s.dp_rank, s.dp_size)
            optim.zero_grad(set_to_none=True)
            total = 0.0
            if pipe is not None:      # every stage reads the batch: the first its inputs, the last its targets
                x, y = data.batch(mine)
                total = pipe.step(x.to(s.device), y.to(s.device)).item()
            for i in range(accum if pipe is None else 0):
                x, y = data.batch(mine[i * micro:(i + 1) * micro])
                sync = i == accum - 1
                ctx = _no_sync(model, sync)
                with ctx:
                    loss = model(x.to(s.device), y.to(s.device)) / accum
                    loss.backward()
                total += loss.item()
            clip_grad_norm_(model.parameters(), 1.0)   # torch's, for parameters on several meshes
            optim.step()
            sched.step()
            train.consume(global_indices)
            train.loss = total
            s.log(loss=total, lr=sched.get_last_lr()[0])
            if args.step_sleep:
                import time
                time.sleep(args.step_sleep)

        digest = weights_digest(model)
        # The last step's loss over the whole global batch (each rank saw only its share): the
        # figure of the last progress line too (the Session reduces each rank's last value).
        # On the training device: a GPU job's group is NCCL, which takes no CPU tensor. A job that
        # stopped after its last checkpoint and before this result comes back here with no step left.
        final_loss = torch.tensor([train.loss], dtype=torch.float64, device=s.device)
        torch.distributed.all_reduce(final_loss)
        train.loss = final_loss.item() / s.world_size
        if s.stopped is None and s.is_rank0:
            result = {"final_step": s.step, "final_loss": train.loss, "weights_sha256": digest,
                      "sample_order_sha256": train.sample_digest, "world_size": s.world_size,
                      "preset": args.preset, "fsdp": args.fsdp, "epoch": sampler.epoch,
                      "mesh": s.mesh.mesh.describe() if s.mesh is not None else None,
                      "cursor": sampler.cursor}
            (s.job_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
            print(f"train_gpt: done at step {s.step}, loss {train.loss:.4f}, weights {digest[:16]}",
                  flush=True)
        s.finish()


def _no_sync(model: nn.Module, sync: bool):
    """No gradient reduction on the micro-batches before the last (DDP, FSDP2; with one
    data-parallel rank under TP there is none to skip)."""
    import contextlib
    if sync or not hasattr(model, "set_requires_gradient_sync") and not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)

        @contextlib.contextmanager
        def restore():
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return restore()
    return model.no_sync()


if __name__ == "__main__":
    main()
