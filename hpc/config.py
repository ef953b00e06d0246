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

Errors speak TOML, not flags: the file, the table and the key with the value as written there,
and an example of that key in TOML (``hpc.toml [defaults] nodes = true is invalid: ... Example:
[defaults] nodes = 2``). Integers, numbers and booleans are TOML's own (``nproc_per_node = 8``,
``exclusive = true``): a quoted ``"8"`` or ``"false"`` is refused, not read as a number or a
boolean, since the quotes usually mean the value was meant as something else (a template, a
typo'd type) and a string ``"0"`` that silently means false is the bug we do not want. Values
that are text on the command line stay text here (``time = "4:00:00"``, ``nodes = "2:4"``,
``mem = "64G"``; ``time`` and ``nodes`` also take an integer: minutes and a node count).
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hpc.contract import values
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import CONFIG_KEYS, JobSpec, parse_options

_TOP_KEYS = ("default_profile", "defaults", "profiles")


@dataclass(frozen=True)
class Where:
    """Where a config value was written: the file, its table and its key."""

    path: str
    table: str      # "defaults", "profiles.mycluster", "tool.hpc.defaults"
    key: str

    def __str__(self) -> str:
        return f"{self.path} [{self.table}] {self.key}"


class ConfigError(SpecError):
    """A bad value in a config file, said in TOML: ``FILE [TABLE] KEY = VALUE is invalid: ...
    Example: [TABLE] KEY = EXAMPLE``."""

    def __init__(self, where: Where, value: object, valid: str, example: str, hint: str = "",
                 key: str = "") -> None:
        key = key or where.key
        super().__init__(f"{where.path} [{where.table}] {key}", value, valid, example, hint)
        message = (f"{where.path} [{where.table}] {key} = {toml_literal(value)} is invalid: {valid}. "
                   f"Example: [{where.table}] {where.key} = {example}" + (f". {hint}" if hint else ""))
        self.args = (message,)


@dataclass(frozen=True)
class Config:
    """A parsed config file: defaults and named profiles, as raw values keyed by field name."""

    path: str = ""
    default_profile: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    prefix: str = ""          # "tool.hpc." for [tool.hpc] in pyproject.toml

    def sources(self, profile: str = "") -> dict[str, Where]:
        """Where each of ``profile``'s option values was written (``[defaults]`` overlaid by the
        profile's table)."""
        name = profile or self.default_profile
        out = {k: Where(self.path, f"{self.prefix}defaults", _key(k)) for k in self.defaults}
        if name in self.profiles:
            table = f"{self.prefix}profiles.{_toml_key(name)}"
            out.update({k: Where(self.path, table, _key(k)) for k in self.profiles[name]})
        return out

    def options_for(self, profile: str = "") -> tuple[dict[str, Any], dict[str, str]]:
        """Raw option values for ``profile`` (``[defaults]`` overlaid by the profile).

        Returns:
            (field name -> raw value, field name -> where it came from, for error messages).
        """
        name = profile or self.default_profile
        merged: dict[str, Any] = dict(self.defaults)
        if name:
            if name not in self.profiles:
                valid = ", ".join(sorted(self.profiles)) or "none defined"
                raise SpecError("--profile", name, f"a profile defined in {self.path or 'hpc.toml'}"
                                f" (defined: {valid})", "--profile mycluster",
                                "Add [profiles.NAME] to hpc.toml to define one")
            merged.update(self.profiles[name])
        where = {k: str(w) for k, w in self.sources(profile).items()}
        if name:
            merged["profile"] = name
            where["profile"] = "--profile"
        return merged, where

    def parsed_options(self, profile: str = "") -> dict[str, Any]:
        """``profile``'s options as field values, each parsed and checked like its flag.

        Raises:
            ConfigError: for a value its key does not take (a quoted number or boolean
                included), naming the file, table and key, in TOML terms.
            SpecError: for an unknown profile.
        """
        raw, _ = self.options_for(profile)
        sources = self.sources(profile)
        out: dict[str, Any] = {}
        for name, value in raw.items():
            if name in sources:
                out[name] = parse_value(name, value, sources[name])
            else:   # the profile's own name, from --profile or default_profile
                out.update(parse_options({name: value}, source=lambda _: "--profile"))
        return out


_FIELDS = {f.name: f for f in fields(JobSpec)}
_TOML_TYPES = {"int": "integer", "float": "number", "bool": "boolean (true or false)"}


def _typed(field_name: str) -> str:
    """The TOML type a key must have ("" when text is fine too: ``time = "4:00:00"``)."""
    f = _FIELDS[field_name]
    return "" if f.metadata.get("parse") is values.parse_time else _TOML_TYPES.get(str(f.type), "")


def toml_example(field_name: str) -> str:
    """A valid value of the field's key in TOML, from its flag's example (pure)."""
    meta = _FIELDS[field_name].metadata
    words = shlex.split(meta.get("example") or "")
    text = " ".join(words[1:])
    if meta.get("flag"):
        return "false" if words and words[0].startswith("--no-") else "true"
    if meta.get("repeat"):
        return toml_literal([text])
    return text if _typed(field_name) else toml_literal(text)


def toml_literal(value: object) -> str:
    """``value`` as it is written in TOML, on one line (``true``, ``"a\\nb"``, ``[1, 2]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)           # nan, inf and -inf are TOML too
    if isinstance(value, str):
        out = []
        for c in value:
            if c in '"\\':
                out.append("\\" + c)
            elif c == "\n":
                out.append("\\n")
            elif c.isascii() and c.isprintable():
                out.append(c)
            else:
                out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
        return '"' + "".join(out) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(x) for x in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {toml_literal(v)}"
                                for k, v in value.items()) + " }"
    return toml_literal(str(value))


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_literal(key)


def parse_value(field_name: str, value: Any, where: Where) -> Any:
    """One config value -> the field's value, checked like its flag (pure).

    Raises:
        ConfigError: for a value the key does not take, in TOML terms.
    """
    kind = _typed(field_name)
    if kind and isinstance(value, str):
        plain = value.strip().lower()
        example = plain if (plain.isascii() and plain.isdigit() and kind == "integer") or \
            (plain in ("true", "false") and kind.startswith("boolean")) else toml_example(field_name)
        raise ConfigError(where, value, f"a TOML {kind}, written without quotes (a quoted value "
                          "is a string)", example)
    parse = _FIELDS[field_name].metadata["parse"]
    try:
        return parse(value, where.key)
    except SpecError as e:
        inner = e.flag[len(where.key):].strip() if e.flag.startswith(where.key) else ""
        valid = e.valid if isinstance(e.value, str) else e.valid.replace(" in ASCII digits", "")
        raise ConfigError(where, e.value if inner else value, valid, toml_example(field_name),
                          e.hint, f"{where.key}.{_toml_key(inner)}" if inner else "") from None


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


def parse_config(data: Mapping[str, Any], path: str = "hpc.toml", prefix: str = "") -> Config:
    """Builds a :class:`Config` from the decoded TOML table (pure, for tests); ``prefix`` is
    ``"tool.hpc."`` for the ``[tool.hpc]`` table of a pyproject.toml."""
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
        defaults=_section(data.get("defaults", {}), f"{path} [{prefix}defaults]"),
        profiles={name: _section(tbl, f"{path} [{prefix}profiles.{_toml_key(name)}]")
                  for name, tbl in profiles_raw.items()},
        prefix=prefix,
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
        return parse_config(data, str(path), "tool.hpc." if in_pyproject else "")
    return Config()
