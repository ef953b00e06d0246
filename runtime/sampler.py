"""An exactly-once resumable sampler keyed by a global sample cursor.

The order of epoch ``e`` is a fixed permutation of the dataset drawn from ``(seed, e)``. Training
consumes that stream in *global* batches; which rank reads which part of a global batch is a
pure function of the rank and world size (:func:`rank_slice`). The saved state is therefore only
``(epoch, cursor)``, where the cursor counts global samples consumed in the epoch, and it means
the same thing at any world size: a job stopped at any step and resumed on 1, 2 or 4 ranks sees
every sample of the epoch exactly once, and the next epoch is reshuffled.

Why not ``torch.utils.data.DistributedSampler``: its position is per rank (it has none, in fact:
it restarts the epoch) and its split depends on the world size, so a resume after a node loss
would repeat or skip data.

The cursor advances when a batch is handed out (:meth:`ResumableSampler.next_global_batch`); save
the sampler after the step that consumed the batch. With a DataLoader that prefetches in worker
processes, drive the loader from the indices this sampler returns rather than letting it iterate
ahead, or the saved cursor will run ahead of training.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


def plan_batches(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Gradient-accumulation steps that keep the global batch constant at any world size.

    ``global_batch = world_size * micro_batch * accum_steps``.

    Args:
        global_batch: Samples per optimizer step, summed over all ranks.
        world_size: Number of ranks.
        micro_batch: Samples per forward/backward on one rank.

    Returns:
        The number of micro-batches each rank runs per optimizer step.

    Raises:
        ValueError: When the global batch does not split evenly.
    """
    if min(global_batch, world_size, micro_batch) < 1:
        raise ValueError(f"global_batch ({global_batch}), world_size ({world_size}) and "
                         f"micro_batch ({micro_batch}) must all be >= 1")
    per_step = world_size * micro_batch
    if global_batch % per_step:
        ok = [m for m in range(1, global_batch // world_size + 1) if global_batch % (world_size * m) == 0]
        none = ("none (global batch is smaller than the world size)" if global_batch < world_size else
                f"none ({global_batch} is not a multiple of {world_size}: pick a global batch that every "
                "world size the job may run at divides, e.g. after a shrink by one worker)")
        raise ValueError(
            f"global batch {global_batch} is not divisible by world_size x micro_batch = "
            f"{world_size} x {micro_batch} = {per_step}; micro-batch sizes that work at world size "
            f"{world_size}: {ok or none}")
    return global_batch // per_step


def rank_slice(global_indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch (balanced when it does not divide evenly)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    n = len(global_indices)
    return list(global_indices[rank * n // world_size:(rank + 1) * n // world_size])


def epoch_permutation(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The deterministic order of one epoch (numpy PCG64 seeded with ``(seed, epoch)``)."""
    if not shuffle:
        return np.arange(dataset_len, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(dataset_len).astype(np.int64)


class ResumableSampler:
    """Hands out global batches of dataset indices; resumable at any world size.

    Args:
        dataset_len: Number of samples in the dataset.
        global_batch: Samples per global batch (all ranks together).
        seed: Seed of the per-epoch permutations.
        shuffle: Permute each epoch (else sequential order).
        drop_last: Skip the last, partial global batch of an epoch (its samples are consumed
            in no batch that epoch; the next epoch is reshuffled). With False the last batch is
            short and every sample of every epoch is consumed exactly once.
    """

    def __init__(self, dataset_len: int, *, global_batch: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if drop_last and global_batch > dataset_len:
            raise ValueError(f"global_batch {global_batch} exceeds the dataset ({dataset_len} samples) "
                             "with drop_last=True: no batch would ever be produced")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def epoch_samples(self) -> int:
        """Samples consumed per epoch (the dataset, less the dropped tail with drop_last)."""
        if self.drop_last:
            return self.dataset_len - self.dataset_len % self.global_batch
        return self.dataset_len

    def batches_left_in_epoch(self) -> int:
        return -(-(self.epoch_samples - self.cursor) // self.global_batch)

    def _order(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            self._perm = (self.epoch, epoch_permutation(self.dataset_len, self.seed, self.epoch, self.shuffle))
        return self._perm[1]

    def next_global_batch(self) -> list[int]:
        """The next global batch (same list on every rank); advances the cursor.

        Rolls over to the next epoch (cursor 0, new permutation) when the epoch is used up.
        """
        if self.cursor >= self.epoch_samples:
            self.epoch += 1
            self.cursor = 0
        end = min(self.cursor + self.global_batch, self.epoch_samples)
        batch = self._order()[self.cursor:end].tolist()
        self.cursor = end
        return batch

    def next_local_batch(self, rank: int, world_size: int) -> list[int]:
        """This rank's share of the next global batch (see :func:`rank_slice`)."""
        return rank_slice(self.next_global_batch(), rank, world_size)

    def __iter__(self) -> Iterator[list[int]]:
        """Global batches to the end of the current epoch (starting a new one if it is used up)."""
        if self.cursor >= self.epoch_samples:
            self.epoch, self.cursor = self.epoch + 1, 0
        while self.cursor < self.epoch_samples:
            yield self.next_global_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the position; the world size and global batch may differ from the saved ones.

        Raises:
            ValueError: When the state belongs to a different dataset size or cursor range.
        """
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(f"sampler state is for a dataset of {state['dataset_len']} samples, "
                             f"this one has {self.dataset_len}: the data changed, refusing to resume")
        cursor = int(state["cursor"])
        if not 0 <= cursor <= self.dataset_len:
            raise ValueError(f"sampler cursor {cursor} is outside 0..{self.dataset_len}")
        self.epoch = int(state["epoch"])
        self.cursor = cursor
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self._perm = None
