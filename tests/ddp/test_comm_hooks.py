"""Comm hooks: ours against torch DDP with torch's same hook; user hooks in torch's style; misuse.

Every rank trains two copies of one float32 MLP on the same shards for a few SGD steps: ours
(``ddp.DistributedDataParallel`` + one of ``ddp.comm_hooks``) and torch's
(``torch.nn.parallel.DistributedDataParallel`` over the gloo group our collectives run on, with
torch's ``default_hooks`` counterpart). Our ranks must end bitwise identical; ours and torch's
must agree within what the reduction dtype allows (see ``TOLERANCE``).

Spawning costs seconds, so each world size runs every case in one launch (cached, like
``test_ddp.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import collectives
import ddp
from ddp import comm_hooks

STEPS = 3
BATCH = 4  # rows per rank per step
LR = 0.1
# float32 parameter bytes, reversed: 4.bias 16, 4.weight 256, 2.bias 64, 2.weight 1024, 0.bias 64,
# 0.weight 512. A 1100-byte cap gives 3 buckets of 84, 272 and 128 elements; the last two do not
# divide by 3 (the reduce-scatter hook pads them).
CAP_MB = 1100 / 2**20

def torch_bf16_compress_hook(process_group, bucket):
    """torch's bf16 hook itself; torch DDP refuses it *by name* unless NCCL is there, gloo runs it."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


# ours -> (our hook, torch's hook on the same data)
HOOKS: dict[str, tuple[Callable, Callable]] = {
    "allreduce": (comm_hooks.allreduce_hook, default_hooks.allreduce_hook),
    "fp16": (comm_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16": (comm_hooks.bf16_compress_hook, torch_bf16_compress_hook),
    "reduce_scatter": (comm_hooks.reduce_scatter_hook, default_hooks.allreduce_hook),
}

# With 2 ranks every hook matches torch bit for bit (checked). With 3 ranks: a bound on
# |ours - torch| per parameter element after STEPS steps, relative to LR * the largest
# reduced gradient element G of the run: each step's update differs by at most LR * (the
# difference of the two reduced gradients), and the parameters then feed the next step's
# gradient (a small factor for this well-conditioned model). The reduced gradients differ only by
# rounding:
# * float32 (allreduce, reduce_scatter): torch divides before summing, we divide after, and the
#   summation orders of gloo's ring and ours differ for 3 ranks: a few float32 roundings,
#   ~1e-7 relative. 1e-5 leaves a wide margin yet catches any real error (a missing or doubled
#   division is off by 50 % or more).
# * fp16: both cast the same float32 values and divide in fp16 identically; the sum of n fp16
#   values is rounded once per addition (2^-11 relative) and with 3 ranks in a different order,
#   so the reduced gradients may differ by about 2 fp16 ulps (2 * 2^-10 relative to G): per
#   step 2^-9 * LR * G, over 3 steps plus propagation: 2^-6.
# * bf16: the same argument with 8 significant bits: 2^-6 per step, 2^-3 over the run.
TOLERANCE = {"allreduce": 1e-5, "reduce_scatter": 1e-5, "fp16": 2.0**-6, "bf16": 2.0**-3}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithUnused(MLP):
    """``extra`` takes part in no forward pass (find_unused_parameters: its bucket is completed at
    the end of backward and reduced through the hook there)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 4)


def data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(world * BATCH, 8, generator=g), torch.randn(world * BATCH, 4, generator=g)) for _ in range(STEPS)]


def _np(params) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in params]


def train(model: nn.Module, params: list[torch.Tensor], rank: int, world: int) -> tuple[list[np.ndarray], float]:
    """STEPS SGD steps on this rank's shard; returns the parameters and the largest |reduced grad|."""
    opt = torch.optim.SGD(params, lr=LR)
    biggest = 0.0
    for x, y in data(world):
        opt.zero_grad()
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        biggest = max([biggest] + [float(p.grad.abs().max()) for p in params if p.grad is not None])
        opt.step()
    return _np(params), biggest


def hook_case(name: str, rank: int, world: int, unused: bool = False) -> dict[str, Any]:
    ours_hook, torch_hook = HOOKS[name]
    torch.manual_seed(rank)  # different on every rank: both wrappers broadcast rank 0's model
    base = WithUnused() if unused else MLP()
    group = collectives.get_default_group()
    ours = ddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB, find_unused_parameters=unused)
    ours.register_comm_hook(None, ours_hook)
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), process_group=group.process_group, find_unused_parameters=unused
    )
    theirs.register_comm_hook(group.process_group, torch_hook)
    ours_final, g_ours = train(ours, list(ours.module.parameters()), rank, world)
    torch_final, g_torch = train(theirs, list(theirs.module.parameters()), rank, world)
    return {"ours": ours_final, "torch": torch_final, "g": max(g_ours, g_torch), "buckets": len(ours.buckets)}


