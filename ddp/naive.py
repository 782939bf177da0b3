"""The naive data parallelism of the lecture notes, and the state broadcast every form needs.

Data parallelism keeps one full replica of the model per rank and gives each rank a different
slice of the batch. It stays correct as long as every rank takes *the same* optimizer step, which
needs two things:

1. the replicas start equal — :func:`~ddp.sync.broadcast_module` copies rank 0's parameters and
   buffers to every rank (ranks seeded differently then agree);
2. the replicas see the same gradient — after ``loss.backward()`` every rank holds the gradient of
   *its own* slice; :func:`all_reduce_gradients` replaces it by the average over ranks. With a
   per-rank mean loss over equal slices, that average is exactly the gradient of the mean loss
   over the whole (concatenated) batch, because the gradient is linear in the loss.

Then ``optimizer.step()`` runs the same update on the same numbers everywhere, and the replicas
stay equal with no further communication. Only *parameter gradients* are communicated: the
gradients of activations are intermediate values of each rank's own backward pass.

The naive form does one blocking all-reduce per parameter after the backward pass: every
parameter pays the message latency ``α`` and none of the communication overlaps the backward
computation. :class:`ddp.DistributedDataParallel` fixes both (buckets, overlap).

::

    ddp.broadcast_module(model)               # once, after building the model
    for x, y in loader:                       # each rank its own slice
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        ddp.all_reduce_gradients(model)       # grad = mean over ranks
        optimizer.step()
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp
from collectives.group import member

from .sync import unique

__all__ = ["all_reduce_gradients"]


def all_reduce_gradients(
    model: nn.Module | Iterable[torch.Tensor], group: Group | None = None, *, op: ReduceOp = ReduceOp.AVG
) -> None:
    """Average every parameter's ``.grad`` over the ranks of ``group``: one blocking all-reduce each.

    The study form, as in the lecture notes: call it after ``loss.backward()`` and before
    ``optimizer.step()``. The average is exact: a SUM all-reduce followed by one division by the
    world size (``op=ReduceOp.SUM`` skips the division).

    Every rank must reduce the same list, in the same order, or the point-to-point messages pair
    up wrongly. So a trainable parameter whose ``.grad`` is ``None`` on this rank (not used in
    this forward pass) is given a zero gradient and reduced anyway: a rank cannot know whether
    the others used it. Shared (tied) parameters are reduced once. On a rank outside ``group``
    (a :class:`~collectives.NonMember`) it does nothing but warn, as a collective does.
    """
    op = ReduceOp.coerce(op)
    if member(group, "all_reduce_gradients") is None:  # not a member: nothing, like a collective
        return
    world = collectives.get_world_size(group)
    for p in unique(model.parameters() if isinstance(model, nn.Module) else model):
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise RuntimeError("all_reduce_gradients: sparse gradients are not supported")
        # SUM then divide, spelled out as in the notes (ReduceOp.AVG would do the same division).
        collectives.all_reduce(p.grad, ReduceOp.SUM if op is ReduceOp.AVG else op, group=group)
        if op is ReduceOp.AVG:
            p.grad.div_(world)
