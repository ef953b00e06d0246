"""``JobEnvironment.to_env()`` is the only writer of the ``HPC_*`` variables in Python (and
``InProcessEnvironment.to_env()`` of in-process recovery's, ``HPC_RECOVERY`` and ``HPC_INPROC_*``).

The launcher-to-worker environment is one record (:mod:`hpc.contract.environment`); a variable
set by hand elsewhere (``os.environ[HPC_X] = ...``, ``env.setdefault(...)``, a dict literal
``{HPC_X: ...}`` handed to a child) would spell its format a second time, and a reader would
parse something :meth:`JobEnvironment.from_env` never checked. Writers build a
``JobEnvironment`` and call ``to_env()`` or ``export()``. Read from the source (AST).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpc.contract import environment, recovery_settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NAMES = {k for module in (environment, recovery_settings) for k, v in vars(module).items()
         if isinstance(v, str) and v.startswith("HPC_")}
HOMES = {ROOT / "hpc" / "contract" / "environment.py", ROOT / "hpc" / "contract" / "recovery_settings.py"}


def _names_hpc_variable(node: ast.AST | None) -> bool:
    """Whether an expression is a ``HPC_*`` literal or the environment module's constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("HPC_") and node.value[4:].isupper()
    if isinstance(node, ast.Attribute):
        return node.attr in NAMES and ast.unparse(node.value).endswith(("job_env", "environment", "recovery_settings"))
    return isinstance(node, ast.Name) and node.id in NAMES


def writers(source: str) -> list[int]:
    """Lines that set an ``HPC_*`` variable other than through ``JobEnvironment``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and _names_hpc_variable(t.slice) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("setdefault", "putenv") and node.args \
                and _names_hpc_variable(node.args[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(_names_hpc_variable(ast.Constant(k.arg))
                                                for k in node.keywords if k.arg):
            lines.append(node.lineno)      # dict(HPC_X=...), os.environ.update(HPC_X=...)
        elif isinstance(node, ast.Dict) and any(_names_hpc_variable(k) for k in node.keys):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_job_environment_writes_hpc_variables() -> None:
    found = []
    for package in ("hpc", "runtime", "hydra_plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path not in HOMES:
                found += [f"{path.relative_to(ROOT)}:{n}" for n in writers(path.read_text())]
    assert found == [], ("set HPC_* through JobEnvironment(...).to_env() / .export(environ), and in-process "
                         "recovery's through InProcessEnvironment(...).to_env()")


@pytest.mark.parametrize("code", [
    "os.environ[job_env.RDZV_EPOCH] = str(epoch)",
    "os.environ['HPC_JOB_END_TIME'] = '1'",
    "os.environ.setdefault(PENDING_WARNING, 'SIGUSR2@1')",
    "env = dict(os.environ, **{job_env.ALLOCATION: '0'})",
    "env = dict(os.environ, HPC_VERBOSE='1')",
    "env = {**os.environ, recovery_settings.JOIN_ENV: '1'}",
    "env[recovery_settings.STORE_ENV] = address",
])
def test_the_check_sees_each_way_of_writing_one(code: str) -> None:
    assert writers(code) == [1]


def test_reads_and_job_environment_writes_pass() -> None:
    assert writers("x = os.environ.get(job_env.RDZV_HOST)\n"
                   "JobEnvironment(rdzv_epoch=1).export(os.environ)\n"
                   "env.update(JobEnvironment(allocation=0).to_env())\n"
                   "print(f'HPC_KEPT={k}')\n") == []


def test_export_writes_to_env_and_keeps_a_first_warning() -> None:
    env = {environment.PENDING_WARNING: "SIGUSR2@1"}
    environment.JobEnvironment(pending_warning="SIGTERM@2", rdzv_epoch=0).export(env, keep_set=True)
    assert env == {environment.PENDING_WARNING: "SIGUSR2@1", environment.RDZV_EPOCH: "0"}
    environment.JobEnvironment(allocation=0, verbose=True).export(env)
    assert env[environment.ALLOCATION] == "0" and env[environment.VERBOSE] == "1"
    assert environment.JobEnvironment.from_env(env).verbose is True


def test_workers_of_the_first_allocation_are_told_it_and_are_fenced(tmp_path: Path) -> None:
    """Allocation 0 is a value: without HPC_ALLOCATION a worker's group skipped the succession
    fence (runtime.succession.fence_reason) in a job's first allocation under Slurm, while
    ``hpc run`` (which set the variable by hand) had it."""
    from hpc.contract.jobspec import JobSpec
    from runtime.launch.main import plan_launch
    from runtime.succession import fence_reason

    plan = plan_launch(JobSpec(script="train.py"), tmp_path, {"SLURM_JOB_ID": "7"},
                       rdzv_host="127.0.0.1", node_rank=0, run_id="r")
    assert plan.worker_env[environment.ALLOCATION] == "0"
    job = environment.JobEnvironment.from_env(plan.worker_env)
    assert job.allocation == 0 and job.job_dir == str(tmp_path)
    env = dict(plan.worker_env)
    environment.JobEnvironment(rdzv_epoch=0).export(env)
    assert fence_reason(env) is None        # no newer epoch on the board: commit as usual
