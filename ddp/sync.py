"""State sync: make every rank's tensors equal to those of one rank (parameters, buffers).

Data parallelism is correct only while every replica holds the same numbers. Both DDP forms start
from here: :func:`broadcast_module` once after building the model, and
:class:`~ddp.DistributedDataParallel` at construction and (``broadcast_buffers``) before every
forward, through :func:`broadcast_tensors`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.nn as nn

import collectives
from collectives import Group
from collectives.group import member


def unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats (tied parameters are one object), first occurrence kept."""
    first: dict[int, torch.Tensor] = {}
    for t in tensors:
        first.setdefault(id(t), t)
    return list(first.values())


def _first_rank(group: Group | None) -> int:
    """Global rank of the first member of ``group`` (the default group's rank 0)."""
    return collectives.get_group(group).ranks[0]


@torch.no_grad()
def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int | None = None, group: Group | None = None) -> None:
    """Broadcast many tensors from global rank ``src`` (default: the group's first rank), in place.

    Tensors are packed into one flat buffer per (dtype, device), so the whole state costs one
    broadcast per dtype instead of one per tensor (one latency ``α`` instead of hundreds).
    Every rank must pass tensors of the same shapes, dtypes and order. On a rank outside ``group``
    (a :class:`~collectives.NonMember`) it does nothing but warn, as a collective does.
    """
    if member(group, "broadcast_tensors") is None:
        return
    src = _first_rank(group) if src is None else src
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in unique(tensors):
        by_kind[(t.dtype, t.device)].append(t)
    for ts in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].detach().reshape(-1).clone()
        collectives.broadcast(flat, src, group=group)
        offset = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def broadcast_module(
    module: nn.Module, src: int | None = None, group: Group | None = None, *, buffers: bool = True
) -> None:
    """Make every rank's ``module`` equal to that of global rank ``src``: parameters and buffers.

    Frozen parameters are included (they must agree too); buffers such as BatchNorm's running
    statistics are included unless ``buffers=False``.
    """
    state = list(module.parameters())
    if buffers:
        state += list(module.buffers())
    broadcast_tensors(state, src, group)
