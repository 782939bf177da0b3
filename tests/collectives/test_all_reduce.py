"""All-reduce beyond exact small integers: random floats, large buffers, async handles, ordering,
subgroups and torch.distributed compatibility."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

import collectives
from collectives.testing import bitwise_equal


def random_floats(rank, world_size, numel, algorithm, dtype):
    """Normal random values: sums are inexact, so the result depends on the reduction order."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    ours, ref = x.clone(), x.clone()
    collectives.all_reduce(ours, algorithm=algorithm)
    tdist.all_reduce(ref)
    # every rank also reports sum(|x|) for the error bound
    absum = x.abs().double()
    tdist.all_reduce(absum)
    return ours, ref, absum


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [3, 4])
def test_random_floats_within_rounding_and_identical_on_all_ranks(pools, world_size):
    pool = pools(world_size)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for algorithm in ("ring", "recursive_doubling"):
            for numel in (1, 5, 1000, 100_003):
                results = pool.run(random_floats, numel, algorithm, dtype)
                ours0 = results[0][0]
                eps = torch.finfo(dtype).eps
                for rank, (ours, ref, absum) in enumerate(results):
                    assert bitwise_equal(ours, ours0), (dtype, algorithm, numel, rank)
                    # Two summation orders of n terms differ by at most ~2(n-1)·eps·sum|x|
                    # (plus one rounding of the final result to dtype).
                    bound = 2 * (world_size - 1) * eps * absum + eps * ours.double().abs()
                    err = (ours.double() - ref.double()).abs()
                    assert bool((err <= bound + 1e-30).all()), (dtype, algorithm, numel, float(err.max()))


def large_exact(rank, world_size):
    n = 3 * (1 << 20) + 7  # 12 MB of float32: ring and chain with the default 4 MiB segments
    x = (torch.arange(n, dtype=torch.float32) % 17) * (rank + 1)
    ours, ref = x.clone(), x.clone()
    collectives.all_reduce(ours)
    tdist.all_reduce(ref)
    big = torch.full((n,), float(rank))
    collectives.broadcast(big, src=world_size - 1, algorithm="chain")
    return torch.equal(ours, ref), bool((big == world_size - 1).all())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_large_buffers(pools, world_size):
    assert all(all(r) for r in pools(world_size).run(large_exact))


def async_and_ordering(rank, world_size):
    ts = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(5)]
    works = [collectives.all_reduce(t, async_op=True) for t in ts]
    sync_t = torch.ones(10)
    collectives.all_reduce(sync_t)  # queued behind the async ones, still in program order
    for w in reversed(works):
        assert w.wait() is True
        assert w.is_completed() and w.is_success()
    expect = [sum(r + i for r in range(world_size)) for i in range(5)]
    ok = all(bool((t == e).all()) for t, e in zip(ts, expect)) and bool((sync_t == world_size).all())
    w = collectives.broadcast(torch.zeros(3), src=0, async_op=True)
    w.wait()
    b = collectives.barrier(async_op=True)
    b.wait()
    return ok


@pytest.mark.timeout(120)
def test_async_handles_and_program_order(pools):
    assert all(pools(3).run(async_and_ordering))


def subgroups(rank, world_size):
    evens = collectives.new_group([0, 2])
    odds = collectives.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    assert collectives.is_non_member(evens) == (rank % 2 == 1) and collectives.is_non_member(odds) == (rank % 2 == 0)
    t = torch.tensor([float(rank)])
    collectives.all_reduce(t, group=mine)
    w = torch.tensor([1.0])
    collectives.all_reduce(w)  # the default group still works alongside
    lst = [torch.zeros(1), torch.zeros(1)]
    collectives.all_gather(lst, torch.tensor([float(rank)]), group=mine)
    got = torch.tensor([float(rank)])
    collectives.broadcast(got, src=2 if rank % 2 == 0 else 3, group=mine)  # src is a global rank
    assert float(got) == (2.0 if rank % 2 == 0 else 3.0)
    return float(t), float(w), [float(x) for x in lst], collectives.get_rank(mine), collectives.get_world_size(mine)


