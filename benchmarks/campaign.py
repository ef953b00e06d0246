"""The fault campaign: one seeded schedule of real faults, the same job, baseline vs hpc-elastic.

On the repo's 3-node Slurm test cluster (root; brought up if needed, held with the cluster lock
for the whole campaign), each contender trains the same model (the example GPT, tiny preset,
global batch 24, 1 process per node, ``--nodes 2:3``: all 3 nodes while they are healthy) for the
same steps, saving every ``--save-every`` steps, and meets the same faults at the same training
steps (:func:`campaign_metrics.schedule`, one per seed):

- ``preempt``: a real preemption: a higher-priority job (partition ``high``, ``--exclusive``) on
  the job's nodes; Slurm signals, requeues it, and gives the nodes back after 4 s;
- ``worker_kill``: SIGKILL of one worker process (not on the rendezvous host);
- ``node_crash``: every process of a node killed (not the rendezvous host); its slurmd is started
  again once Slurm has marked it down (a repaired node);
- ``link_cut``: a node's link taken down (its processes live on); healed once Slurm noticed;
- ``freeze``: SIGSTOP of one worker (nothing exits, nothing is closed);
- ``rdzv_loss``: the node hosting the rendezvous store crashes (repaired as a crash).

Contenders: ``baseline``, what users run today (``benchmarks/baseline/baseline.sbatch``:
``--requeue``, ``torchrun --nnodes 2:3 --max-restarts 3``, c10d, the script's own ``torch.save``
and resume); ``restart``, ``hpc submit`` with today's restart path; ``inprocess``, ``spare`` and
``inprocess_spare`` (both flags) when their flags exist in ``hpc submit --help`` (else recorded
as not landed); ``torchft``, torchft 0.2.0 where it is installed
(``benchmarks/torchft/torchft.sbatch``: a lighthouse on the first node, one replica group per
node healed live by its peers, ``--no-kill``, ``--requeue`` and its own ``torch.save``).

Per run: the goodput ledger (``hpc report``'s for ours; for the baseline the same ledger built
from its step records and Slurm's accounting, :func:`campaign_metrics.plain_events`), the
node-seconds each fault cost (allocated from the fault until the job was back at the step it
had reached), steps computed twice, whether it finished, whether its final weights equal an
uninterrupted run of the same script at the same world size (run locally first), and the
machine's load. Printed as ratios to the baseline with the spread over seeds.

    python benchmarks/campaign.py --seeds 1 2 3 --json benchmarks/campaign.json \\
        --md benchmarks/RESULTS-campaign.md --png-dir docs

One seed per invocation (``--keep`` the same folder: its uninterrupted references are made
once), then ``--merge seed1.json seed2.json ... --json campaign.json``.

The rooms: this module runs the campaign (the schedule, one run, the records);
``campaign_contenders`` says how each contender is submitted and read, ``campaign_faults``
injects the faults and repairs the nodes, ``campaign_metrics`` is the pure arithmetic.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import campaign_metrics as cm  # noqa: E402
from campaign_contenders import CONTENDERS, Config, Contender, Ours, TorchFT, accounting_runs  # noqa: E402
from campaign_faults import Injector  # noqa: E402

CLUSTER_LOCK = Path("/run/hpc-test-cluster.lock")


def load_cluster_module():
    """tests/cluster/slurm_cluster.py (a script, loaded by path)."""
    name = "hpc_test_slurm_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests/cluster/slurm_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- one run


ENDED = ("GONE", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def squeue_state(env: dict[str, str], job_id: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True)
    if r.returncode and "Invalid job id" not in r.stderr:
        return "UNKNOWN"
    return r.stdout.strip() or "GONE"


def run_one(contender: Contender, seed: int, cfg: Config, env: dict[str, str], sc, cluster,
            root: Path) -> tuple[dict[str, Any], Any]:
    """One contender through one seed's schedule; returns the run's record."""
    plan = cm.schedule(seed, cfg.steps, cfg.kinds, min_gap=cfg.min_gap, margin=cfg.margin)
    job = root / f"{contender.name}-seed{seed}"
    inj = Injector(sc, cluster, env, random.Random(seed))
    t_submit = time.time()
    job_id = contender.submit(env, job, cfg)
    job_ids, resubmitted = [job_id], []
    trace: list[tuple[float, int, int, Any]] = []
    faults: list[dict[str, Any]] = []
    loads: list[float] = []
    pending = list(plan)
    state, last_load = "", 0.0
    while time.time() < t_submit + cfg.timeout_s:
        p = contender.progress(job)
        if p and (not trace or (p[0], p[3]) != (trace[-1][1], trace[-1][3])):
            trace.append((p[2], p[0], p[1], p[3]))
        state = squeue_state(env, job_id)
        if pending and p and p[0] >= pending[0][0] and state == "RUNNING":
            step, kind = pending.pop(0)
            t = time.time()
            what = inj.inject(kind, contender, job, job_id)
            faults.append({"kind": kind, "t": t, "step": p[0], "scheduled_step": step, "target": what})
            print(f"  [{contender.name} seed {seed}] {t - t_submit:6.1f} s step {p[0]}: {kind} ({what})",
                  flush=True)
        if state in ENDED:
            if contender.resubmits and contender.result(job) is None and len(resubmitted) < 3:
                resubmitted.append({"t": time.time(), "state": state, "step": p[0] if p else 0})
                job_id = contender.submit(env, job, cfg)
                job_ids.append(job_id)
                print(f"  [{contender.name} seed {seed}] {time.time() - t_submit:6.1f} s: ended {state} "
                      f"unfinished; submitted again as job {job_id}", flush=True)
                continue
            break
        if time.time() - last_load > 5:
            loads.append(os.getloadavg()[0])
            last_load = time.time()
        time.sleep(0.2)
    timed_out = state not in ENDED
    t_end = time.time()
    if timed_out:
        subprocess.run(["scancel", job_id], env=env)
    for t in inj.repairs:
        t.join(timeout=150)
    time.sleep(2)
    result = contender.result(job)
    ledger = contender.ledger(job, job_ids)
    end_alloc = max((a.end for a in ledger.allocations), default=t_end)
    recoveries = contender.recoveries(job)
    costs = cm.fault_costs(faults, [(t, s, g) for t, s, _, g in trace], ledger.allocations, end_alloc,
                           recoveries, cfg.steps)
    worlds = sorted({w for _, _, w, _ in trace})
    finished = bool(result) and int(result.get("final_step", -1)) == cfg.steps and not timed_out
    world = int(result["world_size"]) if result else 0
    record = {
        "contender": contender.name, "seed": seed, "job_ids": job_ids, "job_dir": str(job),
        "resubmitted": resubmitted, "finished_unattended": finished and not resubmitted,
        "schedule": plan, "faults": costs, "faults_not_reached": pending, "finished": finished,
        "timed_out": timed_out, "final_state": state, "wall_s": t_end - t_submit,
        "goodput": ledger.goodput, "allocated_node_s": ledger.allocated_node_s,
        "categories": ledger.categories, "lost_steps": ledger.lost_steps,
        "allocations": len(ledger.allocations), "worlds_seen": worlds, "final_world": world,
        "weights_sha256": (result or {}).get("weights_sha256"), "load_1m": cm.spread(loads),
        "threads": (result or {}).get("threads"),
        "repairs": inj.log, "trace": trace, "inproc_recoveries": recoveries, "steps": cfg.steps,
    }
    record = cm.with_trace_steps_twice(record)   # a crashed host's last events are lost
    print(f"  [{contender.name} seed {seed}] done in {record['wall_s']:.0f} s: finished {finished}, "
          f"goodput {ledger.goodput * 100:.1f}%, allocated {ledger.allocated_node_s:.0f} node-s, "
          f"lost per fault {[round(f['lost_node_s']) for f in costs]}, steps twice {record['lost_steps']}, "
          f"worlds {worlds}", flush=True)
    return record, ledger


def run_campaign(contenders: list[Contender], seeds: list[int], cfg: Config, env: dict[str, str],
                 sc, cluster, root: Path, png_dir: Path | None = None,
                 worlds: tuple[int, ...] = (2, 3), background_references: bool = False,
                 partial: Path | None = None) -> dict[str, Any]:
    """References first (local, uninterrupted, at each world size in ``worlds``; or beside the
    runs, ``background_references``: quicker, but they load the machine the runs measure), then
    seed by seed every contender in turn."""
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]   # sacct, for the ledgers (SlurmClient reads os.environ)
    references: dict[tuple[str, int], str] = {}
    t0 = time.time()

    def make_references() -> None:
        done: dict[tuple[str, int], str] = {}   # one per script and world size
        for c in contenders:
            for world in worlds:
                script = c.numerics()
                out = root / f"ref-{c.name}-w{world}"
                if (script, world) not in done and (out / "result.json").exists():
                    # Made by an earlier invocation with the same --keep (one seed per
                    # invocation): the same script, steps and threads give the same digest.
                    done[(script, world)] = json.loads((out / "result.json").read_text())["weights_sha256"]
                if (script, world) not in done:
                    done[(script, world)] = c.reference(world, cfg, out)
                references[(c.name, world)] = done[(script, world)]
        print(f"references (local, uninterrupted): {time.time() - t0:.0f} s", flush=True)
    maker = threading.Thread(target=make_references, daemon=True)
    maker.start()
    if not background_references:
        maker.join()
    runs, pictures, failed = [], {}, []
    load_before = os.getloadavg()
    for seed in seeds:
        for c in contenders:
            sc.restore(cluster)
            try:
                record, ledger = run_one(c, seed, cfg, env, sc, cluster, root)
            except Exception as e:   # one broken run must not lose the others (recorded)
                print(f"  [{c.name} seed {seed}] run failed: {e!r}", flush=True)
                failed.append({"contender": c.name, "seed": seed, "error": repr(e)})
                continue
            runs.append(record)
            if partial is not None:
                partial.write_text(json.dumps({"runs": runs, "failed": failed}, default=str) + "\n")
            if png_dir is not None and seed == seeds[0]:
                from hpc.report import plot
                pictures[c.name] = str(plot.render_png(
                    ledger, png_dir / f"campaign-{c.name}.png",
                    title=f"{c.name}, seed {seed}, {len(record['faults'])} faults"))
    sc.restore(cluster)
    maker.join()
    for r in runs:
        try:
            slurm_frame(r)   # a hung tail is in Slurm's frame only
        except Exception as e:   # noqa: BLE001 - the ledger's frame stays; said in the record
            r["slurm_frame_error"] = repr(e)
        ref = references.get((r["contender"], r["final_world"]))
        r["weights_equal"] = bool(ref and r.pop("weights_sha256", None) == ref)
        r["reference_world_available"] = ref is not None
    summary = cm.summarize(runs)
    return {"config": asdict(cfg), "seeds": seeds, "contenders": summary, "runs": runs, "failed": failed,
            "pictures": pictures, "references": {f"{k[0]}-w{k[1]}": v for k, v in references.items()},
            "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
                        "campaign_s": time.time() - t0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--contenders", nargs="+", default=["baseline", "restart", "inprocess", "spare"],
                   help=f"of {', '.join(CONTENDERS)}; ones whose flag has not landed are skipped")
    p.add_argument("--faults", default=",".join(cm.KINDS), help="comma-separated kinds")
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--save-every", type=int, default=Config.save_every)
    p.add_argument("--step-sleep", type=float, default=Config.step_sleep)
    p.add_argument("--min-gap", type=int, default=Config.min_gap)
    p.add_argument("--margin", type=int, default=Config.margin)
    p.add_argument("--timeout-s", type=float, default=Config.timeout_s, help="per run")
    p.add_argument("--threads", type=int, default=Config.threads,
                   help="OMP_NUM_THREADS of every worker, runs and references alike")
    p.add_argument("--baseline-fixed-buckets", action="store_true",
                   help="the baseline fixes DDP's bucket layout (train_plain.py --fixed-buckets)")
    p.add_argument("--background-references", action="store_true",
                   help="make the uninterrupted references beside the runs (quicker; they load the "
                        "machine the runs measure)")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="", help="write the results table here")
    p.add_argument("--png-dir", default="", help="draw the first seed's ledger of each contender here")
    p.add_argument("--keep", default="", help="keep job directories here (default: a temporary one)")
    p.add_argument("--from-partial", default="", metavar="PATH",
                   help="summarize a campaign cut short from its JSON.partial record (--keep: its "
                        "job directories, where the uninterrupted references are)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="join records of earlier invocations (e.g. one seed each, the cluster "
                        "free between them) into one (--json, --md); runs nothing")
    args = p.parse_args()
    if args.merge:
        write(cm.merge([json.loads(Path(m).read_text()) for m in args.merge]), args.json, args.md)
        return
    if args.from_partial:
        out = from_partial(Path(args.from_partial), Path(args.keep))
        write(out, args.json, args.md)
        return
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; valid: {', '.join(CONTENDERS)}")
    contenders, skipped = [], {}
    for name in args.contenders:
        c = CONTENDERS[name]
        if isinstance(c, TorchFT) and not c.installed():
            skipped[name] = "torchft is not installed in this interpreter (benchmarks/torchft/install.sh)"
            print(f"skipping {name}: {skipped[name]}")
            continue
        if isinstance(c, Ours) and not c.landed():
            skipped[name] = f"`hpc submit` has no {c.flag} yet (not landed)"
            print(f"skipping {name}: {skipped[name]}")
            continue
        contenders.append(c)
    cfg = Config(steps=args.steps, save_every=args.save_every, step_sleep=args.step_sleep,
                 kinds=tuple(args.faults.split(",")), min_gap=args.min_gap, margin=args.margin,
                 timeout_s=args.timeout_s, threads=args.threads,
                 baseline_fixed_buckets=args.baseline_fixed_buckets)
    sc = load_cluster_module()
    cluster = sc.Cluster(Path(os.environ.get("HPC_TEST_CLUSTER_DIR", str(sc.DEFAULT_STATE_DIR))), 3)
    with open(CLUSTER_LOCK, "a") as lock:
        print("waiting for the cluster lock ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        sc.up(cluster)
        with tempfile.TemporaryDirectory(prefix="hpc-campaign-") as tmp:
            root = Path(args.keep or tmp)
            env = {**cluster.env, "HPC_HOME": str(root / "hpc-home"), "WANDB_MODE": "offline"}
            out = run_campaign(contenders, args.seeds, cfg, env, sc, cluster, root,
                               Path(args.png_dir) if args.png_dir else None,
                               background_references=args.background_references,
                               partial=Path(args.json + ".partial") if args.json else None)
    out["skipped"] = skipped
    write(out, args.json, args.md)


def write(out: dict[str, Any], json_path: str, md_path: str) -> None:
    """Prints the tables; writes the JSON record and the markdown tables where asked."""
    table = cm.markdown(out["contenders"]) + "\nEvery run:\n\n" + cm.runs_markdown(out["runs"])
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if md_path:
        Path(md_path).write_text(table)


def slurm_frame(record: dict[str, Any]) -> None:
    """Each fault's cost on Slurm's frame of the run too (sacct: every allocation's start and each
    node's end): the ledger ends an allocation whose launchers wrote no end (a job cancelled while
    hung) at its last event, so it leaves out a hang's node-time; Slurm does not."""
    from types import SimpleNamespace
    allocs, ends = [], []
    record["slurm_runs"] = []   # what sacct said, kept with the record (the frames are checked by it)
    for job_id in record.get("job_ids") or [record.get("job_id")]:
        for run in accounting_runs(str(job_id)).values():
            record["slurm_runs"].append({"job_id": str(job_id), **run})
            if run.get("start") is None or run.get("end") is None:
                continue
            ends.append(run["end"])
            allocs.append(SimpleNamespace(start=run["start"], node_ends={
                n: (t if t is not None else run["end"]) for n, t in (run.get("node_ends") or {}).items()}))
    if not allocs:
        return
    trace = [(t, s, tuple(g) if isinstance(g, list) else g) for t, s, _, g in record["trace"]]
    faults = [{k: f[k] for k in ("kind", "t", "step", "scheduled_step", "target")} for f in record["faults"]]
    record["faults_ledger_frame"] = record["faults"]
    slurm = cm.fault_costs(faults, trace, allocs, max(ends),
                           [tuple(r) for r in record.get("inproc_recoveries") or ()], record.get("steps"))
    # Each frame can only miss node-time (the ledger a hang's tail, sacct an allocation of a
    # requeued job it did not list: seen): a fault costs the larger of the two.
    for f, led in zip(slurm, record["faults_ledger_frame"]):
        f["lost_node_s_slurm"], f["lost_node_s_ledger"] = f["lost_node_s"], led["lost_node_s"]
        f["lost_node_s"] = max(f["lost_node_s"], led["lost_node_s"])
        f["recovered"] = led["recovered"] and f["recovered"]
    record["faults"] = slurm
    record["allocated_node_s_slurm"] = cm.node_seconds(allocs, min(a.start for a in allocs), max(ends))
    # The goodput on the larger frame too: a hung tail is allocated time the ledger never saw.
    if record["allocated_node_s_slurm"] > record.get("allocated_node_s", 0) > 0:
        record["goodput_ledger"] = record["goodput"]
        record["goodput"] = record["goodput"] * record["allocated_node_s"] / record["allocated_node_s_slurm"]


