"""DDP correctness with real processes: data-parallel training equals single-process training.

Every case trains a float64 model for a few steps on ``world_size`` ranks, each rank on its own
slice of every batch, and the test checks that

* every rank ends with bitwise identical parameters (and had bitwise identical gradients after
  every step, checked inside the ranks);
* the parameters equal those of one process trained on the whole (concatenated) batch, within a
  tight float64 tolerance;
* ranks that start from different seeds agree after the wrapper's broadcast.

Spawning ranks costs seconds, so each world size / backend runs all its cases in one launch; the
first test of a launch pays for it and the others read the cached results.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives
import ddp

STEPS = 3
BATCH = 4  # samples per rank per step (per micro-batch)
DATA_SEED = 1234
MODEL_SEED = 7

# Parameter bytes of the float64 MLP, reversed: 4.bias 32, 4.weight 512, 2.bias 128, 2.weight 2048,
# 0.bias 128, 0.weight 1024. A 2100-byte cap gives 3 buckets.
SEVERAL_MB = 2100 / (1024 * 1024)


# ---------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.net(x)


class FrozenMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)


class Unused(nn.Module):
    """``extra`` is never used; ``branch`` only when the caller says so (rank-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.extra = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 4)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        out = self.l2(h)
        return out + self.branch(h) if use_branch else out


class Tied(nn.Module):
    """Input embedding and output head share one weight (as in language models)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before BatchNorm: its gradient is pure rounding noise, which AdamW would amplify
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.net(x)


MODELS = {"mlp": MLP, "frozen": FrozenMLP, "unused": Unused, "tied": Tied, "bn": BNNet}


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[kind]().double()
    if kind == "bn":  # make the buffers differ between seeds too
        model.net[1].running_mean.normal_()
        model.net[1].running_var.uniform_(0.5, 2.0)
    return model


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


# ---------------------------------------------------------------------------- data and loss


def batches(kind: str, world: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``data[step][m]`` = (inputs, targets) of the whole batch (all ranks) of micro-batch ``m``."""
    g = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(micro):
            n = world * BATCH
            if kind == "tied":
                step.append((torch.randint(0, 10, (n,), generator=g), torch.randint(0, 10, (n,), generator=g)))
            else:
                x = torch.randn(n, 8, generator=g, dtype=torch.float64)
                step.append((x, torch.randn(n, 4, generator=g, dtype=torch.float64)))
        out.append(step)
    return out


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) if kind == "tied" else F.mse_loss(out, y)


def shard(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * BATCH : (r + 1) * BATCH]


def uses_branch(case: dict, group_rank: int) -> bool:
    return case.get("branch", "all") == "all" or group_rank == 0


# ---------------------------------------------------------------------------- cases

SGD_ADAMW = ("sgd", "adamw")


def _case(name: str, **kw: Any) -> dict:
    case = {"name": name, "model": "mlp", "form": "ddp", "opt": "adamw", "ddp": {}, "micro": 1, "set_to_none": True}
    case.update(kw)
    return case


def _cases_2() -> list[dict]:
    cases = []
    for opt in SGD_ADAMW:
        cases.append(_case(f"naive-{opt}", form="naive", opt=opt))
        cases.append(_case(f"one-bucket-{opt}", opt=opt, ddp={"bucket_cap_mb": 25}, expect_buckets=1))
        cases.append(_case(f"several-{opt}", opt=opt, ddp={"bucket_cap_mb": SEVERAL_MB}, expect_buckets=3))
        cases.append(_case(f"per-param-{opt}", opt=opt, ddp={"bucket_cap_mb": 0}, expect_buckets=6))
    cases += [
        _case("first-bucket-cap", opt="sgd", ddp={"bucket_cap_mb": 25, "first_bucket_cap_mb": 0}, expect_buckets=2),
        _case("view", ddp={"bucket_cap_mb": SEVERAL_MB}, set_to_none=False),  # .grad in the buckets: the default
        _case("copy", ddp={"bucket_cap_mb": SEVERAL_MB, "gradient_as_bucket_view": False}, set_to_none=False),
        _case("copy-set-to-none", opt="sgd", ddp={"bucket_cap_mb": SEVERAL_MB, "gradient_as_bucket_view": False}),
        _case("frozen", model="frozen", ddp={"bucket_cap_mb": SEVERAL_MB}),
        _case("unused", model="unused", branch="rank0", ddp={"bucket_cap_mb": 0, "find_unused_parameters": True}),
        _case(
            "unused-view",
            model="unused",
            branch="rank0",
            opt="sgd",
            ddp={"bucket_cap_mb": 25, "find_unused_parameters": True, "gradient_as_bucket_view": False},
        ),
        _case("tied", model="tied", ddp={"bucket_cap_mb": 0}),
        _case("batchnorm", model="bn", opt="sgd", ddp={"bucket_cap_mb": 0}),
        _case("no-sync", micro=3, ddp={"bucket_cap_mb": SEVERAL_MB}),
        _case("no-sync-view", micro=2, opt="sgd", ddp={"bucket_cap_mb": 0}, set_to_none=False),
        _case("no-sync-copy", micro=2, opt="sgd", ddp={"bucket_cap_mb": 0, "gradient_as_bucket_view": False}),
        _case("no-sync-naive", micro=2, form="naive"),
    ]
    return cases


