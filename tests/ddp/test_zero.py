"""ZeRO stages 1-3 with real processes: equal to one process, to our DDP, and to torch's.

Every case trains a float64 model for a few steps on ``world`` ranks (each rank on its slice of
every batch) with ``ddp.ZeroDataParallel(stage=s)`` and ``ddp.ZeroRedundancyOptimizer``, and the
same case at stage 0 (our DDP with a plain optimizer) on the same data. The tests check that

* every rank ends with bitwise identical parameters;
* they equal one process trained on the whole batch within ``rtol=1e-10`` (float64: the runs
  differ only in how the per-rank gradients are summed, a few ulps per step, which Adam's
  normalisation and three steps amplify by at most a few orders of magnitude);
* they equal our DDP's *bitwise* where the reduce-scatter adds the ranks in the all-reduce's
  order: at 2 ranks (``a + b == b + a``) and on ``shm`` at any size (both add in rank order);
  on ``p2p`` above 2 ranks the ring starts each chunk at another rank: the single-process bound.

Models have parameters of uneven sizes (7x13, 13, 13x5, 5, 5x3, 3: none divides by 2, 3 or 4;
4 ranks get 3 bias elements), frozen, unused (on every rank, or on some ranks only) and tied parameters. Each world size runs all its
cases in one launch; the first test that needs a launch pays for it.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives
import ddp
from ddp.zero.flat import FlatLayout, Piece

STEPS = 3
BATCH = 4  # rows per rank per micro-batch
DATA_SEED = 1234
MODEL_SEED = 7
TINY_MB = 600 / 2**20  # bucket cap: 600 bytes of float64 gives 3 buckets for stages 1 and 2


# ---------------------------------------------------------------------------- models


class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.net(x)


class Frozen(Uneven):
    """The first layer's weight never trains (but is sharded at stage 3, beside its bias); a buffer
    scales the output."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)
        self.register_buffer("scale", 1 + torch.rand(3))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.net(x) * self.scale


class Unused(nn.Module):
    """``extra`` takes part in no forward; ``branch`` only where the caller says (rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 13)
        self.extra = nn.Linear(13, 13)
        self.branch = nn.Linear(13, 3)
        self.l2 = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return self.l2(h) + self.branch(h) if use_branch else self.l2(h)


class Shifted(nn.Linear):
    """A Linear that adds ``extra`` to its output only while ``use_extra`` (its parent sets it)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.extra = nn.Parameter(torch.randn(n_out) / 4)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.extra if self.use_extra else y


class UnusedInUnit(nn.Module):
    """``net.4.extra`` takes part only where the caller says (rank 0), inside a unit that runs on
    every rank: the third of four, so that at stage 3 other units' gathers fall between its
    reduce-scatter and the end of the backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), Shifted(5, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        self.net[4].use_extra = use_branch
        return self.net(x)


class Tied(nn.Module):
    """Input embedding and output head share one weight: at stage 3 it lives in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.mid = nn.Linear(7, 7)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


MODELS = {"uneven": Uneven, "frozen": Frozen, "unused": Unused, "unused-in-unit": UnusedInUnit, "tied": Tied}


def build(kind: str, seed: int = MODEL_SEED) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]().double()


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    # every other element-wise optimizer of torch.optim, at stage 2 (what "shardable" means)
    "adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "nadam": (torch.optim.NAdam, {"lr": 0.01}),
    "radam": (torch.optim.RAdam, {"lr": 0.01}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "asgd": (torch.optim.ASGD, {"lr": 0.05, "t0": 1}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "maximize": True}),
}
OTHER_OPTIMIZERS = ("adamax", "nadam", "radam", "rmsprop", "rprop", "adagrad", "adadelta", "asgd", "sgd-nesterov", "adam-amsgrad")


def batches(kind: str, world: int, micro: int, steps: int = STEPS, seed: int = DATA_SEED) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            n = world * BATCH
            if kind == "tied":
                step.append((torch.randint(0, 11, (n,), generator=g), torch.randint(0, 11, (n,), generator=g)))
            else:
                step.append((torch.randn(n, 7, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)))
        out.append(step)
    return out


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) if kind == "tied" else F.mse_loss(out, y)


def rows(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * BATCH : (r + 1) * BATCH]


# ---------------------------------------------------------------------------- cases


def case(name: str, stage: int, **kw: Any) -> dict[str, Any]:
    c = {"name": name, "stage": stage, "model": "uneven", "opt": "adamw", "micro": 1, "clip": None,
         "set_to_none": True, "branch": "all", "zero": {"bucket_cap_mb": TINY_MB}}  # fmt: skip
    c.update(kw)
    return c


def ladder(models: tuple[str, ...], opts: tuple[str, ...] = ("sgd", "adamw")) -> list[dict[str, Any]]:
    out = []
    for stage in (1, 2, 3):
        for model in models:
            for opt in opts:
                kw: dict[str, Any] = {"model": model, "opt": opt}
                if model == "unused":
                    kw["zero"] = {"bucket_cap_mb": TINY_MB, "find_unused_parameters": True}
                    kw["branch"] = "rank0" if stage < 3 else "all"  # stage 3: every rank runs the same units
                if model == "unused-in-unit":  # the same units everywhere, one parameter in one unused
                    kw["zero"] = {"bucket_cap_mb": TINY_MB, "find_unused_parameters": True}
                    kw["branch"] = "rank0"
                out.append(case(f"z{stage}-{model}-{opt}", stage, **kw))
    return out


