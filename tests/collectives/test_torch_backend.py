"""torch's own stack on backend="ringddp", against the same programs on torch's gloo.

Each job builds a ringddp group and a gloo group of the same ranks in the same processes and runs
one program on both: every ``dist.*`` collective and point-to-point call, torch's
DistributedDataParallel in its configurations and comm hooks, FSDP2, DTensor, functional
collectives and ``torch.distributed.checkpoint``; every collective again over the inputs that
break glue code (sizes 0, 1, below the world size, odd, 2-D, beyond a shared-memory piece; four
dtypes; every reduce op; strided views, whose other elements must stay untouched), with
integer-valued data so that any order of a sum is exact (gloo gets contiguous copies: it writes
a strided tensor's storage as if it were contiguous). At two ranks results are bitwise equal (a
sum of two floats does not depend on order); at three, a float sum depends on the order of its
terms, which differs between gloo's algorithm and ours, so training is compared within float32
rounding (``rtol=atol=1e-5``: a few ulps per step over a few steps), collectives of exact values
bitwise. Failure paths, the default group (``init_process_group(backend="ringddp")`` under
torchrun, with a script that never imports collectives) and a 2x2 torchrun across emulated hosts
run in processes of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

import collectives
from collectives.torch_backend import RingddpProcessGroup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _groups(world_size: int):
    """A ringddp group and a gloo group of every rank, made in the same order on every rank."""
    return tdist.new_group(backend="ringddp"), tdist.new_group(backend="gloo")


# ---------------------------------------------------------------------------- every call


def _calls(g, rank: int, n: int) -> dict:
    """Every dist.* collective and point-to-point call on ``g``, as plain lists (exact values)."""
    t = torch.arange(4.0) + rank
    out = {}

    def run(name, f):
        out[name] = f()

    def reduced(op=tdist.ReduceOp.SUM, **kw):
        x = t.clone()
        tdist.all_reduce(x, op=op, group=g, **kw)
        return x.tolist()

    run("all_reduce", reduced)
    run("all_reduce MAX", lambda: reduced(tdist.ReduceOp.MAX))
    run("all_reduce AVG", lambda: reduced(tdist.ReduceOp.AVG) if tdist.get_backend(g) != "gloo" else [1.0 * (n - 1) / 2 + i for i in range(4)])

    def async_all_reduce():
        x = t.clone() * 2
        work = tdist.all_reduce(x, group=g, async_op=True)
        value = work.get_future().wait()[0].tolist()
        return work.wait(), value, x.tolist()

    run("all_reduce async", async_all_reduce)

    def broadcast():
        x = t.clone()
        tdist.broadcast(x, src=n - 1, group=g)
        return x.tolist()

    run("broadcast", broadcast)

    def reduce():
        x = t.clone()
        tdist.reduce(x, dst=0, group=g)
        return x.tolist() if rank == 0 else None

    run("reduce", reduce)

    def all_gather():
        outs = [torch.zeros(4) for _ in range(n)]
        tdist.all_gather(outs, t, group=g)
        return [o.tolist() for o in outs]

    run("all_gather", all_gather)

    def all_gather_into_tensor():
        o = torch.zeros(4 * n)
        tdist.all_gather_into_tensor(o, t, group=g)
        return o.tolist()

    run("all_gather_into_tensor", all_gather_into_tensor)

    def all_gather_coalesced():
        outs = [[torch.zeros(4), torch.zeros(2)] for _ in range(n)]
        tdist.all_gather_coalesced(outs, [t, t[:2] * 3], group=g)
        return [[o.tolist() for o in row] for row in outs]

    run("all_gather_coalesced", all_gather_coalesced)

    def reduce_scatter():
        o = torch.zeros(2)
        tdist.reduce_scatter(o, [torch.full((2,), float(rank + j)) for j in range(n)], group=g)
        return o.tolist()

    run("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor():
        o = torch.zeros(2)
        tdist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + rank, group=g)
        return o.tolist()

    run("reduce_scatter_tensor", reduce_scatter_tensor)

    def all_reduce_coalesced():
        xs = [t.clone(), t.clone() * 2]
        tdist.all_reduce_coalesced(xs, group=g)
        return [x.tolist() for x in xs]

    run("all_reduce_coalesced", all_reduce_coalesced)

    def all_to_all_single():
        o = torch.zeros(2 * n)
        tdist.all_to_all_single(o, torch.arange(2.0 * n) + 10 * rank, group=g)
        return o.tolist()

    run("all_to_all_single", all_to_all_single)

    def all_to_all():
        outs = [torch.zeros(2) for _ in range(n)]
        tdist.all_to_all(outs, [torch.full((2,), float(10 * rank + j)) for j in range(n)], group=g)
        return [o.tolist() for o in outs]

    run("all_to_all", all_to_all)

    def gather():
        outs = [torch.zeros(4) for _ in range(n)] if rank == 0 else None
        tdist.gather(t, outs, dst=0, group=g)
        return [o.tolist() for o in outs] if outs else None

    run("gather", gather)

    def scatter():
        o = torch.zeros(4)
        tdist.scatter(o, [torch.full((4,), float(j)) for j in range(n)] if rank == 0 else None, src=0, group=g)
        return o.tolist()

    run("scatter", scatter)
    run("barrier", lambda: tdist.barrier(group=g))

    def point_to_point():
        x, y = t.clone(), torch.zeros(4)
        right, left = (rank + 1) % n, (rank - 1) % n
        if rank % 2 == 0:
            tdist.send(x, dst=right, group=g)
            tdist.recv(y, src=left, group=g)
        else:
            tdist.recv(y, src=left, group=g)
            tdist.send(x, dst=right, group=g)
        z = torch.zeros(4)
        works = [tdist.isend(x * 2, dst=right, group=g), tdist.irecv(z, src=left, group=g)]
        for w in works:
            w.wait()
        b = torch.zeros(4)
        ops = [tdist.P2POp(tdist.isend, x * 3, right, g), tdist.P2POp(tdist.irecv, b, left, g)]
        for w in tdist.batch_isend_irecv(ops):
            w.wait()
        return y.tolist(), z.tolist(), b.tolist()

    if n > 1:
        run("send/recv", point_to_point)

    def objects():
        gathered = [None] * n
        tdist.all_gather_object(gathered, {"rank": rank}, group=g)
        lst = [rank, "x"]
        tdist.broadcast_object_list(lst, src=n - 1, group=g)
        return gathered, lst

    run("objects", objects)
    return out


def _functional(g, rank: int, n: int) -> list[float]:
    import torch.distributed._functional_collectives as funcol

    t = torch.arange(4.0) + rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = (
            funcol.all_reduce(t, "sum", g),
            funcol.all_gather_tensor(t, 0, g),
            funcol.reduce_scatter_tensor(torch.arange(2.0 * n) + rank, "sum", 0, g),
            funcol.broadcast(t, n - 1, g),
        )
    return torch.cat([p.reshape(-1) for p in parts]).tolist()


def every_call(rank: int, world_size: int) -> tuple:
    ours, gloo = _groups(world_size)
    assert isinstance(ours, RingddpProcessGroup) and tdist.get_backend(ours) == "ringddp"
    names = (ours.group_name != "", ours.name, ours.getBackendName())
    pair = tdist.new_group([0, world_size - 1], backend="ringddp")  # a subgroup of the ringddp world
    sub = None
    if rank in (0, world_size - 1):
        sub = torch.tensor([float(rank)])
        tdist.all_reduce(sub, group=pair)
        sub = sub.item()
    result = (_calls(ours, rank, world_size), _calls(gloo, rank, world_size),
              _functional(ours, rank, world_size), _functional(gloo, rank, world_size), names, sub)
    for g in (pair, ours, gloo):
        tdist.destroy_process_group(g)
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_dist_call_matches_gloo(pools, world_size):
    for rank, (ours, gloo, f_ours, f_gloo, names, sub) in enumerate(pools(world_size).run(every_call)):
        assert ours == gloo, rank
        assert f_ours == f_gloo, rank
        assert names == (True, "ringddp", "ringddp")
        if rank in (0, world_size - 1):
            assert sub == float(world_size - 1)


# ------------------------------------------------------------------ every input, through dist.*

#: dtypes of :func:`every_input` (integer-valued data: sums and products exact in any order).
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def _input(shape: tuple[int, ...], dtype: torch.dtype, seed: int, strided: bool, base_out: list) -> torch.Tensor:
    """Integer values of ``shape``; ``strided``: every second element of a wider tensor, whose
    other elements hold a sentinel that no call may touch (``base_out`` collects the bases)."""
    x = _values(shape, dtype, seed)
    if not strided:
        return x
    wide = torch.full((*shape[:-1], 2 * shape[-1]), 7, dtype=dtype)
    view = wide[..., ::2]
    view.copy_(x)
    base_out.append(wide)
    return view


def every_input(rank: int, world_size: int) -> list[str]:
    """Each dist.* collective on ringddp and on gloo over sizes 0, 1, < n, odd, 2-D and one beyond
    a piece, every dtype of :data:`INPUT_DTYPES`, every reduce op, strided views (gloo gets
    contiguous copies of the same values: it writes a strided tensor's storage as if it were
    contiguous); returns the cases whose results differ, that only ours refused, or whose
    strided bases had an element outside the view written. (A layout gloo refuses is skipped:
    ours takes more, e.g. strided inputs to ``all_to_all_single``.)"""
    ours, gloo = _groups(world_size)
    n, bad = world_size, []
    ops = (tdist.ReduceOp.SUM, tdist.ReduceOp.MAX, tdist.ReduceOp.MIN, tdist.ReduceOp.PRODUCT)
    shapes = [(0,), (1,), (max(1, n - 1),), (7,), (5, 3), ((1 << 20) + 3,)]

    def calls(shape: tuple[int, ...], dtype: torch.dtype, seed: int):
        rows = (n * shape[0],) + shape[1:]
        yield from ((f"all_reduce {op}", lambda x, g, op=op: tdist.all_reduce(x, op=op, group=g), shape) for op in ops)
        yield "all_reduce async", lambda x, g: tdist.all_reduce(x, group=g, async_op=True).wait(), shape
        yield "broadcast", lambda x, g: tdist.broadcast(x, src=n - 1, group=g), shape
        yield "reduce", lambda x, g: tdist.reduce(x, dst=n - 1, group=g), shape
        yield "scatter", lambda x, g: tdist.scatter(
            x, [_values(shape, dtype, seed + j) for j in range(n)] if rank == 0 else None, src=0, group=g), shape
        yield "all_gather", lambda x, g: _out(lambda o: tdist.all_gather(o, x, group=g), [torch.zeros_like(x) for _ in range(n)]), shape
        yield "gather", lambda x, g: _out(lambda o: tdist.gather(x, o, dst=0, group=g),
                                          [torch.zeros_like(x) for _ in range(n)] if rank == 0 else None), shape
        yield "all_gather_into_tensor", lambda x, g: _out(lambda o: tdist.all_gather_into_tensor(o, x, group=g),
                                                          torch.zeros(rows, dtype=dtype)), shape
        yield "all_gather_into_tensor stacked", lambda x, g: _out(lambda o: tdist.all_gather_into_tensor(o, x, group=g),
                                                                  torch.zeros((n, *shape), dtype=dtype)), shape
        yield "reduce_scatter_tensor", lambda x, g: _out(lambda o: tdist.reduce_scatter_tensor(o, x, group=g),
                                                         torch.zeros(shape, dtype=dtype)), rows
        yield "all_to_all_single", lambda x, g: _out(lambda o: tdist.all_to_all_single(o, x, group=g),
                                                     torch.zeros(rows, dtype=dtype)), rows
        if len(shape) == 2:  # uneven: rank r sends (r + j) % 3 rows to rank j
            sends, gets = [(rank + j) % 3 for j in range(n)], [(j + rank) % 3 for j in range(n)]
            yield "all_to_all_single uneven", lambda x, g: _out(
                lambda o: tdist.all_to_all_single(o, x, gets, sends, group=g), torch.zeros((sum(gets), shape[1]), dtype=dtype)
            ), (sum(sends), shape[1])

    seed = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of the *_tensor names
        for dtype in INPUT_DTYPES:
            for shape in shapes:
                if shape[0] > 1000 and dtype != torch.float32:
                    continue
                for name, call, in_shape in calls(shape, dtype, 1000 * rank):
                    for strided in (False, True):
                        seed += 1
                        bases: list[torch.Tensor] = []
                        mine = _input(in_shape, dtype, 1000 * rank + seed, strided, bases)
                        theirs = mine.clone()
                        case = f"{name} {dtype} {tuple(in_shape)}{' strided' if strided else ''}"
                        try:
                            want = call(theirs, gloo)
                        except (RuntimeError, ValueError):
                            continue  # gloo refuses some layouts (an empty stacked output) that we take
                        try:
                            got = call(mine, ours)
                        except (RuntimeError, ValueError) as exc:
                            bad.append(f"{case}: {exc}")
                            continue
                        if name == "reduce" and rank != n - 1:
                            mine = theirs  # a reduce leaves other ranks' tensors unspecified
                        if not _equal(got, want) or not _equal(mine, theirs):
                            bad.append(case)
                        if bases and not bool((bases[0][..., 1::2] == 7).all()):
                            bad.append(case + ": wrote outside the view")
    for g in (ours, gloo):
        tdist.destroy_process_group(g)
    return bad


def _out(call, outputs):
    """Run ``call(outputs)``; the outputs are the result."""
    call(outputs)
    return outputs


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dist_calls_on_every_input_match_gloo(pools, world_size):
    for rank, bad in enumerate(pools(world_size).run(every_input)):
        assert not bad, f"rank {rank}: {len(bad)} cases differ from gloo, e.g. {bad[:8]}"


def refusals(rank: int, world_size: int) -> dict:
    ours, gloo = _groups(world_size)
    out = {}
    for name, call in {
        "sparse max": lambda: tdist.all_reduce(torch.ones(2).to_sparse(), op=tdist.ReduceOp.MAX, group=ours),
        "sparse bool": lambda: tdist.all_reduce(torch.ones(2, dtype=torch.bool).to_sparse(), group=ours),
        "premul sum": lambda: tdist.all_reduce(torch.ones(1), op=tdist._make_nccl_premul_sum(2.0), group=ours),
        "bitwise": lambda: tdist.all_reduce(torch.ones(1, dtype=torch.int32), op=tdist.ReduceOp.BAND, group=ours),
        "monitored barrier": lambda: tdist.monitored_barrier(group=ours),
        "cuda": lambda: tdist.new_group(backend="cpu:gloo,cuda:ringddp"),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError, RuntimeError) as exc:
            out[name] = str(exc)
    tdist.barrier(group=ours)  # nothing was sent: the group still works
    for g in (ours, gloo):
        tdist.destroy_process_group(g)
    return out


@pytest.mark.timeout(120)
def test_what_is_refused_is_refused_clearly(pools):
    for out in pools(2).run(refusals):
        assert "ReduceOp.SUM only" in out["sparse max"] and "torch.float32" in out["sparse bool"]
        assert "PREMUL_SUM" in out["premul sum"] and "PREMUL_SUM" in out["bitwise"]
        assert "GLOO" in out["monitored barrier"]  # torch's own refusal


# ---------------------------------------------------------------------------- torch's DDP


class Net(nn.Module):
    def __init__(self, bn: bool = False, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.b = nn.Linear(16, 4)
        self.u = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


DDP_CASES = {
    "plain": {}, "batchnorm": {"bn": True}, "find_unused_parameters": {"unused": True},
    "gradient_as_bucket_view": {"view": True}, "static_graph": {"static": True}, "no_sync": {"nosync": True},
    "join uneven inputs": {"join": True}, "allreduce_hook": {"hook": "allreduce"},
    "fp16_compress_hook": {"hook": "fp16"}, "powerSGD_hook": {"hook": "powersgd"},
}  # fmt: skip


def _train_ddp(case: dict, group, rank: int) -> torch.Tensor:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Net(bn=case.get("bn", False), unused=case.get("unused", False))
    ddp = DistributedDataParallel(
        model, process_group=group, find_unused_parameters=case.get("unused", False),
        gradient_as_bucket_view=case.get("view", False), static_graph=case.get("static", False), bucket_cap_mb=0.001,
    )  # fmt: skip
    hook = case.get("hook")
    if hook == "allreduce":
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":  # its callbacks issue collectives and wait for them
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)

    def step(i: int) -> None:
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        if case.get("nosync") and i % 2 == 0:
            with ddp.no_sync():
                ((ddp(x) - y) ** 2).mean().backward()
            return
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    steps = 5 + (rank if case.get("join") else 0)
    if case.get("join"):
        with Join([ddp]):
            for i in range(steps):
                step(i)
    else:
        for i in range(steps):
            step(i)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()] + [b.reshape(-1).float() for b in model.buffers()])


def ddp_cases(rank: int, world_size: int, names: list[str]) -> dict:
    ours, gloo = _groups(world_size)
    out = {name: (_train_ddp(DDP_CASES[name], ours, rank), _train_ddp(DDP_CASES[name], gloo, rank)) for name in names}
    for g in (ours, gloo):
        tdist.destroy_process_group(g)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_ddp_matches_gloo(pools, world_size):
    names = list(DDP_CASES) if world_size == 2 else ["plain", "batchnorm", "join uneven inputs", "powerSGD_hook"]
    for rank, out in enumerate(pools(world_size).run(ddp_cases, names)):
        for name, (ours, gloo) in out.items():
            if world_size == 2:
                assert torch.equal(ours, gloo), (rank, name, float((ours - gloo).abs().max()))
            else:
                torch.testing.assert_close(ours, gloo, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


# ---------------------------------------------------------------------------- FSDP2, DTensor, checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.l1, self.l2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(self.norm(x))))


class Transformerish(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sharded(mesh, seed: int = 0) -> Transformerish:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Transformerish()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2(mesh, rank: int) -> torch.Tensor:
    model = _sharded(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(4):
        model(torch.randn(6, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _dtensor(mesh) -> torch.Tensor:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    product = (distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()]))
    resharded = distribute_tensor(a, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)]).full_tensor()
    return torch.cat([product.redistribute(mesh, [Replicate()]).to_local().reshape(-1), resharded.reshape(-1)])


def fsdp_dtensor(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    ours, gloo = _groups(world_size)
    meshes = {name: DeviceMesh.from_group(g, "cpu") for name, g in (("ours", ours), ("gloo", gloo))}
    out = {name: (_fsdp2(mesh, rank), _dtensor(mesh)) for name, mesh in meshes.items()}
    model = _sharded(meshes["ours"])
    dcp.save(model.state_dict(), checkpoint_id=path)
    out["saved"] = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    for g in (ours, gloo):
        tdist.destroy_process_group(g)
    return out


def load_checkpoint(rank: int, world_size: int, path: str) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    ours = tdist.new_group(backend="ringddp")
    model = _sharded(DeviceMesh.from_group(ours, "cpu"), seed=5)  # other initial values
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    loaded = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    tdist.destroy_process_group(ours)
    return loaded


@pytest.mark.timeout(300)
def test_fsdp2_dtensor_and_checkpoint_match_gloo():
    with tempfile.TemporaryDirectory() as path:
        results = collectives.launch(fsdp_dtensor, 2, path, timeout=60, join_timeout=240)
        loaded = collectives.launch(load_checkpoint, 2, path, timeout=60, join_timeout=240)  # fresh processes
    for rank, out in enumerate(results):
        (fsdp_ours, dt_ours), (fsdp_gloo, dt_gloo) = out["ours"], out["gloo"]
        assert torch.equal(fsdp_ours, fsdp_gloo), rank
        assert torch.equal(dt_ours, dt_gloo), rank
        assert torch.equal(loaded[rank], out["saved"]), rank


# ---------------------------------------------------------------------------- failures


def failing_bucket(rank: int, world_size: int) -> tuple[str, str]:
    """Rank 2 stops between forward and backward past the group's deadline: the bucket all-reduce
    of the others fails inside torch's C++ reducer."""
    import datetime

    from torch.nn.parallel import DistributedDataParallel

    ours = tdist.new_group(backend="ringddp", timeout=datetime.timedelta(seconds=2))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 4), process_group=ours)
    model(torch.ones(2, 4)).sum().backward()
    loss = model(torch.ones(2, 4)).sum()
    if rank == 2:
        time.sleep(4)
        return ("stopped", "")
    try:
        loss.backward()
    except RuntimeError as exc:  # torch's reducer re-raises the future's error
        return (type(exc).__name__, str(exc))
    return ("no error", "")