def from_partial(path: Path, root: Path) -> dict[str, Any]:
    """The record of a campaign cut short: its finished runs, the weights compared with the
    references it had made (``root/ref-NAME-wW/result.json``)."""
    data = json.loads(path.read_text())
    refs: dict[tuple[str, int], str] = {}
    for res in root.glob("ref-*-w*/result.json"):
        name, world = res.parent.name[len("ref-"):].rsplit("-w", 1)
        refs[(name, int(world))] = json.loads(res.read_text())["weights_sha256"]
    for (name, world), digest in list(refs.items()):   # shared by contenders of the same numerics
        if name in CONTENDERS:
            for other, c in CONTENDERS.items():
                if c.numerics() == CONTENDERS[name].numerics():
                    refs.setdefault((other, world), digest)
    runs = data["runs"]
    for r in runs:
        slurm_frame(r)
        ref = refs.get((r["contender"], r["final_world"]))
        r["weights_equal"] = bool(ref and r.pop("weights_sha256", None) == ref)
        r["reference_world_available"] = ref is not None
    seeds = sorted({int(r["seed"]) for r in runs})
    return {"seeds": seeds, "contenders": cm.summarize(runs), "runs": runs,
            "failed": data.get("failed", []), "cut_short": True,
            "references": {f"{k[0]}-w{k[1]}": v for k, v in refs.items()}}


if __name__ == "__main__":
    main()
