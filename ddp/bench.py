"""Per-step time of our ``DistributedDataParallel`` next to torch's, in the same run.

    python -m ddp.bench                                   # 2 ranks, 4 x 2048 MLP, 25 MiB buckets
    python -m ddp.bench --bucket-mb 25,5,inf --json ddp.json --plot ddp.png
    python -m ddp.bench --world-size 4 --width 1024 --layers 8 --batch 32
    python -m ddp.bench --comm-hook none,fp16,bf16        # gradient compression, ours and torch's
    python -m ddp.bench --zero 1,2,3 --optimizer adam     # the ZeRO ladder, ours and torch's

What runs
---------
Every rank builds the same wide MLP (``--layers`` Linear layers of ``--width`` features with ReLU
in between; the default 4 x 2048 has 16.8 M parameters, 64 MiB of float32 gradients per step) and
one copy of it per *variant*, each with its own SGD optimizer:

* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` over the gloo process group that
  our collectives run on (torch's defaults: 25 MiB buckets, a 1 MiB first bucket);
* ``torch DDP ringddp``: the same torch DDP over a torch process group of backend ``"ringddp"``
  (``collectives.torch_backend``): torch's reducer, our collectives underneath;
* ``torch DDP ringddp adopt``: the same with adoption opted in (``Options(adopt_bytes=1 GiB)``,
  ``collectives.adoption``): from its second all-reduce each bucket lies in symmetric memory;
* ``torch FSDP2`` / ``torch FSDP2 ringddp``: torch's ``fully_shard`` on every Linear layer and the
  root, over a mesh of the gloo or of the ringddp process group (``--torch-stacks`` chooses the
  ringddp and FSDP2 rows);
* ``ours <cap>``: :class:`ddp.DistributedDataParallel` with ``bucket_cap_mb=<cap>``, one variant
  per value of ``--bucket-mb`` (``inf``: a single bucket, i.e. no overlap at all);
* ``local``: the bare model, same step, no communication: the floor every DDP row pays on top of.

After the steps, each rank also times *returning* from an async 4 KiB all-reduce (``async
return``: what a DDP pays to launch a bucket) through ``torch.distributed`` on the gloo and the
ringddp groups; on the same groups as torch's DDP calls it (``gloo C++``, ``ringddp C++``: the
process group's C++ ``allreduce``, which torch's reducer calls from C++ and which reaches a
Python process group's method through torch's trampoline, without ``dist.all_reduce``'s Python
wrapper); and through our API (``ours``: ``collectives.all_reduce`` on our world group);
medians of 100 per case: ``idle`` (nothing in flight, after another 4 KiB call), ``cold``
(nothing in flight, right after a 16 MiB all-reduce: its traffic has evicted the caller's code
and data from the caches, as backward's does in training) and ``busy`` (a 16 MiB all-reduce
still in flight).

Last, every rank at once times one pass of each kind a reduction makes over the step's gradient
bytes (``passes``: ``copy``, ``scale`` = a copy that multiplies, ``add`` = two reads and a
write), and the line under the table adds up the passes of each no-hook DDP row on shared
memory (:func:`step_passes_ms`): with a core per rank they are taken from backward, so they
estimate the least ``comm`` can be. For torch's DDP that includes its reducer's own copies of
every gradient into its buckets and back, which no backend can avoid.

``--zero`` (comma list of stages 1, 2, 3) adds :class:`ddp.ZeroDataParallel` at each stage with
:class:`ddp.ZeroRedundancyOptimizer` (``ours ZeRO-s``, first ``--bucket-mb``), and torch's
counterpart of each, on the same gloo group: ``torch ZeRO-1`` (torch DDP +
``torch.distributed.optim.ZeroRedundancyOptimizer``), ``torch FSDP2 ZeRO-2`` (``fully_shard`` of
every Linear and the root with ``reshard_after_forward=False``: parameters gathered once per step,
gradients reduce-scattered, torch's ZeRO-2) and ``torch FSDP2`` (``fully_shard``, ZeRO-3). Every
variant steps ``--optimizer`` (``sgd``: plain SGD; ``adam``: Adam, whose two moments make the
optimizer state twice the parameters: what ZeRO shards first). A second table then gives, per
variant and rank, the bytes sent per step and the memory held, by tensor accounting
(``ddp.zero.memory_report``; see "Reading the second table").

Our DDP runs with its default ``gradient_as_bucket_view=True``: the gradients are views into the
buckets, so it does not copy them back after the all-reduce (a copy of every gradient per step;
on shared memory a large part of the cost). ``--grad-view`` gives torch's DDP rows the same
setting (torch's default is False).

``--comm-hook`` (comma list of ``none``, ``allreduce``, ``fp16``, ``bf16``) repeats the two DDP
kinds per comm hook: ours with ``ddp.comm_hooks.<hook>``, torch's with the same hook from
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` (``none``: no hook registered).

A step is ``forward + MSE loss`` / ``loss.backward()`` / ``optimizer.step(); zero_grad()`` on a
fixed synthetic batch (different on every rank). The variants are interleaved: a round runs
``--steps`` steps of each variant in turn (every other round in reverse order) after a barrier,
``--warmup`` untimed rounds first, then ``--rounds`` timed ones; slow drifts of the machine (other
jobs, frequency scaling) hit every variant alike.

Reading the table
-----------------
``step ms``
    median over timed steps of the *slowest rank's* time for that step (the job's pace);
    ``min`` is the fastest such step, a hint of how noisy the machine was.
``forward`` / ``backward`` / ``optim``
    medians (of the mean over ranks) of the three phases. ``backward`` is the time until
    ``loss.backward()`` returns, so for both DDPs it *includes* waiting for the last all-reduces:
    the gradients are averaged when it returns.
``wait``
    ours only: the part of ``backward`` spent in the end-of-backward callback waiting for
    all-reduces still in flight (``last_stats.wait_s``): the exposed, non-overlapped
    communication. Torch DDP does not report it.
``buckets``
    how many all-reduces a step makes (torch DDP: after its bucket rebuild at the second step;
    torch closes a bucket once it *reaches* the cap and starts with a 1 MiB first bucket, ours
    closes one before it would *exceed* the cap, so the same cap can give different layouts; the
    JSON lists the sizes).
``launched``
    ours only: buckets whose all-reduce was started by a gradient hook, i.e. before autograd
    finished / buckets in all (the others start in the end-of-backward callback). The last
    bucket is launched by the very last hook, so ``k/k`` is normal; what overlaps backward
    compute are the buckets launched *before* the last one. With a single bucket (``inf``)
    nothing overlaps and ``wait`` is the whole all-reduce.
``bwd-local``
    backward minus the local baseline's backward: what communication (exposed transfers, plus
    compute slowed by the communication thread and the copies into buckets) adds to the
    backward pass. Compare the DDP rows on this column.
``vs torch``
    step time of torch DDP (on gloo) with the same comm hook / this row's step time: ``> 1`` is
    faster than torch DDP, ``< 1`` slower; ``torch FSDP2 ringddp`` is compared with ``torch FSDP2``
    (on gloo). The local row's value (against torch without hook) is the ceiling any DDP could reach.
``MB/step``
    payload each rank hands to collectives per step (MiB). Where our collectives carry it (ours,
    the ringddp rows) it is *measured*: one extra step per variant runs under
    ``collectives.trace`` before the timing and the bytes of its collectives are summed. Over
    gloo it is computed for DDP (gradient bytes, halved by fp16/bf16 hooks). With a ring
    all-reduce each rank sends ``2(n-1)/n`` times this over the wire.

``comm`` / ``comm/torch``
    the step minus the local step: what data parallelism costs this row per step, and that cost
    over torch DDP's (same comm hook): ``< 1`` means our communication costs less than torch's.

``sync`` is ``ok`` when every rank ended with bitwise identical parameters (checked after the
timing), as data parallelism requires.

Reading the second table (``--zero``)
-------------------------------------
``vs DDP``
    step time over our DDP's (first bucket cap, no hook); torch's rows over torch DDP's.
``vs torch``
    (first table) for a ZeRO row: the step time of torch's counterpart over this row's.
``sent MB``
    what each rank sends per step on a ring, the accounting of the ZeRO paper: an all-reduce of
    ``S`` bytes sends ``2(n-1)/n · S``, a reduce-scatter or all-gather of ``S`` (the full size)
    ``(n-1)/n · S``, a broadcast ``(n-1)/n · S`` on average. Ours: summed over the collectives of
    one traced step (shared memory moves the same bytes through memory instead of a wire).
    Torch's: computed from what their algorithms do (DDP: all-reduce of the gradients; ZeRO-1:
    plus a broadcast of every parameter from its owner; FSDP2: an all-gather per unit in forward,
    another in backward unless ``reshard_after_forward=False``, and a reduce-scatter).
``params`` / ``grads`` / ``optim``
    MiB each rank holds after a step's ``optimizer.step()`` (before ``zero_grad``): parameter
    storage (replicas, flat buffers, master chunks), gradient storage (``.grad``, buckets,
    averaged chunks), optimizer state. torch DDP's own buckets live inside its C++ reducer and are
    not visible (one more copy of the gradients).
``peak``
    ours: params + grads + optim plus the largest transient allocation of a step (gathered units,
    bucket buffers, autograd's fresh gradient), an upper bound; torch's rows: ``-``.

On a small CPU machine the ranks share the cores with each other and with the communication
threads (``torch.set_num_threads(cpu_count // world_size)`` per rank, overridable with
``--threads``), so overlap buys less than on GPUs: reducing a bucket competes with the backward
pass for the same cores. ``--json`` writes every number (and the per-rank medians); ``--plot``
draws the phases as stacked bars.

Allocator. Every row starts its steps with ``zero_grad(set_to_none=True)``, so autograd allocates
fresh gradients each step, and the ``local`` row, which keeps all of them until the next
``zero_grad``, needs the whole gradient size anew each step (a DDP copies each gradient into its
bucket and frees it at once). Whether those pages are still mapped depends on glibc's dynamic
thresholds, hence on every allocation the process made before: measured on the 11 x
Linear(1024) model (2 ranks, ``--torch-stacks none --rounds 15``, two runs each), the ``local``
step took 65.3-65.4 ms in a fresh process (ours 64.5-65.4 ms: 0.99-1.00x) and 52.5-52.8 ms with
freed memory kept (ours 62.5-63.2 ms: 1.19-1.20x); on the default model 88.6-92.9 against
71.9-74.0 ms (ours/local 1.05-1.09x against 1.21-1.24x), and in the full suite, after the other
rows had run, 74.4 ms. So by default (``--allocator steady``) each rank first makes its C
allocator keep what it frees (:func:`keep_freed_memory`): no row pays page faults for memory a
step gave back, ``comm`` is the communication's cost and not the allocator's, and a row's time
no longer depends on which rows ran before it. ``--allocator default`` leaves glibc as it comes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
import zlib
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives
from collectives import torch_backend, trace
from collectives.backends import backend_argument, describe_backends, device_type_of

from . import comm_hooks
from .distributed import DistributedDataParallel
from .zero import ZeroDataParallel, ZeroRedundancyOptimizer, memory_report

log = logging.getLogger("ddp.bench")  # not __name__: under "python -m" the ranks import this as __mp_main__

PHASES = ("step", "forward", "backward", "optim")
COMM_HOOKS = ("none", "allreduce", "fp16", "bf16")
TORCH_STACKS = ("ddp-ringddp", "ddp-ringddp-adopt", "fsdp2")
#: the adoption budget of the ``torch DDP ringddp adopt`` row.
ADOPT_BYTES = 1 << 30
_COMPRESSED = {"fp16": 0.5, "bf16": 0.5}  # payload ratio of the compression hooks (float32 gradients)
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
# bytes a rank sends per byte of the traced payload, on a ring of n ranks (see the docstring)
_SENT_PER_BYTE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n: n - 1,  # traced: the output chunk
    "all_gather_into_tensor": lambda n: n - 1,  # traced: the input chunk
    "broadcast": lambda n: (n - 1) / n,
}
# torch's rows, computed: bytes sent per parameter byte, as multiples of (n-1)/n
_TORCH_SENT = {"torch DDP": 2, "torch ZeRO-1": 3, "torch FSDP2 ZeRO-2": 2, "torch FSDP2": 3}


def _hooks(name: str) -> tuple[Any, Any]:
    """(our hook, torch's hook) for a ``--comm-hook`` name; ``none`` registers none."""
    if name == "none":
        return None, None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ours = {"allreduce": comm_hooks.allreduce_hook, "fp16": comm_hooks.fp16_compress_hook, "bf16": comm_hooks.bf16_compress_hook}

    def torch_bf16(process_group, bucket):  # type: ignore[no-untyped-def]  (torch checks the annotations)
        # torch DDP refuses its bf16 hook *by name* unless NCCL is present; gloo runs it fine.
        return default_hooks.bf16_compress_hook(process_group, bucket)

    theirs = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook, "bf16": torch_bf16}
    return ours[name], theirs[name]