def _cases_3() -> list[dict]:
    return [
        _case("naive-sgd", form="naive", opt="sgd"),
        _case("several-adamw", ddp={"bucket_cap_mb": SEVERAL_MB}),
        _case("per-param-sgd", opt="sgd", ddp={"bucket_cap_mb": 0}),
        _case("unused", model="unused", branch="rank0", ddp={"bucket_cap_mb": 0, "find_unused_parameters": True}),
        _case("tied", model="tied", opt="sgd", ddp={"bucket_cap_mb": SEVERAL_MB}),
        _case("no-sync", micro=2, ddp={"bucket_cap_mb": 0}),
        _case("batchnorm", model="bn", ddp={"bucket_cap_mb": 25}),
        _case("subgroup", ddp={"bucket_cap_mb": SEVERAL_MB}, subgroup=[0, 2]),
    ]


def _cases_torch() -> list[dict]:
    return [
        _case("naive-sgd", form="naive", opt="sgd"),
        _case("several-adamw", ddp={"bucket_cap_mb": SEVERAL_MB}),
        _case("unused", model="unused", branch="rank0", ddp={"bucket_cap_mb": 0, "find_unused_parameters": True}),
        _case("no-sync-copy", micro=2, ddp={"bucket_cap_mb": 0, "gradient_as_bucket_view": False}),
    ]


LAUNCHES = {
    "p2p-2": (2, "p2p", _cases_2()),
    "p2p-3": (3, "p2p", _cases_3()),
    "torch-2": (2, "torch", _cases_torch()),
}


# ---------------------------------------------------------------------------- the ranks


def _np(ts) -> list[np.ndarray]:
    # plain numpy copies: small to ship back to the test process, compared with numpy
    return [t.detach().cpu().numpy().copy() for t in ts]


def _check_grads_identical(model: nn.Module, group, case: dict, step: int) -> None:
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    n = collectives.get_world_size(group)
    allp = torch.empty(n * len(params), dtype=torch.int32)
    collectives.all_gather_into_tensor(allp, present, group=group)
    assert all(torch.equal(row, present) for row in allp.view(n, -1)), f"{case['name']}: .grad presence differs"
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    every = torch.empty(n * flat.numel(), dtype=flat.dtype)
    collectives.all_gather_into_tensor(every, flat, group=group)
    for r, row in enumerate(every.view(n, -1)):
        assert torch.equal(row, flat), f"{case['name']} step {step}: gradients of rank {r} differ from this rank's"


def run_case(case: dict, rank: int, group) -> dict:
    """Train one case on this rank; returns its parameters (and more) as numpy arrays."""
    gr, gw = collectives.get_rank(group), collectives.get_world_size(group)
    kind = case["model"]
    model = build(kind, MODEL_SEED + 1000 * rank)  # different seed on every rank
    before = _np(model.parameters())
    if case["form"] == "naive":
        ddp.broadcast_module(model, group=group)
        wrapped: nn.Module = model
    else:
        wrapped = ddp.DistributedDataParallel(model, group=group, **case["ddp"])
    init = _np(model.parameters())
    opt = make_optimizer(case["opt"], [p for p in model.parameters() if p.requires_grad])
    data = batches(kind, gw, case["micro"])
    overlapped = []
    for step, micro_batches in enumerate(data):
        opt.zero_grad(set_to_none=case["set_to_none"])
        for m, (x, y) in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            ctx = wrapped.no_sync() if (not last and case["form"] == "ddp") else contextlib.nullcontext()
            with ctx:
                out = wrapped(shard(x, gr), use_branch=uses_branch(case, gr))
                (loss_fn(kind, out, shard(y, gr)) / len(micro_batches)).backward()
        if case["form"] == "naive":
            ddp.all_reduce_gradients(model, group=group)
        else:
            overlapped.append(wrapped.last_stats.launched_during_backward)
            if case["ddp"].get("gradient_as_bucket_view", True):
                for bucket in wrapped.reducer.buckets:
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is not None:
                            assert p.grad.data_ptr() == view.data_ptr(), f"{case['name']}: .grad is not the bucket view"
        _check_grads_identical(model, group, case, step)
        opt.step()
    result = {"before": before, "init": init, "final": _np(model.parameters()), "overlapped": overlapped}
    if case["form"] == "ddp":
        result["n_buckets"] = len(wrapped.buckets)
        result["table"] = wrapped.describe_buckets()
        result["stats_unused"] = wrapped.last_stats.unused_params
    if kind == "bn":
        wrapped.eval()
        with torch.no_grad():
            wrapped(shard(data[0][0][0], gr))  # an eval forward re-broadcasts rank 0's buffers
        result["buffers"] = _np(model.buffers())
    return result


