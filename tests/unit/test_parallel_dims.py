"""The job's mesh degrees (``hpc.contract.parallel``): resolving a world, shrinking it, and the
errors a user sees for degrees that cannot fit their nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli import main
from hpc.contract.errors import SpecError
from hpc.contract.jobspec import JobSpec
from hpc.contract.parallel import Mesh, MeshError, ParallelDims, resolve


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
