"""The project's import graph, read from the source (AST, nothing imported).

* No import circle anywhere in ``hpc/`` and ``runtime/``: a circle makes the import order
  matter (a name missing halfway through a module) and hides which module is the base.
* No function-local import of a torch-free project module: such an import hides a dependency
  from the top of the file (and, often, a circle). Heavy modules (those that import torch,
  wandb, torchx, submitit or matplotlib at load, directly or through another project module)
  may be imported where they are used, to keep the login node and the worker's start light;
  the few other exceptions are listed in :data:`ALLOWED`, each with its reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit import import_graph
from tests.unit.import_graph import ROOT, Import, imports, modules

pytestmark = pytest.mark.unit

HEAVY = ("torch", "wandb", "torchx", "submitit", "matplotlib")

_COMMANDS = ("the API is loaded by every `hpc submit`; each API call loads the command module "
             "it wraps (status, logs, sweeps, local runs: ~70 modules with jinja2) when called")
ALLOWED: dict[str, str] = {
    # "module" (all its local imports) or "module -> target": why the import stays local
    "hpc.cli": "command dispatch: `hpc --help` builds the parser only; each command's module is "
               "imported when that command runs (login-node start-up)",
    "hpc.submission -> hpc.api": "`hpc render` / `--dry-run` load no Slurm client, lock or job "
                                 "index (tenacity, subprocess, ~30 modules): only `hpc submit` does",
    "hpc.report.command": "`hpc --help` imports it for its add_parser; main() loads the report "
                          "(ledger, loader, job index with the Slurm client: tenacity)",
    "hpc.sync -> hpc.contract.index": "`hpc --help` imports hpc.sync for its add_parser; the job index "
                             "loads the Slurm client (tenacity)",
    "hpc.sync -> hpc.report.wandb_story": "`hpc --help` imports hpc.sync for its add_parser; the "
                                          "story loads the ledger and its loader (Slurm client, "
                                          "tenacity)",
    "hpc.report.load -> hpc.contract.slurm": "`hpc report DIR` needs no Slurm client (tenacity, "
                                             "subprocess, the sacct parser: a tenth of its start); "
                                             "a job id's queue times do",
    "hpc.api -> hpc.status": _COMMANDS,
    "hpc.api -> hpc.logs": _COMMANDS,
    "hpc.api -> hpc.sweeps": _COMMANDS,
    "hpc.api -> hpc.backends.local": _COMMANDS,
}


def allowed(module: str, target: str) -> bool:
    return module in ALLOWED or f"{module} -> {target}" in ALLOWED


def heavy_modules(mods: dict[str, Path], edges: list[Import], third: dict[str, set[str]]) -> set[str]:
    """Project modules that load a heavy library at import, directly or through others."""
    top: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if not e.local and not e.typing:
            top[e.module].add(e.target)
    heavy = {m for m in mods if third[m] & set(HEAVY)}
    changed = True
    while changed:
        changed = False
        for m in mods:
            if m not in heavy and top[m] & heavy:
                heavy.add(m)
                changed = True
    return heavy


def circles(mods: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), imports of every kind."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        graph[e.module].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for m in sorted(mods):
        if m not in index:
            visit(m)
    return out


def test_no_import_circles_in_hpc_and_runtime() -> None:
    mods = modules()
    edges, _ = imports(mods)
    found = circles(mods, edges)
    detail = [[f"{e.module}:{e.line} -> {e.target}" for e in edges if e.module in c and e.target in c]
              for c in found]
    assert found == [], detail


def test_no_function_local_import_of_a_torch_free_project_module() -> None:
    mods = modules()
    edges, third = imports(mods)
    heavy = heavy_modules(mods, edges, third)
    assert {"runtime.session", "runtime.checkpoint.checkpointer"} <= heavy
    assert "hpc.contract.slurm" not in heavy and "runtime.checkpoint.manifest" not in heavy
    offenders = sorted({f"{e.module}:{e.line} imports {e.target}" for e in edges
                        if e.local and not e.lazy and e.target not in heavy and not allowed(e.module, e.target)})
    assert offenders == [], "\n".join(offenders)


def test_hpc_help_loads_no_command_body() -> None:
    """`hpc --help` builds the parser only: no Slurm client (tenacity), job index or report
    code, which the allow-listed local imports keep out (146 modules on 043ffe6; 196 with them)."""
    import subprocess
    import sys

    code = ("import sys\nfrom hpc.cli import build_parser\nbuild_parser().format_help()\n"
            "print(sorted(m for m in sys.modules if m in BODY))")
    body = ("tenacity", "hpc.contract.slurm", "hpc.contract.index", "hpc.report.load", "hpc.contract.ledger",
            "hpc.status", "hpc.logs", "hpc.api")
    r = subprocess.run([sys.executable, "-c", f"BODY = {body!r}\n" + code], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_checks_see_circles_and_local_imports(tmp_path: Path, monkeypatch) -> None:
    """The detectors themselves, on a made-up package: a circle through a local import, a
    light module imported in a function, a heavy one allowed there."""
    pkg = tmp_path / "hpc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hpc import b\n")
    (pkg / "b.py").write_text("def f():\n    from hpc import a\n    from hpc import c\n")
    (pkg / "c.py").write_text("import torch\n")
    (pkg / "d.py").write_text("def g():\n    from hpc.c import x\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "PACKAGES", ("hpc",))
    mods = modules()
    edges, third = imports(mods)
    assert circles(mods, edges) == [["hpc.a", "hpc.b"]]
    heavy = heavy_modules(mods, edges, third)
    assert heavy == {"hpc.c"}
    local_light = sorted((e.module, e.target) for e in edges if e.local and e.target not in heavy)
    assert local_light == [("hpc.b", "hpc.a")]
