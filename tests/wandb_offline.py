"""Read W&B offline run files back, for tests.

wandb has no public reader for its offline `.wandb` files; `hpc.contract.wandb_records.iter_records` is
ours (the format is described there), shared with `hpc sync`'s story of the job.

Each restart of a run with the same id makes a new `offline-run-*` folder, so `read_run` gathers all
folders of one run id in start order and concatenates them: that is the history `wandb sync` would
upload, and what the tests check for "one job, one run, each step exactly once".
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from hpc.contract.wandb_records import iter_records


@dataclasses.dataclass
class OfflineRun:
    """What one or more offline files of a run contain.

    Attributes:
        run_ids: every run id seen in run records (one for a well-behaved job).
        config: the merged config (later updates win), without wandb's `_wandb` key.
        history: one dict per `log` call, in file order, with `_step` and the logged values.
        files: the `.wandb` files read, in order.
        groups: every run group seen in run records (a sweep's runs share one).
    """

    run_ids: set[str] = dataclasses.field(default_factory=set)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    groups: set[str] = dataclasses.field(default_factory=set)
    files: list[Path] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        """The `_step` of every history row, in order."""
        return [int(row["_step"]) for row in self.history]

    def events(self) -> list[tuple[int, str, dict[str, Any]]]:
        """`(row step, name, fields)` for each `events/<name>` key (fields: `events/<name>/<f>`)."""
        out = []
        for row in self.history:
            for key in row:
                parts = key.split("/")
                if len(parts) == 2 and parts[0] == "events":
                    prefix = key + "/"
                    fields = {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}
                    out.append((int(row["_step"]), parts[1], fields))
        return out


def run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """All `.wandb` files of one run id under a wandb directory, oldest first.

    Folders are `offline-run-<YYYYmmdd_HHMMSS>-<id>`; a start within the same second as the
    previous one gets a `-1`, `-2`, ... suffix.

    Args:
        wandb_dir: the directory holding `offline-run-*` folders (usually `<dir>/wandb`), or its
            parent.
        run_id: the run id.

    Returns:
        The files sorted by start time, then suffix.
    """
    root = Path(wandb_dir)
    if (root / "wandb").is_dir():
        root = root / "wandb"
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for folder in root.glob("offline-run-*"):
        match = pattern.fullmatch(folder.name)
        if match and (folder / f"run-{run_id}.wandb").is_file():
            found.append(((match[1], int(match[2] or 0)), folder / f"run-{run_id}.wandb"))
    return [path for _, path in sorted(found)]


def _item_value(item: Any) -> Any:
    return json.loads(item.value_json) if item.value_json else None


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_files(files: list[Path]) -> OfflineRun:
    """Read and concatenate offline files (for one run, in order)."""
    out = OfflineRun(files=list(files))
    for path in files:
        for record in iter_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.run_ids.add(record.run.run_id)
                if record.run.run_group:
                    out.groups.add(record.run.run_group)
                _apply_config(out.config, record.run.config)
            elif kind == "config":
                _apply_config(out.config, record.config)
            elif kind == "history":
                row = {_item_key(i): _item_value(i) for i in record.history.item}
                out.history.append(row)
    out.config.pop("_wandb", None)
    return out


def _apply_config(config: dict[str, Any], record: Any) -> None:
    for item in record.update:
        config[_item_key(item)] = _unwrap(json.loads(item.value_json))
    for item in record.remove:
        config.pop(_item_key(item), None)


def _unwrap(value: Any) -> Any:
    # wandb stores each config value as {"value": ..., "desc": ...}.
    if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
        return value["value"]
    return value


def read_run(wandb_dir: Path, run_id: str) -> OfflineRun:
    """Read every offline folder of `run_id` under `wandb_dir`, oldest first."""
    files = run_files(wandb_dir, run_id)
    if not files:
        raise ValueError(f"no offline-run-*-{run_id} folders under {wandb_dir}")
    return read_files(files)


def offline_env(root: Path) -> dict[str, str]:
    """Environment that keeps wandb offline and inside `root` (set it before wandb starts).

    Tests apply it with `monkeypatch.setenv` or pass it to child processes, so no test ever
    reaches the network or writes to the user's ~/.config/wandb or ~/.cache/wandb.
    """
    root = Path(root)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           "WANDB_DIR": str(root / "wandb-dir"), "WANDB_CONFIG_DIR": str(root / "wandb-config"),
           "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_DATA_DIR": str(root / "wandb-data"),
           "WANDB_ARTIFACT_DIR": str(root / "wandb-artifacts")}
    for key, value in env.items():
        if key.endswith("_DIR"):
            Path(value).mkdir(parents=True, exist_ok=True)
    return env
