"""How a job spreads its model over its ranks: data, tensor and pipeline parallel degrees.

A job's ranks form a mesh of four dimensions, outermost first ``pp x dp_replicate x dp_shard x
tp`` (torchtitan's order): tensor-parallel groups are consecutive ranks, so with ``tp`` dividing
the processes per node a TP group never leaves its node, as the guides advise (its collectives
run every layer). ``dp_replicate x dp_shard`` is the data-parallel width: replicas (HSDP's outer
dimension) times FSDP shards.

An elastic job keeps every degree but one: the *model* degrees ``tp`` and ``pp`` (and
``dp_replicate``) hold for its whole life, and ``dp_shard`` (0 in the spec: "what the world
leaves") grows and shrinks with the nodes, so a job that loses a node goes on at a smaller data
parallel width with the same global batch (gradient accumulation adapts). A world that cannot
form whole model groups (survivors of a pipeline that spanned nodes) is no mesh:
:func:`resolve` raises :class:`MeshError` and the job is requeued for a whole allocation rather
than run on a wrong mesh.

Pure and torch-free: the login node validates a spec with it (:func:`check_nodes`), the runtime
resolves the mesh of the world it got (:func:`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc.contract.errors import SpecError

MAX_DEGREE = 4096
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first."""
FLAGS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "tp": "--tp", "pp": "--pp"}


class MeshError(ValueError):
    """A world size that cannot form the job's mesh (not a user's typo: the nodes it got)."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees a job asks for.

    Args:
        dp_replicate: Data-parallel replicas (HSDP's replicate dimension; 1: plain FSDP).
        dp_shard: FSDP shards per replica; 0: whatever the world leaves (the dimension an
            elastic job grows and shrinks).
        tp: Tensor-parallel degree (within a node).
        pp: Pipeline-parallel degree (stages).
    """

    dp_replicate: int = 1
    dp_shard: int = 0
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            low = 0 if name == "dp_shard" else 1
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_DEGREE:
                raise SpecError(FLAGS[name], value, f"an integer from {low} to {MAX_DEGREE}"
                                + (" (0: the ranks the other degrees leave)" if low == 0 else ""),
                                f"{FLAGS[name]} 2")

    @property
    def model_ranks(self) -> int:
        """Ranks of one data-parallel slot: ``tp x pp`` (one whole copy of the model)."""
        return self.tp * self.pp

    @property
    def fixed_ranks(self) -> int:
        """The product of the degrees that never change: a valid world is a multiple of it."""
        return self.model_ranks * self.dp_replicate * (self.dp_shard or 1)

    @property
    def trivial(self) -> bool:
        """Plain data parallel (no TP, PP or HSDP): the Session's DDP/FSDP as before."""
        return self.tp == self.pp == self.dp_replicate == 1 and self.dp_shard == 0


@dataclass(frozen=True)
class Mesh:
    """The degrees of one world: every dimension's size, their product the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel width: how many different batches a step trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes in :data:`MESH_DIMS` order (``init_device_mesh``'s shape)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension (row-major over :data:`MESH_DIMS`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out: dict[str, int] = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel slot ``rank`` is in (its share of the global batch)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        parts = [f"{n} {s}" for n, s in zip(MESH_DIMS, self.shape) if s > 1]
        return " x ".join(parts) or "1 rank"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve(dims: ParallelDims, world_size: int, local_world_size: int) -> Mesh:
    """The mesh of a world of ``world_size`` ranks, ``local_world_size`` per node.

    Raises:
        MeshError: When the world is not a whole number of model groups, a TP group would
            span nodes, or an explicit ``dp_shard`` does not fill the world; the message
            says which worlds would work.
    """
    if world_size < 1 or local_world_size < 1:
        raise MeshError(f"world size {world_size} with {local_world_size} per node is no world")
    if dims.tp > 1 and local_world_size % dims.tp:
        raise MeshError(f"tensor parallel {dims.tp} does not divide the {local_world_size} processes "
                        f"of a node: a TP group would span nodes (TP degrees that fit: "
                        f"{divisors(local_world_size)})")
    fixed = dims.fixed_ranks
    if world_size % fixed:
        what = f"tp {dims.tp} x pp {dims.pp}" + (f" x dp_replicate {dims.dp_replicate}"
                                                  if dims.dp_replicate > 1 else "") \
            + (f" x dp_shard {dims.dp_shard}" if dims.dp_shard else "")
        raise MeshError(f"a world of {world_size} ranks cannot form whole groups of {what} = {fixed} "
                        f"ranks (worlds that can: multiples of {fixed})")
    shard = dims.dp_shard or world_size // fixed
    if dims.dp_shard and dims.dp_shard * dims.dp_replicate * dims.model_ranks != world_size:
        raise MeshError(f"dp_shard {dims.dp_shard} fixes the world at {fixed} ranks, this one has "
                        f"{world_size} (dp_shard 0 lets the data-parallel width follow the world)")
    return Mesh(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=shard, tp=dims.tp)


def check_nodes(dims: ParallelDims, *, nodes: tuple[int, int], nproc_per_node: int,
                cli: bool = True) -> None:
    """Checks at submission that the job's node range can form its mesh.

    TP stays within a node; the smallest and the largest allocation must each form whole
    model groups (in between, a world that cannot is requeued: see :func:`resolve`).

    Raises:
        SpecError: Naming the flag, the value and the values that would work.
    """
    def term(name: str) -> str:
        return FLAGS[name] if cli else name

    if dims.tp > 1 and nproc_per_node % dims.tp:
        raise SpecError(term("tp"), dims.tp, f"a divisor of the {nproc_per_node} processes per node "
                        f"(tensor parallel stays within a node): one of {divisors(nproc_per_node)}",
                        f"--nproc-per-node {dims.tp} --tp {dims.tp}" if cli
                        else f"nproc_per_node={dims.tp}, tp={dims.tp}")
    low, high = nodes
    fixed = dims.fixed_ranks
    bad = [n for n in (low, high) if (n * nproc_per_node) % fixed]
    if bad:
        worlds = [n for n in range(low, high + 1) if (n * nproc_per_node) % fixed == 0]
        name = "pp" if dims.pp > 1 else "dp_shard" if dims.dp_shard else \
            "dp_replicate" if dims.dp_replicate > 1 else "tp"
        value = getattr(dims, name)
        fits = [d for d in divisors(bad[0] * nproc_per_node)
                if all((n * nproc_per_node) % (fixed // value * d) == 0 for n in (low, high))]
        raise SpecError(
            term(name), value,
            f"one whose groups fill {bad[0]} node(s) x {nproc_per_node} processes: with --nodes "
            f"{low}:{high} the ranks of tp x pp x dp_replicate x dp_shard ({fixed}) must divide the "
            f"world at both ends; values that do: {fits}"
            + (f"; node counts that work with it: {worlds}" if worlds else ""),
            f"{FLAGS[name]} {fits[-1] if fits else 1}" if cli else f"{name}={fits[-1] if fits else 1}")
    if dims.dp_shard and low != high:
        raise SpecError(term("dp_shard"), dims.dp_shard,
                        f"0 with an elastic node range ({low}:{high}): a fixed shard count fixes the "
                        "world, the data-parallel width must follow the nodes",
                        "--dp-shard 0" if cli else "dp_shard=0")
