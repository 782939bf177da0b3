"""Adoption (``collectives.adoption``): buffers all-reduced again and again move into symmetric memory.

Through the ``ringddp`` torch backend (adoption opted in with ``Options.adopt_bytes``; off by
default) against torch's gloo on copies of
the same inputs, in the same processes. Integer-valued data keep every order of a sum exact, so
the comparisons are bitwise at any world size (torch's DDP trains on floats: bitwise at two
ranks, within float32 rounding at three). Where a tensor's memory lies is read from
``/proc/self/maps``: a shared mapping (``s`` in its permissions) once adopted, private before.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

import collectives
from collectives import CollectiveError
from collectives.torch_backend import Options
from tests.leaks import PrivateTmpfs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory")

#: past the one-shot limit at 2-3 ranks and over two shared-memory pieces of the two-shot
N = 3 << 19  # 6 MiB of float32


def _shared(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a shared mapping (``/proc/self/maps``)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return perms[3] == "s"
    raise AssertionError(f"{ptr:#x} is not mapped")


def _data(rank: int, i: int, numel: int = N, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integers whose sums over 3 ranks stay exact in ``dtype`` (bfloat16: below 256)."""
    return ((torch.arange(numel) * (rank + 1) + 7 * i) % (80 if dtype is torch.bfloat16 else 1000)).to(dtype)


