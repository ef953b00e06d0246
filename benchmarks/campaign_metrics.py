"""The fault campaign's pure half: the schedule, the baseline's ledger, the per-fault cost, the table.

Why pure and apart from ``campaign.py``: the numbers the campaign reports (goodput, node-seconds
lost per fault, steps computed twice, ratios to the baseline with their spread) must come from
one definition, the same for every contender, and be unit tested on recorded inputs
(``tests/unit/test_campaign_metrics.py``); the orchestrator only runs processes and records.

- :func:`schedule`: one seeded list of (step, fault kind), the same for every contender. Faults
  fire at training steps, not wall times: a contender slower to recover meets the next fault
  after the same amount of training, so the schedules stay comparable.
- :func:`plain_events`: the baseline script's own step records (``steps.jsonl``) and Slurm's
  allocations, written in the event vocabulary of :mod:`hpc.contract.events`, so that
  :func:`hpc.contract.ledger.build` (the ledger ``hpc report`` draws) applies to it unchanged;
  :func:`torchft_records` puts the torchft contender's records in the same shape and
  :func:`torchft_recoveries` finds its recoveries in place (a change of the participants).
- :func:`fault_costs`: the node-seconds a fault cost: every node-second allocated from the fault
  until the job completes a step beyond the last one it had done (detection, restart, start-up,
  restore, the lost steps computed again, and one step). Queue waits allocate no node and count
  nothing.
- :func:`summarize` / :func:`markdown`: per contender, over seeds, and as ratios to the baseline.
- :func:`merge`: campaign records of one seed each (one invocation per seed, so that the shared
  cluster is free between seeds) joined into one record, summarized over all their runs.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KINDS = ("preempt", "worker_kill", "node_crash", "link_cut", "freeze", "rdzv_loss")
LABELS = {"preempt": "preemption (higher-priority job)", "worker_kill": "worker SIGKILL",
          "node_crash": "node crash", "link_cut": "link cut", "freeze": "worker frozen (SIGSTOP)",
          "rdzv_loss": "rendezvous host crash"}


def schedule(seed: int, steps: int, kinds: Sequence[str] = KINDS, *, min_gap: int = 30,
             margin: int = 15) -> list[tuple[int, str]]:
    """Seeded fault steps and kinds: ``len(kinds)`` faults in ``[margin, steps - margin]``, at
    least ``min_gap`` steps apart, the kinds in a seeded order.

    Raises:
        ValueError: if the faults cannot fit (name the numbers).
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}; valid: {', '.join(KINDS)}")
    room = steps - 2 * margin - (len(kinds) - 1) * min_gap
    if room < 0:
        raise ValueError(f"{len(kinds)} faults {min_gap} steps apart do not fit in {steps} steps "
                         f"(with {margin} steps at each end); need at least "
                         f"{2 * margin + (len(kinds) - 1) * min_gap} steps")
    rng = random.Random(seed)
    # Spread the slack over the len(kinds)+1 gaps: sorted uniform cut points.
    cuts = sorted(rng.randint(0, room) for _ in kinds)
    order = list(kinds)
    rng.shuffle(order)
    return [(margin + c + i * min_gap, k) for i, (c, k) in enumerate(zip(cuts, order))]


def nodes_up(nodes: Sequence[str], states: Mapping[str, str], repairing: Iterable[str]) -> list[str]:
    """The job's nodes that are up: those a scheduled fault may hit.

    A node crashed or cut off by an earlier fault and not yet repaired, or one Slurm marks down,
    failed, drained or not responding, is left out. A preemption's high-priority job that asks
    for such a node preempts the job and then waits for it, and the requeued job may take the
    nodes back first, so the one scheduled preemption would end two of its allocations (campaign
    seed 1, session 11: a second SIGUSR2 40 s into the next allocation). A worker kill or a
    freeze on a node cut off would hit processes the job has already lost, and a second crash of
    a crashed node would be no fault at all. With no node up, all of them (a preemptor then
    waits, as it would on a real cluster).
    """
    away = set(repairing)

    def up(state: str) -> bool:   # sinfo's short state: "down*", "mix*" (* = not responding), "drain", ...
        return "*" not in state and not state.startswith(("down", "fail", "drain"))

    return [n for n in nodes if n not in away and up(states.get(n, ""))] or list(nodes)


