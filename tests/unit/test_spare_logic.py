"""Hot spares (``--spare-nodes``), the pure parts: the option and what each backend makes of it,
which node waited as a spare and when it joined (from the launchers' events), its idle time as
its own category of the goodput ledger, and ``hpc status``'s line. The behaviour across
processes and nodes is proven in tests/distributed/test_spares_local.py and
tests/slurm/test_spares_on_cluster.py.
"""

from __future__ import annotations

import pytest

from hpc import backends
from hpc.backends import slurm_options
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.ledger import CATEGORIES, build
from hpc.contract.spare_waits import describe, spare_waits
from hpc.report.table import format_table

pytestmark = pytest.mark.unit


def spec(**kw) -> JobSpec:
    return JobSpec(script="train.py", job_dir="/abs/job", **kw)


# --- the option ----------------------------------------------------------------------------
def test_spare_nodes_are_allocated_beyond_max_and_never_waited_for():
    assert slurm_options.nodes_range(spec(nodes=(2, 2), spare_nodes=1)) == "2-3"
    assert slurm_options.nodes_range(spec(nodes=(2, 4), spare_nodes=2)) == "2-6"
    assert slurm_options.nodes_range(spec(nodes=(2, 2))) == "2"


@pytest.mark.parametrize("bad", [-1, "x", 1.5, 1025])
def test_a_bad_spare_count_names_the_flag_and_the_valid_values(bad):
    from hpc.contract import spec_terms
    with spec_terms.cli_terms(), pytest.raises(SpecError) as e:
        spec(spare_nodes=bad)
    assert "--spare-nodes" in str(e.value) and "1024" in str(e.value), str(e.value)


def test_nodes_and_spares_together_stay_within_the_node_limit():
    from hpc.contract import spec_terms, values
    with spec_terms.cli_terms(), pytest.raises(SpecError) as e:
        spec(nodes=(values.MAX_NODES, values.MAX_NODES), spare_nodes=1)
    assert "--spare-nodes" in str(e.value) and "at most 0" in str(e.value)


def test_every_backend_carries_spares_or_refuses_them_naming_the_flag():
    s = spec(nodes=(2, 2), spare_nodes=1)
    assert "--nodes=2-3" in backends.get("sbatch").plan(s).describe()
    assert '"nodes": "2-3"' in backends.get("submitit").plan(s).describe()
    with pytest.raises(SpecError) as e:
        backends.get("torchx").plan(s)
    assert "--spare-nodes" in str(e.value) and "--backend sbatch" in str(e.value)


def test_the_batch_shell_gives_back_excluded_nodes_of_a_job_with_spares():
    """A fixed-size job with a spare has an allocation that can shrink (MIN to MAX + K): the
    exclusions step is needed, so a backend without it must refuse the job."""
    step = next(s for s in backends.BATCH_STEPS if s.name == "exclusions")
    assert step.needed(spec(nodes=(2, 2), spare_nodes=1)) and not step.needed(spec(nodes=(2, 2)))
    assert step.asked_by(spec(nodes=(2, 2), spare_nodes=1)) == "--nodes 2 --spare-nodes 1"
    assert slurm_options.exclusion_lines(spec(nodes=(1, 1), spare_nodes=1)), "two launchers"


# --- which node waited, the ledger ---------------------------------------------------------
def launcher(t, name, node, rank, **kw):
    return {"t": t, "ev": name, "alloc": 0, "node": node, "node_rank": rank, **kw}


def rank0(t, name, restart=0, **kw):
    return {"t": t, "ev": name, "alloc": 0, "node": "n1", "rank": 0, "restart": restart, **kw}


