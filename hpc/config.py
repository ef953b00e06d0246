"""Config files and cluster profiles.

Users keep per-cluster defaults (partition, account, qos, ...) in ``hpc.toml`` or in
``[tool.hpc]`` of their project's ``pyproject.toml``::

    default_profile = "mycluster"

    [defaults]              # applies to every profile
    wandb_project = "gpt"

    [profiles.mycluster]
    partition = "gpu"
    account = "proj123"
    time = "4:00:00"

**Precedence** (the one place it is defined): command-line flag > the selected profile >
``[defaults]`` > the built-in default of :class:`~hpc.contract.jobspec.JobSpec`. The profile is the
one named by ``--profile``, else ``default_profile``, else none.

The file is found at ``--config PATH``, else ``$HPC_CONFIG``, else ``./hpc.toml``, else
``./pyproject.toml`` (``[tool.hpc]``), else ``~/.config/hpc/hpc.toml``. Unknown keys are
errors that list every valid key: a typo must never be silently ignored.

A config file is trusted as input (it is the user's, or came with a cloned repository) but
never executed and never passed through unchecked: every value goes through the same parser
and checks as the flag it stands for, so ``partition = "gpu\\necho pwned"`` or
``partition = true`` is refused (exit 2, naming the file, table and key) exactly like
``--partition`` would be. See docs/security.md.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.contract.errors import SpecError
from hpc.contract.jobspec import CONFIG_KEYS

_TOP_KEYS = ("default_profile", "defaults", "profiles")


@dataclass(frozen=True)
class Config:
    """A parsed config file: defaults and named profiles, as raw values keyed by field name."""

    path: str = ""
    default_profile: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def options_for(self, profile: str = "") -> tuple[dict[str, Any], dict[str, str]]:
        """Raw option values for ``profile`` (``[defaults]`` overlaid by the profile).

        Returns:
            (field name -> raw value, field name -> where it came from, for error messages).
        """
        name = profile or self.default_profile
        merged: dict[str, Any] = dict(self.defaults)
        where = {k: f"{self.path} [defaults] {_key(k)}" for k in self.defaults}
        if name:
            if name not in self.profiles:
                valid = ", ".join(sorted(self.profiles)) or "none defined"
                raise SpecError("--profile", name, f"a profile defined in {self.path or 'hpc.toml'}"
                                f" (defined: {valid})", "--profile mycluster",
                                "Add [profiles.NAME] to hpc.toml to define one")
            merged.update(self.profiles[name])
            where.update({k: f"{self.path} [profiles.{name}] {_key(k)}" for k in self.profiles[name]})
            merged["profile"] = name
            where["profile"] = "--profile"
        return merged, where


def _key(field_name: str) -> str:
    return next(k for k, v in CONFIG_KEYS.items() if v == field_name)


def _section(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise SpecError(where, data, "a table of options", f"[{where}] partition = \"gpu\"")
    out = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm not in CONFIG_KEYS:
            raise SpecError(f"{where} key", key, "one of " + ", ".join(sorted(CONFIG_KEYS)),
                            'partition = "gpu"')
        out[CONFIG_KEYS[norm]] = value
    return out


def parse_config(data: Mapping[str, Any], path: str = "hpc.toml") -> Config:
    """Builds a :class:`Config` from the decoded TOML table (pure, for tests)."""
    for key in data:
        if key not in _TOP_KEYS:
            raise SpecError(f"{path} key", key, "one of " + ", ".join(_TOP_KEYS)
                            + " (options go under [defaults] or [profiles.NAME])",
                            '[profiles.mycluster] partition = "gpu"')
    profiles_raw = data.get("profiles", {})
    if not isinstance(profiles_raw, Mapping):
        raise SpecError(f"{path} profiles", profiles_raw, "tables [profiles.NAME]",
                        '[profiles.mycluster] partition = "gpu"')
    default_profile = data.get("default_profile", "")
    if not isinstance(default_profile, str):
        raise SpecError(f"{path} default_profile", default_profile, "a profile name, quoted",
                        'default_profile = "mycluster"')
    return Config(
        path=path,
        default_profile=default_profile,
        defaults=_section(data.get("defaults", {}), f"{path} [defaults]"),
        profiles={name: _section(tbl, f"{path} [profiles.{name}]") for name, tbl in profiles_raw.items()},
    )


def find_config(explicit: str = "", cwd: Path | None = None,
                environ: Mapping[str, str] = os.environ) -> Config:
    """Finds and parses the config file (see the module docstring for the search order)."""
    cwd = cwd or Path.cwd()
    candidates: list[tuple[Path, bool]] = []
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise SpecError("--config", explicit, "an existing TOML file", "--config hpc.toml")
        candidates.append((p, False))
    elif environ.get("HPC_CONFIG"):
        p = Path(environ["HPC_CONFIG"])
        if not p.is_file():
            raise SpecError("HPC_CONFIG", str(p), "an existing TOML file", "HPC_CONFIG=~/hpc.toml")
        candidates.append((p, False))
    else:
        candidates += [(cwd / "hpc.toml", False), (cwd / "pyproject.toml", True),
                       (Path(environ.get("HOME", "~")).expanduser() / ".config/hpc/hpc.toml", False)]
    for path, in_pyproject in candidates:
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SpecError(str(path), "(file)", f"valid TOML ({e})", 'partition = "gpu"') from None
        except OSError as e:
            raise SpecError(str(path), "(file)", f"a readable file ({e.strerror or e})",
                            "--config hpc.toml") from None
        if in_pyproject:
            tool = data.get("tool", {})
            data = tool.get("hpc") if isinstance(tool, Mapping) else None
            if data is None:
                continue
        if not isinstance(data, Mapping):
            raise SpecError(f"{path} [tool.hpc]" if in_pyproject else str(path), data,
                            "a table of options", '[tool.hpc.profiles.mycluster] partition = "gpu"')
        return parse_config(data, str(path))
    return Config()
