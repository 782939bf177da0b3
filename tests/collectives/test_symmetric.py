"""Symmetric memory (``collectives.symmetric_empty``): all-reduce in place, fallbacks, misuse, DDP.

Over ``shm`` every rank's symmetric tensor is mapped by every peer, and ``all_reduce`` on it (or
on a slice of it) reads the peers' data in place (``shm_algorithms.all_reduce_symmetric``). Each
slice is reduced in rank order by one rank, so the result equals, bit for bit, the fold
``((x0 op x1) op x2) ...`` computed here from every rank's input with plain torch operations
(``ReduceOp`` docs: AVG is SUM then one division; on bool, SUM/MAX are OR and PRODUCT/MIN AND).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn as nn

import collectives
from collectives import CollectiveError, ReduceOp
from collectives import shm_algorithms
from tests.leaks import PrivateTmpfs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory")

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool)
# past the one-shot limit (1 MiB at 2 ranks) for every dtype: 1 100 003 bytes even as uint8 / bool;
# small sizes take the one-shot path (not symmetric-specific, but must agree); odd sizes split unevenly
SIZES = (0, 1, 3, 1_100_003)


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    x = torch.randn(numel, generator=g) * 50
    return x > 0 if dtype is torch.bool else x.to(dtype)


def _ops(dtype: torch.dtype) -> list[ReduceOp]:
    if dtype is torch.bool:
        return [ReduceOp.MAX, ReduceOp.MIN]
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
    return ops + [ReduceOp.AVG] if dtype.is_floating_point else ops


def _fold(op: ReduceOp, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a op b`` elementwise, in plain torch."""
    if a.dtype is torch.bool:
        return a | b if op in (ReduceOp.SUM, ReduceOp.MAX) else a & b
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return a + b
    if op is ReduceOp.PRODUCT:
        return a * b
    return torch.minimum(a, b) if op is ReduceOp.MIN else torch.maximum(a, b)