def _both(t: torch.Tensor, ours, gloo, op=tdist.ReduceOp.SUM, async_op: bool = False) -> bool:
    """All-reduce ``t`` on ours and a copy of it on gloo; whether they agree bitwise."""
    x = t.clone()
    work = tdist.all_reduce(t, op=op, group=ours, async_op=async_op)
    if async_op:
        work.wait()
    tdist.all_reduce(x, op=op, group=gloo)
    return torch.equal(t, x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 16)  # 1.1 MiB of gradients: one bucket past the one-shot limit

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(group, rank: int, steps: int = 5) -> tuple[torch.Tensor, bool]:
    """torch's DDP (gradient_as_bucket_view: the gradients are views of its buckets): the
    parameters after ``steps`` steps and whether the gradients lie in shared memory."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        ((ddp(torch.randn(8, 256, generator=gen)) - 1) ** 2).mean().backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, all(_shared(p.grad) for p in model.parameters())


def adoption_job(rank: int, n: int) -> dict:
    on = Options(adopt_bytes=1 << 30)
    ours, gloo = tdist.new_group(backend="ringddp", pg_options=on), tdist.new_group(backend="gloo")
    out: dict = {}

    # the same tensor again and again: adopted during its second call, a view made before follows
    t = torch.empty(N)
    view = t[5:9]
    for i in range(3):
        t.copy_(_data(rank, i))
        out[f"call {i}"] = (_both(t, ours, gloo), _shared(t))
    out["view follows"] = (view.data_ptr() == t.data_ptr() + 20, torch.equal(view, t[5:9]), _shared(view))
    t.copy_(_data(rank, 3))
    out["MAX, async"] = (_both(t, ours, gloo, tdist.ReduceOp.MAX, async_op=True), _shared(t))
    t.copy_(_data(rank, 4))
    x = t.clone()
    tdist.all_reduce(t, op=tdist.ReduceOp.AVG, group=ours)
    tdist.all_reduce(x, group=gloo)
    out["AVG"] = torch.equal(t, x / n)

    # other dtypes, adopted on their second call too
    for dtype in (torch.bfloat16, torch.int64):
        u = torch.empty(N, dtype=dtype)
        agree = []
        for i in range(2):
            u.copy_(_data(rank, i, dtype=dtype))
            agree.append(_both(u, ours, gloo))
        out[str(dtype)] = (agree, _shared(u))

    # every rank's buffer adopted, but in different allocations on different ranks
    t2 = torch.empty(N)
    for i in range(2):
        t2.copy_(_data(rank, 40 + i))
        tdist.all_reduce(t2, group=ours)
    crossed = t if rank == 0 else t2
    crossed.copy_(_data(rank, 42))
    out["crossed"] = (_both(crossed, ours, gloo), _shared(t2))

    # rank 0 keeps its adopted tensor, the others pass fresh ones every call: still exact
    for i in range(2):
        mixed = t if rank == 0 else torch.empty(N)
        mixed.copy_(_data(rank, 10 + i))
        out[f"mixed {i}"] = _both(mixed, ours, gloo)

    # a slice of a larger storage is never adopted (moving it would move its neighbours)
    base = torch.zeros(N + 8)
    part = base[4 : N + 4]
    for i in range(3):
        part.copy_(_data(rank, 20 + i))
        out[f"slice {i}"] = (_both(part, ours, gloo), _shared(part), float(base[:4].abs().sum() + base[-4:].abs().sum()))

    # memory torch did not allocate (NumPy's) is never adopted: the array would keep the old address
    array = np.zeros(N, dtype=np.float32)
    numpy_view = torch.from_numpy(array)
    for i in range(3):
        numpy_view.copy_(_data(rank, 50 + i))
        expected = numpy_view.clone()
        tdist.all_reduce(expected, group=gloo)
        tdist.all_reduce(numpy_view, group=ours)
        out[f"numpy {i}"] = (torch.equal(torch.from_numpy(array), expected), _shared(numpy_view))

    # budgets: too small for the tensor, off, and the default (off)
    for name, options in (("budget 1M", Options(adopt_bytes=1 << 20)), ("budget 0", Options(adopt_bytes=0)), ("default", None)):
        small = tdist.new_group(backend="ringddp", pg_options=options)
        w = torch.empty(N)
        agree = []
        for i in range(3):
            w.copy_(_data(rank, 30 + i))
            agree.append(_both(w, small, gloo))
        out[name] = (agree, _shared(w))
        tdist.destroy_process_group(small)

    # torch's DDP: its bucket is adopted, parameters as on gloo
    (mine, shared), (theirs, _) = _train(ours, rank), _train(gloo, rank)
    out["ddp"] = (float((mine - theirs).abs().max()), shared)

    # different sizes on different ranks: an error on every rank, not a hang
    bad = tdist.new_group(backend="ringddp", pg_options=on)
    odd = torch.ones(N + rank)
    try:
        for _ in range(2):
            tdist.all_reduce(odd, group=bad)
        out["mismatch"] = "no error"
    except CollectiveError as exc:
        out["mismatch"] = str(exc)

    # the adopted tensor outlives its group
    for g in (ours, gloo):
        tdist.destroy_process_group(g)
    t.fill_(rank)
    out["after destroy"] = float(t.sum())
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reused_buffers_are_adopted_and_results_match_gloo(pools, world_size):
    for rank, out in enumerate(pools(world_size).run(adoption_job)):
        assert out["call 0"] == (True, False), (rank, out)
        assert out["call 1"] == (True, True) and out["call 2"] == (True, True), (rank, out)
        assert out["view follows"] == (True, True, True), rank
        assert out["MAX, async"] == (True, True) and out["AVG"], (rank, out)
        for dtype in ("torch.bfloat16", "torch.int64"):
            assert out[dtype] == ([True, True], True), (rank, dtype, out[dtype])
        assert out["crossed"] == (True, True) and out["mixed 0"] and out["mixed 1"], (rank, out)
        for i in range(3):
            assert out[f"slice {i}"] == (True, False, 0.0), (rank, i, out[f"slice {i}"])
        for i in range(3):
            assert out[f"numpy {i}"] == (True, False), (rank, i, out[f"numpy {i}"])
        for name in ("budget 1M", "budget 0", "default"):
            assert out[name] == ([True] * 3, False), (rank, name, out[name])
        # a float sum of 2 terms does not depend on their order; of 3 it does (gloo's order is not ours)
        assert out["ddp"][1] and out["ddp"][0] <= (0.0 if world_size == 2 else 1e-6), (rank, out["ddp"])
        assert "all_reduce" in out["mismatch"], (rank, out["mismatch"])
        assert out["after destroy"] == rank * N, rank


def adoption_in_a_small_tmpfs(rank: int, world_size: int) -> list[tuple[bool, bool]]:
    """Adoption on for our world group (``tuning.adopt_bytes``), a 12 MiB tensor reduced 4 times."""
    group = collectives.get_group()
    group.tuning.adopt_bytes = 1 << 30
    t = torch.empty(3 << 20)
    out = []
    for i in range(4):
        t.fill_(rank + i)
        collectives.all_reduce(t)
        out.append((bool((t == 2 * i + 1).all()), _shared(t)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size, adopted", [("30m", False), ("80m", True)])
def test_adoption_needs_room_in_the_file_system(monkeypatch, size, adopted):
    """2 transport segments (10 MiB each) fit a 30 MiB tmpfs, a 12 MiB adoption per rank does not:
    both ranks keep their tensors private, and the results are right; in 80 MiB the tensor moves
    on its second call. Nothing is left behind either way."""
    with PrivateTmpfs(size) as fs:
        monkeypatch.setenv("RINGDDP_SHM_DIR", fs.path)
        out = collectives.launch(adoption_in_a_small_tmpfs, 2, backend="shm", timeout=20, join_timeout=90)
        assert out == [[(True, False)] + [(True, adopted)] * 3] * 2
        assert fs.wait_until_empty() == 0


def test_the_budget_comes_from_options_or_the_environment(monkeypatch):
    from collectives.torch_backend import _adopt_bytes

    assert _adopt_bytes(None) == 0 and _adopt_bytes(Options()) == 0  # off unless asked
    monkeypatch.setenv("RINGDDP_ADOPT_BYTES", "512M")
    assert _adopt_bytes(None) == 512 << 20 and _adopt_bytes(Options(adopt_bytes=7)) == 7
    monkeypatch.setenv("RINGDDP_ADOPT_BYTES", "lots")
    with pytest.raises(ValueError, match="RINGDDP_ADOPT_BYTES='lots': expected a byte count"):
        _adopt_bytes(None)
    with pytest.raises(ValueError, match=">= 0"):
        _adopt_bytes(Options(adopt_bytes=-1))
    with pytest.raises(TypeError, match="an int"):
        _adopt_bytes(Options(adopt_bytes=True))
