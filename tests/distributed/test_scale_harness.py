"""The control plane of a 64-node job, simulated with the real code (benchmarks/scale).

One run of :func:`benchmarks.scale.run.simulate` at N = 64 (8 ranks per node): the launcher's
rendezvous (the listed first round, torch's c10d handler inside) and libuv TCPStore, the launchers' keepalive beacons, a node suspended with
SIGSTOP, the stall watch's node records, the succession election on the job directory, and
``hpc status``/``hpc report`` on 64 nodes x 20 allocations of events. The bounds are the
ones that must hold whatever the machine's load (see docs/scale.md for the measured table):
a regression that makes a figure grow (more reads per peer, an election that waits out its
window, a report that reads the history twice) shows here.
"""

from __future__ import annotations

import pytest

from benchmarks.scale.run import simulate
from runtime.liveness.beacon import LOST_AFTER_S
from runtime.succession import ANNOUNCE_WINDOW_S

pytestmark = pytest.mark.distributed

N = 64


@pytest.fixture(scope="module")
def row(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return simulate(N, procs=2, window_s=3.0, ticks=4, join_timeout_s=120.0,
                    work=tmp_path_factory.mktemp("scale"))


def test_all_64_nodes_join_the_rendezvous_with_o1_store_requests_each(row: dict) -> None:
    assert row["joined"] == N, row["notes"]
    assert row["join_s"] is not None and row["join_s"] < 60.0
    # The launcher's listed first round (runtime/launch/rendezvous.py): ~6 requests and ~300
    # bytes a node. torch's c10d round alone made 1,760-33,748 requests (19-430 MB) at 64.
    assert row["rdzv_backend"] == "hpc-static"
    assert row["join_rdzv_requests"] <= 8 * N, row["join_rdzv_requests"]
    assert row["join_rdzv_kb"] <= N, row["join_rdzv_kb"]


def test_no_healthy_node_is_named_lost_while_all_beat(row: dict) -> None:
    assert row["false_lost"] == [], "healthy nodes were named lost while all beat"


def test_a_suspended_node_is_named_lost_by_the_host(row: dict) -> None:
    # Named by every node within LOST_AFTER_S of its last beat (its watcher names it, the root's
    # summary carries the name). Generous for a loaded machine, far below the collective
    # timeout (600 s).
    # The window opens only once every beacon, the victim's too, has beaten: under load its
    # first store connection can take seconds (a 3-s timeout, retried each beat).
    assert row["beating"] == f"{N} of {N}", row["notes"]
    assert row["detect_host_s"] is not None, row["notes"]
    assert row["detect_host_s"] <= LOST_AFTER_S + 15.0


def test_the_election_after_the_host_loss_is_one_decision_within_bounds(row: dict) -> None:
    assert row["elect_agree"], row["notes"]
    # All survivors announce at once: nobody waits out the announce window.
    assert row["elect_s"] < min(5.0, ANNOUNCE_WINDOW_S)
    assert row["elect_fs_ops_per_node"] <= 30


def test_the_store_and_job_directory_load_of_one_node_does_not_grow_with_the_peers(row: dict) -> None:
    # Liveness folded in groups (runtime.liveness.groups): ~2 requests per node per beat plus
    # the watchers' and the root's (was 2N - 1 per node: 8,128 req/s at 64 nodes).
    assert row["beacon_req_per_s"] <= 4 * N, row["notes"]
    # The stall watch writes its own record every 2 s and reads none (was one read per peer
    # per poll: ~0.75 N + 2).
    assert row["fs_ops_per_node_tick"] <= 4


def test_status_and_report_read_64_nodes_x_20_allocations_in_bounds(row: dict) -> None:
    assert row["events_lines"] > 64 * 20 * 4
    assert row["report_s"] is not None and row["report_s"] < 20.0, row.get("history_notes")
    assert row["status_s"] is not None and row["status_s"] < 20.0, row.get("history_notes")
    assert row["report_rss_mb"] < 500