def crash_with_spare(joined: bool = True) -> list[dict]:
    """n1, n2 train from 10 s; n3 waits as the spare. n2 dies at 50 s (no record of its own);
    n3 joins at 55 s, the group resumes at step 40 and finishes at 100 s."""
    evs = [launcher(0, "alloc_start", n, r) for r, n in enumerate(("n1", "n2", "n3"))]
    evs += [launcher(2, "node_ready", n, r, spare_nodes=1) for r, n in enumerate(("n1", "n2", "n3"))]
    evs += [launcher(10, "agent_rendezvous", "n1", 0, t0=3), launcher(10, "agent_rendezvous", "n2", 1, t0=3),
            launcher(10.01, "workers_started", "n1", 0, nodes=2),
            launcher(10.02, "workers_started", "n2", 1, nodes=2),
            rank0(10.5, "session_start", t_proc=10.1), rank0(11, "rendezvous"),
            rank0(11, "restore_begin"), rank0(11, "restore_end", step=0), rank0(11, "loop_start", step=0),
            rank0(50, "steps", t0=11, first=1, last=45, count=45),
            rank0(30, "ckpt_save", step=40, block_s=0.0)]
    if joined:
        evs += [launcher(55, "agent_rendezvous", "n1", 0, t0=51),
                launcher(55, "agent_rendezvous", "n3", 2, t0=3),   # its wait, then the join
                launcher(55.01, "workers_started", "n1", 0, nodes=2),
                launcher(55.02, "workers_started", "n3", 2, nodes=2),
                rank0(55.5, "session_start", restart=1, t_proc=55.1), rank0(56, "rendezvous", restart=1),
                rank0(56, "restore_begin", restart=1), rank0(57, "restore_end", restart=1, step=40),
                rank0(57, "loop_start", restart=1, step=40),
                rank0(97, "steps", restart=1, t0=57, first=41, last=100, count=60),
                rank0(98, "session_end", restart=1, ok=True)]
    else:
        evs += [rank0(97, "steps", t0=50, first=46, last=100, count=55), rank0(98, "session_end", ok=True),
                launcher(100, "agent_rendezvous", "n3", 2, t0=3)]   # released at the end
    evs += [launcher(100, "alloc_end", n, r, kind="finished", exit_code=0)
            for r, n in ((0, "n1"), (2, "n3"))] + \
        ([launcher(100, "alloc_end", "n2", 1, kind="finished", exit_code=0)] if not joined else [])
    return sorted(evs, key=lambda e: e["t"])


def test_the_node_that_waited_is_the_spare_and_its_join_is_when_its_workers_started():
    waits = spare_waits(crash_with_spare(), {"n1": 100, "n2": 100, "n3": 100})
    assert list(waits) == ["n3"]
    w = waits["n3"]
    assert (w.t0, w.t1, w.joined) == (10.01, 55.02, True)


def test_without_spares_no_node_is_one():
    evs = [e for e in crash_with_spare() if e["ev"] != "node_ready"]
    assert spare_waits(evs, {}) == {}
    evs = [dict(e, spare_nodes=0) if e["ev"] == "node_ready" else e for e in crash_with_spare()]
    assert spare_waits(evs, {}) == {}


def test_the_ledger_counts_the_spares_wait_as_its_own_category_and_marks_its_join():
    led = build(crash_with_spare(), slurm_runs={0: {"start": 0, "end": 100, "node_ends": {"n2": 60}}})
    [a] = led.allocations
    assert led.categories["spare"] == pytest.approx(55.02 - 10.01)
    assert sum(led.categories.values()) == pytest.approx(led.allocated_node_s)
    assert [m.label for m in a.markers if m.kind == "spare"] == ["spare n3 joins"]
    assert a.spares == {"n3": [10.01, 55.02, True]}
    assert "idle hot spares" in format_table(led)
    assert "spare" in CATEGORIES


@pytest.mark.parametrize("joined", [True, False])
def test_the_spares_own_rendezvous_round_is_its_wait_not_a_re_form(joined):
    """Its agent's round spans its whole wait ([3, 55], or [3, 100] when released at the end):
    the ledger is the same as without that record."""
    runs = {0: {"start": 0, "end": 100, "node_ends": {"n2": 60}}}
    evs = crash_with_spare(joined)
    without = [e for e in evs if not (e["ev"] == "agent_rendezvous" and e["node"] == "n3")]
    assert build(evs, slurm_runs=runs).categories == build(without, slurm_runs=runs).categories


def test_a_spare_never_needed_is_idle_until_the_end():
    led = build(crash_with_spare(joined=False))
    assert led.categories["spare"] == pytest.approx(100 - 10.01)
    assert sum(led.categories.values()) == pytest.approx(led.allocated_node_s)
    assert not [m for m in led.allocations[0].markers if m.kind == "spare"]


