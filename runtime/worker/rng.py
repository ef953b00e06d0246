"""Per-rank random number generator state: capture, restore, and a deterministic re-seed.

Dropout masks, data augmentation and sampling all draw from four generators: python's
``random``, numpy's global generator, torch's CPU generator and (when present) every CUDA
generator. A resume is exact only when each rank gets back *its own* states, so checkpoints keep
one small file per rank (see ``runtime.checkpoint``) rather than putting RNG state into the
sharded, rank-agnostic part.

When the world size changes, a rank that has no saved state (a new rank, or a rank number that
did not exist before) is re-seeded deterministically with :func:`derived_seed` of
``(base seed, step, rank)``: reproducible, different per rank and per resume step, but of course
not a continuation of any earlier stream.

A captured state is plain data, tensors and one numpy ``uint32`` array (numpy's state), so a
checkpoint loads it with ``torch.load(weights_only=True)``; the numpy types are exactly those
``runtime.checkpoint.storage.runtime_safe_globals`` allows. Anything added here that is not
a tensor or plain data must be added there too, or resumes will refuse the file.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The current states of python, numpy, torch CPU and all CUDA generators (copies)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Mapping[str, Any]) -> None:
    """Restores states captured by :func:`capture` (CUDA only when saved and available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # a different GPU count per process: keep what maps, by index
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


def derived_seed(base_seed: int, step: int, rank: int) -> int:
    """A 63-bit seed from ``(base_seed, step, rank)``; stable across python and torch versions."""
    digest = hashlib.blake2b(f"{base_seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(seed: int) -> None:
    """Seeds python, numpy (32-bit), torch and CUDA from one integer."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds every CUDA device


class RNGState:
    """Stateful adapter for the checkpointer: ``rank_local`` marks it as saved per rank.

    Args:
        seed: Base seed for :func:`derived_seed` when a rank has no saved state.
    """

    rank_local = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return capture()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        restore(state)

    def reseed(self, step: int, rank: int) -> None:
        """Deterministic fresh state for a rank that has none saved (world size grew)."""
        reseed(derived_seed(self.seed, step, rank))