def mismatch(rank: int, world_size: int) -> tuple[str, str]:
    ours = tdist.new_group(backend="ringddp")
    t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        tdist.all_reduce(t, group=ours)
    except tdist.DistBackendError as exc:
        return (type(exc).__name__, str(exc))
    return ("no error", "")


def killed_peer(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1 dies by SIGKILL between all-reduces; the survivors write down what they raised."""
    ours = tdist.new_group(backend="ringddp")
    tdist.all_reduce(torch.ones(4), group=ours)
    if rank == 1:
        os.kill(os.getpid(), 9)
    start = time.monotonic()
    try:
        for _ in range(100):
            tdist.all_reduce(torch.ones(1 << 16), group=ours)
        outcome = "no error"
    except tdist.DistBackendError as exc:
        outcome = str(exc).splitlines()[0]
    with open(os.path.join(tmp, f"{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.3f} {outcome}")


@pytest.mark.timeout(240)
def test_failures_are_errors_naming_op_and_peer_on_every_rank():
    fates = collectives.launch(failing_bucket, 3, timeout=30, join_timeout=120)
    for rank in (0, 1):
        kind, message = fates[rank]
        assert kind == "RuntimeError" and "all_reduce" in message and "rank 2" in message, (rank, message)
    for rank, (kind, message) in enumerate(collectives.launch(mismatch, 2, timeout=30, join_timeout=120)):
        assert kind == "CollectiveError" and "dtype" in message, (rank, message)
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(collectives.LaunchError, match="rank 1 died"):
            collectives.launch(killed_peer, 3, tmp, timeout=30, join_timeout=120)
        for rank in (0, 2):
            with open(os.path.join(tmp, f"{rank}.txt")) as f:
                seconds, message = f.read().split(" ", 1)
            assert "all_reduce" in message and "rank 1" in message, (rank, message)
            assert float(seconds) < 5, (rank, seconds, "a dead peer must fail the others fast, not at the 30 s deadline")


# ---------------------------------------------------------------------------- the default group


UNMODIFIED = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group(backend="ringddp")   # the one changed string; collectives is never imported
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.full((3, 4), float(dist.get_rank()))).sum().backward()
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    with open(f"result{dist.get_rank()}.txt", "w") as f:  # one file per rank: stdout lines interleave
        print(dist.get_rank(), dist.get_backend(), type(dist.group.WORLD).__name__, t.tolist(),
              model.module.weight.grad.sum().item(), file=f)
    dist.destroy_process_group()
    """
)


