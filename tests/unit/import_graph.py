"""The project's import graph, read from the source (AST, nothing imported): every import of a
project module in ``hpc/`` and ``runtime/``, with where it stands (inside a function, under
``if TYPE_CHECKING:``). tests/unit/test_import_graph.py checks the graph for circles and
function-local imports, tests/unit/test_rooms.py for imports across the processes' rooms."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hpc", "runtime")


@dataclass(frozen=True)
class Import:
    module: str      # the importing module
    target: str      # the project module imported
    line: int
    local: bool      # inside a function
    typing: bool     # under `if TYPE_CHECKING:`
    lazy: bool = False   # a name a package exports lazily (its module `__getattr__` imports it)


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ids(nodes: list[ast.AST]) -> set[int]:
    return {id(n) for node in nodes for n in ast.walk(node)}


def imports(mods: dict[str, Path]) -> tuple[list[Import], dict[str, set[str]]]:
    """Every import of a project module, and each module's top-level third-party roots."""
    edges: list[Import] = []
    third: dict[str, set[str]] = {m: set() for m in mods}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    trees = {mod: ast.parse(path.read_text()) for mod, path in mods.items()}
    lazy_exports = {mod for mod, tree in trees.items() if any(
        isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)}
    for mod, path in mods.items():
        tree = trees[mod]
        in_function = _ids([n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))])
        typing_only = _ids([n for n in ast.walk(tree) if isinstance(n, ast.If)
                            and "TYPE_CHECKING" in ast.unparse(n.test)])
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            local, typing = id(node) in in_function, id(node) in typing_only
            for name in names:
                target = resolve(name)
                if target is None:
                    if not local and not typing:
                        third[mod].add(name.split(".")[0])
                elif target != mod:
                    lazy = isinstance(node, ast.ImportFrom) and target in lazy_exports
                    edges.append(Import(mod, target, node.lineno, local, typing, lazy))
    return edges, third