def _expected(world_size: int, numel: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    out = _input(0, numel, dtype)
    for q in range(1, world_size):
        out = _fold(op, out, _input(q, numel, dtype))
    return out / world_size if op is ReduceOp.AVG and world_size > 1 else out


def _symmetric_buffers(group: collectives.Group) -> int:
    return len(group.engine(torch.device("cpu"), "test")._symmetric)


def all_reduce_cases(rank: int, world_size: int) -> list[str]:
    """Every dtype, op and size, on the whole tensor and on a slice; the wrong cases, named."""
    wrong = []
    for dtype in DTYPES:
        for numel in SIZES:
            t = collectives.symmetric_empty(numel + 5, dtype=dtype)
            for op in _ops(dtype):
                t[2 : 2 + numel].copy_(_input(rank, numel, dtype))
                t[:2].fill_(1)
                t[2 + numel :].fill_(1)
                collectives.all_reduce(t[2 : 2 + numel], op)
                if not torch.equal(t[2 : 2 + numel], _expected(world_size, numel, dtype, op)):
                    wrong.append(f"{dtype} {numel} {op.name}")
                if not (bool(t[:2].eq(1).all()) and bool(t[2 + numel :].eq(1).all())):
                    wrong.append(f"{dtype} {numel} {op.name}: wrote outside the slice")
    assert _symmetric_buffers(collectives.get_group()) == (len(DTYPES) * len(SIZES) if world_size > 1 else 0)
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_in_symmetric_memory_is_exact(world_size):
    for wrong in collectives.launch(all_reduce_cases, world_size, backend="shm", timeout=60, join_timeout=240):
        assert wrong == []


def misuse(rank: int, world_size: int) -> list[str]:
    """Bad arguments raise before any traffic; ranks passing different memory raise on every rank."""
    outcome = []
    for args, kwargs in [((-1,), {}), ((2.0,), {}), ((True,), {}), ((4,), {"dtype": "float32"})]:
        try:
            collectives.symmetric_empty(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            outcome.append(type(exc).__name__)
    t = collectives.symmetric_empty(1_000_000)  # the group is still in step
    t.fill_(1)
    collectives.all_reduce(t)
    outcome.append(str(float(t[0])))
    for case in ("symmetric vs private", "different slices"):
        g = collectives.new_group()  # a failed collective breaks its group: one group per case
        t = collectives.symmetric_empty(1_000_000, group=g)  # slices past the one-shot limit
        if case == "symmetric vs private":
            x = t[:300_000] if rank == 0 else torch.ones(300_000)
        else:
            x = t[rank * 8 : rank * 8 + 300_000]
        try:
            collectives.all_reduce(x, group=g)
            outcome.append(f"{case}: no error")
        except CollectiveError as exc:
            outcome.append(f"{case}: {'raised' if 'different collective or size' in str(exc) else exc}")
        g.close()  # the tensor outlives its group: its mapping stays while the tensor uses it
        t.fill_(3)
        outcome.append(str(float(t.sum())))
    return outcome


@pytest.mark.timeout(120)
def test_misuse_raises_on_every_rank():
    expected = ["ValueError", "TypeError", "TypeError", "TypeError", "2.0",
                "symmetric vs private: raised", "3000000.0", "different slices: raised", "3000000.0"]  # fmt: skip
    assert collectives.launch(misuse, 2, backend="shm", timeout=10, join_timeout=90) == [expected] * 2


def plain_everywhere(rank: int, world_size: int) -> list[tuple[int, float]]:
    """On p2p and on torch's backend the tensor is ordinary memory, and everything works."""
    out = []
    for g in (collectives.get_group(), collectives.new_group(backend="torch")):
        t = collectives.symmetric_empty(40_000, dtype=torch.float64, group=g)
        t.fill_(rank + 1)
        collectives.all_reduce(t, group=g)
        out.append((len(getattr(g.engine(torch.device("cpu"), "test"), "_symmetric", [])), float(t[0])))
    return out


@pytest.mark.timeout(120)
def test_other_backends_get_ordinary_tensors():
    assert collectives.launch(plain_everywhere, 2, backend="p2p", timeout=20) == [[(0, 3.0), (0, 3.0)]] * 2


def too_small_for_it(rank: int, world_size: int) -> tuple[int, float]:
    t = collectives.symmetric_empty(2 << 20)  # 8 MiB per rank: the tmpfs has room for one
    t.fill_(rank + 1)
    collectives.all_reduce(t)
    return _symmetric_buffers(collectives.get_group()), float(t[-1])


@pytest.mark.timeout(180)
def test_file_system_too_small_falls_back_to_private_memory(monkeypatch):
    """2 transport segments (10 MiB each) + one 8 MiB segment fit; a second does not: both ranks
    agree on private memory, and the all-reduce is still right."""
    with PrivateTmpfs("30m") as fs:
        monkeypatch.setenv("RINGDDP_SHM_DIR", fs.path)
        assert collectives.launch(too_small_for_it, 2, backend="shm", timeout=20, join_timeout=90) == [(0, 3.0)] * 2
        assert fs.wait_until_empty() == 0  # the segments, and the reservation that failed, are freed


def ddp_matches_torch(rank: int, world_size: int) -> tuple[bool, bool]:
    """Our DDP over shm (buckets in symmetric memory) against torch's DDP over gloo, 3 steps."""
    from ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1100), nn.ReLU(), nn.Linear(1100, 256))  # 2 buckets > 1 MiB
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=collectives.get_group().process_group)
    ours = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1.5)
    engine = collectives.get_group().engine(torch.device("cpu"), "test")
    buckets = ours.reducer.buckets
    in_place = all(engine._in_symmetric(b.buffer) is not None for b in buckets) and len(buckets) > 1
    in_place = in_place and all(b.buffer.nbytes > shm_algorithms.one_shot_limit(world_size) for b in buckets)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)
        for m in (theirs, ours):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    same = all(torch.equal(a, b) for a, b in zip(theirs.parameters(), ours.parameters()))
    return in_place, same


@pytest.mark.timeout(120)
def test_ddp_buckets_live_in_symmetric_memory_and_match_torch():
    assert collectives.launch(ddp_matches_torch, 2, backend="shm", timeout=30) == [(True, True)] * 2
