"""Flat units: parameters laid end to end in one buffer, split into equal per-rank chunks.

Every ZeRO stage shards the same way. A *unit* (a DDP bucket at stages 1 and 2, a wrapped module
at stage 3) lays its parameters end to end, flattened, in a fixed order; the flat length is padded
with zeros up to ``n · chunk`` with ``chunk = ceil(numel / n)``, and rank ``r`` owns elements
``[r · chunk, (r + 1) · chunk)``::

    unit of 3 parameters (5 + 4 + 2 = 11 elements), 3 ranks, chunk 4, 1 element of padding

    flat:   a a a a a b b b b c c .
    rank:   0 0 0 0 1 1 1 1 2 2 2 2
    pieces: rank 0 (a, 0:4) | rank 1 (a, 4:5) (b, 0:3) | rank 2 (b, 3:4) (c, 0:2)

Equal chunks are what ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need, and they
balance memory to within one element per unit, whatever the parameter sizes: one 4 M-element
matrix and a few biases split as evenly as many small tensors. The padding (at most ``n - 1``
elements per unit) is never visible: no parameter view covers it and it stays zero.

A rank's chunk cuts parameters into *pieces* (:class:`Piece`: which elements of which parameter
sit where in the chunk). The sharded optimizer steps one tensor per piece, so per-parameter
semantics survive the cut: a parameter without a gradient is skipped, its param group's
hyperparameters apply. This is exact for every optimizer whose update is element-wise (SGD, Adam,
...); one that looks at a whole matrix (LBFGS, Adafactor's factored moments, Muon) cannot be
sharded this way (``optimizer.py`` refuses it).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), at ``offset`` in a rank's chunk."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Where each parameter of a unit sits in the flat buffer, and each rank's chunk.

    Pure arithmetic on shapes: no tensors are allocated here.

    Args:
        numels: elements of each parameter, in flat order.
        world_size: number of ranks the unit is split over.
    """

    def __init__(self, numels: Sequence[int], world_size: int):
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        self.numels = [int(n) for n in numels]
        self.world_size = world_size
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.chunk = -(-total // world_size)
        self.padded = self.chunk * world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s chunk in the flat buffer (padding included)."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of parameters that fall into rank ``rank``'s chunk, in flat order."""
        lo, hi = self.chunk_range(rank)
        out = []
        for k, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(Piece(k, a - off, b - off, a - lo))
        return out

    def gaps(self, covered: Sequence[int]) -> list[tuple[int, int]]:
        """Ranges of the flat buffer outside the parameters ``covered`` (indices): the padding, and
        the slots of the others. A gradient buffer zeroes them once instead of the whole buffer."""
        spans = sorted((self.offsets[k], self.offsets[k] + self.numels[k]) for k in covered)
        out, pos = [], 0
        for a, b in spans:
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < self.padded:
            out.append((pos, self.padded))
        return out

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped like it."""
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, shapes)]


__all__ = ["FlatLayout", "Piece"]
