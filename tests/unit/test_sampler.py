"""Exactly-once sampling across random stops, resumes and world-size changes (1..4 ranks)."""

from __future__ import annotations

import random

import pytest

from runtime.sampler import ResumableSampler, epoch_permutation, plan_batches, rank_slice

pytestmark = pytest.mark.unit


def test_plan_batches() -> None:
    assert plan_batches(64, 2, 8) == 4
    assert plan_batches(64, 4, 16) == 1
    with pytest.raises(ValueError, match=r"not divisible by world_size x micro_batch = 3 x 8"):
        plan_batches(64, 3, 8)
    with pytest.raises(ValueError, match="must all be >= 1"):
        plan_batches(64, 0, 8)


def test_rank_slices_partition_the_batch() -> None:
    batch = list(range(10))
    for w in range(1, 5):
        parts = [rank_slice(batch, r, w) for r in range(w)]
        assert sum(parts, []) == batch
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        rank_slice(batch, 2, 2)


def test_permutation_is_deterministic_and_reshuffles() -> None:
    a, b = epoch_permutation(100, 7, 0), epoch_permutation(100, 7, 0)
    assert (a == b).all() and sorted(a.tolist()) == list(range(100))
    assert (a != epoch_permutation(100, 7, 1)).any()


def _run_with_restarts(n: int, gb: int, drop_last: bool, rng: random.Random, epochs: int) -> list[list[int]]:
    """Consumes `epochs` epochs with random stops; each segment restarts at a random world size."""
    seen: dict[int, list[int]] = {}
    state = None
    while True:
        world = rng.randint(1, 4)
        # every rank of the new world restores the same state, then reads its slice
        ranks = [ResumableSampler(n, global_batch=gb, seed=3, drop_last=drop_last) for _ in range(world)]
        for s in ranks:
            if state is not None:
                s.load_state_dict(state)
        for _ in range(rng.randint(0, 7)):
            got = []
            for r, s in enumerate(ranks):
                got += s.next_local_batch(r, world)
            epoch = ranks[0].epoch
            if epoch >= epochs:
                return [seen[e] for e in range(epochs)]
            seen.setdefault(epoch, []).extend(got)
        assert len({str(s.state_dict()) for s in ranks}) == 1
        state = ranks[0].state_dict()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("trial", range(25))
def test_exactly_once_across_stops_and_world_sizes(trial: int, drop_last: bool) -> None:
    rng = random.Random(trial)
    n, gb = rng.randint(5, 60), rng.choice([1, 2, 4, 6, 12])
    if drop_last and gb > n:
        gb = n
    epochs = _run_with_restarts(n, gb, drop_last, rng, epochs=3)
    expected = n - n % gb if drop_last else n
    for consumed in epochs:
        assert len(consumed) == expected and len(set(consumed)) == expected, "duplicate or gap"
    if not drop_last:
        assert all(sorted(e) == list(range(n)) for e in epochs)
    if n > 3:
        assert epochs[0] != epochs[1], "epochs must reshuffle"


def test_order_is_independent_of_world_size_and_stops() -> None:
    plain = ResumableSampler(30, global_batch=6, seed=1)
    reference = [plain.next_global_batch() for _ in range(12)]
    s = ResumableSampler(30, global_batch=6, seed=1)
    got = []
    for _ in range(12):
        got.append(s.next_global_batch())
        s2 = ResumableSampler(30, global_batch=6, seed=99)
        s2.load_state_dict(s.state_dict())
        s = s2
    assert got == reference


def test_iter_rolls_over_and_len() -> None:
    s = ResumableSampler(10, global_batch=4, drop_last=False)
    assert s.batches_left_in_epoch() == 3
    assert [len(b) for b in s] == [4, 4, 2] and s.epoch == 0
    assert [len(b) for b in s] == [4, 4, 2] and s.epoch == 1


def test_load_rejects_other_dataset() -> None:
    s = ResumableSampler(10, global_batch=2)
    with pytest.raises(ValueError, match="data changed"):
        s.load_state_dict(ResumableSampler(11, global_batch=2).state_dict())
    with pytest.raises(ValueError, match="exceeds the dataset"):
        ResumableSampler(3, global_batch=4)


def test_a_global_batch_the_world_does_not_divide_says_so_not_that_it_is_too_small():
    # World 6 shrunk to 5 (an in-process shrink) with a global batch of 24: 24 > 5, but no
    # micro-batch splits it over 5 ranks; the message said "smaller than the world size".
    with pytest.raises(ValueError, match=r"none \(24 is not a multiple of 5") as e:
        plan_batches(24, 5, 2)
    assert "smaller" not in str(e.value)
    with pytest.raises(ValueError, match="smaller than the world size"):
        plan_batches(4, 5, 1)
