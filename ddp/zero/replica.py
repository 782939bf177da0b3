"""Optimizer shards that survive a rank's death: rank ``r`` keeps a replica of rank ``r+1``'s shard.

At stages 1 and 2 rank ``r`` alone holds the optimizer state of its chunk of every bucket
(``flat.py``): lose the rank and that state is gone, and it cannot be recomputed (momentum is a
sum over every step so far). A :class:`ShardReplica` is a second copy of one other rank's shard,
kept current step by step:

* **What it holds**: that rank's master chunk of every trainable unit (the parameter values of
  its pieces) and a local optimizer of the same class and hyperparameters over the same pieces,
  in the same order (:class:`Shard`: the owner's copy has the same shape).
* **How it stays current**: the owner sends the averaged gradient of its pieces
  (:func:`piece_gradients`, what its local optimizer steps with; ``chunk`` elements per bucket)
  and the replica steps its pieces with it (:meth:`ShardReplica.step`). The update is
  element-wise and runs on tensors of the same lengths with the same arithmetic, so replica and
  owner hold the same bits after every step (``ddp/elastic.py`` checks this at the end of a run).
  Parameters are never sent: the replica's chunk is stepped too, and equals the owner's.
* **Cost per step** (``n`` ranks, ``Ψ`` parameter bytes): one message of ``Ψ/n`` bytes per rank
  (the gradient chunk to the replica holder), on top of the step's ``2(n-1)/n · Ψ``; so
  ``1/(2(n-1))`` more bytes (+50 % at 2 ranks, +25 % at 3), and one more element-wise optimizer
  step over ``1/n`` of the parameters. Memory: a second shard (parameters and optimizer state of
  ``1/n``). Note that our ZeRO-1 reduce-scatters too (the full buffer holds the rank's own,
  unreduced gradient), so it needs the message as much as ZeRO-2.

:class:`Shard` reads and writes a shard's state (chunks and per-piece optimizer state, by value):
what a replica hands a replacement, and the undo copy of a step in flight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .model import ZeroDataParallel
from .optimizer import ZeroRedundancyOptimizer
from .units import FlatParams


def _trainable_units(model: ZeroDataParallel) -> list[FlatParams]:
    if model.stage not in (1, 2):
        raise ValueError(f"ddp.zero.replica: shards are replicated at stages 1 and 2, not {model.stage}")
    return [unit for unit in model.units if unit.trainable]


class Shard:
    """One rank's shard as tensors: ``chunks`` (the master chunk of every trainable unit),
    ``tensors`` (the pieces the local optimizer ``optim`` steps, views of the chunks)."""

    def __init__(self, chunks: list[torch.Tensor], tensors: list[torch.Tensor], optim: torch.optim.Optimizer):
        self.chunks, self.tensors, self.optim = chunks, tensors, optim

    @classmethod
    def own(cls, model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer) -> Shard:
        """This rank's own shard (views of the model's master chunks and the optimizer's state)."""
        return cls([unit.master for unit in _trainable_units(model)], [t for _, _, t in optimizer.pieces], optimizer.optim)

    @torch.no_grad()
    def state(self, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """A copy, by value: ``{"chunks": [...], "optimizer": [state of each piece]}``. ``into``: an
        earlier copy of this shard, overwritten in place where its tensors fit (a copy every step
        then allocates nothing: no fresh pages to fault in)."""
        if into is None:
            into = {"chunks": [c.detach().clone() for c in self.chunks], "optimizer": [{} for _ in self.tensors]}
        else:
            for c, saved in zip(self.chunks, into["chunks"]):
                saved.copy_(c)
        for t, saved in zip(self.tensors, into["optimizer"]):
            current = self.optim.state.get(t, {})
            for k in [k for k in saved if k not in current]:
                del saved[k]
            for k, v in current.items():
                old = saved.get(k)
                if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                    old.copy_(v)
                else:
                    saved[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        return into

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        """Make this shard ``state`` (:meth:`state` of a shard of the same rank and layout), bit for bit."""
        if [c.numel() for c in state["chunks"]] != [c.numel() for c in self.chunks] or len(state["optimizer"]) != len(self.tensors):
            raise ValueError("Shard.load: the state has another layout (other chunks or pieces)")
        for c, saved in zip(self.chunks, state["chunks"]):
            c.copy_(saved)
        for t, saved in zip(self.tensors, state["optimizer"]):
            self.optim.state.pop(t, None)
            if saved:
                self.optim.state[t] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}


class ShardReplica(Shard):
    """A copy of rank ``rank``'s shard, stepped with the gradients that rank sends (module docstring).

    Built from the full parameters (resident at stages 1 and 2: every rank holds them between
    steps) and an empty optimizer state: build it when every rank's optimizer state is empty too,
    or :meth:`~Shard.load` the owner's state into it.
    """

    def __init__(self, model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer, rank: int):
        units = _trainable_units(model)
        self.rank = rank
        chunks, where = [], {}
        for u, unit in enumerate(units):
            lo, hi = unit.layout.chunk_range(rank)
            chunks.append(unit.full[lo:hi].detach().clone().to(unit.master_dtype))
            for piece in unit.layout.pieces(rank):
                where[id(unit.params[piece.param])] = (u, piece)
        slot_of = {id(p): (b, k) for b in model.reducer.buckets for k, p in enumerate(b.params)}
        tensors, groups, self._slots = [], [], []
        for outer, inner in zip(optimizer.param_groups, optimizer.optim.param_groups):  # the owner's order
            mine = []
            for p in outer["params"]:
                if id(p) in where:
                    u, piece = where[id(p)]
                    mine.append(nn.Parameter(chunks[u][piece.offset : piece.offset + piece.numel]))
                    self._slots.append(slot_of[id(p)])
            tensors += mine
            groups.append({**{k: v for k, v in inner.items() if k != "params"}, "params": mine})
        self._outer = optimizer.param_groups
        # every hyperparameter travels in the groups (the constructor's own defaults may name
        # keys it does not take as arguments, as AdamW's decoupled_weight_decay)
        super().__init__(chunks, tensors, type(optimizer.optim)(groups))

    @torch.no_grad()
    def step(self, grads: torch.Tensor) -> None:
        """Step the pieces with the owner's :func:`piece_gradients` (a piece whose parameter has no
        gradient this step is skipped, as on the owner: that is the same on every rank)."""
        for outer, inner in zip(self._outer, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        offset = 0
        for t, (bucket, k) in zip(self.tensors, self._slots):
            has = bucket.grad is not None and bucket.has_grad[k]
            t.grad = grads[offset : offset + t.numel()] if has else None
            offset += t.numel()
        self.optim.step()
        for t in self.tensors:
            t.grad = None

    def numel(self) -> int:
        """Elements of the gradient message (:func:`piece_gradients` of the owner)."""
        return sum(t.numel() for t in self.tensors)


def piece_gradients(optimizer: ZeroRedundancyOptimizer, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's averaged gradient of each piece it owns, laid end to end in the local
    optimizer's order (zeros for a piece without one), in ``out`` if given: what the replica of
    this rank's shard steps with (:meth:`ShardReplica.step`)."""
    parts = []
    for _, piece, t in optimizer.pieces:
        g = None if piece is None else piece.grad()
        parts.append(t.new_zeros(t.numel()) if g is None else g.reshape(-1))
    if not parts:
        return torch.empty(0) if out is None else out
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


__all__ = ["Shard", "ShardReplica", "piece_gradients"]