# ---------------------------------------------------------------------------- hooks users write


def torch_style_allreduce_hook(process_group, bucket):
    """torch's ``default_hooks._allreduce_fut`` body, with ``dist`` = our collectives."""
    dist = collectives
    group_to_use = process_group if process_group is not None else dist.group.WORLD

    # Apply the division first to avoid overflow, especially for FP16.
    tensor = bucket.buffer()
    tensor.div_(group_to_use.size())

    return dist.all_reduce(tensor, group=group_to_use, async_op=True).get_future().then(lambda fut: fut.value()[0])


def noop_hook(_: Any, bucket) -> torch.futures.Future:
    """torch's ``debugging_hooks.noop_hook``: no communication, the gradients stay local."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def recording_hook(seen: list, bucket) -> torch.futures.Future:
    """Records what the bucket offers, then averages with collectives calls (get_world_size)."""
    grads, params = bucket.gradients(), bucket.parameters()
    assert len(grads) == len(params) and all(g.shape == p.shape for g, p in zip(grads, params))
    assert all(g.data_ptr() >= bucket.buffer().data_ptr() for g in grads)  # views into the buffer
    seen.append((bucket.index(), bucket.is_last(), bucket.buffer().numel()))
    buf = bucket.buffer().div_(collectives.get_world_size())
    return collectives.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def user_hooks_case(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = data(world)[0]
    rows = slice(rank * BATCH, (rank + 1) * BATCH)

    seen: list = []
    model = ddp.DistributedDataParallel(MLP(), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(seen, recording_hook)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    out["seen"] = seen
    out["recorded_grads"] = _np(p.grad for p in model.module.parameters())

    # torch's own DDP (default reduction) on the same parameters and shard
    reference = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model.module), process_group=collectives.get_default_group().process_group
    )
    for p in reference.module.parameters():
        p.grad = None
    F.mse_loss(reference(x[rows]), y[rows]).backward()
    out["torch_grads"] = _np(p.grad for p in reference.module.parameters())

    local = copy.deepcopy(model.module)
    model = ddp.DistributedDataParallel(copy.deepcopy(local), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(None, noop_hook)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    F.mse_loss(local(x[rows]), y[rows]).backward()
    out["noop_equals_local"] = all(torch.equal(a.grad, b.grad) for a, b in zip(model.module.parameters(), local.parameters()))

    model = ddp.DistributedDataParallel(copy.deepcopy(local), bucket_cap_mb=CAP_MB)
    model.register_comm_hook(collectives.get_default_group(), torch_style_allreduce_hook)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    out["torch_style_grads"] = _np(p.grad for p in model.module.parameters())
    return out


# ---------------------------------------------------------------------------- misuse


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    return "none", ""


def _misuse_input(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(500 + rank))


def misuse_case(rank: int, world: int) -> dict[str, Any]:
    x = _misuse_input(rank)
    out = {}

    model = ddp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, comm_hooks.allreduce_hook)
    out["twice"] = _error(lambda: model.register_comm_hook(None, comm_hooks.fp16_compress_hook))

    model = ddp.DistributedDataParallel(MLP())
    model(x).sum().backward()
    out["after_backward"] = _error(lambda: model.register_comm_hook(None, comm_hooks.allreduce_hook))
    out["not_callable"] = _error(lambda: ddp.DistributedDataParallel(MLP()).register_comm_hook(None, "allreduce"))
    out["one_argument"] = _error(lambda: ddp.DistributedDataParallel(MLP()).register_comm_hook(None, lambda bucket: bucket))

    model = ddp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, lambda state, bucket: bucket.buffer())  # a tensor, not a future
    out["returns_tensor"] = _error(lambda: model(x).sum().backward())

    def list_future(state, bucket):  # forgot .then(lambda fut: fut.value()[0])
        return collectives.all_reduce(bucket.buffer(), async_op=True).get_future()

    model = ddp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, list_future)
    out["future_of_list"] = _error(lambda: model(x).sum().backward())

    def fails_once(calls: list, bucket):
        calls.append(bucket.index())
        return None if len(calls) == 1 else comm_hooks.allreduce_hook(None, bucket)

    model = ddp.DistributedDataParallel(MLP(), bucket_cap_mb=CAP_MB)
    model.register_comm_hook([], fails_once)
    start = copy.deepcopy(model.module)  # rank 0's parameters, on every rank
    out["fails_once"] = _error(lambda: model(x).sum().backward())
    model.zero_grad()
    model(x).sum().backward()  # drops the failed pass (nothing in flight), then reduces normally
    recovered = model.reducer._pass is None and model.last_stats.buckets == 3
    out["recovered"] = ("ok" if recovered else "stale", "")
    out["recovered_grads"] = _np(p.grad for p in model.module.parameters())
    # the average of every rank's local gradient, by plain autograd here: (g0 + g1) / 2
    local = []
    for q in range(world):
        m = copy.deepcopy(start)
        m(_misuse_input(q)).sum().backward()
        local.append([p.grad for p in m.parameters()])
    out["expected_grads"] = _np(sum(gs[1:], gs[0]) / world for gs in zip(*local))

    # the group still works: nothing was left half-paired
    t = torch.ones(2)
    collectives.all_reduce(t)
    out["group_ok"] = ("ok" if t.tolist() == [world] * 2 else "broken", "")
    return out


# ---------------------------------------------------------------------------- launching (cached)


def worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {name: hook_case(name, rank, world) for name in HOOKS}
    if world == 2:
        results["fp16-unused"] = hook_case("fp16", rank, world, unused=True)
        results["user"] = user_hooks_case(rank, world)
        results["misuse"] = misuse_case(rank, world)
    return results


_results: dict[int, list[dict]] = {}


def results_of(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = collectives.launch(worker, world, timeout=30, join_timeout=240)
    return _results[world]


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hook", list(HOOKS))
def test_hook_matches_torch_ddp_with_the_same_hook(world: int, hook: str) -> None:
    per_rank = [r[hook] for r in results_of(world)]
    ours0 = per_rank[0]["ours"]
    assert per_rank[0]["buckets"] == 3
    for r, res in enumerate(per_rank):
        for a, b in zip(res["ours"], ours0):
            assert np.array_equal(a, b), f"{hook}: rank {r}'s parameters differ from rank 0's"
    if world == 2:
        # a + b == b + a exactly and x / 2 is exact: the two DDPs agree bit for bit
        for i, (a, b) in enumerate(zip(ours0, per_rank[0]["torch"])):
            assert np.array_equal(a, b), f"{hook}, parameter {i}: differs from torch DDP with 2 ranks"
    bound = TOLERANCE[hook] * LR * per_rank[0]["g"]
    for i, (a, b) in enumerate(zip(ours0, per_rank[0]["torch"])):
        np.testing.assert_allclose(a, b, rtol=0, atol=bound, err_msg=f"{hook}, parameter {i}")
    if hook in ("fp16", "bf16"):  # compression did happen: the result is not the float32 one
        exact = results_of(world)[0]["allreduce"]["ours"]
        assert any(not np.array_equal(a, b) for a, b in zip(ours0, exact))


@pytest.mark.timeout(300)
def test_hook_reduces_buckets_completed_for_unused_parameters() -> None:
    per_rank = [r["fp16-unused"] for r in results_of(2)]
    for res in per_rank:
        for i, (a, b) in enumerate(zip(res["ours"], per_rank[0]["torch"])):
            assert np.array_equal(a, b), f"parameter {i}: differs from torch DDP (find_unused_parameters, fp16 hook)"


@pytest.mark.timeout(300)
def test_user_hooks_in_torch_style_run() -> None:
    per_rank = results_of(2)
    for res in per_rank:
        user = res["user"]
        # one call per bucket, in launch order, the last one flagged
        assert [(i, last) for i, last, _ in user["seen"]] == [(0, False), (1, False), (2, True)]
        # torch's DDP divides, then sums; /2 then SUM is exact on 2 ranks: bit for bit
        for a, b in zip(user["recorded_grads"], user["torch_grads"]):
            assert np.array_equal(a, b)
        for a, b in zip(user["torch_style_grads"], user["torch_grads"]):
            assert np.array_equal(a, b)
        assert user["noop_equals_local"]


@pytest.mark.timeout(300)
def test_misuse_gives_clear_errors() -> None:
    for res in results_of(2):
        m = res["misuse"]
        assert m["twice"][0] == "RuntimeError" and "only once" in m["twice"][1]
        assert m["after_backward"][0] == "RuntimeError" and "before the first backward" in m["after_backward"][1]
        assert m["not_callable"][0] == "TypeError" and "callable" in m["not_callable"][1]
        assert m["one_argument"][0] == "TypeError" and "(state, bucket)" in m["one_argument"][1]
        assert m["returns_tensor"][0] == "TypeError" and "torch.futures.Future" in m["returns_tensor"][1]
        assert m["future_of_list"][0] == "TypeError" and "holds list" in m["future_of_list"][1]
        assert m["fails_once"][0] == "TypeError" and "returned NoneType" in m["fails_once"][1]
        assert m["recovered"][0] == "ok"
        assert m["group_ok"][0] == "ok"
    for res in results_of(2):  # after the failed pass, the next one reduces exactly: (g0 + g1) / 2
        for a, b in zip(res["misuse"]["recovered_grads"], res["misuse"]["expected_grads"]):
            assert np.array_equal(a, b)