def unused_error_case(rank: int, group) -> str:
    """``extra`` is unused on every rank, without find_unused_parameters: a clear error everywhere."""
    model = ddp.DistributedDataParallel(build("unused", MODEL_SEED), group=group, bucket_cap_mb=25)
    x = torch.randn(BATCH, 8, dtype=torch.float64)
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("a backward with unused parameters did not raise")
    # the group is still usable afterwards (nothing was half-launched)
    t = torch.ones(3)
    collectives.all_reduce(t, group=group)
    assert t.tolist() == [collectives.get_world_size(group)] * 3
    return message


def layout_mismatch_case(rank: int) -> str:
    """Ranks that build different bucket layouts are told so at construction, all of them."""
    try:
        ddp.DistributedDataParallel(build("mlp", MODEL_SEED), bucket_cap_mb=25 if rank == 0 else 0)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("mismatched bucket layouts were not detected")


def divergent_unused_case(rank: int) -> tuple[str, str]:
    """``branch`` is used on rank 0 only, without find_unused_parameters: rank 1 raises the clear
    error; rank 0, waiting for rank 1 in the all-reduce of branch's bucket, gets the timeout."""
    group = collectives.new_group([0, 1], timeout=2)
    model = build("unused", MODEL_SEED)
    model.extra.requires_grad_(False)
    wrapped = ddp.DistributedDataParallel(model, group=group, bucket_cap_mb=0)
    x = torch.randn(BATCH, 8, dtype=torch.float64)
    try:
        wrapped(x, use_branch=rank == 0).sum().backward()
    except Exception as exc:  # noqa: BLE001
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = ("none", "")
    collectives.barrier()  # rank 1 stays connected until rank 0 timed out
    return outcome


def worker(rank: int, world: int, cases: list[dict], with_error_case: bool) -> dict:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    subgroups = {}
    for case in cases:  # every rank creates every subgroup, in the same order
        if case.get("subgroup") and tuple(case["subgroup"]) not in subgroups:
            subgroups[tuple(case["subgroup"])] = collectives.new_group(case["subgroup"])
    for case in cases:
        if case.get("subgroup"):
            group = subgroups[tuple(case["subgroup"])]
            if collectives.is_non_member(group):
                continue
        else:
            group = None
        results[case["name"]] = run_case(case, rank, group)
    if with_error_case:
        results["unused-error"] = unused_error_case(rank, None)
        results["layout-mismatch"] = layout_mismatch_case(rank)
        results["divergent-unused"] = divergent_unused_case(rank)
    return results


# ---------------------------------------------------------------------------- single-process reference


def reference(case: dict, world: int) -> dict:
    """One process, whole batch: what every rank's model must equal."""
    kind = case["model"]
    model = build(kind, MODEL_SEED)  # rank 0's seed: the wrapper broadcasts rank 0's model
    init = _np(model.parameters())
    opt = make_optimizer(case["opt"], [p for p in model.parameters() if p.requires_grad])
    rank0_buffers = [b.clone() for b in model.buffers()]
    for micro_batches in batches(kind, world, case["micro"]):
        opt.zero_grad()
        for x, y in micro_batches:
            if kind == "bn" or case.get("branch", "all") != "all":
                # BatchNorm normalises per rank and the branch is rank-dependent: the loss of
                # the whole batch is the mean of the per-rank losses, each computed as a rank would.
                loss = 0.0
                for r in range(world):
                    if kind == "bn":  # each rank starts its forward from rank 0's buffers
                        bn = model.net[1]  # (fresh tensors: the graph holds the old ones)
                        bn.running_mean, bn.running_var, bn.num_batches_tracked = (b.clone() for b in rank0_buffers)
                    out = model(shard(x, r), use_branch=uses_branch(case, r))
                    loss = loss + loss_fn(kind, out, shard(y, r)) / world
                    if r == 0 and kind == "bn":
                        after0 = [b.clone() for b in model.buffers()]
                if kind == "bn":
                    rank0_buffers = after0
            else:
                loss = loss_fn(kind, model(x), y)  # the whole concatenated batch
            (loss / len(micro_batches)).backward()
        opt.step()
    return {"init": init, "final": _np(model.parameters()), "buffers": _np(rank0_buffers)}