def fault_targets(kind: str, nodes: Sequence[str], host: str, up: Iterable[str]) -> list[str]:
    """The nodes a fault of ``kind`` may hit, in the order it tries them (pure).

    ``nodes`` are the job's (``squeue``), ``host`` the rendezvous host's, ``up`` what
    :func:`nodes_up` left of them. A rendezvous-host loss hits the host, whatever its state. A
    worker kill or freeze tries the nodes up other than the host first, then the host; a node
    crash or cut link hits one of the nodes up other than the host. A node down is tried only
    when no node of the kind is up (the fault then hits what is left, as before this rule).
    """
    if kind == "rdzv_loss":
        return [host]
    live = set(up)
    others = sorted(n for n in nodes if n != host)
    live_others = [n for n in others if n in live]
    if kind in ("worker_kill", "freeze"):
        return (live_others + ([host] if host in live else [])) or others + [host]
    return live_others or others or [host]


def plain_events(records: Iterable[Mapping[str, Any]], runs: Mapping[int, Mapping[str, Any]]
                 ) -> list[dict[str, Any]]:
    """The baseline's step records and Slurm's runs as ledger events (pure).

    Args:
        records: ``steps.jsonl`` of ``benchmarks/baseline/train_plain.py`` (rank 0): ``start``
            (``t_proc``), ``restored`` (``t0``, ``step``), ``step``, ``save`` (``t0``), ``end``;
            each with ``alloc`` (Slurm's restart count) and ``restart`` (torchrun's).
        runs: Slurm's allocations of the job (:func:`hpc.report.load.runs_from_accounting`, with
            ``nodes``: the allocation's node names), in order; with ``job_id`` and ``restart``
            (Slurm's restart count) when the job was submitted more than once.

    The frame (each node from Slurm's start to its end) stands in for our launchers' records; a
    worker group that ends without ``end`` vanished (the ledger paints its tail lost).
    """
    out: list[dict[str, Any]] = []
    # A record's allocation: (Slurm job id, its restart count) -> the run's index; a job that
    # was submitted again (a person resubmitting a failed job) continues the numbering.
    index = {(str(run.get("job_id", "")), int(run.get("restart", k))): k for k, run in runs.items()}

    def alloc_of(r: Mapping[str, Any]) -> int:
        key = (str(r.get("job", "")), int(r.get("alloc", 0)))
        return index.get(key, int(r.get("alloc", 0)))

    for k, run in sorted(runs.items()):
        if run.get("start") is None:
            continue
        end = run.get("end")
        for node in run.get("nodes", ()):
            out.append({"t": float(run["start"]), "ev": "alloc_start", "alloc": k, "node": node})
            n_end = (run.get("node_ends") or {}).get(node) or end
            if n_end is not None:
                out.append({"t": float(n_end), "ev": "alloc_end", "alloc": k, "node": node, "kind": ""})
    prev_t: float | None = None
    for r in records:
        base = {"alloc": alloc_of(r), "restart": int(r.get("restart", 0)), "rank": 0,
                "node": r.get("node", "")}
        ev = r.get("ev")
        if ev == "start":
            out.append({**base, "t": float(r["t"]), "ev": "session_start", "t_proc": r.get("t_proc")})
            prev_t = None
        elif ev == "restored":
            out.append({**base, "t": float(r["t0"]), "ev": "restore_begin"})
            out.append({**base, "t": float(r["t"]), "ev": "restore_end", "step": int(r["step"])})
            out.append({**base, "t": float(r["t"]), "ev": "loop_start", "step": int(r["step"])})
            prev_t = float(r["t"])
        elif ev == "step":
            t = float(r["t"])
            out.append({**base, "t": t, "ev": "steps", "first": int(r["step"]), "last": int(r["step"]),
                        "count": 1, "t0": prev_t if prev_t is not None else t})
            prev_t = t
        elif ev == "save":
            out.append({**base, "t": float(r["t"]), "ev": "ckpt_save", "step": int(r["step"]),
                        "block_s": float(r["t"]) - float(r["t0"])})
        elif ev == "end":
            out.append({**base, "t": float(r["t"]), "ev": "session_end", "ok": True})
    out.sort(key=lambda e: e["t"])
    return out


