"""A short fault campaign in CI (benchmarks/campaign.py): ours against what users run today.

Two real preemptions by a higher-priority job, at the same seeded training steps for both
contenders. The baseline is ``benchmarks/baseline/baseline.sbatch`` (``--requeue``, ``torchrun
--nnodes 2:3 --max-restarts 3``, the script's own ``torch.save`` every 10 steps); ours is ``hpc
submit`` with today's restart path. What a user cares about: both finish (the baseline's job,
ended by each preemption, submitted again as its user would; ours requeues itself, unattended),
both end with the weights of an uninterrupted run at the same world size (a preemption keeps
it; every worker of both and of the references runs 1 thread: like for like), and ours loses
no training to a preemption (it saves on the warning) while the baseline computes the steps
since its last save again.

The node-seconds each fault cost are printed, not asserted: which contender costs less per
preemption depends on the machine's load. The baseline loses the steps since its last save,
ours starts heavier (launcher, Session, W&B, DCP restore: ~40 s from allocation to first step
at a 1-min load of 12 on 2 cores, against ~15 s for the plain script). Measured here: at load
~3 ours 41 and 41 node-s, the baseline 54 and 48; at load ~12 ours 144 and 149, the baseline
95 and 88. A test that must pass under any load cannot assert that order; the full campaign
(``benchmarks/RESULTS-campaign.md``) records it with its load.

Why preemptions and not a worker SIGKILL here: the baseline's torchrun restarts on torch 2.13
often fail to reconnect (gloo ``connectFullMesh ... Connection refused``, the bug our launcher
avoids with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and then hang the job: a fact the full
campaign records (``benchmarks/RESULTS-campaign.md``, six kinds of faults over three seeds), too
random for a test that must pass every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import campaign  # noqa: E402


@pytest.mark.timeout(1000)   # two runs of up to 420 s at a load of ~40 (measured: 468 s at ~36)
def test_short_campaign_both_finish_equal_weights_ours_loses_no_steps(slurm_cluster, tmp_path):
    # One thread per worker everywhere (runs and references: like for like), and the baseline
    # with DDP's bucket layout fixed: plain DDP resumed at 3 ranks rounds its first step
    # otherwise than an uninterrupted run, which would hide what this checks: that the
    # baseline resumed at the right step with the right data (the full campaign runs the
    # plain script and records that its weights differ, and why).
    # A fault is seen up to 14 steps after its scheduled step (the progress file's lag) and
    # lands ~1 s later (sbatch, Slurm's preemption): up to ~20 steps at ~7 steps/s. In CI of
    # 32c4e0b, at 30 steps with faults near 10 and 20, the second was seen at step 30 of 30 and
    # found nothing to stop. 80 steps with faults at 25-35 and 45-55 leave 25 steps after the
    # latest for it to land (at 60 steps one was seen at 53), for ~7 s more training a run.
    cfg = campaign.Config(steps=80, save_every=10, step_sleep=0.1, kinds=("preempt", "preempt"),
                          min_gap=20, margin=25, timeout_s=420, threads=1, baseline_fixed_buckets=True)
    env = {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}
    contenders = [campaign.CONTENDERS["baseline"], campaign.CONTENDERS["restart"]]
    out = campaign.run_campaign(contenders, [1], cfg, env, campaign.load_cluster_module(),
                                slurm_cluster.cluster, tmp_path, worlds=(3,), background_references=True)
    assert not out["failed"], out["failed"]
    runs = {r["contender"]: r for r in out["runs"]}
    for name, r in runs.items():
        print(f"{name}: finished {r['finished']} (resubmitted {len(r['resubmitted'])}x), goodput "
              f"{r['goodput']:.3f}, faults {[(f['kind'], f['step'], round(f['lost_node_s'], 1)) for f in r['faults']]}, "
              f"steps twice {r['lost_steps']}, worlds {r['worlds_seen']}, load {r['load_1m']}")
    for name, r in runs.items():
        assert r["finished"], (name, r["final_state"], r["job_dir"])
        assert [f["kind"] for f in r["faults"]] == [k for _, k in r["schedule"]], (name, r["faults"])
        assert all(f["recovered"] for f in r["faults"]), (name, r["faults"])
        assert r["final_world"] == 3 and r["weights_equal"], (name, r["worlds_seen"], r["job_dir"])
    assert runs["baseline"]["threads"] == cfg.threads, runs["baseline"]   # like for like
    # Ours needs nobody; the baseline's preemption ends its job (torchrun exits on the SIGTERM,
    # the batch script with it, inside the grace time: Slurm has nothing left to requeue), and
    # the campaign submits it again as its user would.
    assert runs["restart"]["finished_unattended"] and not runs["restart"]["resubmitted"], runs["restart"]
    # Ours saved on each warning: no step computed twice; the baseline lost its unsaved steps.
    assert runs["restart"]["lost_steps"] == 0, runs["restart"]["faults"]
    assert runs["baseline"]["lost_steps"] > 0, runs["baseline"]["faults"]
