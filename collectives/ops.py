"""Reduction operators and the dtypes the collectives accept.

``ReduceOp`` mirrors ``torch.distributed.ReduceOp`` (and accepts torch's values, so code written
for torch keeps working). ``combine`` applies an operator elementwise *in place*, with ``out=``,
so a reduction step allocates nothing.
"""

from __future__ import annotations

import contextvars
import enum
from typing import Callable

import torch
import torch.distributed as dist

#: dtypes every collective accepts (a tuple: a fixed order keeps test case generation reproducible).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)


class ReduceOp(enum.Enum):
    """How values from different ranks are combined.

    AVG is SUM followed by one division by the group size; it is defined for floating dtypes only.
    On ``bool`` tensors SUM/MAX act as logical OR and PRODUCT/MIN as logical AND, like torch.
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    # members are singletons: identity hashing (C) instead of Enum's hash of the name (a Python
    # frame on every lru_cache and dict lookup of the call path); never compared across processes
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, op: object) -> "ReduceOp":
        """Accept our ReduceOp, torch.distributed.ReduceOp (a constant or a ``ReduceOp`` object),
        or a name like ``"sum"``; anything else (torch's PREMUL_SUM and bitwise ops among them)
        raises ``ValueError``."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        else:
            # torch's constant, or its object form (options structs) holding one in .op; looked
            # up by value: hashing torch's constant costs more than the rest of the call
            code = op if type(op) is _TORCH_CONSTANT else getattr(op, "op", None)
            if type(code) is _TORCH_CONSTANT and (ours := _FROM_TORCH_CODE.get(int(code))) is not None:
                return ours
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {[o.name for o in cls]}")

    def to_torch(self) -> dist.ReduceOp:
        return _TO_TORCH[self]


_TO_TORCH = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}
_TORCH_CONSTANT = type(dist.ReduceOp.SUM)  # torch's ReduceOp.RedOpType
_FROM_TORCH_CODE = {int(theirs): ours for ours, theirs in _TO_TORCH.items()}


def check_dtype(dtype: torch.dtype, op_name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op_name}: dtype {dtype} is not supported; supported: "
            f"{sorted(str(d) for d in SUPPORTED_DTYPES)}"
        )


def check_op_dtype(op: ReduceOp, dtype: torch.dtype, op_name: str) -> None:
    """Reject reductions that are undefined for ``dtype`` before any traffic."""
    if dtype not in SUPPORTED_DTYPES:
        check_dtype(dtype, op_name)
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"{op_name}: ReduceOp.AVG needs a floating dtype, got {dtype}; use SUM and divide")


#: When set, called with the bytes of every :func:`combine`'s output before it runs: the simulated
#: backend charges virtual time for local reductions this way (``collectives.sim``), only in the
#: contexts of its virtual ranks. None everywhere else.
combine_cost: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "ringddp_combine_cost", default=None
)


def combine(op: ReduceOp, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a (op) b`` elementwise, without allocating; ``out`` may be ``a`` or ``b``.

    AVG combines as SUM. Algorithms always pass operands in a fixed order (``a`` from the
    lower-ranked side), so every rank that computes a value computes the same expression.
    When ``out`` is ``a`` itself, a sum runs in place (``a.add_(b)``: the same kernel and bits
    as ``torch.add(a, b, out=a)``, without the ``out=`` argument's checks: 4 KiB float32 1.16 µs
    instead of 1.50, 64 KiB 2.82 instead of 3.80, best of 7 on the 2-core VM).
    """
    if (charge := combine_cost.get()) is not None:
        charge(out.numel() * out.element_size())
    if out is a and (op is ReduceOp.SUM or op is ReduceOp.AVG) and out.dtype != torch.bool:
        a.add_(b)
    elif out.dtype == torch.bool:
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            torch.logical_or(a, b, out=out)
        else:
            torch.logical_and(a, b, out=out)
    elif op is ReduceOp.SUM or op is ReduceOp.AVG:
        torch.add(a, b, out=out)
    elif op is ReduceOp.PRODUCT:
        torch.mul(a, b, out=out)
    elif op is ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    else:
        torch.maximum(a, b, out=out)


def finish(op: ReduceOp, buf: torch.Tensor, world_size: int) -> None:
    """Apply the last step of ``op`` to a fully reduced buffer (AVG divides; others do nothing)."""
    if op is ReduceOp.AVG and world_size > 1:
        buf.div_(world_size)
