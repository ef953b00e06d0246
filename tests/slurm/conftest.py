"""Fixtures for the slurm tier: one real multi-node Slurm cluster per test session.

The cluster (``tests/cluster/slurm_cluster.py``) is brought up once, or reused when one is already
up and healthy, and every test gets it back clean: after each test, cut links are healed, killed
daemons restarted, leftover jobs cancelled and all nodes idle again, so that a test that crashes a
node cannot poison the next one. Without root or without Slurm installed the fixture fails with
the reason; it never skips silently. ``HPC_KEEP_CLUSTER=1`` keeps a cluster this session started.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping

import pytest

_HERE = Path(__file__).resolve().parent


def _load_cluster_module() -> ModuleType:
    """Import tests/cluster/slurm_cluster.py by path (it is a script, not part of the package)."""
    name = "hpc_test_slurm_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE.parent / "cluster" / "slurm_cluster.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is created
    spec.loader.exec_module(module)
    return module


sc = _load_cluster_module()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/slurm is in the slurm tier, even if its module forgot the mark."""
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


@dataclass
class SlurmTestCluster:
    """A running test cluster, as handed to tests.

    Attributes:
        cluster: Where it lives (state dir, node count).
        env: Environment for subprocesses (this process's plus ``SLURM_CONF``).
        nodes: Compute node names, ``["node1", "node2", "node3"]``.
        started_here: Whether this session brought it up (and so takes it down).
    """

    cluster: "sc.Cluster"
    env: dict[str, str] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    started_here: bool = False

    def crash(self, node: str) -> list[int]:
        """SIGKILL slurmd and every job process on ``node``; returns the killed pids."""
        return sc.crash(self.cluster, node)

    def processes(self, node: str, match) -> list[int]:
        """PIDs of ``node``'s processes whose argv (bytes fields) ``match`` accepts."""
        return sc.node_processes(node, match)

    def cut(self, node: str) -> None:
        """Take ``node``'s network link down (processes keep running, unreachable)."""
        sc.cut(self.cluster, node)

    def heal(self, node: str) -> None:
        """Bring ``node``'s link back up."""
        sc.heal(self.cluster, node)

    def restart_slurmd(self, node: str) -> None:
        """Start ``node``'s slurmd again (after :meth:`crash`)."""
        sc.restart_slurmd(self.cluster, node)

    def stop_controller(self) -> None:
        """Stop slurmctld (clients then see "Unable to contact slurm controller")."""
        sc.stop_slurmctld(self.cluster)

    def start_controller(self) -> None:
        """Start slurmctld again with its saved state."""
        sc.start_slurmctld(self.cluster)

    def node_states(self) -> dict[str, str]:
        """sinfo state of each node (``idle``, ``alloc``, ``down*`` ...)."""
        return sc.node_states(self.cluster)

    def wait_idle(self, nodes: list[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until the nodes are idle, resuming any that Slurm marked down."""
        sc.wait_idle(self.cluster, nodes, timeout)

    def restore(self) -> None:
        """Heal, restart daemons, cancel all jobs, wait until every node is idle."""
        sc.restore(self.cluster)


# One cluster per machine: concurrent test sessions (several checkouts, test lanes) take
# turns. Not /tmp/hpc-slurm.lock, which people wrap whole pytest runs in by hand.
CLUSTER_LOCK = Path("/run/hpc-test-cluster.lock")


@pytest.fixture(scope="session")
def _cluster_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """Hold the machine's cluster lock for this session's slurm tests."""
    with open(CLUSTER_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"\nslurm test cluster busy ({CLUSTER_LOCK}): waiting for the other session")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest, _cluster_turn: None) -> Iterator[SlurmTestCluster]:
    """The session's Slurm cluster (brought up, or reused when already up and healthy)."""
    try:
        sc.check_prerequisites()
    except sc.ClusterError as exc:
        pytest.fail(f"the slurm test tier needs the real test cluster: {exc}", pytrace=False)
    cluster = sc.Cluster(Path(os.environ.get("HPC_TEST_CLUSTER_DIR", str(sc.DEFAULT_STATE_DIR))))
    nodes_recorded = sc._load_record(cluster).get("nodes")
    if nodes_recorded:
        cluster = sc.Cluster(cluster.state_dir, int(nodes_recorded))
    healthy = sc.is_healthy(cluster)
    t0 = time.monotonic()
    try:
        if healthy:
            sc.restore(cluster)
        else:
            sc.up(cluster)
    except sc.ClusterError as exc:
        pytest.fail(f"could not bring the Slurm test cluster up: {exc}", pytrace=False)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # into the CI log, past pytest's capture
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nslurm test cluster: {cluster.nodes} nodes "
                                f"{'reused' if healthy else 'brought up'} in {time.monotonic() - t0:.1f} s")
    handle = SlurmTestCluster(cluster=cluster, env=cluster.env, nodes=cluster.node_names,
                              started_here=not healthy)
    yield handle
    if handle.started_here and os.environ.get("HPC_KEEP_CLUSTER") != "1":
        sc.down(cluster)


@pytest.fixture(autouse=True)
def _clean_cluster_after_test(slurm_cluster: SlurmTestCluster, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run each test in its own directory (job output lands there, not in the checkout); after
    it: heal, restart, cancel leftover jobs, all nodes idle again."""
    monkeypatch.chdir(tmp_path)
    yield
    slurm_cluster.restore()


# The environment of the tests in test_fault_tolerance and test_succession_on_cluster (a module
# with an `env` of its own uses that one).
@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


# The uninterrupted runs that chaos tests compare against: started once per session by the first
# test that needs one (each is a 20-57 s local `hpc run`, which runs while that test's cluster job
# does), shared by every module.
@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mapping]:
    """2 nodes x 2 processes, tiny preset: final step, weights and sample-order digests."""
    from tests.slurm.support import Baseline
    run = Baseline(tmp_path_factory.mktemp("baseline"))
    yield run
    run.stop()


@pytest.fixture(scope="session")
def elastic_baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mapping]:
    """As :func:`baseline`, with a global batch that divides at world size 4 and 6."""
    from tests.slurm.support import ELASTIC, Baseline
    run = Baseline(tmp_path_factory.mktemp("elastic-baseline"), *ELASTIC)
    yield run
    run.stop()
