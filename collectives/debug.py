"""Debug levels, and the DETAIL check that all ranks issue the same collective before running it.

Point-to-point algorithms trust that every rank calls the same collective with matching
arguments; when they don't (a rank skips a call, passes another size or dtype), the messages pair
up wrongly. The wire check (:mod:`collectives.wire`: payload tags at every level, a header
exchange from CHECK up) turns that into a ``CollectiveError``. With ``RINGDDP_DEBUG=DETAIL`` (like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) every collective first also all-gathers a small fixed-size
signature — collective, dtype, element count, shape, reduce op, root — and every rank raises the
same ``ValueError`` describing the mismatch if they differ. It costs one extra small all-gather
per collective.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Callable, NamedTuple

import torch

from .ops import ReduceOp

class Signature(NamedTuple):
    """What one rank's call of a collective looks like (``"-"`` / ``-1`` where not applicable)."""

    name: str
    dtype: str
    numel: int
    shape: tuple[int, ...]
    op: str
    root: int
    nbytes: int  # payload size, for traces; not compared (numel and dtype are)


_FIELDS = 6  # name .. root are compared across ranks


#: ``RINGDDP_DEBUG`` levels, cheapest first (see :mod:`collectives.wire`). OFF: payload messages
#: are tagged with what they are, so a mismatch never aborts a process or corrupts a result, but it
#: surfaces only at the group's deadline (``CollectiveTimeoutError``). CHECK (default): plus a
#: header exchange, so a mismatch is a ``CollectiveError`` describing both calls at once on every
#: rank. DETAIL: CHECK plus the all-gathered signature below (also compares shapes; a
#: ``ValueError``, and the group stays usable).
LEVELS = ("OFF", "CHECK", "DETAIL")
DEFAULT_LEVEL = "CHECK"
_SPELLINGS = {"": DEFAULT_LEVEL, "0": "OFF", "FALSE": "OFF", "1": "DETAIL", "ON": "DETAIL", "TRUE": "DETAIL"}


def level() -> str:
    """The checking level from ``$RINGDDP_DEBUG`` (read per call; set it the same on every rank)."""
    return _level(os.environ.get("RINGDDP_DEBUG", ""))


@functools.lru_cache(maxsize=16)
def _level(text: str) -> str:
    raw = text.strip().upper()
    value = _SPELLINGS.get(raw, raw)
    if value not in LEVELS:
        raise ValueError(f"RINGDDP_DEBUG={raw!r}: expected one of {', '.join(LEVELS)}")
    return value


def signature(
    name: str, tensor: torch.Tensor | None, op: ReduceOp | None = None, root: int = -1, uneven: bool = False
) -> Signature:
    """``uneven``: ranks may legitimately pass different sizes (all-to-all); numel and shape are not compared."""
    if tensor is None:
        return Signature(name, "-", 0, (), "-", root, 0)
    numel = tensor.numel()
    return Signature(
        name, str(tensor.dtype), -1 if uneven else numel, () if uneven else tuple(tensor.shape),
        op.name if op else "-", root, numel * tensor.element_size(),
    )  # fmt: skip


def _encode(sig: Signature) -> torch.Tensor:
    h = lambda s: zlib.crc32(str(s).encode())  # noqa: E731 - stable across processes, unlike hash()
    return torch.tensor([h(sig.name), h(sig.dtype), sig.numel, h(sig.shape), h(sig.op), sig.root], dtype=torch.int64)


def describe(sig: Signature) -> str:
    name, dtype, numel, shape, op, root = sig[:_FIELDS]
    parts = [name]
    if dtype != "-":
        parts.append(f"dtype={dtype} shape={list(shape)} numel={numel}")
    if op != "-":
        parts.append(f"op={op}")
    if root >= 0:
        parts.append(f"root={root}")
    return " ".join(parts)


def check_agreement(
    sig: Signature, rank: int, n: int, all_gather: Callable[[list[torch.Tensor], torch.Tensor], None]
) -> None:
    """All-gather every rank's signature and raise ``ValueError`` on any difference.

    ``all_gather(outs, mine)`` is the group's: ``outs[r]`` receives rank ``r``'s ``mine`` (a CPU
    int64 tensor) for each of the ``n`` ranks; ``rank`` is this rank's index among them.
    """
    mine = _encode(sig)
    gathered = torch.empty(n * _FIELDS, dtype=torch.int64)
    all_gather(list(gathered.split(_FIELDS)), mine)
    rows = gathered.view(n, _FIELDS)
    mismatched = [r for r in range(n) if not torch.equal(rows[r], rows[rank])]
    if mismatched:
        # Each rank only knows its own readable signature; the codes tell which fields differ.
        fields = ["collective", "dtype", "numel", "shape", "op", "root"]
        diffs = sorted({fields[i] for r in mismatched for i in range(_FIELDS) if rows[r, i] != mine[i]})
        raise ValueError(
            f"{sig.name}: ranks disagree on {', '.join(diffs)} (RINGDDP_DEBUG check). This rank "
            f"({rank}) called {describe(sig)}; ranks {mismatched} called something else"
            + (f" (numel {[int(rows[r, 2]) for r in range(n)]})" if "numel" in diffs else "")
        )