def cases_for(world: int) -> list[dict[str, Any]]:
    """The whole matrix at 2 ranks; at 1, 3 and 4 ranks every stage with a few models."""
    if world == 1:
        return ladder(("uneven",), ("adamw",))
    if world == 2:
        out = ladder(("uneven", "frozen", "unused", "tied")) + ladder(("unused-in-unit",), ("adamw",))
        for stage in (1, 2, 3):
            out.append(case(f"z{stage}-no-sync-clip", stage, micro=2, clip=0.05))
            out.append(case(f"z{stage}-keep-grads", stage, opt="sgd", set_to_none=False))
        out += [case(f"z2-{opt}", 2, opt=opt) for opt in OTHER_OPTIMIZERS]
        out.append(case("z3-units-per-sequential", 3, zero={"units": {nn.Sequential}}))
        out.append(case("z3-no-prefetch", 3, zero={"prefetch": False}))
        out.append(case("z3-unused-in-unit-no-prefetch-no-sync", 3, model="unused-in-unit", branch="rank0", micro=2,
                        zero={"bucket_cap_mb": TINY_MB, "find_unused_parameters": True, "prefetch": False}))
        return out
    pick = {3: ("z1-uneven-adamw", "z2-unused-adamw", "z3-unused-adamw"),
            4: ("z1-tied-adamw", "z2-uneven-adamw", "z3-uneven-adamw", "z3-tied-adamw", "z3-unused-in-unit-adamw")}
    out = [c for c in ladder(("uneven", "unused", "unused-in-unit", "tied"), ("adamw",)) if c["name"] in pick[world]]
    if world == 3:
        out.append(case("z2-no-sync-clip", 2, micro=2, clip=0.05))
    return out


# ---------------------------------------------------------------------------- one rank


def _np(ts) -> list[np.ndarray]:
    return [t.detach().cpu().numpy().copy() for t in ts]


def train(c: dict[str, Any], rank: int, world: int, group: Any = None, stage: int | None = None,
          device: str = "cpu") -> list[np.ndarray]:
    """Train case ``c`` at ``stage`` (default the case's) on ``group`` (rank ``rank`` of ``world``),
    model and batches on ``device``; the full parameters afterwards."""
    stage = c["stage"] if stage is None else stage
    kind = c["model"]
    model = build(kind, MODEL_SEED + 1000 * rank).to(device)  # the wrapper broadcasts rank 0's
    params = list(model.parameters())
    zero_kw = dict(c["zero"])
    if stage == 0:
        zero_kw = {k: v for k, v in zero_kw.items() if k in ("bucket_cap_mb", "find_unused_parameters")}
    wrapped = ddp.ZeroDataParallel(model, stage=stage, group=group, **zero_kw)
    cls, kw = OPTIMIZERS[c["opt"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = ddp.ZeroRedundancyOptimizer(trainable, cls, **kw) if stage else cls(trainable, **kw)
    for micro_batches in batches(kind, world, c["micro"]):
        for m, (x, y) in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            x, y = x.to(device), y.to(device)
            with contextlib.nullcontext() if last else wrapped.no_sync():
                out = wrapped(rows(x, rank), use_branch=c["branch"] == "all" or rank == 0)
                (loss_fn(kind, out, rows(y, rank)) / len(micro_batches)).backward()
        if c["clip"] is not None:
            wrapped.clip_grad_norm_(c["clip"])
        opt.step()
        opt.zero_grad(set_to_none=c["set_to_none"])
    with wrapped.summon_full_params():
        return _np(params)


def train_cases(rank: int, world: int, cases: list[dict[str, Any]], group: Any) -> dict[str, Any]:
    """Every case at its stage, and at stage 0 (our DDP) once per distinct setting."""
    out: dict[str, Any] = {}
    ddp_runs: dict[str, list[np.ndarray]] = {}
    for c in cases:
        key = repr([c[k] for k in ("model", "opt", "micro", "clip", "set_to_none", "branch")])
        if key not in ddp_runs:
            ddp_runs[key] = train(c, rank, world, group, stage=0)
        out[c["name"]] = {"zero": train(c, rank, world, group), "ddp": ddp_runs[key]}
    return out


# ---------------------------------------------------------------------------- single process


def reference(c: dict[str, Any], world: int, steps: int = STEPS) -> list[np.ndarray]:
    kind = c["model"]
    model = build(kind)
    cls, kw = OPTIMIZERS[c["opt"]]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    for micro_batches in batches(kind, world, c["micro"], steps):
        for x, y in micro_batches:
            if c["branch"] == "all":
                loss = loss_fn(kind, model(x), y)
            else:  # the branch is rank-dependent: the mean of each rank's loss, computed as it would
                loss = sum(loss_fn(kind, model(rows(x, r), use_branch=r == 0), rows(y, r)) for r in range(world)) / world
            (loss / len(micro_batches)).backward()
        if c["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
        opt.step()
        opt.zero_grad(set_to_none=c["set_to_none"])
    return _np(model.parameters())


def assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{what}, parameter {i}")


# ---------------------------------------------------------------------------- against torch


def torch_zero1_case(rank: int, world: int) -> dict[str, Any]:
    """Ours at stage 1 vs torch DDP + torch's ZeroRedundancyOptimizer, same model, data and seed."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    pg = collectives.get_default_group().process_group
    base = build("uneven", MODEL_SEED + 1000 * rank)
    ours = ddp.ZeroDataParallel(copy.deepcopy(base), stage=1, bucket_cap_mb=TINY_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=pg)
    opt_ours = ddp.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=0.01)
    opt_theirs = TorchZeRO(theirs.parameters(), torch.optim.Adam, process_group=pg, lr=0.01)
    # torch's usage with ours: our DDP averages, our optimizer flattens and all-gathers
    plain = ddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=TINY_MB)
    opt_plain = ddp.ZeroRedundancyOptimizer(plain.parameters(), torch.optim.Adam, lr=0.01)
    for (x, y), in batches("uneven", world, 1):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs), (plain, opt_plain)):
            F.mse_loss(model(rows(x, rank)), rows(y, rank)).backward()
            opt.step()
            opt.zero_grad()
    return {"ours": _np(ours.module.parameters()), "torch": _np(theirs.module.parameters()), "plain": _np(plain.module.parameters())}


def torch_fsdp2_case(rank: int, world: int) -> dict[str, Any]:
    """Ours at stage 3 vs torch's FSDP2 (``fully_shard`` per Linear, then the root) on gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = build("uneven", MODEL_SEED)  # FSDP2 does not broadcast: the same seed everywhere
    ours = ddp.ZeroDataParallel(copy.deepcopy(base), stage=3)
    theirs = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,))
    for layer in theirs.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt_ours = ddp.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=0.01, weight_decay=0.1)
    for (x, y), in batches("uneven", world, 1):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            F.mse_loss(model(rows(x, rank)), rows(y, rank)).backward()
            opt.step()
            opt.zero_grad()
    with ours.summon_full_params():
        mine = _np(ours.module.parameters())
    return {"ours": mine, "torch": [p.full_tensor().detach().numpy().copy() for p in theirs.parameters()]}


