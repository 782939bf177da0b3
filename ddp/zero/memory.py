"""Memory per rank by tensor accounting: parameters, gradients, optimizer state.

The point of the ZeRO ladder is memory, so it is measured, not estimated: :func:`memory_report`
walks the tensors a data-parallel model and its optimizer hold and adds up their bytes, merging
overlapping ranges (a parameter that is a view into a flat buffer, a gradient that is a view into
a bucket, count once). It works for our :class:`~ddp.DistributedDataParallel` and
:class:`~ddp.ZeroDataParallel`, for torch's DDP, ``ZeroRedundancyOptimizer`` and FSDP2 (DTensor
shards count their local part), and for a bare module.

*Held* bytes are what exists when it is called (between steps). The sharded stages also allocate
memory only *during* a step: gathered units (ZeRO-3), bucket buffers and autograd's fresh
gradients (ZeRO-2, 3). Those pass through a :class:`PeakTracker` as they are allocated and freed;
the ``*_peak`` fields add the largest such transient to the held bytes (an upper bound on the real
peak: the held part is counted in full even at moments it did not all exist yet). Activations and
the collectives' staging buffers are not counted: they do not depend on the stage.

RSS would mix all of this with the allocator's caching, the shared-memory segments of the
transport and the interpreter; tensor accounting says where the bytes are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..distributed import DistributedDataParallel

MiB = 1024 * 1024


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes covered by ``tensors``, each byte once (views and aliases of one buffer overlap)."""
    spans = []
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this rank's part
            t = t.to_local()
        n = t.numel() * t.element_size()
        if n:
            spans.append((t.data_ptr(), t.data_ptr() + n))
    total, end = 0, -1
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class PeakTracker:
    """Running bytes of the transient allocations of one kind (``"params"``, ``"grads"``), and their peak."""

    def __init__(self) -> None:
        self.current = {"params": 0, "grads": 0}
        self.peak = {"params": 0, "grads": 0}

    def add(self, kind: str, delta: int) -> None:
        now = self.current[kind] + delta
        self.current[kind] = now
        if now > self.peak[kind]:
            self.peak[kind] = now

    def reset_peak(self) -> None:
        self.peak = dict(self.current)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank (see the module docstring).

    Attributes:
        params: parameter storage: replicas, flat buffers, master chunks, gathered units.
        grads: gradient storage: ``.grad``, DDP buckets, averaged chunks (ZeRO).
        optimizer: optimizer state (momentum, Adam's moments, step counters).
        params_peak, grads_peak: the held bytes plus the largest transient allocation of the
            steps so far (ZeRO); elsewhere equal to the held bytes (what torch's wrappers allocate
            inside a step is not seen).
    """

    params: int
    grads: int
    optimizer: int
    params_peak: int | None = None
    grads_peak: int | None = None

    def as_mib(self) -> dict[str, float | None]:
        return {k: None if v is None else v / MiB for k, v in dataclasses.asdict(self).items()}

    def describe(self) -> str:
        def part(held: int, peak: int | None) -> str:
            shown = f"{held / MiB:.2f}"
            return shown if peak is None or peak == held else f"{shown} (peak {peak / MiB:.2f})"

        return (
            f"parameters {part(self.params, self.params_peak)} MiB, gradients {part(self.grads, self.grads_peak)} MiB, "
            f"optimizer state {self.optimizer / MiB:.2f} MiB"
        )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (of the local optimizer inside a ZeRO wrapper)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optim", None)  # torch's ZeroRedundancyOptimizer and ours
    state = (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state
    return [v for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes this rank holds for ``model``'s parameters and gradients and ``optimizer``'s state.

    ``model`` may be a bare module or any data-parallel wrapper; ours report their buckets, master
    chunks and averaged gradient chunks, and (ZeRO) the peaks of what only exists during a step.
    """
    params: list[Any] = [p.data for p in model.parameters()]
    grads: list[Any] = [p.grad for p in model.parameters()]
    peaks = None
    sharded = getattr(model, "memory_tensors", None)  # ddp.ZeroDataParallel (which imports this module)
    if sharded is not None:
        extra_params, extra_grads, peaks = sharded()
        params += extra_params
        grads += extra_grads
    elif isinstance(model, DistributedDataParallel):  # its all-reduce buckets
        grads += [b.buffer for b in model.reducer.buckets]
    held_params, held_grads = tensor_bytes(params), tensor_bytes(grads)
    return MemoryReport(
        params=held_params,
        grads=held_grads,
        optimizer=tensor_bytes(optimizer_state_tensors(optimizer)),
        params_peak=held_params + peaks["params"] if peaks is not None else held_params,
        grads_peak=held_grads + peaks["grads"] if peaks is not None else held_grads,
    )


__all__ = ["MemoryReport", "PeakTracker", "memory_report", "tensor_bytes"]
