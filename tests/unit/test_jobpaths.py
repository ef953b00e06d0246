"""Every job-directory name is spelled once (hpc/contract/jobpaths.py), and JobPaths puts the
files where the layout says (issue 25: ~10 names lived outside jobdir.py, ~8 paths were bare
literals, hangs.jsonl was named in three places)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from hpc.contract import jobpaths
from hpc.contract.jobpaths import JobPaths

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DECLARED_IN = REPO / "hpc" / "contract" / "jobpaths.py"

# The same word meaning something else than the file (a CLI command, a record's field, a key of
# a checkpoint's metadata): (module, literal) -> why it is not the job directory's name.
OTHER_MEANINGS = {
    ("hpc/cli.py", "logs"): "the `hpc logs` command",
    ("hpc/contract/ledger.py", "checkpoints"): "a key of the ledger's JSON",
    ("runtime/checkpoint/manifest.py", "wandb_run_id"): "a key of the checkpoint's metadata",
    ("runtime/session.py", "wandb_run_id"): "a key of the checkpoint's metadata",
    ("runtime/session.py", "slurm_job_id"): "a key of the checkpoint's metadata",
    ("hpc/contract/records.py", "health"): "an exclusion's kind (a failed health check)",
    ("runtime/launch/main.py", "health"): "an exclusion's kind (a failed health check)",
    ("hpc/sync.py", "wandb"): "python -m wandb",
    ("runtime/wandb_env.py", "wandb"): "the wandb module's name",
    ("runtime/worker/forkserver.py", "wandb"): "the wandb module's name (imported ahead of need)",
    ("runtime/checkpoint/storage.py", "rank-"): "a checkpoint shard's name, not a log",
}


def declared_names() -> dict[str, str]:
    """Constant name -> the literal piece to look for (a pattern's text before its first field)."""
    out = {}
    for node in ast.parse(DECLARED_IN.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper() and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            piece = re.split(r"\{[^}]*\}", node.value.value)[0]
            if len(piece) >= 4:            # "{duty}-claim-..." has no fixed start worth matching
                out[node.targets[0].id] = piece
    return out


def literals(path: Path) -> list[tuple[int, str]]:
    """Every string literal and f-string piece in ``path`` but docstrings, with its line."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_every_job_dir_name_is_spelled_once() -> None:
    names = declared_names()
    assert {"OUTCOMES", "HANGS", "EXCLUSIONS", "STRAGGLERS", "RESUBMISSIONS", "EVENTS", "LOCK",
            "SLURM_JOB_ID", "CHECKPOINTS", "LOGS", "LIVENESS", "ALLOC", "HANG_STACKS"} <= set(names)
    wanted = {piece: name for name, piece in names.items()}
    found: dict[str, list[str]] = defaultdict(list)
    used = set()
    for path in sorted([*(REPO / "hpc").rglob("*.py"), *(REPO / "runtime").rglob("*.py")]):
        if path == DECLARED_IN:
            continue
        rel = path.relative_to(REPO).as_posix()
        for line, text in literals(path):
            if text in wanted and (rel, text) in OTHER_MEANINGS:
                used.add((rel, text))
            elif text in wanted:
                found[wanted[text]].append(f"{rel}:{line} {text!r}")
    assert not found, ("job-directory names spelled outside hpc/contract/jobpaths.py (use "
                       "JobPaths or the constant): " + "; ".join(x for v in found.values() for x in v))
    assert used == set(OTHER_MEANINGS), f"allowed but no longer there: {set(OTHER_MEANINGS) - used}"


def test_job_paths_follow_the_documented_layout(tmp_path: Path) -> None:
    p = JobPaths(tmp_path)
    assert p.outcomes == tmp_path / "outcomes.jsonl" and p.lock == tmp_path / ".hpc-lock.json"
    assert p.rank_log(2, 1, 3) == tmp_path / "logs/alloc-2/restart-1/rank-3.log"
    assert p.rank_log(2, 1, 3, epoch=4) == tmp_path / "logs/alloc-2/epoch-4-restart-1/rank-3.log"
    assert p.node_log(0, "node1") == tmp_path / "logs/alloc-0/node-node1.log"
    assert p.hang_stacks(0, "node1", 2) == tmp_path / "logs/alloc-0/hang-node1-2.txt"
    assert p.liveness_node(1, 0) == tmp_path / "liveness/alloc-1/node-0.json"
    assert p.claim(3, "requeue") == tmp_path / "requeue-claim-alloc-3"
    assert p.requeue_request(3) == tmp_path / f"{jobpaths.REQUEUE_REQUEST_PREFIX}3"
    assert p.batch_log("42") == tmp_path / "logs/slurm-42.out"
    assert p.sweep_task(7) == tmp_path / "task-7"
    assert p.rdzv_epoch(0, 2) == tmp_path / ".rdzv/alloc-0/epoch-2"
