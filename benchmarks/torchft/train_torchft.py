"""The fault campaign's torchft contender: the example GPT trained with torchft (0.2.0).

What a torchft user writes for data parallelism across replica groups (torchft's own
``train_ddp.py`` example, applied to the campaign's model): one replica group per node (here
one process each, started by ``torchrun`` on every node, ``REPLICA_GROUP_ID`` = the node's index),
a :class:`torchft.Manager` with :class:`torchft.ProcessGroupGloo` talking to the lighthouse that
``benchmarks/torchft/torchft.sbatch`` starts on the allocation's first node, torchft's
:class:`~torchft.DistributedDataParallel` (its gradient hook's failure path mended:
:func:`ddp_class`) and :class:`~torchft.Optimizer` wrappers, and the
state-dict hooks the Manager uses to heal a replica live (a peer sends model, optimizer and LR
schedule over HTTP; no restart of the others). torchft heals between replica groups but a
whole-job requeue (a preemption, the lighthouse's node lost) needs a checkpoint: the
participating replica of rank 0 ``torch.save``s model, optimizer, schedule and the Manager's
state every ``--save-every`` steps (temporary file, renamed), and every replica resumes from it
on start (a restarted replica that is behind its peers is then healed to their step).

The same model, data, global batch, micro batch and LR schedule as
``benchmarks/baseline/train_plain.py`` (the pure pieces of ``examples/train_gpt.py``): each step's
global batch is a function of the step alone, split over the step's participants
(``manager.num_participants()``, ``participating_rank()``), gradient accumulation making up the
rest, so the global batch is 12 at 1, 2 or 3 participants. A replica being healed computes on
rank 0's share (its gradients are zeroed by the Manager) and steps with the averaged gradients
after the transferred state is applied, as torchft intends.

Records: ``OUT/steps.jsonl``, one JSON line per event, the baseline's vocabulary
(``campaign_metrics.plain_events`` builds the same goodput ledger from it): each replica
process writes ``start`` and ``restored`` (with ``replica``); the participating replica of rank 0
writes each committed ``step`` (``world``: the participants), ``save`` and ``end``; a replica
healed by a peer writes ``heal``. ``OUT/result.json`` (final step, SHA-256 of the weights) is
written by the replica that committed the last step. A replica that starts after it exists
exits at once (the training is over).

    torchft_lighthouse --min_replicas 1 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --standalone \\
        --nproc-per-node 1 benchmarks/torchft/train_torchft.py --out /tmp/tft --steps 40
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

T_PROC = time.time()   # this worker process's start (before the imports)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "baseline"))
import train_plain as plain  # noqa: E402  (the same model, data order and records)


def ddp_class():
    """torchft's ``DistributedDataParallel`` with its gradient hook's failure path mended.

    torchft 0.2.0's hook waits on the cross-replica allreduce and returns the future inside
    torchft's managed one; when the wait raises (a peer died mid-allreduce: gloo's "Connection
    closed by peer"), torchft reports the error to the Manager (the step will not commit) but
    never sets that inner future, and the hook's ``assert fut._fut`` crashes the surviving
    replica's worker too (seen on this cluster: a worker SIGKILL on one node took another
    node's worker down with an ``AssertionError`` from ``torchft/ddp.py``; torchrun restarted it
    from the checkpoint). Here the hook returns the bucket as it is instead: the error is already
    reported, ``should_commit`` returns False, and the step is done again by the new quorum, as
    torchft intends. The same hook otherwise.
    """
    from torchft import DistributedDataParallel

    class DDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", fut)   # a torchft managed future, or a plain one after an error
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner
    return DDP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="directory for checkpoint, steps.jsonl, result.json")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=20, help="torch.save every N steps")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="the Manager's min_replica_size: a step commits with at least this many "
                        "replica groups (1: training goes on while any replica group lives)")
    p.add_argument("--timeout-s", type=float, default=30.0,
                   help="the Manager's timeout (allreduce, should_commit, the healing transfer) and "
                        "the gloo process group's")
    p.add_argument("--quorum-timeout-s", type=float, default=60.0,
                   help="how long a quorum request waits at the lighthouse (torchft's default)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "result.json").exists():
        return   # the training is over: a replica restarted after it ended has nothing to do
    from torchft import Manager, Optimizer, ProcessGroupGloo

    ex = plain._example()
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    ids = {"job": os.environ.get("SLURM_JOB_ID", ""), "alloc": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "replica": replica}
    plain.log(out, {"ev": "start", "t": time.time(), "t_proc": T_PROC, "node": os.uname().nodename, **ids})
    cfg, _, _, _, lr, data_bytes = ex.PRESETS["tiny"]
    micro = args.micro_batch
    torch.manual_seed(args.seed)   # every replica starts from the same weights (init_sync=False)
    data = ex.Blocks(ex.load_text(data_bytes), cfg.block_size)
    module = ex.GPT(cfg)
    inner = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(inner, ex.lr_lambda(max(1, args.steps // 10), args.steps))

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])

    ckpt = out / "ckpt.pt"
    t0 = time.time()
    saved = None
    if ckpt.exists():
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        load_state_dict(saved)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    # Built after the restore: the Manager heartbeats to the lighthouse from here on, and a
    # replica that heartbeats but has not asked for a quorum holds the others up to the
    # lighthouse's join timeout.
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.min_replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"train_ddp_{replica}", timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout_s),
                      init_sync=False)   # identical seeds: no transfer at step 0
    if saved is not None:
        manager.load_state_dict(saved["manager"])
    start = manager.current_step()
    plain.log(out, {"ev": "restored", "t0": t0, "t": time.time(), "step": start, **ids})
    model = ddp_class()(manager, module)
    optim = Optimizer(manager, inner)

    last_logger = False
    while manager.current_step() < args.steps:
        if (out / "result.json").exists():
            break   # finished by the others while this replica was out of the quorum
        optim.zero_grad(set_to_none=True)   # starts the quorum (and a heal if this replica is behind)
        n = manager.num_participants()      # waits for the quorum
        rank = manager.participating_rank()
        step = manager.current_step()       # the quorum's step (a healed replica's jumps to it)
        healing = rank is None
        share = plain.batch_indices(step, args.global_batch, len(data), args.seed)[(rank or 0)::max(n, 1)]
        accum = args.global_batch // (max(n, 1) * micro)
        for i in range(accum):
            x, y = data.batch(share[i * micro:(i + 1) * micro])
            ctx = model.no_sync() if i < accum - 1 else plain._null()
            with ctx:
                (model(x, y) / accum).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optim.step()   # should_commit: applies a healing transfer first, steps only if committed
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if manager.current_step() != step + 1:
            continue   # not committed (a peer failed mid-step): the step is done again
        sched.step()
        done = step + 1
        if healing:
            plain.log(out, {"ev": "heal", "t": time.time(), "step": done, **ids})
        last_logger = rank == 0
        if last_logger:
            plain.log(out, {"ev": "step", "t": time.time(), "step": done, "world": n, **ids})
            if done % args.save_every == 0 and done < args.steps:
                s0 = time.time()
                tmp = out / f"ckpt.pt.tmp{replica}"
                torch.save({**state_dict(), "manager": manager.state_dict(), "step": done}, tmp)
                os.replace(tmp, ckpt)
                plain.log(out, {"ev": "save", "t0": s0, "t": time.time(), "step": done, **ids})

    if last_logger and manager.current_step() == args.steps:
        h = hashlib.sha256()
        sd = module.state_dict()
        for name in sorted(sd):
            h.update(name.encode())
            h.update(sd[name].detach().float().contiguous().numpy().tobytes())
        tmp = out / f"result.json.tmp{replica}"
        tmp.write_text(json.dumps(
            {"final_step": args.steps, "weights_sha256": h.hexdigest(), "world_size": manager.num_participants(),
             "threads": torch.get_num_threads(), "min_replicas": args.min_replicas}) + "\n")
        os.replace(tmp, out / "result.json")
        plain.log(out, {"ev": "end", "t": time.time(), "step": args.steps, **ids})
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