def torchft_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The torchft trainer's records (``benchmarks/torchft/train_torchft.py``) in the baseline's
    shape, for :func:`plain_events` (pure).

    Every replica process writes ``start`` and ``restored``; a replica restarted by its node's
    torchrun (a worker killed) writes them again mid-allocation and is then healed live by a
    peer (``heal``) while the others train on. The ledger's worker group is one per allocation:
    its first ``start`` and first ``restored``; the ``step``/``save``/``end`` lines (written by the
    step's participating rank 0, whichever replica that is); ``restart`` is 0 (no whole-group
    restart inside an allocation: torchrun restarts one replica group, not the job).
    """
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str, int]] = set()
    for r in records:
        ev = r.get("ev")
        if ev in ("start", "restored"):
            key = (str(ev), str(r.get("job", "")), int(r.get("alloc", 0)))
            if key in seen:
                continue
            seen.add(key)
        elif ev not in ("step", "save", "end"):
            continue
        out.append({**r, "restart": 0})
    return out


def torchft_recoveries(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """The torchft trainer's recoveries in place, for :func:`back_at` (pure): one at each change
    of the participants (``world`` of its ``step`` records, within one allocation): a replica
    group dropped from, or healed into, the quorum. Each is (just before the first step of the
    new participants, the last step of the old ones): :func:`back_at` then finds the job back at
    that first step.

    Why: torchft recovers without a new worker group. Taken from the fault's step alone, a
    fault that lands while a step is in flight (the survivors finish it at full strength, then
    stall until the quorum re-forms) looked back at that step (a node crash cost 0.25 node-s in
    the first cluster run, the 5-s stall after it missed), and a fault followed later by a
    requeue (a new group) was charged until the requeue's first step (campaign seed 3: a node
    crash at step 7, back at step 8 after 7.6 s, charged 38.8 s until the rendezvous host's
    crash at step 16 had been recovered from).
    """
    out: list[tuple[float, int]] = []
    prev: Mapping[str, Any] | None = None
    for r in records:
        if r.get("ev") != "step":
            continue
        if (prev is not None and (prev.get("job"), prev.get("alloc")) == (r.get("job"), r.get("alloc"))
                and int(prev["world"]) != int(r["world"])):
            out.append((float(r["t"]) - 1e-6, int(prev["step"])))
        prev = r
    return out


def back_at(trace: Sequence[tuple[float, int, Any]], t_fault: float,
            recoveries: Sequence[tuple[float, int]] = (), last_step: int | None = None) -> float | None:
    """When the job was back after a fault at ``t_fault``: the first step a later worker group
    completed beyond every step done before that group began (None: never).

    ``trace`` is (time, step, group) as observed; ``group`` tells worker groups apart (ours:
    allocation, restart, start step; the baseline: its rank 0's process starts). The group hit
    may finish a step or two after the fault (a preemption's agreed stop); those count as done.
    A fault that starts no new group (recovery in place) is back at the first step beyond the
    step at the fault.

    ``recoveries``: (time, step gone on from) of the job's in-process recoveries
    (``inproc_recovery`` events). The first one after the fault and before any new group is
    this fault's: the job is back at the first step beyond every step done before it. Without
    them, a later fault's new group (a preemption's requeue) was taken for this fault's
    recovery, and an in-process recovery was charged until that requeue's first step.

    ``last_step``: the run's last step. When given, a step counts as back only if the job went
    on to a later step, or it is the last: a frozen worker's peers may finish the step in
    flight and then hang (campaign session 14, the baseline's seed 3: the freeze at step 54,
    step 55 done, then nothing until the run's cap 400 s later, charged 1 node-s as "back at
    55").
    """
    if last_step is not None:
        trace = [p for i, p in enumerate(trace)
                 if p[1] >= last_step or any(q[1] > p[1] and q[0] > p[0] for q in trace[i + 1:])]
    before = [p for p in trace if p[0] <= t_fault]
    after = [p for p in trace if p[0] > t_fault]
    seen = {p[2] for p in before}
    first_new = next((i for i, p in enumerate(after) if p[2] not in seen), None)
    t_new = after[first_new][0] if first_new is not None else float("inf")
    rec = next(((t, s) for t, s in sorted(recoveries) if t_fault <= t < t_new), None)
    if rec is not None:
        ref = max([p[1] for p in trace if p[0] <= rec[0]] + [rec[1]])
        back = next((p[0] for p in after if p[0] > rec[0] and p[1] > ref), None)
        if back is not None and back < t_new:
            return back
    if first_new is None:
        ref = max((p[1] for p in before), default=-1)
        return next((p[0] for p in after if p[1] > ref), None)
    ref = max((p[1] for p in before + after[:first_new]), default=-1)
    return next((p[0] for p in after[first_new:] if p[1] > ref), None)


def steps_twice(trace: Sequence[tuple[float, int, Any]]) -> int:
    """Steps computed twice as the campaign saw the job (pure): at each new worker group, the
    steps done before it from the group's first observed step on.

    A lower bound (the trace samples the progress: a group's first steps may go unseen), as
    the ledger's count is another: the ledger reads rank 0's events, and a crashed node's last
    seconds of them are lost with it (in-process seed 1: the rendezvous host's crash at step 45,
    a restart from step 40, and the ledger's last record of the host said step 35). The
    campaign keeps the larger of the two.
    """
    done, total, seen = -1, 0, set()
    for _, step, group in sorted(trace, key=lambda p: p[0]):
        key = tuple(group) if isinstance(group, list) else group
        if key not in seen:
            seen.add(key)
            if done >= 0:
                total += max(0, done - (int(step) - 1))
        done = max(done, int(step))
    return total


def node_seconds(allocations: Iterable[Any], t0: float, t1: float) -> float:
    """Node-seconds allocated in ``[t0, t1]`` (ledger allocations: ``start``, ``node_ends``)."""
    total = 0.0
    for a in allocations:
        for end in a.node_ends.values():
            total += max(0.0, min(end, t1) - max(a.start, t0))
    return total


def fault_costs(faults: Sequence[Mapping[str, Any]], trace: Sequence[tuple[float, int, Any]],
                allocations: Iterable[Any], run_end: float,
                recoveries: Sequence[tuple[float, int]] = (),
                last_step: int | None = None) -> list[dict[str, Any]]:
    """Each fault's node-seconds lost: allocated from the fault until back at its step (pure).

    Args:
        faults: ``{"kind", "t", "step"}``: when each fault was injected, at which step.
        trace: (time, step, worker group) as the campaign observed the job's progress.
        allocations: The job's ledger allocations.
        run_end: The end of the run (a fault never recovered from counts until then).
        recoveries: The job's in-process recoveries, (time, step gone on from) (:func:`back_at`).
        last_step: The run's last step (:func:`back_at`: a step with none after it is no
            recovery unless it is the last).
    """
    allocations = list(allocations)
    out = []
    for f in faults:
        back = back_at(trace, float(f["t"]), recoveries, last_step)
        end = back if back is not None else run_end
        out.append({**f, "back_s": (end - float(f["t"])), "recovered": back is not None,
                    "lost_node_s": node_seconds(allocations, float(f["t"]), end)})
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _per_fault(run: Mapping[str, Any]) -> float:
    faults = run["faults"]
    return sum(f["lost_node_s"] for f in faults) / len(faults) if faults else 0.0


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a list of values (the campaign's spread over seeds)."""
    return {"median": _median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def summarize(runs: Sequence[Mapping[str, Any]], baseline: str = "baseline") -> dict[str, Any]:
    """Per contender, over its runs (one per seed): the figures and their ratios to ``baseline``.

    A run is ``{"contender", "seed", "goodput", "faults": [fault_costs rows], "lost_steps",
    "finished", "weights_equal", ...}``. Ratios pair runs by seed (the same schedule).
    """
    by: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(str(r["contender"]), {})[int(r["seed"])] = r
    out: dict[str, Any] = {}
    for name, seeds in by.items():
        per_fault = {s: _per_fault(r) for s, r in seeds.items()}
        kinds: dict[str, list[float]] = {}
        for r in seeds.values():
            for f in r["faults"]:
                kinds.setdefault(f["kind"], []).append(f["lost_node_s"])
        entry: dict[str, Any] = {
            "seeds": sorted(seeds),
            "goodput": spread([r["goodput"] for r in seeds.values()]),
            "lost_node_s_per_fault": spread(list(per_fault.values())),
            "lost_node_s_by_kind": {k: spread(v) for k, v in kinds.items()},
            "steps_computed_twice": spread([float(r["lost_steps"]) for r in seeds.values()]),
            "finished": [bool(r["finished"]) for _, r in sorted(seeds.items())],
            "finished_unattended": [bool(r.get("finished_unattended", r["finished"]))
                                    for _, r in sorted(seeds.items())],
            "weights_equal": [bool(r.get("weights_equal")) for _, r in sorted(seeds.items())],
        }
        base = by.get(baseline, {})
        paired = [s for s in seeds if s in base]
        if name != baseline and paired:
            base_pf = {s: _per_fault(r) for s, r in base.items()}
            entry["ratio_to_baseline"] = {
                "goodput": spread([seeds[s]["goodput"] / base[s]["goodput"] for s in paired
                                   if base[s]["goodput"]]),
                "lost_node_s_per_fault": spread([per_fault[s] / base_pf[s] for s in paired if base_pf[s]]),
            }
        out[name] = entry
    return out


def with_trace_steps_twice(run: Mapping[str, Any]) -> dict[str, Any]:
    """The run with ``lost_steps`` the larger of the ledger's count (kept as
    ``lost_steps_ledger``) and :func:`steps_twice` of its trace (idempotent)."""
    out = dict(run)
    ledger = int(out.get("lost_steps_ledger", out.get("lost_steps", 0)))
    trace = [(float(p[0]), int(p[1]), p[3]) for p in out.get("trace") or ()]
    out["lost_steps_ledger"], out["lost_steps"] = ledger, max(ledger, steps_twice(trace))
    return out


def merge(records: Sequence[Mapping[str, Any]], baseline: str = "baseline") -> dict[str, Any]:
    """Campaign records (``campaign.py --json`` of one seed or more each) as one record.

    The runs are joined (each already carries its weights check and Slurm's frame; steps
    computed twice become the larger of the ledger's and the trace's count,
    :func:`with_trace_steps_twice`), summarized
    again over all of them (ratios still pair a contender's run with the baseline's of the same
    seed), and each record's machine figures and configuration kept per record.

    Raises:
        ValueError: if the records' configurations differ (naming the keys), or a contender and
            seed are in two records (naming them).
    """
    configs = [dict(r.get("config") or {}) for r in records]
    differ = sorted({k for c in configs for k in c if any(o.get(k) != c.get(k) for o in configs)})
    if differ:
        raise ValueError(f"the records were run with different configurations ({', '.join(differ)}); "
                         "merge only records of the same campaign settings")
    runs: list[Mapping[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for rec in records:
        for r in map(with_trace_steps_twice, rec.get("runs") or ()):
            key = (str(r["contender"]), int(r["seed"]))
            if key in seen:
                raise ValueError(f"{key[0]} seed {key[1]} is in more than one record")
            seen.add(key)
            runs.append(r)
    return {"config": configs[0] if configs else {},
            "seeds": sorted({s for _, s in seen}), "contenders": summarize(runs, baseline), "runs": runs,
            "failed": [f for rec in records for f in rec.get("failed") or ()],
            "pictures": {k: v for rec in records for k, v in (rec.get("pictures") or {}).items()},
            "references": {k: v for rec in records for k, v in (rec.get("references") or {}).items()},
            "machine": [rec.get("machine") for rec in records]}


def markdown(summary: Mapping[str, Any], baseline: str = "baseline") -> str:
    """The results table: each contender's figures (median [min, max] over seeds) and ratios."""
    def fmt(sp: Mapping[str, float], pct: bool = False, digits: int = 1) -> str:
        if not sp:
            return "-"
        f = (lambda v: f"{v * 100:.{digits}f}%") if pct else (lambda v: f"{v:.{digits}f}")
        return f"{f(sp['median'])} [{f(sp['min'])}, {f(sp['max'])}]"
    lines = ["| contender | goodput | node-s lost per fault | steps computed twice | finished (of it "
             "unattended) | weights equal "
             "| goodput / baseline | lost per fault / baseline |",
             "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for name, e in summary.items():
        r = e.get("ratio_to_baseline", {})
        lines.append(f"| {name} | {fmt(e['goodput'], pct=True)} | {fmt(e['lost_node_s_per_fault'])} | "
                     f"{fmt(e['steps_computed_twice'], digits=0)} | "
                     f"{sum(e['finished'])}/{len(e['finished'])} ({sum(e['finished_unattended'])}) | "
                     f"{sum(e['weights_equal'])}/{len(e['weights_equal'])} | "
                     f"{fmt(r.get('goodput', {}), digits=2) if name != baseline else '1'} | "
                     f"{fmt(r.get('lost_node_s_per_fault', {}), digits=3) if name != baseline else '1'} |")
    kinds = [k for k in KINDS if any(k in e["lost_node_s_by_kind"] for e in summary.values())]
    lines += ["", "Node-seconds lost per fault kind (median [min, max] over seeds):", "",
              "| fault | " + " | ".join(summary) + " |", "| --- |" + " ---: |" * len(summary)]
    for k in kinds:
        lines.append(f"| {LABELS[k]} | " + " | ".join(fmt(e["lost_node_s_by_kind"].get(k, {}))
                                                   for e in summary.values()) + " |")
    return "\n".join(lines) + "\n"


def runs_markdown(runs: Sequence[Mapping[str, Any]]) -> str:
    """One line per run: how it ended, each fault's cost, the machine's load while it ran."""
    lines = ["| contender | seed | finished | resubmitted | goodput | allocated node-s | faults: step, node-s lost "
             "(* never recovered) | steps twice | worlds | load (1-min, median [min, max]) |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for r in runs:
        faults = ", ".join(f"{f['kind']} @{f['step']}: {f['lost_node_s']:.0f}{'' if f['recovered'] else '*'}"
                           for f in r["faults"])
        missed = r.get("faults_not_reached") or []
        if missed:
            faults += f"; not reached: {', '.join(k for _, k in missed)}"
        load = r.get("load_1m") or {}
        load_s = f"{load['median']:.1f} [{load['min']:.1f}, {load['max']:.1f}]" if load else "-"
        lines.append(f"| {r['contender']} | {r['seed']} | {'yes' if r['finished'] else 'no'} | "
                     f"{len(r.get('resubmitted') or [])} | {r['goodput'] * 100:.1f}% | {r['allocated_node_s']:.0f} | "
                     f"{faults} | {r['lost_steps']} | {r.get('worlds_seen')} | {load_s} |")
    return "\n".join(lines) + "\n"