# ---------------------------------------------------------------------------- mixed precision, memory


def mixed_precision_case(rank: int, world: int) -> dict[str, Any]:
    """bfloat16 compute, float32 reduce and masters, at stages 1-3 (a float32 copy of the model)."""
    out = {}
    for stage in (1, 2, 3):
        model = build("uneven").float()
        mp = ddp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        wrapped = ddp.ZeroDataParallel(model, stage=stage, mixed_precision=mp, bucket_cap_mb=TINY_MB)
        cls, kw = OPTIMIZERS["sgd"]
        opt = ddp.ZeroRedundancyOptimizer(wrapped.parameters(), cls, **kw)
        dtypes = set()
        for (x, y), in batches("uneven", world, 1):
            out_ = wrapped(rows(x, rank).float())
            dtypes.add(str(out_.dtype))
            F.mse_loss(out_.float(), rows(y, rank).float()).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = {"state": {k: v.numpy() for k, v in wrapped.full_state_dict(rank0_only=False).items()}, "dtypes": dtypes}
        out[stage]["summon"] = summon_case(wrapped, rank, torch.bfloat16)  # after the state: it writes
        # the same without mixed precision (stages 1, 2: the master chunk is a view of the parameters)
        plain = ddp.ZeroDataParallel(build("uneven", MODEL_SEED + stage), stage=stage, bucket_cap_mb=TINY_MB)
        out[f"{stage}-plain"] = {"summon": summon_case(plain, rank, torch.float64)}
    return out


def computed_with(wrapped: ddp.ZeroDataParallel, kind: str, compute: torch.dtype) -> dict[str, Any]:
    """What ``wrapped`` holds on this rank: its masters and buffers (``full_state_dict``), its output
    on a fixed batch, and the output of the plain model with those masters cast to ``compute``
    (what the wrapper must compute with; buffers stay as they are)."""
    x = torch.randn(BATCH, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(compute)
    state = wrapped.full_state_dict(rank0_only=False)
    with torch.no_grad():
        got = wrapped(x)
        ref = build(kind)
        ref.load_state_dict(state)  # float32 masters into float64: exact
        for p in ref.parameters():
            p.data = p.data.to(compute)
        want = ref(x)
    return {"masters": {k: v.numpy() for k, v in state.items()}, "forward": got.float().numpy(), "cast_forward": want.float().numpy()}


def summon_case(wrapped: ddp.ZeroDataParallel, rank: int, compute: torch.dtype) -> dict[str, Any]:
    """``summon_full_params`` on a trained model: what the block shows, and what stays after it
    (:func:`computed_with`: the masters and what the module computes with)."""

    def after() -> dict[str, Any]:
        return computed_with(wrapped, "uneven", compute)

    out: dict[str, Any] = {"before": after()}
    with wrapped.summon_full_params():
        out["shown"] = {n: (str(p.dtype), p.detach().double().numpy().copy()) for n, p in wrapped.module.named_parameters()}
    out["empty"] = after()
    bias, weight = wrapped.module.net[0].bias, wrapped.module.net[2].weight
    with torch.no_grad():
        with wrapped.summon_full_params(writeback=False):
            bias.fill_(5.0)
        out["discarded"] = after()
        with wrapped.summon_full_params():
            bias.fill_(1 / 3)  # no bfloat16 holds it
        out["written"] = after()
        with wrapped.summon_full_params():
            weight.fill_(float(rank))  # each rank writes something else: the ranks still agree after
        out["per_rank"] = after()
    return out


def memory_case(rank: int, world: int) -> dict[str, Any]:
    """Tensor accounting of each stage on a model of 4 equal layers (buckets = units = layers)."""
    width = 64
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        bucket_mb = (width * width + width) * 4 / 2**20  # one layer per bucket
        wrapped = ddp.ZeroDataParallel(model, stage=stage, bucket_cap_mb=bucket_mb)
        opt = (ddp.ZeroRedundancyOptimizer(wrapped.parameters(), torch.optim.Adam, lr=1e-3) if stage
               else torch.optim.Adam(wrapped.parameters(), lr=1e-3))  # fmt: skip
        x = torch.randn(8, width)
        for _ in range(2):
            wrapped(x).square().mean().backward()
            opt.step()
            report = ddp.zero.memory_report(wrapped, opt)
            opt.zero_grad()
        out[stage] = report
    return out


# ---------------------------------------------------------------------------- checkpoints


CKPT_STEPS, CKPT_AT = 4, 2


def ckpt_case(c: dict[str, Any], rank: int, world: int, directory: str, load: str | None) -> dict[str, Any]:
    """Train ``c`` for CKPT_STEPS steps, saving at CKPT_AT into ``directory``; or (``load``) load that
    step's checkpoint from ``load`` and train the rest. Returns parameters at CKPT_AT and at the end."""
    kind = c["model"]
    model = build(kind, MODEL_SEED + 1000 * rank + (load is not None))  # loads into other values
    wrapped = ddp.ZeroDataParallel(model, stage=c["stage"], bucket_cap_mb=TINY_MB)
    cls, kw = OPTIMIZERS[c["opt"]]
    opt = ddp.ZeroRedundancyOptimizer(wrapped.parameters(), cls, **kw)
    data = batches(kind, world, 1, CKPT_STEPS)
    start = 0
    out: dict[str, Any] = {}
    if load is not None:
        start = ddp.zero.load_checkpoint(load, wrapped, opt)["step"]
        out["at"] = wrapped.full_state_dict(rank0_only=False)
        out["computed"] = computed_with(wrapped, kind, torch.float64)
    for step in range(start, CKPT_STEPS):
        if load is None and step == CKPT_AT:
            ddp.zero.save_checkpoint(directory, wrapped, opt, extra={"step": step})
            out["at"] = wrapped.full_state_dict(rank0_only=False)
        (x, y), = data[step]
        F.mse_loss(wrapped(rows(x, rank)), rows(y, rank)).backward()
        opt.step()
        opt.zero_grad()
    out["final"] = {k: v.numpy() for k, v in wrapped.full_state_dict(rank0_only=False).items()}
    out["at"] = {k: v.numpy() for k, v in out["at"].items()}
    opt.consolidate_state_dict(to=0)
    out["optimizer"] = opt.state_dict() if rank == 0 else None
    return out


def reload_case(rank: int, world: int) -> dict[str, Any]:
    """Full state dicts: train at stage 2, consolidate, load into a fresh stage-3 model and
    optimizer (every rank gets rank 0's dicts), take one more step with both: the same result."""
    data = batches("uneven", world, 1, 3)
    runs = []
    for stage in (2, 3):
        model = ddp.ZeroDataParallel(build("uneven", MODEL_SEED + 1000 * rank + stage), stage=stage)
        runs.append((model, ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)))
    (first, opt_first), (second, opt_second) = runs
    for (x, y), in data[:2]:
        F.mse_loss(first(rows(x, rank)), rows(y, rank)).backward()
        opt_first.step()
        opt_first.zero_grad()
    opt_first.consolidate_state_dict(to=0)
    dicts = [first.full_state_dict(), opt_first.state_dict() if rank == 0 else None]
    collectives.broadcast_object_list(dicts, src=0)
    second.load_full_state_dict(dicts[0])
    opt_second.load_state_dict(dicts[1])
    (x, y), = data[2]
    for model, opt in runs:
        F.mse_loss(model(rows(x, rank)), rows(y, rank)).backward()
        opt.step()
    return {stage: {k: v.numpy() for k, v in model.full_state_dict(rank0_only=False).items()} for stage, (model, _) in zip((2, 3), runs)}


