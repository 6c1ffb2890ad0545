"""taifuse.data.DistributedSampler against torch.utils.data.DistributedSampler (issue 30)."""

from __future__ import annotations

import numpy as np
import pytest

from taifuse.data import DataLoader, DistributedSampler, TensorDataset

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler as TorchDistributedSampler

CASES = [(n, world, drop_last) for n in (0, 1, 5, 7, 12, 13) for world in (1, 2, 3, 4) for drop_last in (False, True)]


@pytest.mark.parametrize(("n", "world", "drop_last"), CASES)
def test_without_shuffle_every_rank_gets_torchs_indices(n, world, drop_last):
    data = list(range(n))
    for rank in range(world):
        ours = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last)
        theirs = TorchDistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last)
        assert len(ours) == len(theirs)
        assert list(ours) == list(theirs)


@pytest.mark.parametrize(("n", "world", "drop_last"), [c for c in CASES if c[0]])
def test_shuffled_shares_are_torchs_sizes_disjoint_and_cover_the_epoch(n, world, drop_last):
    data = list(range(n))
    for epoch in (0, 1):
        shares = []
        for rank in range(world):
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=3, drop_last=drop_last)
            sampler.set_epoch(epoch)
            theirs = TorchDistributedSampler(data, num_replicas=world, rank=rank, drop_last=drop_last)
            shares.append(list(sampler))
            assert len(shares[-1]) == len(sampler) == len(theirs)
        flat = [i for share in shares for i in share]
        if drop_last:  # each index at most once, and all but the remainder are seen
            assert len(set(flat)) == len(flat) == world * (n // world)
        else:  # every index, padded by repeats of the first ones to divide evenly
            assert set(flat) == set(data)
            assert len(flat) == world * -(-n // world)


def test_set_epoch_reshuffles_and_the_same_seed_and_epoch_repeat():
    data = list(range(50))
    a = DistributedSampler(data, num_replicas=2, rank=0, seed=7)
    b = DistributedSampler(data, num_replicas=2, rank=0, seed=7)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(DistributedSampler(data, num_replicas=2, rank=0, seed=8)) != first


def test_feeds_a_data_loader_with_this_ranks_share():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    sampler = DistributedSampler(x, num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(TensorDataset(x), batch_size=2, sampler=sampler)
    rows = np.concatenate([batch[0].numpy() for batch in loader])
    np.testing.assert_array_equal(rows, x[1::2])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas"),
        ({"num_replicas": 2, "rank": 2}, ValueError, "invalid rank 2"),
        ({"num_replicas": 2, "rank": -1}, ValueError, "invalid rank -1"),
        ({"num_replicas": 2.0, "rank": 0}, TypeError, "num_replicas"),
        ({"num_replicas": 2, "rank": True}, TypeError, "rank"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedSampler(list(range(4)), **kwargs)
