"""The job's mesh degrees (``hpc.contract.parallel``): resolving a world, shrinking it, and the
errors a user sees for degrees that cannot fit their nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli import main
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.parallel import Mesh, MeshError, ParallelDims, check_nodes, resolve
from runtime.sampler import plan_batches


def test_tp_groups_are_consecutive_ranks_and_dp_fills_the_world() -> None:
    mesh = resolve(ParallelDims(tp=2), world_size=4, local_world_size=2)
    assert mesh == Mesh(pp=1, dp_replicate=1, dp_shard=2, tp=2) and mesh.dp == 2
    assert [mesh.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [mesh.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]     # a TP pair reads one batch
    assert mesh.describe() == "dp_shard 2 x tp 2"


def test_a_lost_node_shrinks_only_the_data_parallel_dimension() -> None:
    dims = ParallelDims(tp=2, pp=2)
    assert resolve(dims, 8, 4).shape == (2, 1, 2, 2)
    assert resolve(dims, 4, 4).shape == (2, 1, 1, 2)                 # one node left: dp 1
    with pytest.raises(MeshError, match=r"world of 6 ranks cannot form whole groups of tp 2 x pp 2 = 4 "
                                         r"ranks \(worlds that can: multiples of 4\)"):
        resolve(dims, 6, 2)


def _groups(mesh: Mesh, dim: str) -> list[list[int]]:
    """The ranks that differ only along ``dim``: one TP group, one pipeline..."""
    out: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        out.setdefault(tuple(v for k, v in c.items() if k != dim), []).append(r)
    return list(out.values())


@pytest.mark.parametrize("dims, per_node", [(ParallelDims(tp=2), 2), (ParallelDims(tp=2, pp=2), 2),
                                            (ParallelDims(tp=2, pp=2), 4), (ParallelDims(pp=3), 1),
                                            (ParallelDims(tp=2, dp_replicate=2), 2)])
def test_an_elastic_world_is_a_multiple_of_the_model_and_only_dp_follows_the_nodes(dims: ParallelDims,
                                                                                   per_node: int) -> None:
    """A job's life over 1..8 nodes, shrinking and growing: every world that is a whole number
    of ``tp x pp (x dp_replicate)`` groups keeps those degrees and gives the rest to dp_shard,
    every TP group stays on one node, the global batch stays what it was; any other world is
    refused (the job is requeued), never resolved to a different model split."""
    global_batch, micro = 840, 1                          # divisible by every width 1..8
    seen = []
    for nodes in [2, 1, 3, 8, 5, 4, 6, 7]:                  # lose, grow, lose, grow...
        world = nodes * per_node
        if world % dims.fixed_ranks:
            with pytest.raises(MeshError, match=rf"world of {world} ranks cannot form whole groups"):
                resolve(dims, world, per_node)
            continue
        mesh = resolve(dims, world, per_node)
        assert (mesh.tp, mesh.pp, mesh.dp_replicate) == (dims.tp, dims.pp, dims.dp_replicate)
        assert mesh.world_size == world and mesh.dp == world // dims.model_ranks
        for group in _groups(mesh, "tp"):                   # TP's collectives never leave a node
            assert len({r // per_node for r in group}) == 1, (nodes, group)
        slots = sorted({mesh.dp_rank(r) for r in range(world)})
        assert slots == list(range(mesh.dp))                # each slot one whole model copy
        assert all(sum(mesh.dp_rank(r) == d for r in range(world)) == dims.model_ranks for d in slots)
        accum = plan_batches(global_batch, mesh.dp, micro)
        assert mesh.dp * micro * accum == global_batch      # constant global batch
        seen.append(mesh.dp)
    assert len(set(seen)) > 1, "the walk should have changed the data-parallel width"


def test_tp2_x_dp2_on_two_nodes_loses_one_and_goes_on_at_dp1_x_tp2_then_grows_back() -> None:
    dims = ParallelDims(tp=2)
    before, after, again = (resolve(dims, w, 2) for w in (4, 2, 4))
    assert before.describe() == "dp_shard 2 x tp 2" and after.describe() == "tp 2" and again == before
    assert [plan_batches(16, m.dp, 4) for m in (before, after, again)] == [2, 4, 2]


def test_tp_that_would_cross_a_node_is_refused_whatever_the_world() -> None:
    for world in (4, 8, 16):                                # multiples of tp: still refused
        with pytest.raises(MeshError, match=r"tensor parallel 4 does not divide the 2 processes"):
            resolve(ParallelDims(tp=4), world, 2)
    with pytest.raises(SpecError, match=r"--tp 4 is invalid: a divisor of the 2 processes per node"):
        check_nodes(ParallelDims(tp=4), nodes=(2, 4), nproc_per_node=2)
    # A pipeline may span nodes (its stages talk once per micro-batch), but both ends of the
    # node range must then form whole pipelines.
    check_nodes(ParallelDims(pp=2), nodes=(2, 4), nproc_per_node=1)
    with pytest.raises(SpecError, match=r"--pp 2 is invalid.*node counts that work with it: \[2, 4\]"):
        check_nodes(ParallelDims(pp=2), nodes=(2, 5), nproc_per_node=1)


def test_hsdp_keeps_its_replicas_and_an_explicit_shard_count_fixes_the_world() -> None:
    assert resolve(ParallelDims(dp_replicate=2), 8, 4).shape == (1, 2, 4, 1)
    with pytest.raises(MeshError, match="dp_shard 2 fixes the world at 4 ranks, this one has 8"):
        resolve(ParallelDims(dp_shard=2, tp=2), 8, 4)


def test_tp_must_stay_within_a_node_at_run_time() -> None:
    with pytest.raises(MeshError, match=r"tensor parallel 4 does not divide the 2 processes of a node.*\[1, 2\]"):
        resolve(ParallelDims(tp=4), 4, 2)


def test_degrees_are_checked_in_python_terms_too() -> None:
    with pytest.raises(SpecError, match=r"--tp 0 is invalid: an integer from 1 to 4096"):
        ParallelDims(tp=0)
    with pytest.raises(SpecError, match=r"tp 4 is invalid: a divisor of the 2 processes per node .*\[1, 2\]"):
        JobSpec(script="s", nproc_per_node=2, tp=4)
    spec = JobSpec(script="s", nodes=(1, 2), nproc_per_node=4, tp=2, pp=2)
    assert spec.parallel == ParallelDims(tp=2, pp=2)
    assert JobSpec.from_json(spec.to_json()).parallel == spec.parallel


@pytest.mark.parametrize("argv, flag, valid", [
    (["--nproc-per-node", "2", "--tp", "4"], "--tp", "one of [1, 2]"),
    (["--nodes", "2:3", "--nproc-per-node", "2", "--pp", "4"], "--pp", "values that do: [1, 2]"),
    (["--nodes", "1:2", "--nproc-per-node", "2", "--dp-shard", "2"], "--dp-shard", "0 with an elastic"),
])
def test_the_cli_names_the_flag_and_the_values_that_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], argv: list[str],
                                                        flag: str, valid: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HPC_CONFIG", raising=False)
    (tmp_path / "train.py").write_text("")
    assert main(["render", "train.py", *argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} " in err and valid in err, err


def test_a_valid_mesh_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HPC_CONFIG", raising=False)
    (tmp_path / "train.py").write_text("")
    assert main(["render", "train.py", "--nodes", "1:2", "--nproc-per-node", "2", "--tp", "2"]) == 0
