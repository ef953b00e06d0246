"""Randomized overlapping faults against ``hpc run --recovery inprocess`` (local, 3 workers).

Each trial is one seeded job: the tiny Session script of the in-process tests
(``tests/distributed/scripts/inproc_train.py``, DDP on gloo) under ``--recovery inprocess`` and
the trial's ``--replacement``, with 1-4 faults drawn from the seed (:func:`draw`). The faults
are the ones that overlap in practice:

- ``kill``: SIGKILL of a worker (any rank, rank 0 included);
- ``stop``: SIGSTOP of a worker (a frozen process: the launcher must find and replace it);
- ``double``: two workers SIGKILLed within 0.5 s;
- ``in_detect``: a SIGKILL, and a second one as soon as the first one's ``inproc_detect``
  is recorded (a fault while the survivors re-form);
- ``in_recovery``: a SIGKILL as soon as the next ``inproc_recovery`` is recorded (a fault
  right after a recovery, while the joiner settles);
- ``joiner``: a SIGKILL, then the SIGKILL of its joiner as soon as ``inproc_replace`` names it;
- ``all``: every worker SIGKILLed (only the checkpoint holds the state: the restart path);
- ``save``: a SIGKILL while a checkpoint is written (its ``ckpt_save`` recorded).

A trial passes when the job ends with exit 0 and:

- no stretch without a new step line is longer than ``--hang-s`` (60 s): past it the trial is
  ended, every process's stack dumped (py-spy, when installed), and counted a hang;
- every step any rank ran used the same global batch as the same step of an uninterrupted run
  (exact samples), and the final sampler state is that run's;
- every rank ends with the same weights, and under ``wait`` with the uninterrupted run's
  weights when every rank ended at the job's starting world (bit-equal).

Run: ``python benchmarks/fault_trials.py --trials 50 --json benchmarks/fault_trials.json``.
Trial ``i`` uses seed ``i`` and ``--replacement`` ``wait`` for even seeds, ``shrink`` for odd
ones. The suite runs a short form (``tests/distributed/test_fault_trials.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.liveness import proc  # noqa: E402

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
KINDS = ("kill", "stop", "double", "in_detect", "in_recovery", "joiner", "all", "save")
WORLD = 3


@dataclass(frozen=True)
class Fault:
    """One fault of a trial: what, on which rank, from which step on (pure data)."""

    kind: str
    rank: int
    step: int


@dataclass(frozen=True)
class Plan:
    """A trial's faults and settings, all drawn from its seed (:func:`draw`)."""

    seed: int
    replacement: str
    steps: int
    faults: tuple[Fault, ...]


