"""torch's elastic agent as the launcher runs it: one class per run, composed in a fixed order,
put where torch's ``launch_agent`` looks in one place (``runtime/launch/agent.py``)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_each_run_composes_one_agent_class_in_a_fixed_order_and_gives_torchs_back() -> None:
    from torch.distributed.launcher import api as launcher_api

    from runtime.inprocess.launcher.agent import InProcessAgent
    from runtime.launch import agent, quorum

    torchs = launcher_api.LocalElasticAgent
    settings = object()
    with agent.installed(agent.StopRules(lambda: False), (InProcessAgent, {"inproc": settings})) as cls:
        assert launcher_api.LocalElasticAgent is cls
        assert cls.__mro__[1:5] == (InProcessAgent, agent.StopAware, quorum.MarksFinished, torchs)
        assert cls.inproc is settings
    assert launcher_api.LocalElasticAgent is torchs
    with agent.installed(agent.StopRules(lambda: False)) as cls:   # the restart path: no part of its own
        assert cls.__mro__[1:4] == (agent.StopAware, quorum.MarksFinished, torchs)
    assert launcher_api.LocalElasticAgent is torchs


class _Torch:
    """torch's monitor, as far as the stop rules read it: a failed group (pure logic)."""

    def _monitor_workers(self, worker_group: Any) -> Any:
        return SimpleNamespace(state=SimpleNamespace(name="FAILED"), failures={1: "boom"})


def _agent(**rules: Any) -> Any:
    from runtime.launch import agent

    cls = type("A", (agent.StopAware, _Torch), {"stop_rules": agent.StopRules(**rules)})
    a = cls()
    a._remaining_restarts = 3
    return a


def test_a_stopping_allocation_or_a_failure_that_would_repeat_restarts_no_worker() -> None:
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=3))
    stopping = _agent(stopping=lambda: True)
    stopping._monitor_workers(group)
    assert stopping._remaining_restarts == 0
    futile = _agent(stopping=lambda: False, futile=lambda result: "the disk is full")
    futile._monitor_workers(group)
    assert futile._remaining_restarts == 0
    told: list[tuple[Any, int, int]] = []
    healthy = _agent(stopping=lambda: False, on_restart=lambda f, k, n: told.append((f, k, n)))
    healthy._monitor_workers(group)
    assert healthy._remaining_restarts == 3 and told == [({1: "boom"}, 1, 3)]


def _assignments(attrs: set[str]) -> list[str]:
    out = []
    for f in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in attrs:
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno} .{t.attr}")
    return out


def test_torchs_agent_is_replaced_in_one_place_and_no_agent_keeps_state_in_its_dict() -> None:
    """One assignment to torch's agent attribute (and its restoring), none of torch's agent
    functions patched (its process start, its exit barrier): a feature extends the agent as a
    part of the composed class. No ``self.__dict__`` state in runtime/: an attribute is declared
    where it is made."""
    patched = _assignments({"LocalElasticAgent", "SimpleElasticAgent", "start_processes", "_exit_barrier"})
    assert [p.split(":")[0] for p in patched] == ["runtime/launch/agent.py"] * 2, patched
    dict_state = [f"{f.relative_to(ROOT)}:{i}" for f in sorted((ROOT / "runtime").rglob("*.py"))
                  for i, line in enumerate(f.read_text().splitlines(), 1) if "self.__dict__" in line]
    assert dict_state == []
