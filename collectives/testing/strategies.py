"""Hypothesis strategies for property-testing collectives.

A :class:`Case` describes one call: which collective, on what dtype/shape/memory layout, with
which reduce op, root and algorithm, plus a seed. :func:`make_input` turns a case into the exact
tensor a given rank passes. Values are chosen so that results are *exact* in every dtype
(small integers for sums, powers of two for products), so implementations that reduce in
different orders can still be compared with ``torch.equal`` instead of a tolerance.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from ..engine import ALL_REDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS
from ..ops import SUPPORTED_DTYPES, ReduceOp

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "gather",
    "all_to_all",
    "all_to_all_single",
)
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
DTYPES = SUPPORTED_DTYPES
#: how a tensor is laid out in memory: plain, a transposed view, every other element of a
#: larger buffer, or a slice starting inside a larger buffer.
LAYOUTS = ("contiguous", "transposed", "strided", "offset")


@dataclasses.dataclass(frozen=True)
class Case:
    collective: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: ReduceOp = ReduceOp.SUM
    layout: str = "contiguous"
    root: int = 0
    seed: int = 0
    algorithm: str = "auto"


def world_sizes(min_size: int = 1, max_size: int = 5) -> st.SearchStrategy[int]:
    return st.integers(min_size, max_size)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


def reduce_ops(dtype: torch.dtype) -> st.SearchStrategy[ReduceOp]:
    """Every op defined for ``dtype`` (AVG only for floating types)."""
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    if dtype.is_floating_point:
        ops.append(ReduceOp.AVG)
    return st.sampled_from(ops)


def shapes(max_numel: int = 300) -> st.SearchStrategy[tuple[int, ...]]:
    """0-d, empty, tiny, odd and multi-dimensional shapes; long 1-D ones when ``max_numel`` allows."""
    small = st.lists(st.integers(0, 12), min_size=0, max_size=3).filter(
        lambda s: _numel(s) <= max_numel
    ).map(tuple) | st.sampled_from([(), (0,), (1,), (2, 0), (1000,), (17, 33)])
    if max_numel <= 2000:
        return small
    return small | st.integers(2000, max_numel).map(lambda n: (n,))


def cases(
    world_size: int,
    collectives: tuple[str, ...] = COLLECTIVES,
    max_numel: int = 300,
) -> st.SearchStrategy[Case]:
    """Cases for a group of ``world_size`` ranks (roots in range)."""

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        name = draw(st.sampled_from(collectives))
        dtype = draw(dtypes())
        shape = draw(shapes(max_numel))
        if name == "all_to_all_single" and not shape:
            shape = (0,)
        if name == "all_to_all_single":  # dim 0 is split among the ranks
            shape = (shape[0] - shape[0] % world_size,) + shape[1:]
        op = draw(reduce_ops(dtype)) if name in REDUCING else ReduceOp.SUM
        algorithm = "auto"
        if name == "all_reduce":
            algorithm = draw(st.sampled_from(ALL_REDUCE_ALGORITHMS))
        elif name == "broadcast":
            algorithm = draw(st.sampled_from(BROADCAST_ALGORITHMS))
        elif name == "reduce":
            algorithm = draw(st.sampled_from(REDUCE_ALGORITHMS))
        return Case(
            collective=name,
            dtype=dtype,
            shape=shape,
            op=op,
            layout=draw(st.sampled_from(LAYOUTS)),
            root=draw(st.integers(0, world_size - 1)),
            seed=draw(st.integers(0, 2**31 - 1)),
            algorithm=algorithm,
        )

    return build()


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def values(case: Case, rank: int, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Deterministic contiguous values for ``rank`` whose reductions are exact in ``case.dtype``."""
    g = torch.Generator().manual_seed((case.seed * 1_000_003 + rank * 7919 + salt) % 2**63)
    n = _numel(shape)
    if case.dtype == torch.bool:
        flat = torch.randint(0, 2, (n,), generator=g).bool()
    elif case.op is ReduceOp.PRODUCT:
        pick = torch.randint(0, 4, (n,), generator=g)
        table = torch.tensor([1.0, -1.0, 2.0, 0.5] if case.dtype.is_floating_point else [1, -1, 2, 3])
        flat = table[pick].to(case.dtype) if case.dtype != torch.uint8 else table[pick].abs().to(case.dtype)
    else:
        low = 0 if case.dtype == torch.uint8 else -8
        flat = torch.randint(low, 9, (n,), generator=g).to(case.dtype)
    return flat.reshape(shape)


def layout(t: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Place ``t``'s values in a view of the given layout; returns ``(view, base)``.

    ``base`` is the whole allocation (pre-filled around the view with a sentinel) so a test can
    check that nothing outside the view was written.
    """
    sentinel = torch.ones((), dtype=t.dtype) if t.dtype == torch.bool else torch.full((), SENTINEL, dtype=t.dtype)
    if kind == "contiguous" or t.dim() == 0:
        base = t.clone()
        return base, base
    if kind == "transposed" and t.dim() >= 2:
        base = t.transpose(0, -1).contiguous()
        return base.transpose(0, -1), base
    if kind == "offset":
        base = sentinel.expand(t.numel() + 3).clone()
        view = base[1 : 1 + t.numel()].view(t.shape)
        view.copy_(t)
        return view, base
    # strided (also the fallback for 1-d "transposed"): every other element of a larger buffer
    base = sentinel.expand(*t.shape[:-1], t.shape[-1] * 2).clone()
    view = base[..., ::2]
    view.copy_(t)
    return view, base


SENTINEL = 77


def untouched_outside(view: torch.Tensor, base: torch.Tensor) -> bool:
    """True if every element of contiguous ``base`` not covered by ``view`` still holds the sentinel."""
    if view.data_ptr() == base.data_ptr() and view.shape == base.shape:
        return True
    index = torch.arange(base.numel()).view(base.shape)
    offset = view.storage_offset() - base.storage_offset()
    covered = torch.zeros(base.numel(), dtype=torch.bool)
    covered[index.as_strided(view.shape, view.stride(), offset).reshape(-1)] = True
    outside = base.reshape(-1)[~covered]
    expected = True if base.dtype == torch.bool else SENTINEL
    return bool((outside == expected).all())


def make_input(case: Case, rank: int, shape: tuple[int, ...] | None = None, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor ``rank`` passes for ``case`` (in ``case.layout``) and its backing allocation."""
    return layout(values(case, rank, case.shape if shape is None else shape, salt), case.layout)