# ---------------------------------------------------------------------------- launching (cached)

_results: dict[str, list[dict]] = {}


def results_of(launch_name: str) -> tuple[int, list[dict]]:
    world, backend, cases = LAUNCHES[launch_name]
    if launch_name not in _results:
        _results[launch_name] = collectives.launch(
            worker, world, cases, launch_name == "p2p-2", backend=backend, timeout=30, join_timeout=180
        )
    return world, _results[launch_name]


def _all_cases() -> list:
    return [pytest.param(name, case["name"], id=f"{name}-{case['name']}") for name, (_, _, cases) in LAUNCHES.items() for case in cases]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{what}, tensor {i}")


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch_name,case_name", _all_cases())
def test_matches_single_process_training(launch_name: str, case_name: str) -> None:
    world, per_rank = results_of(launch_name)
    case = next(c for c in LAUNCHES[launch_name][2] if c["name"] == case_name)
    members = case.get("subgroup", list(range(world)))
    ranks = [per_rank[r][case_name] for r in members]
    ref = reference(case, len(members))

    # ranks started from different seeds, and the broadcast made them equal to rank 0's model
    assert not all(np.array_equal(a, b) for a, b in zip(ranks[0]["before"], ranks[1]["before"]))
    for r, res in zip(members, ranks):
        for a, b in zip(res["init"], ref["init"]):
            assert np.array_equal(a, b), f"rank {r} does not start from rank 0's parameters"

    # every rank ends bitwise equal, and equal to one process trained on the whole batch
    for r, res in zip(members, ranks):
        for a, b in zip(res["final"], ranks[0]["final"]):
            assert np.array_equal(a, b), f"rank {r} parameters differ from rank {members[0]}'s"
    _assert_close(ranks[0]["final"], ref["final"], case_name)

    if "expect_buckets" in case:
        assert ranks[0]["n_buckets"] == case["expect_buckets"], ranks[0]["table"]
    if case["form"] == "ddp" and case["ddp"].get("bucket_cap_mb") == 0 and case.get("branch", "all") == "all":
        # one bucket per parameter, all used: every bucket started inside the backward pass
        assert all(n == ranks[0]["n_buckets"] for n in ranks[0]["overlapped"]), ranks[0]["overlapped"]
    if case["model"] == "frozen":
        assert np.array_equal(ranks[0]["final"][0], ref["init"][0])  # never trained, but broadcast
    if case["model"] == "bn":
        for r, res in zip(members, ranks):
            for a, b in zip(res["buffers"], ref["buffers"]):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"rank {r} buffers")
    if case["model"] == "unused":
        # extra (used nowhere) stays untouched even under AdamW's weight decay: its .grad stayed None
        names = [n for n, _ in build("unused", 0).named_parameters()]
        extra = names.index("extra.weight")
        assert np.array_equal(ranks[0]["final"][extra], ref["init"][extra])
        assert set(per_rank[1][case_name]["stats_unused"]) >= {"extra.weight", "extra.bias", "branch.weight"}


@pytest.mark.timeout(240)
def test_bucket_table_and_tied_names() -> None:
    _, per_rank = results_of("p2p-2")
    table = per_rank[0]["several-adamw"]["table"]
    lines = table.splitlines()
    assert "net.4.bias, net.4.weight, net.2.bias" in lines[2]
    assert "net.2.weight" in lines[3] and "2.0 KiB" in lines[3]
    assert lines[-1].startswith("total") and "3 buckets" in lines[-1]
    tied = per_rank[0]["tied"]["table"]
    assert "emb.weight (= head.weight)" in tied and "head.weight," not in tied


@pytest.mark.timeout(240)
def test_unused_parameters_without_flag_raise_a_clear_error() -> None:
    _, per_rank = results_of("p2p-2")
    for r in range(2):
        message = per_rank[r]["unused-error"]
        assert "extra.weight" in message and "extra.bias" in message
        assert "find_unused_parameters=True" in message
        assert "l1.weight" not in message


@pytest.mark.timeout(240)
def test_different_layouts_are_detected_at_construction() -> None:
    _, per_rank = results_of("p2p-2")
    for r in range(2):
        assert "disagree on the trainable parameters or the bucket layout" in per_rank[r]["layout-mismatch"]


@pytest.mark.timeout(240)
def test_rank_dependent_unused_parameter_fails_without_hanging() -> None:
    _, per_rank = results_of("p2p-2")
    kind0, message0 = per_rank[0]["divergent-unused"]
    kind1, message1 = per_rank[1]["divergent-unused"]
    assert kind1 == "RuntimeError" and "branch.weight" in message1 and "l2.weight" not in message1
    assert kind0 == "CollectiveTimeoutError", message0  # the peer that used it: the group's timeout