def test_status_names_the_spare_and_what_became_of_it():
    assert describe(crash_with_spare(), 1) == "hot spares: 1; n3 joined 55s in"
    assert describe(crash_with_spare(joined=False), 1) == "hot spares: 1; n3 not needed"
    running = [e for e in crash_with_spare(joined=False) if e["ev"] != "alloc_end"]
    assert describe(running, 1) == "hot spares: 1; n3 waiting"
    assert describe(crash_with_spare(), 0) == ""


def test_launchers_sharing_a_host_are_told_apart_by_node_rank():
    """hpc run: every launcher is on this machine."""
    evs = [dict(e, node="vm") for e in crash_with_spare()]
    assert describe(evs, 1) == "hot spares: 1; vm (node rank 2) joined 55s in"


def test_the_picture_gives_the_spare_a_lane(tmp_path):
    pytest.importorskip("matplotlib")
    from hpc.report.plot import render_png

    led = build(crash_with_spare(), slurm_runs={0: {"start": 0, "end": 100, "node_ends": {"n2": 60}}})
    assert render_png(led, tmp_path / "t.png").stat().st_size > 1000


def spare_allocation(n: int) -> list[dict]:
    """``n`` launchers and 2 hot spares: the first ``n`` train from 10 s; node 0 dies at 50 s
    (no record of its own) and the first spare joins at 55 s; the other spare is never needed."""
    hosts = [f"node{r:05d}" for r in range(n + 2)]
    evs = [launcher(0.001 * r, "alloc_start", h, r) for r, h in enumerate(hosts)]
    evs += [launcher(2, "node_ready", h, r, spare_nodes=2) for r, h in enumerate(hosts)]
    evs += [launcher(10, "agent_rendezvous", h, r, t0=3) for r, h in enumerate(hosts[:n])]
    evs += [launcher(10.01, "workers_started", h, r, nodes=n) for r, h in enumerate(hosts[:n])]
    evs += [rank0(10.5, "session_start", t_proc=10.1), rank0(11, "rendezvous"), rank0(11, "restore_begin"),
            rank0(11, "restore_end", step=0), rank0(11, "loop_start", step=0),
            rank0(50, "steps", t0=11, first=1, last=45, count=45), rank0(50, "crash", error="lost", step=46)]
    evs += [launcher(55, "agent_rendezvous", h, r, t0=51 if r < n else 3)
            for r, h in enumerate(hosts[1:n + 1], 1)]
    evs += [launcher(55.01, "workers_started", h, r, nodes=n) for r, h in enumerate(hosts[1:n + 1], 1)]
    evs += [rank0(55.5, "session_start", restart=1, t_proc=55.1), rank0(56, "rendezvous", restart=1),
            rank0(56, "restore_begin", restart=1), rank0(57, "restore_end", restart=1, step=40),
            rank0(57, "loop_start", restart=1, step=40),
            rank0(97, "steps", restart=1, t0=57, first=41, last=100, count=60),
            rank0(98, "session_end", restart=1, ok=True)]
    evs += [launcher(100, "alloc_end", h, r, kind="finished", exit_code=0) for r, h in enumerate(hosts) if r]
    return sorted(evs, key=lambda e: e["t"])


def test_the_ledger_of_an_allocation_with_spares_is_linear_in_its_launchers() -> None:
    """With hot spares, every launcher's rendezvous round recomputed every launcher's label
    (``in_wait``: O(N) per event), and every ready node scanned every node's worker starts
    (``spare_waits``): O(N^2) per allocation. The ledger's work is counted in lines of Python
    run, not timed, at 256 and 1,024 launchers: four times the launchers, at most five times
    the work (it was 15 times)."""
    from tests.work import lines_run

    for n in (256, 1024):
        led = build(spare_allocation(n))
        a = led.allocations[0]
        assert list(a.spares) == [f"node{n:05d}", f"node{n + 1:05d}"]
        assert a.spares[f"node{n:05d}"][1:] == [55.01, True]
        assert a.node_dead == {"node00000": 50.0}
    small, big = (lines_run(lambda evs=spare_allocation(n): build(evs)) for n in (256, 1024))
    assert big <= 5 * small, (small, big)
