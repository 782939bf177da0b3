"""data.DistributedSampler: same indices as torch's, in-process (rank/num_replicas passed explicitly)."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from data import DistributedSampler, global_order, shard_sizes


@st.composite
def sampler_args(draw):
    length = draw(st.integers(0, 300))
    replicas = draw(st.integers(1, 8))
    return dict(
        length=length,
        num_replicas=replicas,
        rank=draw(st.integers(0, replicas - 1)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(-(2**31), 2**31)),
        epoch=draw(st.integers(0, 10_000)),
        drop_last=draw(st.booleans()),
    )


def _pair(a: dict, rank: int | None = None):
    rank = a["rank"] if rank is None else rank
    ours = DistributedSampler(range(a["length"]), a["num_replicas"], rank, a["shuffle"], a["seed"], a["drop_last"])
    theirs = TorchSampler(range(a["length"]), a["num_replicas"], rank, a["shuffle"], a["seed"], a["drop_last"])
    ours.set_epoch(a["epoch"])
    theirs.set_epoch(a["epoch"])
    return ours, theirs


@settings(max_examples=300, deadline=None)
@given(sampler_args())
def test_indices_equal_torch(a):
    ours, theirs = _pair(a)
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)
    assert ours.indices().tolist() == list(theirs)


@settings(max_examples=150, deadline=None)
@given(sampler_args())
def test_union_of_shards_covers_each_row_once_plus_padding(a):
    n, reps = a["length"], a["num_replicas"]
    shards = [list(_pair(a, rank=r)[0]) for r in range(reps)]
    per_rank, total = shard_sizes(n, reps, a["drop_last"])
    assert all(len(s) == per_rank for s in shards)
    counts = collections.Counter(i for s in shards for i in s)
    assert sum(counts.values()) == total
    assert all(0 <= i < n for i in counts)
    if a["drop_last"]:
        assert max(counts.values(), default=1) == 1  # nothing repeated ...
        assert len(counts) == total  # ... and only the last n % reps rows of the order are left out
        order = global_order(n, a["shuffle"], a["seed"], a["epoch"]).tolist()
        assert set(counts) == set(order[:total])
    else:
        assert set(counts) == set(range(n))  # every row at least once
        padding = total - n
        repeats = sum(c - 1 for c in counts.values())
        assert repeats == padding
        if n:
            assert max(counts.values()) <= 1 + -(-padding // n)


@settings(max_examples=150, deadline=None)
@given(sampler_args(), st.integers(1, 8), st.integers(1, 40), st.data())
def test_resuming_mid_epoch_sees_each_row_of_the_epoch_once(a, new_replicas, batch, data):
    """A job interrupted after ``k`` batches of ``batch`` rows per rank resumes with
    ``set_epoch(epoch, start=k * batch * num_replicas)``: at the same world size each rank's rest
    is exactly the rest of its uninterrupted epoch; at any other one the rows seen before and after
    the resume together are one epoch's (every row once, plus the padding of the resumed part)."""
    n, reps = a["length"], a["num_replicas"]
    full = [list(_pair(a, rank=r)[0]) for r in range(reps)]
    k = data.draw(st.integers(0, max(0, -(-len(full[0]) // batch) - 1)))  # a batch boundary before the last batch
    done, start = [s[: k * batch] for s in full], min(k * batch, len(full[0])) * reps
    kwargs = dict(shuffle=a["shuffle"], seed=a["seed"], drop_last=a["drop_last"])

    def rest(replicas: int, rank: int) -> list[int]:
        s = DistributedSampler(range(n), num_replicas=replicas, rank=rank, **kwargs)
        s.set_epoch(a["epoch"], start=start)
        assert len(s) == len(list(s))
        return list(s)

    assert [d + rest(reps, r) for r, d in enumerate(done)] == full
    after = [rest(new_replicas, r) for r in range(new_replicas)]
    assert len({len(x) for x in after}) <= 1  # every new rank takes as many steps
    seen = collections.Counter(i for part in done + after for i in part)
    order = global_order(n, a["shuffle"], a["seed"], a["epoch"]).tolist()
    padding = sum(len(x) for x in after) - (n - start)
    if a["drop_last"]:
        assert padding <= 0 and max(seen.values(), default=1) == 1
        assert set(seen) == set(order[: start + sum(len(x) for x in after)])
    else:
        assert padding >= 0 and set(seen) == set(range(n))
        assert sum(c - 1 for c in seen.values()) == padding


def test_resume_start_is_checked():
    s = DistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match=r"start must be in \[0, 10\], got 11"):
        s.set_epoch(0, start=11)
    with pytest.raises(TypeError, match="start must be an int"):
        s.set_epoch(0, start=1.0)


def test_shuffle_changes_with_epoch_and_seed_only():
    ds = range(100)
    a = DistributedSampler(ds, 4, 1, shuffle=True, seed=3)
    b = DistributedSampler(ds, 4, 1, shuffle=True, seed=3)
    first = list(a)
    assert list(b) == first  # same seed and epoch: same order, no communication needed
    a.set_epoch(1)
    assert list(a) != first
    a.set_epoch(0)
    assert list(a) == first
    assert list(DistributedSampler(ds, 4, 1, shuffle=True, seed=4)) != first
    assert list(DistributedSampler(ds, 4, 1, shuffle=False)) == list(range(1, 100, 4))


def test_padding_larger_than_dataset_wraps_around_repeatedly():
    # 3 rows over 8 replicas: the order is repeated to fill 8 slots, like torch.
    got = [list(DistributedSampler(range(3), 8, r, shuffle=False)) for r in range(8)]
    assert got == [[0], [1], [2], [0], [1], [2], [0], [1]]
    assert [len(DistributedSampler(range(3), 8, r, drop_last=True)) for r in range(8)] == [0] * 8


def test_with_dataloader():
    x = torch.arange(50.0).unsqueeze(1)
    ds = TensorDataset(x, torch.arange(50))
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, seed=5)
        sampler.set_epoch(2)
        batches = list(DataLoader(ds, batch_size=4, sampler=sampler))
        got = torch.cat([y for _, y in batches]).tolist()
        assert got == list(sampler)
        assert all(torch.equal(xb.squeeze(1), yb.float()) for xb, yb in batches)
        seen += got
    assert set(seen) == set(range(50)) and len(seen) == 51  # 17 x 3: one padding row


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_replicas=0, rank=0), ValueError, "num_replicas must be >= 1"),
        (dict(num_replicas=-2, rank=0), ValueError, "num_replicas must be >= 1"),
        (dict(num_replicas=4, rank=4), ValueError, r"rank must be in \[0, 3\], got 4"),
        (dict(num_replicas=4, rank=-1), ValueError, r"rank must be in \[0, 3\], got -1"),
        (dict(num_replicas=2.0, rank=0), TypeError, "num_replicas must be an int"),
        (dict(num_replicas=2, rank=True), TypeError, "rank must be an int"),
        (dict(num_replicas=2, rank=0, seed="7"), TypeError, "seed must be an int"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedSampler(range(10), **kwargs)


def test_bad_epoch_and_dataset():
    s = DistributedSampler(range(10), 2, 0)
    with pytest.raises(TypeError, match="epoch must be an int"):
        s.set_epoch(1.5)
    with pytest.raises(TypeError, match="must have a length"):
        DistributedSampler(iter(range(10)), 2, 0)


def test_defaults_need_initialised_collectives():
    import collectives

    assert not collectives.is_initialized()  # this test process never joins a group
    with pytest.raises(RuntimeError, match="not initialised.*num_replicas= and rank="):
        DistributedSampler(range(10))