@pytest.mark.timeout(120)
def test_subgroups(pools):
    results = pools(4).run(subgroups)
    for rank, (t, w, lst, grank, gsize) in enumerate(results):
        assert t == (2.0 if rank % 2 == 0 else 4.0)
        assert w == 4.0
        assert lst == ([0.0, 2.0] if rank % 2 == 0 else [1.0, 3.0])
        assert (grank, gsize) == (rank // 2, 2)


def torch_compat(rank, world_size):
    t = torch.tensor([2.0, float(rank)])
    collectives.all_reduce(t, op=tdist.ReduceOp.MAX)  # torch's enum is accepted
    u = torch.tensor([3])
    collectives.all_reduce(u, op="product")
    return t.tolist(), int(u)


@pytest.mark.timeout(60)
def test_accepts_torch_reduce_ops(pools):
    for t, u in pools(2).run(torch_compat):
        assert t == [2.0, 1.0] and u == 9


# ---------------------------------------------------------------------------- sparse tensors


def _sparse_cases(rank: int, world_size: int) -> list[torch.Tensor]:
    """Random COO tensors of this rank: duplicate indices, a rank (or every rank) with none,
    different counts per rank, hybrid (dense) dimensions, integer values (exact sums) in four of
    gloo's dtypes; the same shapes on every rank."""
    g = torch.Generator().manual_seed(rank)
    cases = []
    for seed, (shape, sparse_dim, dtype) in enumerate([
        ((7,), 1, torch.float32),
        ((5, 6), 2, torch.float64),
        ((4, 3, 2), 1, torch.int64),  # values are rows of 3 x 2
        ((6, 5, 3), 2, torch.bfloat16),
        ((3, 3), 2, torch.float32),  # empty on every rank
    ]):
        nnz = 0 if seed == 4 else int(torch.randint(0, 9, (1,), generator=g)) * (rank != seed % world_size)
        indices = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)])
        values = torch.randint(-9, 10, (nnz,) + shape[sparse_dim:], generator=g).to(dtype)
        cases.append(torch.sparse_coo_tensor(indices, values, shape))  # uncoalesced: duplicates likely
    return cases


def sparse_sums(rank, world_size, way):
    """Every case summed by gloo (the pool's world) and by ``way``: ours on the world (p2p), on a
    shm group, or torch's all_reduce on a ringddp group; odd cases async. Also the refusals."""
    lib, group = {
        "p2p": (collectives, None),
        "shm": (collectives, collectives.new_group(backend="shm")),
        "ringddp": (tdist, tdist.new_group(backend="ringddp")),
    }[way]
    out = []
    for i, case in enumerate(_sparse_cases(rank, world_size)):
        ref, ours = case.clone(), case.clone()
        tdist.all_reduce(ref)
        handle = lib.all_reduce(ours, group=group, async_op=i % 2 == 1)
        if handle is not None:
            handle.wait()
        ref = ref.coalesce()
        same = ours.is_coalesced() and torch.equal(ours._indices(), ref._indices()) and torch.equal(ours._values(), ref._values())
        out.append(same or f"case {i}: ours {ours} gloo {ref}")
    refused = []
    for call in (
        lambda: lib.all_reduce(torch.ones(3).to_sparse(), op=tdist.ReduceOp.MAX, group=group),
        lambda: lib.all_reduce(torch.ones(3, dtype=torch.float16).to_sparse(), group=group),
        lambda: lib.all_reduce(torch.ones(2 + rank).to_sparse(), group=group),  # shapes differ across ranks
    ):
        try:
            call()
            refused.append("no error")
        except (ValueError, TypeError) as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    dense = torch.ones(3)
    lib.all_reduce(dense, group=group)  # the group is still usable, dense tensors as before
    return out, refused, dense.tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sparse_all_reduce_matches_gloo(pools, world_size):
    pool = pools(world_size)
    for way in ("p2p", "shm", "ringddp"):
        for rank, (same, refused, dense) in enumerate(pool.run(sparse_sums, way)):
            assert all(s is True for s in same), (way, rank, same)
            assert dense == [float(world_size)] * 3
            max_op, half, shapes = refused
            assert max_op.startswith("ValueError") and "ReduceOp.SUM only" in max_op, max_op
            assert half.startswith("TypeError") and "torch.float32" in half, half
            assert shapes.startswith("ValueError") and "differ" in shapes and f"({2 + rank},)" in shapes, shapes
