"""Hypothesis strategies for property-testing collectives.

A :class:`Case` describes one call: which collective, on how many ranks, with what dtype, shape,
memory layout, reduce op, root, algorithm and (all-to-all only) split sizes, plus a seed.
:func:`cases` draws them, narrowed by filters (collectives, ops, dtypes, world sizes, a size range
in bytes, layouts, roots, even or uneven splits). :func:`values` turns a case into the exact
values a rank passes.

Values are chosen so that every reduction is *exact* whatever the order of the operands (small
integers for sums, min and max; ±1, 2, 3 or 0.5 for products), so an implementation that reduces
in another order than torch's can still be compared bit for bit. They also use each dtype's full
width — integers are scaled by ``2**56 + 1`` (int64) or ``2**24 + 1`` (int32) and floats by
``1 + 2**-45`` (float64) or ``1 + 2**-16`` (float32) — so a reduction or copy that passes through
a narrower dtype changes them. The exactness argument holds up to 15 ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import torch
from hypothesis import strategies as st

from ..ops import SUPPORTED_DTYPES, ReduceOp
from ..tuning import ALL_REDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS

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
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
ROOTED = frozenset({"broadcast", "reduce", "scatter", "gather"})
#: collectives whose pieces may differ in size between pairs of ranks.
SPLITTING = frozenset({"all_to_all", "all_to_all_single"})
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ALL_REDUCE_ALGORITHMS,
    "broadcast": BROADCAST_ALGORITHMS,
    "reduce": REDUCE_ALGORITHMS,
}
#: every supported dtype (hypothesis shrinks towards the first, float32).
DTYPES = SUPPORTED_DTYPES
#: how a tensor is laid out in memory: plain, a transposed view, every other element of a
#: larger buffer, or a slice starting inside a larger buffer.
LAYOUTS = ("contiguous", "transposed", "strided", "offset")
#: byte that fills memory around a view; any write there changes it (also for bool storage).
SENTINEL_BYTE = 0x77
#: byte that fills output buffers before the call; a buffer never written keeps it.
UNWRITTEN_BYTE = 0x55
#: default size limit of one tensor (bytes); raise ``max_bytes`` to reach the ring algorithms.
DEFAULT_MAX_BYTES = 2400

_SCALE = {torch.int64: 2**56 + 1, torch.int32: 2**24 + 1, torch.float64: 1 + 2**-45, torch.float32: 1 + 2**-16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One collective call, the same on every rank.

    ``splits`` (all-to-all only; ``None`` = equal pieces) is a ``world_size x world_size``
    matrix: rank ``r`` sends ``splits[r][j]`` rows (along dim 0, rows of ``shape[1:]``) to rank
    ``j``. ``world_size`` 0 means "the size of the pool the case runs on".
    """

    collective: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: ReduceOp = ReduceOp.SUM
    layout: str = "contiguous"
    root: int = 0
    seed: int = 0
    algorithm: str = "auto"
    world_size: int = 0
    splits: tuple[tuple[int, ...], ...] | None = None

    def describe(self) -> str:
        parts = [self.collective, f"world size {self.world_size}", str(self.dtype).replace("torch.", ""),
                 f"shape {self.shape}", f"layout {self.layout}"]
        if self.collective in REDUCING:
            parts.append(f"op {self.op.name}")
        if self.collective in ROOTED:
            parts.append(f"root {self.root}")
        if self.collective in ALGORITHMS:
            parts.append(f"algorithm {self.algorithm}")
        if self.splits is not None:
            parts.append(f"splits {[list(s) for s in self.splits]}")
        return ", ".join(parts) + f", seed {self.seed}"


def _as_dtype(d: torch.dtype | str) -> torch.dtype:
    dtype = getattr(torch, d.replace("torch.", "")) if isinstance(d, str) else d
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cases: unsupported dtype {d!r}; supported: {[str(x) for x in DTYPES]}")
    return dtype


def _valid_ops(dtype: torch.dtype, ops: Sequence[ReduceOp]) -> list[ReduceOp]:
    return [o for o in ops if o is not ReduceOp.AVG or dtype.is_floating_point]


