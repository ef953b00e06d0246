"""The job's ``DeviceMesh``: the degrees of :mod:`hpc.contract.parallel` made into process groups.

Every dimension is in the mesh, size 1 included (``pp x dp_replicate x dp_shard x tp``), so code
can always ask for ``mesh["tp"]`` or the flattened data-parallel dimension ``mesh["dp"]``
whatever the job's degrees; a size-1 dimension costs one trivial group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc.contract.parallel import MESH_DIMS, Mesh

DP = "dp"                     # the flattened dp_replicate x dp_shard dimension


@dataclass(frozen=True)
class MeshPlace:
    """Where one rank sits in the job's mesh.

    Attributes:
        mesh: The degrees.
        device_mesh: torch's ``DeviceMesh`` (dimensions :data:`MESH_DIMS`, plus ``dp``).
        coords: This rank's index along each dimension.
    """

    mesh: Mesh
    device_mesh: Any
    coords: dict[str, int]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp_replicate"] * self.mesh.dp_shard + self.coords["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.mesh.dp

    def __getitem__(self, name: str | tuple[str, ...]) -> Any:
        return self.device_mesh[name]


def build(mesh: Mesh, rank: int, device_type: str) -> MeshPlace:
    """Builds the ``DeviceMesh`` of ``mesh`` on the default process group (all ranks call it).

    Args:
        mesh: The resolved degrees (their product is the world size).
        rank: This rank's global rank.
        device_type: ``"cuda"`` or ``"cpu"``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=MESH_DIMS)
    device_mesh[("dp_replicate", "dp_shard")]._flatten(DP)
    coords = mesh.coords(rank)
    assert all(device_mesh[n].get_local_rank() == coords[n] for n in MESH_DIMS), \
        "torch's mesh and hpc.contract.parallel disagree on this rank's place"
    return MeshPlace(mesh, device_mesh, coords)
