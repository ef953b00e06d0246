"""The tree of ``runtime/`` answers "which process runs this file".

Three kinds of process run our code inside a job: the per-node launcher (one per node, with
torch's elastic agent in it), the training workers the agent starts, and the batch shell. Each
module of ``runtime/`` lives in a folder named for the process that runs it (:data:`ROOMS`), or
at the top of ``runtime/`` where it is declared in :data:`TOP`: the modules both sides use, and
the user's own import paths (``from runtime.session import Session``), which stay where user
scripts find them.

The rule that keeps the rooms honest: a launcher-side module never imports a worker-side one,
a worker-side module never a launcher-side one, and a shared module neither (imports under
``if TYPE_CHECKING:`` aside: they run nowhere). A crossing that must stay is listed in
:data:`CROSSINGS` with its reason. The graph is read from the source (AST), as
tests/unit/import_graph.py does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.import_graph import Import, imports, modules

pytestmark = pytest.mark.unit

LAUNCHER, WORKER, SHARED = "launcher", "worker", "shared"

ROOMS: dict[str, tuple[str, str]] = {
    # folder of runtime/: (side, the process that runs it)
    "launch": (LAUNCHER, "the per-node launcher, one per node (python -m runtime.launch)"),
    "ending": (LAUNCHER, "node 0's launcher once its agent has returned: the end of an allocation"),
    "worker": (WORKER, "every training process (python -m runtime.worker SCRIPT)"),
    "checkpoint": (WORKER, "every training process (the Session's saves and loads)"),
    "integrations": (WORKER, "every training process: hooks into frameworks' own loops (HF Trainer)"),
    "parallel": (WORKER, "every training process: the device mesh, TP and FSDP2 on it, pipeline stages"),
    "liveness": (SHARED, "workers write heartbeats and stacks; the launcher's watchdog reads them"),
}

# A feature's wing: one folder of runtime/ that holds the whole feature, its sub-rooms named for
# the process that runs each file; the modules at the top of the wing are pure and both sides'.
WINGS: dict[str, dict[str, tuple[str, str]]] = {
    "inprocess": {   # recovery without restart: docs/inprocess.md
        "launcher": (LAUNCHER, "the per-node launcher: its agent, adoption, lifelines, silent-loss "
                               "watch, hot spare and warm standby"),
        "worker": (WORKER, "every training process: the recovery's stages, guards, membership, "
                           "transfers, shard copies, rebind; the warm standby process"),
    },
}
WING_TOP = SHARED   # a wing's own top modules (its protocol and its pure rules)

TOP: dict[str, tuple[str, str]] = {
    # module at the top of runtime/: (side, who runs it)
    "session": (WORKER, "the user's import path: from runtime.session import Session"),
    "sampler": (WORKER, "the user's import path: from runtime.sampler import ResumableSampler"),
    "env": (SHARED, "the one reader of torchrun's and Slurm's variables (launcher and workers)"),
    "console": (SHARED, "the lines both sides print, and how they are recognised"),
    "events": (SHARED, "events.jsonl: the launcher's allocation frame and the Session's steps"),
    "preemption": (SHARED, "the warning -> deadline -> save-or-exit rules (launcher and workers)"),
    "stopping": (SHARED, "the agreed stop notice: the launcher writes it, the workers obey it"),
    "stop_deadline": (SHARED, "when a stop becomes a kill, read by the launcher and the workers"),
    "node_files": (SHARED, "the user's private node-local directory and the warm processes' orders kept there "
                           "(the launcher writes them, workers and /proc readers read them)"),
    "peer_sockets": (SHARED, "a lost store's connections shut down (the launcher's fence, the workers' rebind)"),
    "succession": (SHARED, "the rendezvous board: launchers elect, checkpoints are fenced by it"),
    "exclusions": (SHARED, "bad nodes: the launcher and its watchdog record, the batch shell "
                           "enforces (python -m runtime.exclusions)"),
    "wandb_env": (SHARED, "the job's one W&B run id (launcher and sink), the W&B variables the "
                          "launcher hands to scripts' own wandb.init(), the worker's finish on SIGTERM"),
}

CROSSINGS: dict[str, str] = {
    # "module -> target": why this import crosses from one side to the other (none today: the
    # job's W&B run id, created by the launcher and the sink alike, lives in runtime.wandb_env)
}


def side_of(module: str) -> str | None:
    """The side a ``runtime`` module runs on, from its place in the tree (None: undeclared)."""
    parts = module.split(".")
    if parts[0] != "runtime" or len(parts) == 1:
        return SHARED if parts == ["runtime"] else None
    if parts[1] in ROOMS:
        return ROOMS[parts[1]][0]
    if parts[1] in WINGS:
        if len(parts) == 2 or (len(parts) == 3 and parts[2] not in WINGS[parts[1]]):
            return WING_TOP
        return WINGS[parts[1]][parts[2]][0]
    if len(parts) == 2 and parts[1] in TOP:
        return TOP[parts[1]][0]
    return None


def crossings(edges: list[Import]) -> list[str]:
    """The imports that cross sides: launcher <-> worker, or shared -> either."""
    out = []
    for e in edges:
        a, b = side_of(e.module), side_of(e.target)
        if e.typing or a is None or b is None or b == SHARED or a == b:
            continue
        if f"{e.module} -> {e.target}" not in CROSSINGS:
            out.append(f"{e.module}:{e.line} ({a}) imports {e.target} ({b})")
    return sorted(out)


def test_every_runtime_module_has_a_room() -> None:
    undeclared = sorted(m for m in modules() if m.startswith("runtime") and side_of(m) is None)
    assert undeclared == [], ("put each in a folder of runtime/ named for the process that runs "
                              f"it ({sorted(ROOMS)}), or declare its new folder in ROOMS (or a new "
                              f"top-level module in TOP) of tests/unit/test_rooms.py: {undeclared}")


def test_declared_rooms_and_top_modules_exist() -> None:
    root = Path(__file__).resolve().parents[2] / "runtime"
    assert sorted(r for r in ROOMS if not (root / r / "__init__.py").is_file()) == []
    assert sorted(f"{w}/{r}" for w, rooms in WINGS.items() for r in rooms
                  if not (root / w / r / "__init__.py").is_file()) == []
    assert sorted(t for t in TOP if not (root / f"{t}.py").is_file()) == []


def test_no_import_crosses_from_the_launcher_to_the_workers_or_back() -> None:
    edges, _ = imports(modules())
    assert crossings(edges) == []
    listed = {f"{e.module} -> {e.target}" for e in edges}
    assert sorted(set(CROSSINGS) - listed) == [], "a listed crossing is gone: drop it from CROSSINGS"


def test_the_rule_catches_each_kind_of_crossing() -> None:
    """The checker itself: each forbidden direction is reported, the allowed ones are not."""
    edges = [Import("runtime.worker.metrics", "runtime.launch.plan", 1, False, False),
             Import("runtime.session", "runtime.ending.outcome", 2, True, False),
             Import("runtime.ending.outcome", "runtime.checkpoint.manifest", 3, False, False),
             Import("runtime.stopping", "runtime.launch.main", 4, False, False),
             Import("runtime.launch.main", "runtime.stopping", 5, False, False),
             Import("runtime.session", "runtime.liveness.heartbeat", 6, False, False),
             Import("runtime.ending.outcome", "runtime.launch.plan", 7, False, True),
             Import("runtime.ending.outcome", "runtime.session", 8, False, True)]
    assert [c.split(":")[0] for c in crossings(edges)] == [
        "runtime.ending.outcome", "runtime.session", "runtime.stopping", "runtime.worker.metrics"]
    assert side_of("runtime.newfile") is None and side_of("runtime.launch.newfile") == LAUNCHER
    assert side_of("runtime.inprocess.launcher.agent") == LAUNCHER
    assert side_of("runtime.inprocess.worker.stages") == WORKER
    assert side_of("runtime.inprocess.protocol") == SHARED == side_of("runtime.inprocess")


def test_a_feature_lives_in_its_wing_and_no_file_name_carries_its_prefix() -> None:
    """In-process recovery is one place, ``runtime/inprocess/``: no module elsewhere in
    ``runtime/`` or the contract is named for it (the login side's report of its events,
    ``hpc/report/inproc.py``, is the report's), and no file name carries a feature prefix
    (``inprocess_agent.py`` beside the launcher's own modules is how a feature grows beside the
    structure instead of into it)."""
    root = Path(__file__).resolve().parents[2]
    def in_a_wing(f: Path) -> bool:
        return f.is_relative_to(root / "runtime") and f.relative_to(root / "runtime").parts[0] in WINGS

    stray = sorted(str(f.relative_to(root)) for top in ("runtime", "hpc/contract") for f in (root / top).rglob("*.py")
                   if any(w in f.stem for w in ("inprocess", "inproc", "standby")) and not in_a_wing(f))
    assert stray == [], f"in-process code outside runtime/inprocess/: {stray}"
    prefixed = sorted(str(f.relative_to(root)) for f in (root / "runtime").rglob("*.py")
                      if any(f.stem.startswith(w + "_") for w in WINGS))
    assert prefixed == [], f"a wing's name as a file-name prefix: {prefixed}"


# The modules outside a wing that import it, each with why: a process's one seam to the feature.
SEAMS: dict[str, str] = {
    "runtime.launch.recovery": "the launcher's one seam: for_run() makes each agent run's recovery "
                               "object from --recovery (the restart path's does nothing)",
    "runtime.worker.recovery": "the Session's one seam: for_session() makes the worker's recovery "
                               "object from --recovery (the restart path's does nothing)",
}


def test_the_core_reaches_a_wing_only_through_its_seams() -> None:
    """The launcher's core (``launch/main.py``, the fence, the agent run) asks one object made
    by ``runtime.launch.recovery.for_run`` and names no in-process module; a new import of the
    wing from outside it is a feature growing beside the structure again."""
    edges, _ = imports(modules())
    reaching = {e.module for e in edges if not e.typing and e.target.split(".")[:2] == ["runtime", "inprocess"]
                and e.module.split(".")[:2] != ["runtime", "inprocess"]}
    assert sorted(reaching) == sorted(SEAMS), "import the wing only in a seam listed in SEAMS"


def test_the_launchers_say_a_worker_is_dead_in_one_place() -> None:
    """``dead/UID`` and ``fault/G`` are written on the launchers' side by
    ``runtime.inprocess.launcher.announce.dead`` alone, whatever saw the death (its child's
    end, a closed lifeline, a silent beacon, a spare's joiner): one format, one order."""
    import ast

    root = Path(__file__).resolve().parents[2] / "runtime"
    writers = []
    for f in sorted([*(root / "launch").rglob("*.py"), *(root / "inprocess" / "launcher").rglob("*.py")]):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("set", "add") \
                    and node.args and isinstance(node.args[0], ast.Call) \
                    and ast.unparse(node.args[0].func).endswith(("proto.dead", "proto.fault")):
                writers.append(f"{f.relative_to(root)}:{node.lineno}")
    assert [w.split(":")[0] for w in writers] == ["inprocess/launcher/announce.py"] * 2, writers


def test_no_function_in_runtime_is_over_100_lines() -> None:
    """A function that grew past 100 lines holds several decisions that each want a name (the
    launcher's agent run was 193 lines, the in-process agent a 302-line function around a class)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    long = sorted(f"{f.relative_to(root)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
                  for f in (root / "runtime").rglob("*.py") for n in ast.walk(ast.parse(f.read_text()))
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= 100)
    assert long == []


def test_the_job_imports_from_the_login_side_only_its_contract() -> None:
    """``runtime/`` reaches ``hpc/`` only through ``hpc.contract``: what both sides read (the
    job spec, the records, the goodput ledger and its interval rule, the job index, W&B's
    offline records) lives there; the login side's commands stay out of the job's processes."""
    edges, _ = imports(modules())
    outside = sorted(f"{e.module}:{e.line} -> {e.target}" for e in edges
                     if e.module.split(".")[0] == "runtime" and e.target.split(".")[0] == "hpc"
                     and e.target.split(".")[:2] != ["hpc", "contract"])
    assert outside == []


def test_the_event_recorder_records_and_the_checkpoint_room_decides_the_interval() -> None:
    """``--checkpoint-interval auto`` is decided in ``runtime/checkpoint/auto_interval.py`` over
    the contract's pure rule (``hpc.contract.young_daly``, ``hpc.contract.interval``), and the
    Session owns it; ``runtime/events.py`` records events and asks nothing of the rule."""
    edges, _ = imports(modules())
    rule = {"hpc.contract.young_daly", "hpc.contract.interval", "runtime.checkpoint.auto_interval"}
    assert sorted(e.target for e in edges if e.module == "runtime.events" and e.target in rule) == []
    assert rule - {"runtime.checkpoint.auto_interval"} <= {
        e.target for e in edges if e.module == "runtime.checkpoint.auto_interval"}
    assert "runtime.checkpoint.auto_interval" in {e.target for e in edges if e.module == "runtime.session"}


def _mode_comparisons(root: Path) -> list[str]:
    """Where ``runtime/`` compares the recovery mode: a comparison with ``INPROCESS``/``RESTART``
    or their strings, or a read of ``InProcessEnvironment...inprocess``."""
    import ast

    found = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(ast.unparse(x).endswith(("INPROCESS", "RESTART")) or
                       (isinstance(x, ast.Constant) and x.value in ("inprocess", "restart")) for x in sides):
                    found.append(f"{f.relative_to(root)}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "inprocess" \
                    and "InProcessEnvironment" in ast.unparse(node.value):
                found.append(f"{f.relative_to(root)}:{node.lineno}")
    return found


def test_the_session_compares_the_recovery_mode_once_and_holds_no_in_process_step() -> None:
    """The worker side compares the mode in one place (``runtime.worker.recovery.for_session``):
    the Session asks the object made there at fixed points and names no in-process module, so
    its loop reads the same whatever the recovery (it was 1,134 lines with 50 branches on
    ``self._inproc``). On the launcher side, ``runtime.launch.recovery.for_run`` compares it, and
    the NCCL variables of the workers' environment (``runtime.liveness.nccl_watch``) once more. Inside
    the wing the mode is the feature's own (its adopter tells its workers by their environment)."""
    root = Path(__file__).resolve().parents[2] / "runtime"
    where = [w for w in _mode_comparisons(root) if not w.startswith("inprocess/")]   # the wing's own reads
    worker = [w for w in where if side_of("runtime." + w.split(":")[0][:-3].replace("/", ".")) != LAUNCHER
              and not w.startswith("liveness/nccl_watch.py")]
    assert [w.split(":")[0] for w in worker] == ["worker/recovery.py"], where
    assert sorted(w.split(":")[0] for w in where if w not in worker) == ["launch/recovery.py", "liveness/nccl_watch.py"], where
    session = (root / "session.py").read_text()
    assert "inproc" not in session.lower().replace("in-process", ""), "an in-process step in runtime/session.py"
    assert len(session.splitlines()) <= 900


def test_the_mode_check_sees_each_form(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = mode == recovery_settings.INPROCESS\ny = 'restart' != m\n"
                                   "z = recovery_settings.InProcessEnvironment.from_env(e).inprocess\n"
                                   "w = mode == 'other'\n")
    assert _mode_comparisons(tmp_path) == ["a.py:1", "a.py:2", "a.py:3"]


def _silent_broad_handlers(roots: list[Path], base: Path) -> list[str]:
    """``except Exception`` / ``except BaseException`` handlers that go on (no ``raise`` in them)
    without a comment, on the handler's line or its first, saying what may fail and why going
    on is right."""
    import ast

    found = []
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            lines = f.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if not (isinstance(node, ast.ExceptHandler) and node.type is not None
                        and ast.unparse(node.type) in ("Exception", "BaseException")):
                    continue
                if any(isinstance(n, ast.Raise) for b in node.body for n in ast.walk(b)):
                    continue   # cleans up and raises again
                said = ("#" in lines[node.lineno - 1] or "#" in lines[node.body[0].lineno - 1]
                        or lines[node.lineno].lstrip().startswith("#"))
                if not said:
                    found.append(f"{f.relative_to(base)}:{node.lineno}")
    return found


def test_every_broad_handler_that_goes_on_says_why() -> None:
    """A broad handler that swallows an error hides the next bug unless it says what it expects
    to fail and why the job is better off going on (there were 55 in runtime/ alone)."""
    base = Path(__file__).resolve().parents[2]
    assert _silent_broad_handlers([base / "runtime", base / "hpc"], base) == []


def test_the_broad_handler_check_sees_a_silent_one(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("try:\n    f()\nexcept Exception:\n    pass\n"
                                   "try:\n    f()\nexcept Exception:  # a reason\n    pass\n"
                                   "try:\n    f()\nexcept BaseException:\n    g()\n    raise\n")
    assert _silent_broad_handlers([tmp_path], tmp_path) == ["a.py:3"]


# File names that two runtime modules share because they are one concept on two sides.
SHARED_NAMES: dict[str, str] = {
    "agent": "torch's agent: the class composed per run (launch/) and the in-process part of it",
    "recovery": "the one seam to the recovery, on the launcher's side (launch/) and the workers' (worker/)",
    "standby": "the warm standby: the process (inprocess/worker/) and its launcher's keeper (inprocess/launcher/)",
}


def test_a_module_name_means_one_thing() -> None:
    """Two modules of one name are two things a reader confuses (``events`` was both the
    events.jsonl recorder and the stall records of hangs.jsonl; ``nccl`` both the workers' NCCL
    settings and the in-process NCCL path), unless they are one concept seen from two sides."""
    root = Path(__file__).resolve().parents[2] / "runtime"
    by_name: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        if not f.name.startswith("__"):
            by_name.setdefault(f.stem, []).append(str(f.relative_to(root)))
    twice = {n: places for n, places in by_name.items() if len(places) > 1}
    assert sorted(twice) == sorted(SHARED_NAMES), twice