@dataclasses.dataclass
class Config:
    world_size: int = 2
    width: int = 2048
    layers: int = 4
    batch: int = 64
    bucket_mb: tuple[float, ...] = (25.0,)
    comm_hooks: tuple[str, ...] = ("none",)
    torch_stacks: tuple[str, ...] = TORCH_STACKS
    first_bucket_mb: float | None = None
    grad_view: bool = False
    zero: tuple[int, ...] = ()
    optimizer: str = "sgd"
    warmup: int = 1
    rounds: int = 10
    steps: int = 3
    lr: float = 1e-3
    backend: str = "auto"
    threads: int | None = None
    seed: int = 0
    timeout: float = 120.0
    allocator: str = "steady"


def make_model(width: int, layers: int) -> nn.Module:
    """``layers`` Linear(width, width) with ReLU between them (none after the last)."""
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _mb_label(mb: float) -> str:
    return "inf" if math.isinf(mb) else f"{mb:g}"


def _mb_json(mb: float | None) -> float | str | None:
    return "inf" if mb is not None and math.isinf(mb) else mb


class _Variant:
    """One model copy, its optimizer, and the per-step measurements of one rank."""

    def __init__(
        self,
        key: str,
        name: str,
        kind: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        bucket_mb: float | None = None,
        hook: str = "none",
        versus: str | None = None,
    ):
        self.key, self.name, self.kind, self.model, self.bucket_mb, self.hook = key, name, kind, model, bucket_mb, hook
        self.versus = versus  # the torch row this one is compared with (None: torch DDP, same hook)
        self.comm_bytes: int | None = None
        self.sent_bytes: float | None = None
        self.memory: dict[str, int | None] | None = None
        self.optimizer = optimizer
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}
        self.wait: list[float] = []
        self.reducer_backward: list[float] = []
        self.launched: list[int] = []
        self.buckets = len(model.buckets) if isinstance(model, DistributedDataParallel) else None
        self.stage = model.stage if isinstance(model, ZeroDataParallel) else None

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> float:
        t0 = time.perf_counter()
        loss = F.mse_loss(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if record:
            for phase, t in zip(PHASES, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
                self.times[phase].append(t)
            if isinstance(self.model, DistributedDataParallel):
                stats = self.model.last_stats
                self.wait.append(stats.wait_s)
                self.reducer_backward.append(stats.backward_s)
                self.launched.append(stats.launched_during_backward)
        return t3 - t0

    def measure_comm_bytes(self, x: torch.Tensor, y: torch.Tensor, world_size: int) -> None:
        """One untimed step under tracing: the bytes handed to collectives and the bytes a rank
        sends (ours), or both computed (torch)."""
        n = world_size
        if self.kind in ("ours", "ringddp"):  # our collectives carry it: measured
            with trace.tracing() as tracer:
                self.step(x, y, record=False)
            events = [e["args"] for e in tracer.events if e["cat"] == "collective"]
            self.comm_bytes = sum(a.get("bytes", 0) for a in events)
            self.sent_bytes = sum(a.get("bytes", 0) * _SENT_PER_BYTE.get(a["op"], lambda n: 0.0)(n) for a in events)
        elif self.kind == "torch":
            grad_bytes = sum(_local(p).numel() * p.element_size() for p in self.model.parameters())
            fsdp = self.name.startswith("torch FSDP2")
            if self.name in _TORCH_SENT:  # FSDP2's parameters are shards: the full size is n times
                self.sent_bytes = _TORCH_SENT[self.name] * (n - 1) / n * grad_bytes * (n if fsdp else 1)
            self.comm_bytes = None if fsdp else int(grad_bytes * _COMPRESSED.get(self.hook, 1.0))

    def measure_memory(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One untimed step; what the rank holds after ``optimizer.step()`` (before ``zero_grad``)."""
        F.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        report = memory_report(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.memory = dataclasses.asdict(report)
        if self.kind != "ours":
            self.memory["params_peak"] = self.memory["grads_peak"] = None  # not tracked inside torch's wrappers

    def torch_buckets(self) -> list[int] | None:
        """Bucket sizes in bytes of a torch DDP after its bucket rebuild (private API: best effort)."""
        try:
            data = self.model._get_ddp_logging_data()
            text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
            return [int(v) for v in str(text).split(",")]
        except Exception:  # noqa: BLE001 - only a detail of the report
            return None

    def checksum(self) -> int:
        """CRC of the full parameters (collective for sharded ones: every rank calls it in turn)."""
        crc = 0
        full = self.model.summon_full_params() if self.stage == 3 else contextlib.nullcontext()
        with full:  # type: ignore[attr-defined]
            for p in self.model.parameters():
                value = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's DTensor
                crc = zlib.crc32(value.detach().contiguous().numpy().tobytes(), crc)
        return crc

    def report(self) -> dict[str, Any]:
        bucket_bytes = [b.nbytes for b in self.model.buckets] if self.kind == "ours" else None
        if self.kind in ("torch", "ringddp"):
            bucket_bytes = self.torch_buckets()
            self.buckets = None if bucket_bytes is None else len(bucket_bytes)
        return {
            "key": self.key,
            "name": self.name,
            "kind": self.kind,
            "bucket_mb": _mb_json(self.bucket_mb),
            "comm_hook": self.hook,
            "stage": self.stage,
            "versus": self.versus,
            "comm_bytes": self.comm_bytes,
            "sent_bytes": self.sent_bytes,
            "memory": self.memory,
            "buckets": self.buckets,
            "bucket_bytes": bucket_bytes,
            "times": self.times,
            "wait": self.wait,
            "reducer_backward": self.reducer_backward,
            "launched": self.launched,
            "checksum": self.checksum(),
        }


def _torch_zero_variants(
    cfg: Config, base: nn.Module, pg: Any, ringddp: Any, optimizer_class: type
) -> list[_Variant]:
    """torch's counterparts of the ``--zero`` stages, on the gloo group our collectives run on;
    with the ``fsdp2`` stack, torch's FSDP2 on gloo and on the ``ringddp`` process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    out = []
    if 1 in cfg.zero:
        model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=pg)
        optimizer = TorchZeRO(model.parameters(), optimizer_class, process_group=pg, lr=cfg.lr)
        out.append(_Variant("torch:zero1", "torch ZeRO-1", "torch", model, optimizer, versus="torch ZeRO-1"))
    from torch.distributed.device_mesh import DeviceMesh

    def sharded(group: Any, reshard: bool) -> nn.Module:
        mesh = DeviceMesh.from_group(group, "cpu")
        model = copy.deepcopy(base)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    fsdp2 = "fsdp2" in cfg.torch_stacks
    for stage in (2, 3):
        if stage in cfg.zero or (stage == 3 and fsdp2):
            model = sharded(pg, stage == 3)
            name = "torch FSDP2" if stage == 3 else "torch FSDP2 ZeRO-2"
            out.append(_Variant(f"torch:fsdp{stage}", name, "torch", model, optimizer_class(model.parameters(), lr=cfg.lr), versus=name))
    if fsdp2:
        model = sharded(ringddp, True)
        out.append(_Variant("ringddp:fsdp3", "torch FSDP2 ringddp", "ringddp", model,
                            optimizer_class(model.parameters(), lr=cfg.lr), versus="torch FSDP2"))  # fmt: skip
    return out


#: the cases of :func:`_async_return_us`, in the order each cycle runs them.
ASYNC_CASES = ("busy", "cold", "idle")


def _async_return_us(calls: dict[str, Callable[[torch.Tensor], Any]], reps: int = 100) -> dict[str, dict[str, float]]:
    """Median µs to *return* from an async 4 KiB all-reduce (``calls[name](tensor)`` starts one
    and returns its handle), per case of :data:`ASYNC_CASES` (see the module docstring)."""
    small, big = torch.ones(1024), torch.ones(4 << 20)
    out: dict[str, dict[str, float]] = {}
    for name, start in calls.items():
        times: dict[str, list[float]] = {case: [] for case in ASYNC_CASES}
        for i in range(reps * len(ASYNC_CASES)):
            case = ASYNC_CASES[i % len(ASYNC_CASES)]
            collectives.barrier()
            behind = start(big) if case == "busy" else None
            t0 = time.perf_counter()
            work = start(small)
            times[case].append(1e6 * (time.perf_counter() - t0))
            work.wait()
            if behind is not None:
                behind.wait()
        out[name] = {f"{case}_us": statistics.median(v) for case, v in times.items()}
    return out


#: the elementwise passes :func:`_gradient_passes_ms` times, each over the step's gradient bytes ``G``.
GRADIENT_PASSES = ("copy", "scale", "add")


def _gradient_passes_ms(numel: int, reps: int = 9) -> dict[str, float]:
    """Median ms of one pass over ``numel`` float32 elements, every rank at once (after a barrier,
    as in a step, where the ranks reduce together and share the memory bandwidth): ``copy``
    (``dst.copy_(src)``), ``scale`` (``torch.mul(src, s, out=dst)``, torch's reducer copying a
    gradient into its bucket) and ``add`` (``torch.add(x, y, out=dst)``: two reads, one write)."""
    src, other, dst = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    passes = {
        "copy": lambda: dst.copy_(src),
        "scale": lambda: torch.mul(src, 0.5, out=dst),
        "add": lambda: torch.add(src, other, out=dst),
    }
    out = {}
    for name in GRADIENT_PASSES:
        times = []
        for _ in range(reps):
            collectives.barrier()
            t0 = time.perf_counter()
            passes[name]()
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
    return out


def step_passes_ms(passes: dict[str, float], world_size: int) -> dict[str, float]:
    """What the passes over the gradients that a DDP row's reduction makes on shared memory cost
    a step, from the timed single passes (``passes``: :func:`_gradient_passes_ms`). With a core
    per rank they take the core from backward, so they add to ``comm`` whatever overlaps: an
    estimate of the least the row's communication can cost, not a strict bound (a pass that runs
    while the peer computes has the memory bus to itself, and the local row pays for memory
    the DDPs do not: it keeps every fresh gradient until ``zero_grad``, so the allocator hands
    it new pages every step, while a DDP copies each into its bucket and frees it at once: on
    the 11 x Linear(1024) model alone, ``zero_grad(set_to_none=True)`` measured 10,200 minor page
    faults and 66 ms a step against 1,000-2,000 and 57 ms with ``set_to_none=False``).

    With ``G`` the gradient bytes, ``n`` ranks and buckets above the one-shot limit:

    * ``ours`` (buckets in symmetric memory, ``all_reduce_symmetric`` with AVG): autograd's
      fresh gradients (``zero_grad(set_to_none=True)``, as every row here) copied into the
      buckets, then ``n - 1`` adds over ``G/n``, a division of ``G/n``, copies of ``(n-1)/n G``
      from the peers: ``copy + (n-1)/n (add + copy) + scale/n``;
    * ``torch DDP ringddp`` (torch's reducer scales each gradient into a private bucket and copies
      the result back; the two-shot all-reduce copies ``(n-1)/n G`` into the region, reduces
      ``G/n``, copies it back and ``(n-1)/n G`` from the peers):
      ``scale + copy + (n-1)/n (add + 2 copy) + copy/n``;
    * ``torch DDP ringddp adopt`` (the same, its buckets adopted into symmetric memory,
      ``collectives.adoption``: each rank reduces its ``G/n`` where the buckets lie and copies
      ``(n-1)/n G`` from the peers): ``scale + copy + (n-1)/n (add + copy)``.
    """
    n = world_size
    copy, scale, add = passes["copy_ms"], passes["scale_ms"], passes["add_ms"]
    share = (n - 1) / n
    return {
        "ours": copy + share * (add + copy) + scale / n,
        "torch DDP ringddp": scale + copy + share * (add + 2 * copy) + copy / n,
        "torch DDP ringddp adopt": scale + copy + share * (add + copy),
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (FSDP2's are DTensors)."""
    return p.to_local() if hasattr(p, "to_local") else p


#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: allocations up to this many bytes come from the heap under :func:`keep_freed_memory`.
KEPT_ALLOCATION_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Make this process's C allocator keep the memory it frees and hand it out again (glibc
    ``mallopt``: allocations up to :data:`KEPT_ALLOCATION_BYTES` from the heap, which is never
    trimmed). Returns whether it took effect (``False`` where the C library has no ``mallopt``
    or refuses). See "Allocator" in the module docstring."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEPT_ALLOCATION_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def bench_rank(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """One rank: build the variants, run the interleaved rounds, return the raw per-step times."""
    allocator = "steady" if cfg.allocator == "steady" and keep_freed_memory() else "default"
    if rank == 0 and allocator != cfg.allocator:
        log.warning("--allocator steady: this C library has no usable mallopt; its allocator runs as it comes")
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    group = collectives.get_default_group()
    torch.manual_seed(cfg.seed)
    base = make_model(cfg.width, cfg.layers)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    x = torch.randn(cfg.batch, cfg.width, generator=gen)
    y = torch.randn(cfg.batch, cfg.width, generator=gen)
    if rank == 0:
        log.info(
            "model: %d x Linear(%d, %d), %s parameters (%.1f MiB of float32 gradients); batch %d per rank; "
            "%d ranks, %d thread(s) each",
            cfg.layers, cfg.width, cfg.width, f"{n_params:,}", n_params * 4 / 2**20, cfg.batch, world_size, threads,
        )  # fmt: skip

    optimizer_class = OPTIMIZERS[cfg.optimizer]

    def plain(model: nn.Module) -> torch.optim.Optimizer:
        return optimizer_class(model.parameters(), lr=cfg.lr)

    # Construction order is the same on every rank (each wrapper talks to its peers).
    ringddp = torch.distributed.new_group(backend="ringddp", pg_options=torch_backend.Options(backend=cfg.backend))
    torch_groups = {"torch": ("torch DDP", group.process_group)}  # key: (label, process group)
    if "ddp-ringddp" in cfg.torch_stacks:
        torch_groups["ringddp"] = ("torch DDP ringddp", ringddp)
    adopting = None
    if "ddp-ringddp-adopt" in cfg.torch_stacks:
        options = torch_backend.Options(backend=cfg.backend, adopt_bytes=ADOPT_BYTES)
        adopting = torch.distributed.new_group(backend="ringddp", pg_options=options)
        torch_groups["ringddp-adopt"] = ("torch DDP ringddp adopt", adopting)
    variants = []
    for hook in cfg.comm_hooks:
        suffix = "" if hook == "none" else f" {hook}"
        for key, (label, pg) in torch_groups.items():
            model = torch.nn.parallel.DistributedDataParallel(
                copy.deepcopy(base), process_group=pg, gradient_as_bucket_view=cfg.grad_view
            )
            if hook != "none":
                model.register_comm_hook(pg, _hooks(hook)[1])
            kind = "torch" if key == "torch" else "ringddp"
            variants.append(_Variant(f"{key}:{hook}", label + suffix, kind, model, plain(model), hook=hook))
    variants += _torch_zero_variants(cfg, base, group.process_group, ringddp, optimizer_class)
    for mb in cfg.bucket_mb:
        for hook in cfg.comm_hooks:
            suffix = "" if hook == "none" else f" {hook}"
            model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb, first_bucket_cap_mb=cfg.first_bucket_mb)
            if hook != "none":
                model.register_comm_hook(None, _hooks(hook)[0])
            name = f"ours {_mb_label(mb)} MB{suffix}"
            variants.append(_Variant(f"ours:{_mb_label(mb)}:{hook}", name, "ours", model, plain(model), mb, hook))
        if rank == 0:
            sizes = ", ".join(f"{b.nbytes / 2**20:.1f}" for b in model.buckets)
            log.info("ours %s MB: %d buckets of %s MiB (launch order)", _mb_label(mb), len(model.buckets), sizes)
    for stage in cfg.zero:
        model = ZeroDataParallel(copy.deepcopy(base), stage=stage, bucket_cap_mb=cfg.bucket_mb[0])
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, lr=cfg.lr)
        versus = "torch ZeRO-1" if stage == 1 else "torch FSDP2 ZeRO-2" if stage == 2 else "torch FSDP2"
        variants.append(_Variant(f"zero:{stage}", f"ours ZeRO-{stage}", "ours", model, optimizer, cfg.bucket_mb[0], versus=versus))
    local = copy.deepcopy(base)
    variants.append(_Variant("local", "local (no comm)", "local", local, plain(local)))
    del base
    for v in variants:  # same order on every rank
        v.measure_comm_bytes(x, y, world_size)
        if cfg.zero:
            v.measure_memory(x, y)

    total = cfg.warmup + cfg.rounds
    for r in range(total):
        record = r >= cfg.warmup
        order = variants if r % 2 == 0 else variants[::-1]
        last: dict[str, float] = {}
        for v in order:
            collectives.barrier()  # every rank starts the variant together
            for _ in range(cfg.steps):
                last[v.name] = v.step(x, y, record)
        if rank == 0:
            what = "timed" if record else "warm-up"
            log.info(
                "round %d/%d (%s): %s", r + 1, total, what,
                ", ".join(f"{v.name} {1e3 * last[v.name]:.0f} ms" for v in variants),
            )  # fmt: skip
    collectives.barrier()
    if rank == 0:
        sizes = variants[0].torch_buckets()
        if sizes is not None:
            log.info("torch DDP: %d buckets of %s MiB (after its rebuild)", len(sizes), ", ".join(f"{b / 2**20:.1f}" for b in sizes))
    reports = [v.report() for v in variants]
    reducer_opts = torch.distributed.AllreduceOptions()  # SUM, async: what torch's reducer passes
    enqueue = _async_return_us({
        "gloo": lambda t: torch.distributed.all_reduce(t, group=group.process_group, async_op=True),
        "ringddp": lambda t: torch.distributed.all_reduce(t, group=ringddp, async_op=True),
        "gloo C++": lambda t: torch.distributed.ProcessGroup.allreduce(group.process_group, [t], reducer_opts),
        "ringddp C++": lambda t: torch.distributed.ProcessGroup.allreduce(ringddp, [t], reducer_opts),
        "ours": lambda t: collectives.all_reduce(t, async_op=True),
    })
    for pg in (ringddp, adopting):
        if pg is not None:
            torch.distributed.destroy_process_group(pg)
    passes = _gradient_passes_ms(n_params)
    return {"rank": rank, "threads": threads, "allocator": allocator, "params": n_params, "variants": reports, "async_return": enqueue, "passes": passes}


# ---------------------------------------------------------------------------- summary (parent)


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def summarize(per_rank: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Combine the ranks' raw times into one row per variant (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    n_variants = len(per_rank[0]["variants"])
    for i in range(n_variants):
        reports = [r["variants"][i] for r in per_rank]
        first = reports[0]
        steps = len(first["times"]["step"])
        slowest = [max(rep["times"]["step"][s] for rep in reports) for s in range(steps)]
        mean = {p: [statistics.fmean(rep["times"][p][s] for rep in reports) for s in range(steps)] for p in PHASES}
        row: dict[str, Any] = {
            "name": first["name"],
            "kind": first["kind"],
            "bucket_mb": first["bucket_mb"],
            "comm_hook": first["comm_hook"],
            "stage": first["stage"],
            "versus": first["versus"],
            "comm_mib": None if first["comm_bytes"] is None else first["comm_bytes"] / 2**20,
            "sent_mib": None if first["sent_bytes"] is None else first["sent_bytes"] / 2**20,
            "memory_mib": _largest_memory([rep["memory"] for rep in reports]),
            "buckets": first["buckets"],
            "bucket_mib": None if first["bucket_bytes"] is None else [round(b / 2**20, 2) for b in first["bucket_bytes"]],
            "steps": steps,
            "step_ms": _median_ms(slowest),
            "step_min_ms": 1e3 * min(slowest) if slowest else float("nan"),
            "step_max_ms": 1e3 * max(slowest) if slowest else float("nan"),
            "forward_ms": _median_ms(mean["forward"]),
            "backward_ms": _median_ms(mean["backward"]),
            "optim_ms": _median_ms(mean["optim"]),
            "per_rank_step_ms": [_median_ms(rep["times"]["step"]) for rep in reports],
            "in_sync": len({rep["checksum"] for rep in reports}) == 1,
        }
        if first["kind"] == "ours":
            row["wait_ms"] = _median_ms([statistics.fmean(rep["wait"][s] for rep in reports) for s in range(steps)])
            row["reducer_backward_ms"] = _median_ms(
                [statistics.fmean(rep["reducer_backward"][s] for rep in reports) for s in range(steps)]
            )
            row["launched_during_backward"] = statistics.median_low([min(rep["launched"][s] for rep in reports) for s in range(steps)])
        else:
            row["wait_ms"] = None
            row["launched_during_backward"] = None
        rows.append(row)
    torch_ms = {r["comm_hook"]: r["step_ms"] for r in rows if r["kind"] == "torch" and r["versus"] is None}
    by_name = {r["name"]: r["step_ms"] for r in rows}
    local = next(r for r in rows if r["kind"] == "local")
    ddp_ms = {"ours": by_name[f"ours {_mb_label(cfg.bucket_mb[0])} MB"], "torch": torch_ms["none"] if "none" in torch_ms else None}
    for row in rows:
        if row["versus"] is not None:
            reference = by_name[row["versus"]]
        else:
            reference = torch_ms.get(row["comm_hook"], torch_ms[cfg.comm_hooks[0]])
        row["speed_vs_torch"] = reference / row["step_ms"] if row["step_ms"] > 0 else float("nan")
        ddp = ddp_ms.get(row["kind"])
        row["vs_ddp"] = None if ddp is None else row["step_ms"] / ddp
        row["backward_over_local_ms"] = row["backward_ms"] - local["backward_ms"]
        row["comm_ms"] = None if row["kind"] == "local" else row["step_ms"] - local["step_ms"]
        torch_comm = reference - local["step_ms"]
        row["comm_vs_torch"] = None if row["comm_ms"] is None or torch_comm <= 0 else row["comm_ms"] / torch_comm
    passes = {k: max(r["passes"][k] for r in per_rank) for k in per_rank[0]["passes"]}  # the slowest rank's
    return {
        "config": {k: (list(map(_mb_json, v)) if k == "bucket_mb" else _mb_json(v) if k == "first_bucket_mb" else v)
                   for k, v in dataclasses.asdict(cfg).items()},
        "params": per_rank[0]["params"],
        "threads_per_rank": per_rank[0]["threads"],
        "allocator": per_rank[0]["allocator"],
        "async_return_us": {  # the slowest rank's medians
            name: {k: max(r["async_return"][name][k] for r in per_rank) for k in per_rank[0]["async_return"][name]}
            for name in per_rank[0]["async_return"]
        },
        "passes_ms": passes,
        "step_passes_ms": step_passes_ms(passes, cfg.world_size) if cfg.backend in ("auto", "shm") and cfg.world_size > 1 else None,
        "torch_version": torch.__version__,
        "rows": rows,
    }  # fmt: skip


_COLUMNS = (
    ("variant", 22, "<"), ("buckets", 7, ">"), ("MB/step", 8, ">"), ("step ms", 9, ">"), ("min", 8, ">"), ("forward", 8, ">"),
    ("backward", 9, ">"), ("optim", 7, ">"), ("wait", 7, ">"), ("launched", 9, ">"), ("bwd-local", 10, ">"),
    ("vs torch", 9, ">"), ("comm", 6, ">"), ("comm/torch", 10, ">"), ("sync", 5, ">"),
)  # fmt: skip


def _largest_memory(per_rank: list[dict[str, int | None] | None]) -> dict[str, float | None] | None:
    """MiB per category, the largest over the ranks (they differ by at most a chunk's padding)."""
    if per_rank[0] is None:
        return None
    return {
        k: None if any(m[k] is None for m in per_rank) else max(m[k] for m in per_rank) / 2**20  # type: ignore[index,type-var]
        for k in per_rank[0]
    }


_ZERO_COLUMNS = (
    ("variant", 22, "<"), ("step ms", 9, ">"), ("vs DDP", 7, ">"), ("vs torch", 9, ">"), ("sent MB", 8, ">"),
    ("params", 8, ">"), ("grads", 8, ">"), ("optim", 8, ">"), ("peak", 8, ">"), ("sync", 5, ">"),
)  # fmt: skip


def format_zero_table(summary: dict[str, Any]) -> str:
    """Traffic and memory per rank of every variant (``--zero``): the second table."""

    def num(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None or x != x else format(x, fmt)

    lines = [" ".join(f"{title:{align}{width}}" for title, width, align in _ZERO_COLUMNS)]
    lines.append(" ".join("-" * width for _, width, _ in _ZERO_COLUMNS))
    for r in summary["rows"]:
        m = r["memory_mib"] or {}
        peak = None if m.get("params_peak") is None else m["params_peak"] + m["grads_peak"] + m["optimizer"]
        sync = "-" if r["kind"] == "local" else ("ok" if r["in_sync"] else "DIFF")
        cells = (
            r["name"], num(r["step_ms"]), num(r["vs_ddp"], ".2f") + ("x" if r["vs_ddp"] is not None else ""),
            num(r["speed_vs_torch"], ".2f") + "x", num(r["sent_mib"]), num(m.get("params")), num(m.get("grads")),
            num(m.get("optimizer")), num(peak), sync,
        )  # fmt: skip
        lines.append(" ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _ZERO_COLUMNS)))
    return "\n".join(lines)


def title(summary: dict[str, Any]) -> str:
    """One line above :func:`format_table`: ranks, threads, model, batch, rounds and the run's seconds."""
    cfg = summary["config"]
    return (
        f"{cfg['world_size']} ranks x {summary['threads_per_rank']} thread(s), {cfg['layers']} x Linear({cfg['width']}) "
        f"({summary['params'] / 1e6:.1f} M params), batch {cfg['batch']}/rank, "
        f"{cfg['rounds']} rounds x {cfg['steps']} steps per variant, medians in ms ({summary['seconds']:.0f} s)"
        + (", gradient_as_bucket_view=True" if cfg["grad_view"] else "")
        + f", {summary.get('allocator', 'default')} allocator"
    )


def async_cases(measured: dict[str, dict[str, float]]) -> list[str]:
    """The cases of :data:`ASYNC_CASES` that every group of ``measured`` (``async_return_us``)
    holds, in display order (idle, cold, busy); older records have no ``cold``."""
    return [c for c in ASYNC_CASES[::-1] if all(f"{c}_us" in v for v in measured.values())]


def format_async_return(summary: dict[str, Any]) -> str:
    """One line: each group's median µs to return from an async 4 KiB all-reduce, per case."""
    measured = summary["async_return_us"]
    cases = async_cases(measured)
    return (f"async return (µs to return from an async 4 KiB all_reduce, median; {' / '.join(cases)}): "
            + "; ".join(f"{name} " + " / ".join(f"{v[f'{c}_us']:.0f}" for c in cases) for name, v in measured.items()))


def format_passes(summary: dict[str, Any]) -> str | None:
    """One line: the passes over the gradients (every rank at once) and what they cost a step of
    each row (:func:`step_passes_ms`); None for records without them."""
    passes, per_step = summary.get("passes_ms"), summary.get("step_passes_ms")
    if passes is None:
        return None
    mib = summary["params"] * 4 / 2**20
    line = (f"passes (ms per pass over the {mib:.1f} MiB of gradients, every rank at once): "
            + ", ".join(f"{k} {passes[f'{k}_ms']:.1f}" for k in GRADIENT_PASSES))
    if per_step:
        line += "; a step's reduction passes (shared memory, no comm hook): " + ", ".join(f"{name} {ms:.1f}" for name, ms in per_step.items())
    return line


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table, one row per variant."""

    def num(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None or x != x else format(x, fmt)

    lines = [" ".join(f"{title:{align}{width}}" for title, width, align in _COLUMNS)]
    lines.append(" ".join("-" * width for _, width, _ in _COLUMNS))
    for r in summary["rows"]:
        launched = "-" if r["launched_during_backward"] is None else f"{r['launched_during_backward']}/{r['buckets']}"
        buckets = "-" if r["buckets"] is None else str(r["buckets"])
        sync = "-" if r["kind"] == "local" else ("ok" if r["in_sync"] else "DIFF")
        cells = (
            r["name"], buckets, num(r["comm_mib"], ".2f"), num(r["step_ms"]), num(r["step_min_ms"]), num(r["forward_ms"]),
            num(r["backward_ms"]), num(r["optim_ms"]), num(r["wait_ms"]), launched,
            "-" if r["kind"] == "local" else f"{r['backward_over_local_ms']:+.1f}",
            num(r["speed_vs_torch"], ".2f") + "x", num(r["comm_ms"]),
            "-" if r["comm_vs_torch"] is None else f"{r['comm_vs_torch']:.2f}x", sync,
        )  # fmt: skip
        lines.append(" ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS)))
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: str) -> None:
    """Horizontal stacked bars per variant: forward, backward (ours: minus the exposed wait), wait, optim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    names = [r["name"] for r in rows]
    wait = [r["wait_ms"] or 0.0 for r in rows]
    parts = {
        "forward": [r["forward_ms"] for r in rows],
        "backward (ours: minus the exposed wait)": [r["backward_ms"] - w for r, w in zip(rows, wait)],
        "exposed comm wait": wait,
        "optimizer": [r["optim_ms"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 2.2))
    left = [0.0] * len(rows)
    for label, values in parts.items():
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    for y, r in enumerate(rows):
        ax.text(left[y], y, f"  {r['step_ms']:.0f} ms", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (medians)")
    cfg = summary["config"]
    ax.set_title(f"{cfg['world_size']} ranks, {cfg['layers']} x {cfg['width']} MLP ({summary['params'] / 1e6:.1f} M params), batch {cfg['batch']}")
    ax.set_xlim(0, max(left) * 1.18)
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_mb_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of MiB values (or inf), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative MiB values, got {text!r}")
    return values


def _parse_hooks(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [n for n in names if n not in COMM_HOOKS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(COMM_HOOKS)}, got {text!r}")
    return names


def _parse_stacks(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if names == ("none",):
        return ()
    bad = [n for n in names if n not in TORCH_STACKS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(TORCH_STACKS)}, or none; got {text!r}")
    return names


def _parse_stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ZeRO stages 1, 2, 3, got {text!r}") from None
    if not stages or any(s not in (1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"expected a comma list of ZeRO stages 1, 2, 3 (stage 0 is our DDP's row), got {text!r}")
    return stages


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="ringddp-ddp-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--width", type=int, default=2048, help="features of every Linear layer (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4: 16.8 M parameters)")
    p.add_argument("--batch", type=int, default=64, help="rows per rank per step (default 64)")
    p.add_argument("--bucket-mb", type=_parse_mb_list, default=(25.0,), help="comma list of our bucket caps in MiB, 'inf' = one bucket (default 25)")
    p.add_argument("--comm-hook", type=_parse_hooks, default=("none",), help=f"comma list of comm hooks to compare, from {', '.join(COMM_HOOKS)} (default none)")
    p.add_argument("--torch-stacks", type=_parse_stacks, default=TORCH_STACKS,
                   help="torch rows besides torch DDP on gloo: comma list of ddp-ringddp (torch DDP on backend "
                        "'ringddp'), ddp-ringddp-adopt (the same with adoption opted in), fsdp2 (FSDP2 on gloo "
                        "and on ringddp), or none (default all)")
    p.add_argument("--first-bucket-mb", type=float, default=None, help="cap of our first bucket (default: the bucket cap; torch uses 1)")
    p.add_argument("--zero", type=_parse_stages, default=(), help="comma list of ZeRO stages (1, 2, 3) to add, ours and torch's")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="optimizer of every variant (default sgd)")
    p.add_argument("--grad-view", action="store_true",
                   help="torch's DDP rows with gradient_as_bucket_view=True too (ours has it by default): no copy out of the buckets")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--steps", type=int, default=3, help="steps of each variant per round (default 3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", default="auto", type=backend_argument, help=f"backend of our collectives (default auto: shm on one host): {describe_backends()}")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpu_count // world size)")
    p.add_argument("--allocator", choices=("steady", "default"), default="steady",
                   help="steady (default): every rank's C allocator keeps the memory it frees, so no row pays page faults for "
                        "memory an earlier step gave back; default: glibc as it comes (see the module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any communication may block")
    p.add_argument("--json", metavar="OUT.json", help="write the summary to this JSON file")
    p.add_argument("--plot", metavar="OUT.png", help="write a stacked bar chart of the phases")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress messages")
    a = p.parse_args(argv)
    if min(a.world_size, a.width, a.layers, a.batch, a.rounds, a.steps) < 1 or a.warmup < 0:
        p.error("--world-size, --width, --layers, --batch, --rounds and --steps must be >= 1, --warmup >= 0")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    if device_type_of(a.backend) != "cpu":
        p.error(f"--backend {a.backend}: this benchmark runs on CPU tensors")
    cfg = Config(
        world_size=a.world_size, width=a.width, layers=a.layers, batch=a.batch, bucket_mb=a.bucket_mb, comm_hooks=a.comm_hook,
        torch_stacks=a.torch_stacks, first_bucket_mb=a.first_bucket_mb, grad_view=a.grad_view, zero=a.zero, optimizer=a.optimizer, warmup=a.warmup,
        rounds=a.rounds, steps=a.steps, lr=a.lr,
        backend=a.backend, threads=a.threads, seed=a.seed, timeout=a.timeout, allocator=a.allocator,
    )  # fmt: skip
    return cfg, a


def run(cfg: Config, log_level: int = logging.INFO) -> dict[str, Any]:
    """Launch ``cfg.world_size`` local ranks, benchmark, and return the summary."""
    started = time.perf_counter()
    per_rank = collectives.launch(bench_rank, cfg.world_size, cfg, backend=cfg.backend, timeout=cfg.timeout, log_level=log_level)
    summary = summarize(per_rank, cfg)
    summary["seconds"] = time.perf_counter() - started
    return summary


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    level = logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s")
    summary = run(cfg, log_level=level)
    print(title(summary))
    print(format_table(summary))
    print(format_async_return(summary))
    if (passes := format_passes(summary)) is not None:
        print(passes)
    if cfg.zero:
        print(f"\nper rank and step: bytes sent and memory held (MiB, tensor accounting), {cfg.optimizer} optimizer")
        print(format_zero_table(summary))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        log.info("wrote %s", args.json)
    if args.plot:
        plot(summary, args.plot)
        log.info("wrote %s", args.plot)
    out_of_sync = [r["name"] for r in summary["rows"] if r["kind"] != "local" and not r["in_sync"]]
    if out_of_sync:
        log.error("parameters differ between ranks after the run: %s", ", ".join(out_of_sync))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