def draw(seed: int, replacement: str | None = None, *, steps: int = 60) -> Plan:
    """The trial of ``seed`` (pure): 1-4 faults at increasing steps, spread over the run's
    first two thirds so that each has steps after it to show the job went on."""
    rng = random.Random(seed)
    replacement = replacement or ("wait" if seed % 2 == 0 else "shrink")
    n = rng.randint(1, 4)
    at = sorted(rng.sample(range(4, max(5, steps * 2 // 3)), n))
    faults = tuple(Fault(rng.choice(KINDS), rng.randrange(WORLD), s) for s in at)
    return Plan(seed, replacement, steps, faults)


@dataclass
class Outcome:
    """What a trial did and whether it passed."""

    seed: int
    replacement: str
    faults: list[dict]
    passed: bool = False
    hang: bool = False
    exit: int | None = None
    wall_s: float = 0.0
    longest_gap_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    injected: list[str] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)


class Job:
    """One ``hpc run`` of the trial script and what it has written so far."""

    def __init__(self, where: Path, plan: Plan, *, step_sleep: float, extra_env: dict[str, str]) -> None:
        self.where, self.plan = where, plan
        self.out, self.dir = where / "out", where / "job"
        self.out.mkdir(parents=True)
        env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="5",
                   **extra_env)
        self.log = open(where / "hpc-run.log", "wb")  # noqa: SIM115 - closed in close()
        self.run = subprocess.Popen(
            [sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", str(WORLD),
             "--recovery", "inprocess", "--replacement", plan.replacement, "--max-restarts", "12",
             "--checkpoint-every-steps", "10", "--job-dir", str(self.dir), "--", "--out", str(self.out),
             "--steps", str(plan.steps), "--step-sleep", str(step_sleep)],
            env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def lines(self) -> dict[int, list[dict]]:
        """pid -> its step lines."""
        out = {}
        for f in self.out.glob("steps-*.jsonl"):
            rows = []
            for x in f.read_text().splitlines():
                try:
                    rows.append(json.loads(x))
                except ValueError:   # a line being written
                    pass
            out[int(f.stem.split("-")[1])] = rows
        return out

    def events(self) -> list[dict]:
        f = self.dir / "events.jsonl"
        if not f.exists():
            return []
        rows = []
        for x in f.read_text().splitlines():
            try:
                rows.append(json.loads(x))
            except ValueError:
                pass
        return rows

    def workers(self) -> dict[int, int]:
        """Live workers of this job: pid -> the rank its last step line names (-1: none yet)."""
        lines = self.lines()
        found = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            pid = int(d.name)
            argv = proc.cmdline(pid)   # a worker (not the fork server, a standby or a launcher)
            if proc.state(pid) in (None, "Z") or "runtime.worker" not in argv or str(SCRIPT) not in argv:
                continue
            if proc.environ(pid).get("HPC_JOB_DIR") != str(self.dir):
                continue
            ran = lines.get(pid) or []
            found[pid] = ran[-1]["rank"] if ran else -1
        return found

    def progress(self) -> int:
        """Step lines written so far (any rank)."""
        return sum(len(v) for v in self.lines().values())

    def newest_step(self) -> int:
        return max((r["step"] for v in self.lines().values() for r in v), default=-1)

    def close(self) -> None:
        if self.run.poll() is None:
            try:
                os.killpg(self.run.pid, signal.SIGKILL)
            except OSError:
                pass
            self.run.wait()
        self.log.close()


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


class Injector(threading.Thread):
    """Plays a plan's faults against a running job, each once its step is reached."""

    def __init__(self, job: Job, outcome: Outcome) -> None:
        super().__init__(daemon=True)
        self.job, self.outcome = job, outcome
        self.stopped: set[int] = set()
        self.done = threading.Event()

    def note(self, what: str) -> None:
        self.outcome.injected.append(f"{time.time():.2f} {what}")

    def victim(self, rank: int) -> int | None:
        live = self.job.workers()
        ranked = {r: p for p, r in live.items() if r >= 0 and p not in self.stopped}
        if rank in ranked:
            return ranked[rank]
        rest = sorted(p for p in live if p not in self.stopped)
        return rest[rank % len(rest)] if rest else None

    def wait_event(self, name: str, after: int, timeout: float = 60.0) -> dict | None:
        deadline = time.time() + timeout
        while time.time() < deadline and self.job.run.poll() is None:
            got = [e for e in self.job.events() if e.get("ev") == name]
            if len(got) > after:
                return got[after]
            time.sleep(0.02)
        return None

    def count(self, name: str) -> int:
        return sum(1 for e in self.job.events() if e.get("ev") == name)

    def strike(self, f: Fault) -> None:
        pid = self.victim(f.rank)
        if pid is None:
            self.note(f"{f.kind}: no live worker")
            return
        if f.kind == "stop":
            _kill(pid, signal.SIGSTOP)
            self.stopped.add(pid)
            self.note(f"stop {pid} (rank {f.rank})")
        elif f.kind == "all":
            live = sorted(self.job.workers())
            for p in live:
                _kill(p)
            self.note(f"all killed {live}")
        elif f.kind == "double":
            _kill(pid)
            time.sleep(random.Random(f.step).uniform(0.0, 0.5))
            other = self.victim(f.rank + 1)
            if other is not None and other != pid:
                _kill(other)
            self.note(f"double {pid} {other}")
        elif f.kind == "in_detect":
            seen = self.count("inproc_detect")
            _kill(pid)
            if self.wait_event("inproc_detect", seen, 20.0) is not None:
                other = self.victim(f.rank + 1)
                if other is not None:
                    _kill(other)
                self.note(f"in_detect {pid} then {other}")
            else:
                self.note(f"in_detect {pid}, no detect seen")
        elif f.kind == "in_recovery":
            seen = self.count("inproc_recovery")
            _kill(pid)
            if self.wait_event("inproc_recovery", seen, 60.0) is not None:
                other = self.victim(f.rank + 1)
                if other is not None:
                    _kill(other)
                self.note(f"in_recovery {pid} then {other}")
            else:
                self.note(f"in_recovery {pid}, no recovery seen")
        elif f.kind == "joiner":
            seen = self.count("inproc_replace")
            _kill(pid)
            got = self.wait_event("inproc_replace", seen, 30.0)
            if got is not None:
                _kill(int(got["pid"]))
                self.note(f"joiner: {pid} then its joiner {got['pid']}")
            else:
                self.note(f"joiner: {pid}, no joiner started")
        elif f.kind == "save":
            seen = self.count("ckpt_save")
            if self.wait_event("ckpt_save", seen, 30.0) is not None:
                pid = self.victim(f.rank) or pid
            _kill(pid)
            self.note(f"save {pid}")
        else:
            _kill(pid)
            self.note(f"kill {pid} (rank {f.rank})")

    def run(self) -> None:
        for f in self.job.plan.faults:
            while self.job.run.poll() is None and self.job.newest_step() < f.step:
                if self.done.wait(0.05):
                    return
            if self.job.run.poll() is not None or self.done.is_set():
                return
            self.strike(f)


def dump_stacks(job: Job, where: Path) -> None:
    """Every live process of the job's stack (py-spy), for a hang's record."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    pids = [p for p in proc.children(job.run.pid)] + list(job.workers())
    seen: set[int] = set()
    with open(where / "stacks.txt", "w") as f:
        while pids:
            pid = pids.pop()
            if pid in seen:
                continue
            seen.add(pid)
            pids.extend(proc.children(pid))
            f.write(f"=== {pid} {' '.join(proc.cmdline(pid))[:200]}\n")
            if Path(spy).exists():
                r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                   timeout=30)
                f.write(r.stdout + r.stderr + "\n")


def baseline(where: Path, steps: int, step_sleep: float) -> dict:
    """An uninterrupted run: step -> its global batch's first index, the weights, the sampler."""
    job = Job(where, Plan(-1, "wait", steps, ()), step_sleep=step_sleep, extra_env={})
    try:
        job.run.wait(timeout=600)
    finally:
        job.close()
    results = [json.loads(f.read_text()) for f in job.out.glob("result-*.json")]
    assert job.run.returncode == 0 and len(results) == WORLD, (where / "hpc-run.log").read_text()[-3000:]
    firsts = {r["step"]: r["first"] for v in job.lines().values() for r in v}
    return {"firsts": firsts, "weights": results[0]["weights"], "sampler": results[0]["sampler"]}


def check(job: Job, plan: Plan, base: dict, outcome: Outcome) -> None:
    """The trial's outcome against the uninterrupted run (see the module docstring)."""
    results = [json.loads(f.read_text()) for f in job.out.glob("result-*.json")]
    if outcome.exit != 0:
        outcome.problems.append(f"exit {outcome.exit}")
    finished = [r for r in results if r["step"] == plan.steps]
    if not finished:
        outcome.problems.append(f"no rank finished all {plan.steps} steps")
    wrong = sorted({r["step"] for v in job.lines().values() for r in v
                    if base["firsts"].get(r["step"]) != r["first"]})
    if wrong:
        outcome.problems.append(f"steps with another batch than the uninterrupted run's: {wrong[:10]}")
    if any(r["sampler"] != base["sampler"] for r in finished):
        outcome.problems.append("a final sampler state differs from the uninterrupted run's")
    if len({r["weights"] for r in finished}) > 1:
        outcome.problems.append("the ranks ended with different weights")
    kept = all(r["world"] == WORLD for r in finished) and len(finished) == WORLD
    if plan.replacement == "wait" and kept and finished[0]["weights"] != base["weights"]:
        outcome.problems.append("weights differ from the uninterrupted run's at the same world")
    if outcome.longest_gap_s > outcome_hang_s[0]:
        outcome.problems.append(f"{outcome.longest_gap_s:.0f} s without a step")


outcome_hang_s = [60.0]


def trial(plan: Plan, where: Path, base: dict, *, step_sleep: float, hang_s: float,
          deadline_s: float = 900.0) -> Outcome:
    """Runs one trial in ``where`` (a fresh directory)."""
    outcome = Outcome(plan.seed, plan.replacement, [asdict(f) for f in plan.faults])
    job = Job(where, plan, step_sleep=step_sleep, extra_env={})
    injector = Injector(job, outcome)
    t0 = time.time()
    last, since = -1, time.time()
    injector.start()
    try:
        while job.run.poll() is None:
            n = job.progress()
            now = time.time()
            if n != last:
                last, since = n, now
            outcome.longest_gap_s = max(outcome.longest_gap_s, now - since)
            if now - since > hang_s or now - t0 > deadline_s:
                outcome.hang = True
                dump_stacks(job, where)
                break
            time.sleep(0.2)
    finally:
        injector.done.set()
        job.close()
        injector.join(timeout=30)
    outcome.exit = job.run.returncode
    outcome.wall_s = round(time.time() - t0, 1)
    outcome.longest_gap_s = round(outcome.longest_gap_s, 1)
    for e in job.events():
        name = e.get("ev", "")
        if name.startswith("inproc_") or name in ("workers_started", "ckpt_commit"):
            outcome.events[name] = outcome.events.get(name, 0) + 1
    if outcome.hang:
        outcome.problems.append(f"hang: {hang_s:.0f} s without a step (stacks in {where}/stacks.txt)")
    else:
        check(job, plan, base, outcome)
    outcome.passed = not outcome.problems
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--replacement", choices=("wait", "shrink"), default=None,
                    help="every trial's (default: wait for even seeds, shrink for odd)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-sleep", type=float, default=0.2)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--work", default="/tmp/fault-trials")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    outcome_hang_s[0] = args.hang_s
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"baseline: {args.steps} steps, {WORLD} workers", flush=True)
    base = baseline(work / "baseline", args.steps, args.step_sleep)
    outcomes = []
    for seed in range(args.first_seed, args.first_seed + args.trials):
        plan = draw(seed, args.replacement, steps=args.steps)
        load = os.getloadavg()[0]
        o = trial(plan, work / f"seed-{seed}", base, step_sleep=args.step_sleep, hang_s=args.hang_s)
        outcomes.append({**asdict(o), "load": round(load, 1)})
        kinds = ",".join(f"{f.kind}@{f.step}" for f in plan.faults)
        print(f"seed {seed:3d} {plan.replacement:6s} {kinds:40s} {'PASS' if o.passed else 'FAIL'} "
              f"{o.wall_s:6.1f}s gap {o.longest_gap_s:5.1f}s load {load:.1f} {'; '.join(o.problems)}",
              flush=True)
    passed = sum(o["passed"] for o in outcomes)
    hangs = sum(o["hang"] for o in outcomes)
    print(f"{passed}/{len(outcomes)} passed, {hangs} hung", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": outcomes, "passed": passed, "hangs": hangs,
                                               "steps": args.steps, "step_sleep": args.step_sleep},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