def shapes(min_numel: int, max_numel: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with ``min_numel <= numel <= max_numel``: 0-d, empty, tiny, odd and multi-dimensional
    ones, and (when the range allows) long 1-D and 2-D ones drawn log-uniformly up to ``max_numel``."""
    small = (
        st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)
        | st.sampled_from([(), (0,), (1,), (2, 0), (1000,), (17, 33)])
    ).filter(lambda s: min_numel <= math.prod(s) <= max_numel)
    if max_numel <= 2000:
        return small

    @st.composite
    def large(draw: st.DrawFn) -> tuple[int, ...]:
        lo = max(min_numel, 2000)
        exponent = draw(st.floats(math.log2(lo), math.log2(max_numel)))
        numel = min(max_numel, max(lo, int(2**exponent)))
        if draw(st.booleans()):
            return (numel,)
        rows = max(1, numel // 33)
        return (rows, 33) if min_numel <= rows * 33 <= max_numel else (numel,)

    return large() if min_numel > 1000 else small | large()


def cases(
    world_size: int | Iterable[int],
    collectives: Iterable[str] = COLLECTIVES,
    *,
    ops: Iterable[ReduceOp | str | object] | None = None,
    dtypes: Iterable[torch.dtype | str] | None = None,
    min_bytes: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    layouts: Iterable[str] = LAYOUTS,
    roots: Iterable[int] | None = None,
    uneven: bool | None = None,
    algorithms: Iterable[str] | None = None,
) -> st.SearchStrategy[Case]:
    """Cases for groups of ``world_size`` ranks (an int, or several to draw from).

    Every filter narrows what is drawn:

    Args:
        collectives: names from :data:`COLLECTIVES`.
        ops: reduce ops for the reducing collectives (``ReduceOp``, torch's, or ``"sum"`` ...);
            default all; AVG is drawn for floating dtypes only.
        dtypes: ``torch.dtype`` or names like ``"float32"``; default every supported dtype.
        min_bytes, max_bytes: size range of the main tensor (one rank's contribution). Sizes
            above ``Tuning.small_bytes`` (4 MiB) make ``auto`` pick the ring algorithms, and above
            ``Tuning.segment_bytes`` the rings pipeline several segments.
        layouts: names from :data:`LAYOUTS`.
        roots: allowed roots of broadcast/reduce/scatter/gather (out-of-range ones are dropped).
        uneven: all-to-all pieces of unequal sizes: ``True`` always, ``False`` never, ``None``
            both. The rows a rank sends are bounded by ``max_bytes``.
        algorithms: allowed algorithms of all_reduce/broadcast/reduce (``"auto"`` is kept when
            none of a collective's own is listed); default all of them.
    """
    sizes = [world_size] if isinstance(world_size, int) else sorted(set(world_size))
    names = list(collectives)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"cases: world sizes must be >= 1, got {sizes}")
    if not names or set(names) - set(COLLECTIVES):
        raise ValueError(f"cases: unknown collectives {sorted(set(names) - set(COLLECTIVES))}; known: {COLLECTIVES}")
    op_list = [ReduceOp.coerce(o) for o in ops] if ops is not None else list(ReduceOp)
    dtype_list = [_as_dtype(d) for d in dtypes] if dtypes is not None else list(DTYPES)
    layout_list = list(layouts)
    if not op_list or not dtype_list or not layout_list or set(layout_list) - set(LAYOUTS):
        raise ValueError(f"cases: need at least one op, dtype and layout (layouts from {LAYOUTS})")
    if any(n in REDUCING for n in names) and not any(_valid_ops(d, op_list) for d in dtype_list):
        raise ValueError(f"cases: no dtype in {dtype_list} supports the ops {op_list} (AVG needs a floating dtype)")
    root_list = None if roots is None else sorted(set(roots))
    if root_list is not None and not any(r < n for r in root_list for n in sizes):
        raise ValueError(f"cases: no root in {root_list} fits world sizes {sizes}")
    if min_bytes > max_bytes:
        raise ValueError(f"cases: min_bytes {min_bytes} > max_bytes {max_bytes}")
    wanted_algorithms = None if algorithms is None else set(algorithms)

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        n = draw(st.sampled_from(sizes))
        name = draw(st.sampled_from(names))
        reducing = name in REDUCING
        dtype = draw(st.sampled_from([d for d in dtype_list if not reducing or _valid_ops(d, op_list)]))
        op = draw(st.sampled_from(_valid_ops(dtype, op_list))) if reducing else ReduceOp.SUM
        esize = torch.empty((), dtype=dtype).element_size()
        lo, hi = -(-min_bytes // esize), max_bytes // esize
        shape = draw(shapes(lo, hi))
        splits = None
        if name in SPLITTING:
            shape = shape or (0,)
            if uneven if uneven is not None else draw(st.booleans()):
                row = math.prod(shape[1:])
                most = max(1, hi // max(1, row) // n)  # rows one rank sends to one peer
                splits = tuple(tuple(draw(st.integers(0, most)) for _ in range(n)) for _ in range(n))
            elif name == "all_to_all_single":  # dim 0 is split equally among the ranks
                shape = (shape[0] - shape[0] % n,) + shape[1:]
        algorithm = "auto"
        if name in ALGORITHMS:
            own = [a for a in ALGORITHMS[name] if wanted_algorithms is None or a in wanted_algorithms]
            algorithm = draw(st.sampled_from(own or ["auto"]))
        fitting = [r for r in root_list if r < n] if root_list is not None else list(range(n))
        return Case(
            collective=name,
            dtype=dtype,
            shape=shape,
            op=op,
            layout=draw(st.sampled_from(layout_list)),
            root=draw(st.sampled_from(fitting or [0])) if name in ROOTED else 0,
            seed=draw(st.integers(0, 2**31 - 1)),
            algorithm=algorithm,
            world_size=n,
            splits=splits,
        )

    return build()


def values(case: Case, rank: int, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Deterministic contiguous values of one tensor of ``rank`` whose reductions are exact."""
    g = torch.Generator().manual_seed((case.seed * 1_000_003 + rank * 7919 + salt) % 2**63)
    n = math.prod(shape)
    if case.dtype == torch.bool:
        flat = torch.randint(0, 2, (n,), generator=g).bool()
    elif case.op is ReduceOp.PRODUCT and case.collective in REDUCING:
        pick = torch.randint(0, 4, (n,), generator=g)
        table = torch.tensor([1.0, -1.0, 2.0, 0.5] if case.dtype.is_floating_point else [1, -1, 2, 3])
        flat = table[pick].to(case.dtype) if case.dtype != torch.uint8 else table[pick].abs().to(case.dtype)
    else:  # drawn straight in the dtype and scaled in place: cheap for multi-MB tensors
        flat = torch.randint(0 if case.dtype == torch.uint8 else -8, 9, (n,), generator=g, dtype=case.dtype)
        if case.dtype in _SCALE:
            flat.mul_(_SCALE[case.dtype])  # exact: k * scale fits the dtype's significand
    return flat.reshape(shape)


def filled(shape: tuple[int, ...], dtype: torch.dtype, byte: int) -> torch.Tensor:
    """A contiguous tensor every byte of which is ``byte``."""
    t = torch.empty(shape, dtype=dtype)
    t.reshape(-1).view(torch.uint8).fill_(byte)
    return t


def layout(t: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Place ``t``'s values in a view of the given layout; returns ``(view, base)``.

    ``base`` is the whole allocation; every byte of it outside the view holds
    :data:`SENTINEL_BYTE`, so :func:`written_outside` can tell whether anything wrote there.
    """
    if kind == "contiguous" or t.dim() == 0:
        base = t.clone()
        return base, base
    if kind == "transposed" and t.dim() >= 2:
        base = t.transpose(0, -1).contiguous()
        return base.transpose(0, -1), base
    if kind == "offset":
        base = filled((t.numel() + 3,), t.dtype, SENTINEL_BYTE)
        view = base[1 : 1 + t.numel()].view(t.shape)
    else:  # strided (also the fallback for 1-d "transposed"): every other element of a larger buffer
        base = filled((*t.shape[:-1], t.shape[-1] * 2), t.dtype, SENTINEL_BYTE)
        view = base[..., ::2]
    view.copy_(t)
    return view, base


def written_outside(view: torch.Tensor, base: torch.Tensor) -> list[int]:
    """Element indices of contiguous ``base``, outside ``view``, whose bytes are no longer the sentinel."""
    if view.data_ptr() == base.data_ptr() and view.shape == base.shape:
        return []
    index = torch.arange(base.numel()).view(base.shape)
    covered = torch.zeros(base.numel(), dtype=torch.bool)
    covered[index.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).reshape(-1)] = True
    raw = base.reshape(-1).view(torch.uint8).view(base.numel(), base.element_size())
    changed = (raw != SENTINEL_BYTE).any(dim=1) & ~covered
    return changed.nonzero().reshape(-1).tolist()


def make_input(case: Case, rank: int, shape: tuple[int, ...] | None = None, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor ``rank`` passes for ``case`` (in ``case.layout``) and its backing allocation."""
    return layout(values(case, rank, case.shape if shape is None else shape, salt), case.layout)
