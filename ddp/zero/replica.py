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

from typing import Any, Sequence

import torch
import torch.nn as nn

from .model import ZeroDataParallel
from .optimizer import ZeroRedundancyOptimizer
from .flat import FlatLayout, Piece
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
        chunks = []
        for unit in units:
            lo, hi = unit.layout.chunk_range(rank)
            chunks.append(unit.full[lo:hi].detach().clone().to(unit.master_dtype))
        slot_of = {id(p): (b, k) for b in model.reducer.buckets for k, p in enumerate(b.params)}
        tensors, groups, self._slots = [], [], []
        order = shard_pieces(model, optimizer, rank)
        for g, (outer, inner) in enumerate(zip(optimizer.param_groups, optimizer.optim.param_groups)):
            mine = []
            for _, u, piece in (entry for entry in order if entry[0] == g):
                mine.append(nn.Parameter(chunks[u][piece.offset : piece.offset + piece.numel]))
                self._slots.append(slot_of[id(units[u].params[piece.param])])
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


def shard_pieces(model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer, rank: int, world_size: int | None = None
                 ) -> list[tuple[int, int, Piece]]:
    """``(param group, unit, piece)`` of each tensor of rank ``rank``'s shard when the trainable
    units are split over ``world_size`` ranks (default: the model's split), in the local
    optimizer's order: the order of :meth:`Shard.state`'s ``optimizer`` list. A parameter falls
    into a rank's contiguous chunk at most once, so this is the param groups' order."""
    where = {}
    for u, unit in enumerate(_trainable_units(model)):
        layout = unit.layout if world_size in (None, unit.layout.world_size) else FlatLayout(unit.layout.numels, world_size)
        for piece in layout.pieces(rank):
            where[id(unit.params[piece.param])] = (u, piece)
    return [(g, *where[id(p)]) for g, outer in enumerate(optimizer.param_groups) for p in outer["params"] if id(p) in where]


@torch.no_grad()
def reshard(model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer, states: Sequence[dict[str, Any]],
            ranks: Sequence[int], world_size: int | None = None) -> list[dict[str, Any]]:
    """The shards of ``ranks`` under a split over ``world_size`` ranks (default: the model's), cut
    from ``states``, every shard of the same training state under another split (``states[k]``:
    rank ``k``'s :meth:`Shard.state` when the units were split over ``len(states)`` ranks). What
    a world that shrank loads (``ddp/elastic.py``): values are moved, never computed, so the bits
    are the old shards'.

    Every rank of the new split rebuilds the whole state here (the masters and the optimizer
    state of every parameter), so for a moment it holds what ZeRO otherwise spreads over all."""
    old, units = len(states), _trainable_units(model)
    flats = [torch.cat([s["chunks"][u] for s in states])[: unit.layout.numel] for u, unit in enumerate(units)]
    full: dict[tuple[int, int], dict[str, Any]] = {}  # (unit, parameter): its state, whole
    filled: dict[tuple[int, int, str], int] = {}
    for k, state in enumerate(states):
        for (_, u, piece), saved in zip(shard_pieces(model, optimizer, k, old), state["optimizer"], strict=True):
            target = full.setdefault((u, piece.param), {})
            for key, v in saved.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    whole = target.setdefault(key, v.new_empty(units[u].layout.numels[piece.param]))
                    whole[piece.start : piece.stop] = v.reshape(-1)
                    filled[u, piece.param, key] = filled.get((u, piece.param, key), 0) + piece.numel
                else:
                    target.setdefault(key, v)
    torn = [key for key, n in filled.items() if n != units[key[0]].layout.numels[key[1]]]
    if torn:  # a state some pieces of a parameter have and others not: refuse to invent the rest
        raise ValueError(f"ddp.zero.replica.reshard: the shards' optimizer state covers parameters only in part: {torn}")
    out = []
    for rank in ranks:
        chunks = []
        for unit, flat in zip(units, flats):
            lo, hi = (unit.layout if world_size is None else FlatLayout(unit.layout.numels, world_size)).chunk_range(rank)
            chunk = flat.new_zeros(hi - lo)  # the padding stays zero
            chunk[: max(0, min(hi, flat.numel()) - lo)] = flat[lo:hi]
            chunks.append(chunk)
        entries = []
        for _, u, piece in shard_pieces(model, optimizer, rank, world_size):
            saved = full.get((u, piece.param), {})
            entries.append({key: (v[piece.start : piece.stop].clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                                  else v.clone() if isinstance(v, torch.Tensor) else v) for key, v in saved.items()})
        out.append({"chunks": chunks, "optimizer": entries})
    return out


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


__all__ = ["Shard", "ShardReplica", "piece_gradients", "reshard", "shard_pieces"]
