"""Helpers that the distributed tier's test modules share: the worker probe script, whether a
process is alive, a job's outcomes, the launchers of a local ``hpc run`` (which node ranks
started or are ready, a node rank's launcher pid), and the environment of a real ``wandb sync``
against a local endpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.wandb_offline import offline_env

PROBE = REPO / "tests" / "distributed" / "scripts" / "worker_probe.py"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def outcomes(job_dir: Path) -> list[dict]:
    path = job_dir / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def launchers(job: Path) -> tuple[set[int], set[int]]:
    """(node ranks whose workers started, node ranks ready to join)."""
    try:
        evs = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return set(), set()
    return ({e["node_rank"] for e in evs if e.get("ev") == "workers_started"},
            {e["node_rank"] for e in evs if e.get("ev") == "node_ready"})


def launcher_pid(job: Path, node_rank: int) -> int:
    """The pid of ``hpc run``'s launcher for ``node_rank`` (its own session: its pgid)."""
    for pid in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "runtime.launch" in words and str(job) in words and \
                words[words.index("--node-rank") + 1] == str(node_rank):
            return int(pid)
    raise AssertionError(f"no launcher for node rank {node_rank}")


def key_env(tmp_path: Path, url: str) -> dict[str, str]:
    return {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": url, "HOME": str(tmp_path)}


def real_sync_env(tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (offline_env(tmp_path / "sync-env") | key_env(tmp_path, url)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_MODE")