def load_case(directory: str, stage: int, rank: int, compute: torch.dtype) -> dict[str, Any]:
    """Load a checkpoint of the frozen model into a fresh one of another seed, at ``stage``
    (computing in ``compute``), whose ``net.2.weight`` is stored transposed (not contiguous):
    what this rank holds and computes with then."""
    mp = None if compute == torch.float64 else ddp.MixedPrecision(param_dtype=compute)
    model = build("frozen", MODEL_SEED + 1000 * rank + 1)
    model.net[2].weight = nn.Parameter(model.net[2].weight.detach().t().contiguous().t())
    wrapped = ddp.ZeroDataParallel(model, stage=stage, bucket_cap_mb=TINY_MB, mixed_precision=mp)
    ddp.zero.load_checkpoint(directory, wrapped)
    return computed_with(wrapped, "frozen", compute)


CKPT_SAVE = case("ckpt-save", 2, model="frozen", opt="adamw")
CKPT_FROM_4 = case("ckpt-from-4", 3, model="frozen", opt="adamw")


# ---------------------------------------------------------------------------- misuse


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    return "none", ""


def misuse_case(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    x = torch.randn(BATCH, 7, dtype=torch.float64)
    out["bad_stage"] = _error(lambda: ddp.ZeroDataParallel(build("uneven"), stage=4))
    out["bool_stage"] = _error(lambda: ddp.ZeroDataParallel(build("uneven"), stage=True))
    out["units_below_3"] = _error(lambda: ddp.ZeroDataParallel(build("uneven"), stage=2, units=[]))
    out["mp_at_0"] = _error(lambda: ddp.ZeroDataParallel(build("uneven"), stage=0, mixed_precision=ddp.MixedPrecision(torch.bfloat16)))
    # stage mismatch: one collective check at construction, the same error on every rank
    out["stage_mismatch"] = _error(lambda: ddp.ZeroDataParallel(build("uneven"), stage=2 if rank == 0 else 3))

    model = ddp.ZeroDataParallel(build("uneven"), stage=2)
    out["lbfgs"] = _error(lambda: ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=1.0))
    out["adafactor"] = _error(lambda: ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adafactor, lr=0.01))
    out["not_a_class"] = _error(lambda: ddp.ZeroRedundancyOptimizer(model.parameters(), "adam", lr=0.01))
    opt = ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    out["add_param_group"] = _error(lambda: opt.add_param_group({"params": [extra]}))
    out["state_dict_unconsolidated"] = _error(lambda: opt.state_dict())
    out["comm_hook"] = _error(lambda: model.register_comm_hook(None, ddp.comm_hooks.allreduce_hook))
    out["join"] = _error(lambda: model.join())
    with model.summon_full_params():
        out["forward_in_summon"] = _error(lambda: model(x))
        out["nested_summon"] = _error(lambda: model.summon_full_params().__enter__())
    model.module.net.add_module("late", nn.Linear(3, 3).double())  # a parameter added after wrapping
    out["added_param"] = _error(lambda: model(x))

    # a backward pass that raises half-way (some buckets launched, some units gathered), then
    # training goes on: the step must equal one that never saw the failed pass
    (x0, y0), = batches("uneven", world, 1, 1)[0]
    for stage in (2, 3):
        finals = []
        for fail in (False, True):
            wrapped = ddp.ZeroDataParallel(build("uneven"), stage=stage, bucket_cap_mb=TINY_MB)
            opt = ddp.ZeroRedundancyOptimizer(wrapped.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
            if fail:
                def boom(module, args, output):
                    output.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("boom")))
                handle = wrapped.module.net[1].register_forward_hook(boom)
                out[f"failed_backward_{stage}"] = _error(lambda: F.mse_loss(wrapped(rows(x0, rank)), rows(y0, rank)).backward())
                handle.remove()
                opt.zero_grad()
            F.mse_loss(wrapped(rows(x0, rank)), rows(y0, rank)).backward()
            opt.step()
            with wrapped.summon_full_params():
                finals.append(_np(wrapped.module.parameters()))
        same = all(np.array_equal(a, b) for a, b in zip(*finals))
        out[f"recovered_{stage}"] = ("ok" if same else "differs", "")

    # stage 3, a unit run on rank 0 only: the all-gathers pair up wrongly; every rank raises
    group = collectives.new_group(list(range(world)), timeout=5)
    wrapped = ddp.ZeroDataParallel(build("unused"), stage=3, group=group, find_unused_parameters=True)
    out["divergent_unit"] = _error(lambda: wrapped(x, use_branch=rank == 0).sum().backward())
    return out