def _torchrun(args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ARGS`` in a session of its own, killed whole on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(180)
def test_unmodified_script_under_torchrun():
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(UNMODIFIED)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("RINGDDP_BACKEND", None)
        proc = _torchrun(["--standalone", "--nproc-per-node", "2", script], env, tmp, timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = []
        for rank in range(2):
            with open(os.path.join(tmp, f"result{rank}.txt")) as f:
                lines.append(f.read().split())
    assert [line[:4] for line in lines] == [["0", "ringddp", "RingddpProcessGroup", "[3.0,"], ["1", "ringddp", "RingddpProcessGroup", "[3.0,"]]
    assert lines[0][-1] == lines[1][-1]  # the same averaged gradient on both ranks


# ---------------------------------------------------------------------------- real GPU (skipped here)


def cuda_through_ringddp(rank: int, world_size: int) -> dict:
    """CUDA tensors through a ringddp group (under ``auto``: our nccl-cupy engine) and through
    torch's NCCL group: a few calls, and torch's DDP on a CUDA model."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    ours, nccl = tdist.new_group(backend="ringddp"), tdist.new_group(backend="nccl")
    out: dict = {}
    for name, g in (("ringddp", ours), ("nccl", nccl)):
        t = torch.arange(6, dtype=torch.float32, device=dev) + rank
        tdist.all_reduce(t, group=g)
        b = torch.full((3,), float(rank), device=dev)
        tdist.broadcast(b, 0, group=g)
        gathered = torch.empty(2 * world_size, device=dev)
        tdist.all_gather_into_tensor(gathered, torch.tensor([rank, -rank], dtype=torch.float32, device=dev), group=g)
        scattered = torch.empty(2, device=dev)
        tdist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world_size, device=dev) * (rank + 1), group=g)
        a = torch.ones(4, device=dev)
        tdist.all_reduce(a, group=g, async_op=True).wait()
        out[name] = [x.cpu() for x in (t, b, gathered, scattered, a)] + [_train_cuda_ddp(g, rank, dev)]
    return {k: [x.tolist() for x in v] for k, v in out.items()}


def _train_cuda_ddp(group, rank: int, dev: torch.device) -> torch.Tensor:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Net().to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index], process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x, y = torch.randn(5, 8, generator=gen).to(dev), torch.randn(5, 4, generator=gen).to(dev)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


@pytest.mark.timeout(300)
def test_gpu_cuda_tensors_through_the_ringddp_backend():
    """On a GPU machine with CuPy, CUDA tensors on a ringddp group run on our nccl-cupy engine:
    equal to torch's NCCL (bitwise: exact values, and at most two ranks' sums), torch's DDP too."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible: CUDA through the ringddp backend is skipped")
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install ringddp[cuda])")
    world = min(2, torch.cuda.device_count())
    for result in collectives.launch(cuda_through_ringddp, world, timeout=60, join_timeout=240):
        assert result["ringddp"] == result["nccl"]
