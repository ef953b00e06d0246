"""Login-node speed: importing hpc and running `hpc --help` / `hpc render` never imports torch,
wandb, torchx or matplotlib (each costs 0.2-1.5 s, and torch may not even be installed on a login
node); `hpc report` loads matplotlib only to draw a picture."""

import subprocess
import sys

import pytest

from tests.unit.support import BLOCK_HEAVY

pytestmark = pytest.mark.unit


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_HEAVY + code], capture_output=True, text=True)


def test_import_hpc_cli_without_torch():
    r = _run("import hpc, hpc.cli, hpc.contract.jobspec, hpc.config, hpc.contract.jobdir")
    assert r.returncode == 0, r.stderr


def test_hpc_help_without_torch():
    r = _run("import sys; sys.argv=['hpc','--help']\nfrom hpc.cli import main\nmain()")
    assert "usage: hpc" in r.stdout, r.stderr


def test_no_heavy_module_loaded_by_help():
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom hpc.cli import build_parser\n"
                        "build_parser().format_help()\n"
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                        "('torch','wandb','torchx','submitit','matplotlib')))"], capture_output=True, text=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_no_module_of_hpc_imports_runtime() -> None:
    """hpc/ is the login-node side and the job contract; runtime/ depends on it, never the
    other way (hpc doctor runs ``python -m runtime.launch.doctor`` as a process)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "hpc"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(root.parent)}: {n}" for n in names
                          if n == "runtime" or n.startswith("runtime.")]
    assert offenders == []


def test_hpc_report_table_and_json_without_torch_or_matplotlib(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "events" / "worker_fail_resume"
    for name in ("events.jsonl", "outcomes.jsonl"):
        (tmp_path / name).write_text((fixture / name).read_text())
    for extra in ([], ["--json"]):
        r = _run(f"import sys; sys.argv=['hpc','report',{str(tmp_path)!r},*{extra!r}]\n"
                 "from hpc.cli import main\nsys.exit(main())")
        assert r.returncode == 0, r.stderr
        assert "goodput" in r.stdout


def test_api_names_are_not_shadowed_by_modules():
    """``hpc.submit`` is the API function in every import order (no module of that name)."""
    r = _run("import hpc, hpc.cli, hpc.submission, hpc.sweeps, hpc.status\n"
             "assert hpc.submit.__module__ == 'hpc.api' and hpc.sweep.__module__ == 'hpc.api'\n"
             "from hpc.cli import main\nimport sys\nsys.exit(main(['render', 'README.md']))")
    assert "invalid" not in r.stderr and "AttributeError" not in r.stderr, r.stderr


def test_hpc_render_without_torch_or_matplotlib(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = _run(f"import sys; sys.argv=['hpc','render',{str(script)!r},'--nodes','2','--job-dir',"
             f"{str(tmp_path / 'job')!r}]\nfrom hpc.cli import main\nsys.exit(main())")
    assert r.returncode == 0, r.stderr
    assert "#SBATCH" in r.stdout