def replica_case(rank: int, world: int) -> dict[str, bool]:
    """ddp.zero.replica: rank r's replica of rank r+1's shard, stepped with the gradients r+1
    sends, stays bitwise equal to r+1's own shard (AdamW: state and parameter values matter); and
    ``reshard`` moves shards between splits without changing a bit."""
    from ddp.zero.replica import Shard, ShardReplica, piece_gradients, reshard

    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))  # chunks cut parameters unevenly
        wrapped = ddp.ZeroDataParallel(net, stage=stage, bucket_cap_mb=0.0002)
        opt = ddp.ZeroRedundancyOptimizer(wrapped.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        own, replica = Shard.own(wrapped, opt), ShardReplica(wrapped, opt, (rank + 1) % world)
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            opt.zero_grad()
            F.mse_loss(wrapped(torch.randn(5, 7, generator=g)), torch.randn(5, 3, generator=g)).backward()
            grads = piece_gradients(opt)
            incoming = grads.new_empty(replica.numel())
            for work in collectives.batch_isend_irecv([collectives.P2POp(collectives.isend, grads, (rank - 1) % world),
                                                       collectives.P2POp(collectives.irecv, incoming, (rank + 1) % world)]):
                work.wait()
            replica.step(incoming)
            opt.step()
        every: list[Any] = [None] * world
        collectives.all_gather_object(every, (own.state(), replica.state()))
        out[f"stage {stage}"] = len(opt.optim.state) > 0 and same_shard(every[(rank + 1) % world][0], every[rank][1])
        # reshard: the shards cut for 1, 3 and 7 ranks and back are the same bits; cut for one rank
        # they are the whole state, as consolidate_state_dict gathers it
        owns = [e[0] for e in every]
        out[f"stage {stage} resharded"] = all(
            all(map(same_shard, reshard(wrapped, opt, reshard(wrapped, opt, owns, range(n), n), range(world)), owns))
            for n in (1, 3, 7))
        whole = reshard(wrapped, opt, owns, [0], 1)[0]
        opt.consolidate_state_dict(0)
        if rank == 0:
            units = [u for u in wrapped.units if u.trainable]
            gathered = opt.state_dict()["state"]
            out[f"stage {stage} whole"] = all(
                torch.equal(c[: u.layout.numel], u.full[: u.layout.numel]) for c, u in zip(whole["chunks"], units)) and all(
                entry.keys() == gathered[i].keys() and all(torch.equal(v.reshape(-1), gathered[i][k].reshape(-1)) for k, v in entry.items())
                for i, entry in enumerate(whole["optimizer"]))
    return out


def same_shard(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two :meth:`ddp.zero.replica.Shard.state` copies hold the same bits."""
    return len(a["chunks"]) == len(b["chunks"]) and all(torch.equal(x, y) for x, y in zip(a["chunks"], b["chunks"])) and len(
        a["optimizer"]) == len(b["optimizer"]) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["optimizer"], b["optimizer"]))


# ---------------------------------------------------------------------------- launches (cached)


def worker(rank: int, world: int, launch: str, ckpt_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    extras = LAUNCHES[launch][2]
    out: dict[str, Any] = {"cases": {}}
    for run, (where, size, backend, _) in RUNS.items():  # smaller worlds run on a subgroup
        if where != launch:
            continue
        group = None if size == world else collectives.new_group(list(range(size)), backend=backend)
        if size == world or not collectives.is_non_member(group):
            out["cases"][run] = train_cases(rank, size, cases_for(size), group)
    if "torch" in extras:
        out["torch_zero1"] = torch_zero1_case(rank, world)
        out["torch_fsdp2"] = torch_fsdp2_case(rank, world)
    if "mp" in extras:
        out["mp"] = mixed_precision_case(rank, world)
    if "memory" in extras:
        out["memory"] = memory_case(rank, world)
    if "ckpt-save" in extras:
        out["ckpt"] = ckpt_case(CKPT_SAVE if world == 2 else CKPT_FROM_4, rank, world, f"{ckpt_dir}/w{world}", None)
    if "replica" in extras:
        out["replica"] = replica_case(rank, world)
    if "reload" in extras:
        out["reload"] = reload_case(rank, world)
    if "misuse" in extras:
        out["misuse"] = misuse_case(rank, world)
    return out


def restart_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Fresh processes: continue from the world-2 checkpoint, and from the world-4 one."""
    torch.set_num_threads(1)
    resumed = ckpt_case(CKPT_SAVE, rank, world, "", f"{ckpt_dir}/w2")
    from_4 = ckpt_case(CKPT_FROM_4, rank, world, "", f"{ckpt_dir}/w4")
    loaded = {  # saved at stage 2 by 2 ranks (w2) and at stage 3 by 4 (w4), loaded by 2
        "w2-into-stage-2": resumed["computed"],
        "w4-into-stage-3": from_4["computed"],
        "w2-into-stage-1-bf16": load_case(f"{ckpt_dir}/w2", 1, rank, torch.bfloat16),
        "w4-into-stage-2": load_case(f"{ckpt_dir}/w4", 2, rank, torch.float64),
        "w4-into-stage-0": load_case(f"{ckpt_dir}/w4", 0, rank, torch.float64),
    }
    return {"resumed": resumed, "from_4": from_4, "loaded": loaded}


# Spawning ranks costs seconds (more on a loaded machine), so there are three launches: 2 ranks
# on p2p (world 1 on a subgroup), 4 ranks on shm (world 3 on a p2p subgroup), and the restart.
LAUNCHES: dict[str, tuple[int, str, tuple[str, ...]]] = {
    "L2": (2, "p2p", ("torch", "mp", "memory", "ckpt-save", "reload", "misuse")),
    "L4": (4, "shm", ("ckpt-save", "replica")),
}
# run: (launch, world size, backend, bitwise equal to our DDP: 2 ranks, or shm)
RUNS: dict[str, tuple[str, int, str, bool]] = {
    "w1": ("L2", 1, "p2p", True),
    "w2": ("L2", 2, "p2p", True),
    "w3": ("L4", 3, "p2p", False),
    "w4": ("L4", 4, "shm", True),
}

_results: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zero-ckpt"))


def results_of(name: str, ckpt_dir: str) -> list[dict[str, Any]]:
    if name not in _results:
        if name == "restart":
            for needed in LAUNCHES:
                results_of(needed, ckpt_dir)
            _results[name] = collectives.launch(restart_worker, 2, ckpt_dir, backend="p2p", timeout=30, join_timeout=180)
        else:
            world, backend, _ = LAUNCHES[name]
            _results[name] = collectives.launch(worker, world, name, ckpt_dir, backend=backend, timeout=30, join_timeout=300)
    return _results[name]


# ---------------------------------------------------------------------------- tests


def test_flat_layout_pieces_and_padding() -> None:
    layout = FlatLayout([5, 4, 2], 3)  # 11 elements, chunk 4, one of padding
    assert (layout.chunk, layout.padded, layout.offsets) == (4, 12, [0, 5, 9])
    assert layout.pieces(0) == [Piece(0, 0, 4, 0)]
    assert layout.pieces(1) == [Piece(0, 4, 5, 0), Piece(1, 0, 3, 1)]
    assert layout.pieces(2) == [Piece(1, 3, 4, 0), Piece(2, 0, 2, 1)]
    assert layout.gaps([0, 1, 2]) == [(11, 12)] and layout.gaps([0, 2]) == [(5, 9), (11, 12)]
    few = FlatLayout([3], 4)  # fewer elements than ranks: the last rank owns only padding
    assert few.chunk == 1 and few.pieces(3) == [] and sum(p.numel for r in range(4) for p in few.pieces(r)) == 3
    for numels, n in (([7 * 13, 13, 13 * 5, 5, 5 * 3, 3], 4), ([1], 2), ([2, 2], 2)):
        lay = FlatLayout(numels, n)
        owned = sorted((p.param, p.start, p.stop) for r in range(n) for p in lay.pieces(r))
        assert sum(b - a for _, a, b in owned) == sum(numels)  # every element owned exactly once


def _all_cases() -> list:
    return [pytest.param(run, c["name"], id=f"{run}-{c['name']}") for run, (_, world, _, _) in RUNS.items() for c in cases_for(world)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("run,case_name", _all_cases())
def test_stage_matches_single_process_and_our_ddp(run: str, case_name: str, ckpt_dir: str) -> None:
    launch, world, _, bitwise = RUNS[run]
    per_rank = [r["cases"][run][case_name] for r in results_of(launch, ckpt_dir)[:world]]
    c = next(c for c in cases_for(world) if c["name"] == case_name)
    for r, res in enumerate(per_rank):
        for i, (a, b) in enumerate(zip(res["zero"], per_rank[0]["zero"])):
            assert np.array_equal(a, b), f"rank {r} parameter {i} differs from rank 0's"
    ours, ddp_run = per_rank[0]["zero"], per_rank[0]["ddp"]
    assert_close(ours, reference(c, world), f"{case_name} vs one process")
    if bitwise and c["clip"] is None:
        for i, (a, b) in enumerate(zip(ours, ddp_run)):
            assert np.array_equal(a, b), f"{case_name}: parameter {i} differs from our DDP's (bitwise expected)"
    elif bitwise:  # clipping scales by max_norm / |g|, and a sharded |g| adds its squares per owned piece, our
        # DDP's per parameter: the same sum in another order, equal to a few float64 ulps (2.8e-17 seen on one
        # CPU, 0 on another), so the steps agree to rounding, not bit for bit
        for i, (a, b) in enumerate(zip(ours, ddp_run)):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15, err_msg=f"{case_name}: parameter {i} vs our DDP's")
    else:
        assert_close(ours, ddp_run, f"{case_name} vs our DDP")
    init = [p.detach().numpy() for p in build(c["model"]).parameters()]
    if c["model"] == "frozen":
        assert np.array_equal(ours[0], init[0])  # never trained
    if c["model"] == "unused":  # extra got no gradient anywhere: untouched, even by AdamW's decay
        names = [n for n, _ in build("unused").named_parameters()]
        assert np.array_equal(ours[names.index("extra.weight")], init[names.index("extra.weight")])


@pytest.mark.timeout(400)
def test_against_torch_zero_redundancy_optimizer(ckpt_dir: str) -> None:
    ranks = results_of("L2", ckpt_dir)
    for res in ranks:
        got = res["torch_zero1"]
        # 2 ranks: torch's (x/2 + y/2) and our (x + y)/2 are the same float, Adam is element-wise
        for i, (a, b, c) in enumerate(zip(got["ours"], got["torch"], got["plain"])):
            assert np.array_equal(a, b), f"parameter {i}: stage 1 differs from torch's ZeroRedundancyOptimizer"
            assert np.array_equal(c, b), f"parameter {i}: our optimizer over our DDP differs from torch's"


@pytest.mark.timeout(400)
def test_stage3_against_torch_fsdp2(ckpt_dir: str) -> None:
    for res in results_of("L2", ckpt_dir):
        got = res["torch_fsdp2"]
        # FSDP2 shards by rows and reduces with gloo, dividing before or after the sum: same
        # numbers up to float64 rounding (see the module docstring for the tolerance)
        assert_close(got["ours"], got["torch"], "stage 3 vs FSDP2")


@pytest.mark.timeout(400)
def test_mixed_precision_tracks_float32_training(ckpt_dir: str) -> None:
    ranks = results_of("L2", ckpt_dir)
    c = case("fp32", 1, opt="sgd")
    want = reference(c, 2)
    names = [n for n, _ in build("uneven").named_parameters()]
    for stage in (1, 2, 3):
        res = ranks[0]["mp"][stage]
        assert res["dtypes"] == {"torch.bfloat16"}  # the module computed in bfloat16
        for r in ranks:
            for k, v in r["mp"][stage]["state"].items():
                assert np.array_equal(v, res["state"][k]), f"stage {stage}: {k} differs between ranks"
        for name, w in zip(names, want):
            got = res["state"][name]
            assert got.dtype == np.float32  # float32 masters
            # bfloat16 keeps 8 significant bits: each forward/backward value is off by up to
            # 2^-8 relative, so each update by about 2^-8 of lr * |grad| (lr 0.1, |grad| < 1,
            # momentum 0.9 sums at most 3 of them): 3 steps stay well inside 0.01, while a
            # missing or doubled update is off by lr * |grad| ~ 0.05
            np.testing.assert_allclose(got, w.astype(np.float32), rtol=0, atol=1e-2, err_msg=f"stage {stage} {name}")
        # the float32 masters kept what bfloat16 copies would have rounded away
        masters = torch.cat([torch.from_numpy(v).reshape(-1) for v in res["state"].values()])
        assert not torch.equal(masters, masters.bfloat16().float())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("key", ["1", "2", "3", "1-plain", "2-plain", "3-plain"])
def test_summon_full_params_keeps_the_masters(key: str, ckpt_dir: str) -> None:
    """The block shows the masters (their dtype, unrounded); leaving it keeps them unless the block
    wrote, and then exactly what was written; the compute copies follow the masters on every rank."""
    ranks = [r["mp"][int(key[0]) if key.isdigit() else key]["summon"] for r in results_of("L2", ckpt_dir)]
    res = ranks[0]
    before = res["before"]["masters"]
    for what in ("empty", "discarded"):  # nothing written (or not kept): the masters did not move
        for k, v in before.items():
            assert np.array_equal(res[what]["masters"][k], v), f"{key} {what}: master {k} changed by {np.abs(res[what]['masters'][k] - v).max()}"
    for name, (dtype, value) in res["shown"].items():
        assert dtype == f"torch.{before[name].dtype}", f"{key}: the block shows {name} in {dtype}, not the masters' dtype"
        assert np.array_equal(value, before[name]), f"{key}: the block shows {name} rounded"
    for what in ("empty", "discarded", "written", "per_rank"):
        for r, other in enumerate(ranks):
            for k, v in res[what]["masters"].items():
                assert np.array_equal(other[what]["masters"][k], v), f"{key} {what}: rank {r}'s {k} differs from rank 0's"
            assert np.array_equal(other[what]["forward"], res[what]["forward"]), f"{key} {what}: rank {r} computes otherwise"
        # the parameters the module computes with are the masters, cast
        assert np.array_equal(res[what]["forward"], res[what]["cast_forward"]), f"{key} {what}: compute copy is not the masters'"
    written = res["written"]["masters"]
    assert np.array_equal(written["net.0.bias"], np.full(13, 1 / 3, dtype=written["net.0.bias"].dtype)), key
    for k, v in before.items():
        if k != "net.0.bias":
            assert np.array_equal(written[k], v), f"{key}: master {k} changed by writing another parameter"


@pytest.mark.timeout(400)
def test_shard_replica_stays_bitwise_equal_to_its_owner_and_shards_cut_for_other_worlds(ckpt_dir: str) -> None:
    for rank, r in enumerate(results_of("L4", ckpt_dir)):
        expected = {f"stage {s}{what}": True for s in (1, 2) for what in ("", " resharded") + ((" whole",) if rank == 0 else ())}
        assert r["replica"] == expected, f"rank {rank}: {r['replica']}"


def test_memory_per_rank_by_tensor_accounting(ckpt_dir: str) -> None:
    ranks = results_of("L2", ckpt_dir)
    n = 2
    layer = (64 * 64 + 64) * 4
    for res in ranks:
        m = res["memory"]
        full = 4 * layer
        assert m[0].params == full and m[0].grads == 2 * full  # DDP: .grad and the buckets
        assert m[0].optimizer >= 2 * full
        for stage in (1, 2, 3):
            # optimizer state: 1/n of DDP's (+ a few step counters), the ZeRO-1 saving
            assert m[stage].optimizer <= m[0].optimizer / n * 1.05, (stage, m[stage])
        assert m[1].grads == full + full // n  # ZeRO-1 keeps its buckets (and the averaged chunks)
        for stage in (2, 3):
            assert m[stage].grads == full // n  # only the averaged chunks between steps
            # during backward: + one bucket (a layer) + autograd's fresh gradient of one weight
            assert m[stage].grads_peak <= full // n + layer + 64 * 64 * 4, (stage, m[stage])
        assert m[1].params == full and m[2].params == full
        assert m[3].params == full // n  # masters only
        # while computing: + the unit at work + the prefetched next one
        assert m[3].params_peak <= full // n + 2 * layer, m[3]


@pytest.mark.timeout(400)
def test_checkpoint_restart_and_reshard(ckpt_dir: str) -> None:
    saved2 = results_of("L2", ckpt_dir)[0]["ckpt"]
    saved4 = results_of("L4", ckpt_dir)[0]["ckpt"]
    restarted = results_of("restart", ckpt_dir)
    for res in restarted:
        # same world size, fresh processes: exactly the run that never stopped
        for k, v in saved2["final"].items():
            assert np.array_equal(res["resumed"]["final"][k], v), f"{k}: resumed run differs"
        for k, v in saved2["at"].items():
            assert np.array_equal(res["resumed"]["at"][k], v), f"{k}: loaded parameters differ"
        # saved by 4 ranks, loaded by 2: the parameters come back bitwise, training goes on
        for k, v in saved4["at"].items():
            assert np.array_equal(res["from_4"]["at"][k], v), f"{k}: 4 -> 2 ranks changed the parameters"
    # the consolidated optimizer state equals a plain optimizer's after the same steps
    c = CKPT_SAVE
    model = build(c["model"])
    cls, kw = OPTIMIZERS[c["opt"]]
    opt = cls(model.parameters(), **kw)
    for (x, y), in batches(c["model"], 2, 1, CKPT_STEPS):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()
    got = restarted[0]["resumed"]["optimizer"]
    assert got["param_groups"][0]["params"] == want["param_groups"][0]["params"]
    for i, state in want["state"].items():
        assert float(got["state"][i]["step"]) == float(state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(got["state"][i][key].numpy(), state[key].numpy(), rtol=1e-9, atol=1e-15)
    # and the run saved by 4 ranks and continued by 2 follows one process fed the same batches
    c = CKPT_FROM_4
    model = build(c["model"])
    cls, kw = OPTIMIZERS[c["opt"]]
    opt = cls(model.parameters(), **kw)
    data = batches(c["model"], 4, 1, CKPT_STEPS)[:CKPT_AT] + batches(c["model"], 2, 1, CKPT_STEPS)[CKPT_AT:]
    for (x, y), in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    assert_close([restarted[0]["from_4"]["final"][n] for n in names], _np(model.parameters()), "4 ranks, then 2")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("load", ["w2-into-stage-2", "w4-into-stage-3", "w2-into-stage-1-bf16", "w4-into-stage-2", "w4-into-stage-0"])
def test_checkpoint_load_restores_every_parameter_and_buffer(load: str, ckpt_dir: str) -> None:
    """Loaded into a model initialised with another seed: on every rank every parameter (the frozen
    weight too) and buffer equals the saved one, and the module computes with them (cast to
    bfloat16 under mixed precision)."""
    saved = results_of("L2" if load.startswith("w2") else "L4", ckpt_dir)[0]["ckpt"]["at"]
    ranks = [r["loaded"][load] for r in results_of("restart", ckpt_dir)]
    for r, got in enumerate(ranks):
        assert sorted(got["masters"]) == sorted(saved)
        for k, v in saved.items():
            assert np.array_equal(got["masters"][k], v), f"{load}: rank {r}'s {k} is not the saved one"
        assert np.array_equal(got["forward"], got["cast_forward"]), f"{load}: rank {r} computes with other values than the loaded ones"
        assert np.array_equal(got["forward"], ranks[0]["forward"]), f"{load}: rank {r} computes otherwise than rank 0"


@pytest.mark.timeout(400)
def test_full_state_dicts_load_across_stages(ckpt_dir: str) -> None:
    for res in results_of("L2", ckpt_dir):
        # stage 2 trained 2 steps, its full dicts loaded into stage 3: the third step agrees
        # bitwise (2 ranks: both stages compute our DDP's numbers)
        for k, v in res["reload"][2].items():
            assert np.array_equal(res["reload"][3][k], v), k


@pytest.mark.timeout(400)
def test_misuse_raises_clear_errors_on_every_rank(ckpt_dir: str) -> None:
    for res in results_of("L2", ckpt_dir):
        m = res["misuse"]
        assert m["bad_stage"][0] == "ValueError" and "stage must be one of" in m["bad_stage"][1]
        assert m["bool_stage"][0] == "TypeError"
        assert m["units_below_3"][0] == "ValueError" and "stage 3" in m["units_below_3"][1]
        assert m["mp_at_0"][0] == "ValueError"
        assert m["stage_mismatch"][0] == "RuntimeError" and "ZeRO stage (per rank: [2, 3])" in m["stage_mismatch"][1]
        assert m["lbfgs"][0] == "TypeError" and "LBFGS cannot be sharded" in m["lbfgs"][1]
        assert m["adafactor"][0] == "TypeError" and "Adafactor cannot be sharded" in m["adafactor"][1]
        assert m["not_a_class"][0] == "TypeError"
        assert m["add_param_group"][0] == "RuntimeError" and "cannot be added" in m["add_param_group"][1]
        assert m["state_dict_unconsolidated"][0] == "RuntimeError" and "consolidate_state_dict" in m["state_dict_unconsolidated"][1]
        assert m["comm_hook"][0] == "RuntimeError" and m["join"][0] == "RuntimeError"
        assert m["added_param"][0] == "RuntimeError" and "net.late.weight" in m["added_param"][1]
        assert m["forward_in_summon"][0] == "RuntimeError" and "inside summon_full_params" in m["forward_in_summon"][1]
        assert m["nested_summon"][0] == "RuntimeError" and "no nesting" in m["nested_summon"][1]
        for stage in (2, 3):
            assert m[f"failed_backward_{stage}"][0] == "ValueError" and m[f"recovered_{stage}"][0] == "ok", m
        kind, message = m["divergent_unit"]  # the gather-order check, or the collectives' own mismatch check
        assert kind == "RuntimeError" and "gathered different units" in message or "Collective" in kind, m["divergent_unit"]


# ---------------------------------------------------------------------------- real GPU (skipped here)


def gpu_cases() -> list[dict[str, Any]]:
    return ladder(("uneven", "unused", "tied"), ("adamw",)) + [
        case("z2-no-sync-clip", 2, micro=2, clip=0.05), case("z1-keep-grads", 1, opt="sgd", set_to_none=False)]


def gpu_worker(rank: int, world: int) -> dict[str, list[np.ndarray]]:
    """Each of :func:`gpu_cases` at its stage and at stage 0 (our DDP), on this rank's GPU."""
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    out = {}
    for c in gpu_cases():
        out[c["name"]] = train(c, rank, world, device=device)
        out[c["name"] + "@0"] = train(c, rank, world, stage=0, device=device)
    return out


@pytest.mark.timeout(400)
def test_gpu_stages_on_cuda_match_one_process() -> None:
    """ZeRO 1-3 and our DDP on CUDA tensors over ``nccl-cupy`` (one rank per GPU: 1 rank with one
    GPU, 2 with two): replicas bitwise equal, and equal to one CPU process on the whole batch
    (float64; cuBLAS and the CPU sum in other orders, so ``rtol=1e-9``)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible: the GPU ZeRO run is skipped")
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install ringddp[cuda])")
    world = min(2, torch.cuda.device_count())
    per_rank = collectives.launch(gpu_worker, world, backend="nccl-cupy", timeout=60, join_timeout=300)
    cases = {c["name"]: c for c in gpu_cases()}
    for name, got in per_rank[0].items():
        for r in range(1, world):
            assert all(np.array_equal(a, b) for a, b in zip(per_rank[r][name], got)), f"{name}: rank {r} differs"
        want = reference(cases[name.removesuffix("@0")], world)
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=f"{name} on CUDA, parameter {i}")
