"""Debug levels, and the DETAIL check that all ranks issue the same collective before running it.

Point-to-point algorithms trust that every rank calls the same collective with matching
arguments; when they don't (a rank skips a call, passes another size or dtype), the messages pair
up wrongly. The wire check (:mod:`collectives.wire`: payload tags at every level, a header
exchange from CHECK up) turns that into a ``CollectiveError``. With ``RINGDDP_DEBUG=DETAIL`` (like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) every collective first also all-gathers a small signature —
collective, dtype, element count, shape, reduce op, root, and what the wire header compares
besides (algorithm, the group's ``Tuning``, for all-to-all the bytes for each peer) — and every
rank raises the same ``ValueError`` describing the mismatch if they differ. No payload has moved
then, so the group stays usable: every mismatch the wire check could see is caught here first.
It costs one extra small all-gather per collective (``8 + 2n`` integers per rank).
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Callable, NamedTuple, Sequence

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


#: the fixed fields of the all-gathered signature (then the bytes to and from each peer)
_FIELD_NAMES = ("collective", "dtype", "numel", "shape", "op", "root", "algorithm", "tuning")
_FIELDS = len(_FIELD_NAMES)


#: ``RINGDDP_DEBUG`` levels, cheapest first (see :mod:`collectives.wire`). OFF: payload messages
#: are tagged with what they are, so a mismatch never aborts a process or corrupts a result, but it
#: surfaces only at the group's deadline (``CollectiveTimeoutError``). CHECK (default): plus a
#: header exchange, so a mismatch is a ``CollectiveError`` describing both calls at once on every
#: rank. DETAIL: CHECK plus the all-gathered signature below (compares shapes too, and everything
#: the header does; a ``ValueError`` before any payload moves, and the group stays usable).
LEVELS = ("OFF", "CHECK", "DETAIL")
DEFAULT_LEVEL = "CHECK"
_SPELLINGS = {"": DEFAULT_LEVEL, "0": "OFF", "FALSE": "OFF", "1": "DETAIL", "ON": "DETAIL", "TRUE": "DETAIL"}


_chosen: str | None = None  # set_level's choice; None: the environment's
_from_environment: str | None = None  # $RINGDDP_DEBUG's level as last read


def level() -> str:
    """The checking level in force: the last :func:`set_level`, else ``$RINGDDP_DEBUG`` as read
    when the newest group was created (set it the same on every rank).

    Not read from the environment per call: reading an unset variable raises and catches a
    ``KeyError`` inside ``os.environ.get``, 0.5 µs a call, ~12 µs on a call that finds the caches
    cold (the largest single cost of a cold 4 KiB all-reduce before its traffic).
    """
    if _chosen is not None:
        return _chosen
    return _from_environment if _from_environment is not None else read_environment()


def read_environment() -> str:
    """Read the level from ``$RINGDDP_DEBUG`` (``ValueError`` for an unknown one): every group
    creation does, so a level set before ``init_process_group`` / ``new_group`` applies (unless
    :func:`set_level` chose one)."""
    global _from_environment
    _from_environment = _level(os.environ.get("RINGDDP_DEBUG", ""))
    return _from_environment


def set_level(name: str | None) -> str | None:
    """Change the level from the next collective on (``"OFF"``, ``"CHECK"``, ``"DETAIL"``, or the
    spellings ``$RINGDDP_DEBUG`` accepts); ``None`` goes back to ``$RINGDDP_DEBUG``, read again.
    Every rank must make the same change at the same point of its sequence of collectives.
    Returns the previous choice (``None``: the environment's), to restore it with."""
    global _chosen
    previous = _chosen
    if name is None:
        _chosen = None
        read_environment()
    else:
        _chosen = _level(name)
    return previous


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
    return _signature(name, tensor.dtype, tensor.shape, op, root, uneven)


@functools.lru_cache(maxsize=1024)
def _signature(
    name: str, dtype: torch.dtype, shape: torch.Size, op: ReduceOp | None, root: int, uneven: bool
) -> Signature:
    """Signatures are immutable: a training loop's repeated calls reuse one."""
    numel = shape.numel()
    return Signature(
        name, str(dtype), -1 if uneven else numel, () if uneven else tuple(shape),
        op.name if op else "-", root, numel * dtype.itemsize,
    )  # fmt: skip


def _code(value: object) -> int:
    return zlib.crc32(str(value).encode())  # stable across processes, unlike hash()


def _encode(
    sig: Signature, algorithm: str, tuning: int, sizes: tuple[Sequence[int], Sequence[int]] | None, n: int
) -> torch.Tensor:
    fixed = [_code(sig.name), _code(sig.dtype), sig.numel, _code(sig.shape), _code(sig.op), sig.root,
             _code(algorithm), tuning]  # fmt: skip
    pairs = [*sizes[0], *sizes[1]] if sizes is not None else [-1] * (2 * n)
    return torch.tensor(fixed + pairs, dtype=torch.int64)


def describe(sig: Signature) -> str:
    name, dtype, numel, shape, op, root = sig[:6]
    parts = [name]
    if dtype != "-":
        parts.append(f"dtype={dtype} shape={list(shape)} numel={numel}")
    if op != "-":
        parts.append(f"op={op}")
    if root >= 0:
        parts.append(f"root={root}")
    return " ".join(parts)


def check_agreement(
    sig: Signature,
    rank: int,
    n: int,
    all_gather: Callable[[list[torch.Tensor], torch.Tensor], None],
    algorithm: str = "-",
    tuning: int = 0,
    sizes: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """All-gather every rank's signature and raise ``ValueError`` on any difference.

    ``all_gather(outs, mine)`` is the group's: ``outs[r]`` receives rank ``r``'s ``mine`` (a CPU
    int64 tensor) for each of the ``n`` ranks; ``rank`` is this rank's index among them.
    ``algorithm``, ``tuning`` (a hash of the group's ``Tuning``) and ``sizes`` (all-to-all: bytes
    this rank sends to, and expects from, each rank) are what the wire header compares besides:
    checked here too, so every mismatch the header would find is found before any payload moves.
    Every rank sees every row, so all raise the same error.
    """
    mine = _encode(sig, algorithm, tuning, sizes, n)
    width = mine.numel()
    gathered = torch.empty(n * width, dtype=torch.int64)
    all_gather(list(gathered.split(width)), mine)
    rows = gathered.view(n, width)
    fixed = rows[:, :_FIELDS]
    mismatched = [r for r in range(n) if not torch.equal(fixed[r], fixed[rank])]
    if mismatched:
        # Each rank only knows its own readable signature; the codes tell which fields differ.
        diffs = sorted({_FIELD_NAMES[i] for r in mismatched for i in range(_FIELDS) if fixed[r, i] != fixed[rank, i]})
        raise ValueError(
            f"{sig.name}: ranks disagree on {', '.join(diffs)} (RINGDDP_DEBUG check). This rank "
            f"({rank}) called {describe(sig)}"
            + (f" (algorithm={algorithm})" if "algorithm" in diffs else "")
            + f"; ranks {mismatched} called something else"
            + (f" (numel {[int(rows[r, 2]) for r in range(n)]})" if "numel" in diffs else "")
        )
    sends, recvs = rows[:, _FIELDS : _FIELDS + n], rows[:, _FIELDS + n :]
    if sizes is not None and not torch.equal(sends, recvs.T):  # rank i's bytes to j are what j expects from i
        i, j = next((i, j) for i in range(n) for j in range(n) if sends[i, j] != recvs[j, i])
        raise ValueError(
            f"{sig.name}: ranks disagree on the bytes exchanged (RINGDDP_DEBUG check): rank {i} sends "
            f"{int(sends[i, j])} bytes to rank {j}, which expects {int(recvs[j, i])} from it"
        )
