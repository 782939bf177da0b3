"""Gradient buckets: which parameters share one flat buffer and one all-reduce.

Why buckets
-----------
A collective over ``n`` ranks costs about ``2(n-1)α + 2(n-1)/n · Sβ`` (ring all-reduce; ``α`` the
latency of one message, ``β`` the seconds per byte, ``S`` the bytes). Reducing every gradient
separately pays the latency term once *per parameter*: a model with 200 small tensors pays
``200 · 2(n-1)α`` even when the bytes are few. Packing the gradients into a few large flat
buffers pays it once per *bucket*. One single bucket would be cheapest in ``α``, but it can only
start when the *last* gradient is ready, so nothing would overlap with the backward pass.
Buckets of a few MiB (torch's default 25 MiB) are the compromise: large enough that ``Sβ``
dominates ``α``, small enough that the first all-reduce starts early in the backward pass.

Why reverse order
-----------------
Autograd produces gradients roughly in the reverse of the order the parameters were used in the
forward pass, which for most models is the reverse of their registration order. Filling buckets
from the *last* parameter backwards means bucket 0 is complete first, bucket 1 next, and so on:
each bucket's all-reduce starts while autograd is still computing the gradients of the earlier
layers.

One dtype (and device) per bucket, because a flat buffer has one dtype. A parameter is never split
across buckets; one larger than the cap gets a bucket of its own.

This module holds the pure layout logic (:func:`assign_buckets`) and the readable description
(:class:`BucketInfo`, :func:`format_bucket_table`); ``distributed.py`` does the communication.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Sequence

import torch

MiB = 1024 * 1024


def assign_buckets(
    sizes_bytes: Sequence[int],
    keys: Sequence[Hashable],
    cap_bytes: float,
    first_cap_bytes: float | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, walking the parameters in reverse order.

    Args:
        sizes_bytes: size in bytes of each parameter, in registration (forward) order.
        keys: what must be equal within a bucket, e.g. ``(dtype, device)``, per parameter.
        cap_bytes: a bucket is closed before adding a parameter would take it above this size
            (so a bucket exceeds it only when it holds a single parameter larger than the cap).
            ``0`` gives one bucket per parameter, ``math.inf`` one bucket per key.
        first_cap_bytes: cap of the first bucket of each key (default ``cap_bytes``); a small
            first bucket starts communication earlier in the backward pass.

    Returns:
        Buckets as lists of parameter indices. Within a bucket the indices are in descending order
        (the order their gradients are expected); buckets are ordered by when they are expected
        to be complete, i.e. by their first (highest) index, descending.

    >>> assign_buckets([4, 4, 4, 4], ["f"] * 4, cap_bytes=8)
    [[3, 2], [1, 0]]
    >>> assign_buckets([4, 4, 4], ["f", "d", "f"], cap_bytes=100)
    [[2, 0], [1]]
    """
    if len(sizes_bytes) != len(keys):
        raise ValueError(f"assign_buckets: {len(sizes_bytes)} sizes but {len(keys)} keys")
    if cap_bytes < 0 or (first_cap_bytes is not None and first_cap_bytes < 0):
        raise ValueError("assign_buckets: bucket caps must be >= 0")
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_per_key: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for i in reversed(range(len(sizes_bytes))):
        key, size = keys[i], int(sizes_bytes[i])
        first = closed_per_key.get(key, 0) == 0
        cap = first_cap_bytes if (first and first_cap_bytes is not None) else cap_bytes
        bucket = open_buckets.get(key)
        if bucket and open_bytes[key] + size > cap:
            done.append(bucket)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = []
            open_bytes[key] = 0
        bucket.append(i)
        open_bytes[key] += size
    done.extend(b for b in open_buckets.values() if b)
    done.sort(key=lambda b: -b[0])
    return done


def cap_from_mb(mb: float | None) -> float:
    """``bucket_cap_mb`` (MiB, like torch) to bytes; ``None`` or ``inf`` means no cap."""
    if mb is None or math.isinf(mb):
        return math.inf
    if mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {mb}")
    return mb * MiB


@dataclasses.dataclass(frozen=True)
class BucketInfo:
    """A readable description of one bucket (what ``DistributedDataParallel.buckets`` lists).

    Attributes:
        index: launch order; bucket 0 is all-reduced first.
        dtype, device: of the flat buffer (and of every gradient in it).
        param_names: qualified names, in the order they sit in the buffer. A tied parameter is
            listed once, as ``"first.name (= other.name)"``.
        shapes: the parameters' shapes, same order.
        numel: elements in the flat buffer.
        nbytes: bytes of the flat buffer (what one all-reduce of this bucket moves).
    """

    index: int
    dtype: torch.dtype
    device: torch.device
    param_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    nbytes: int


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_bucket_table(buckets: Sequence[BucketInfo], max_names: int = 4) -> str:
    """A fixed-width table of the buckets, one row each, plus a total line."""
    header = ("bucket", "dtype", "device", "params", "elements", "bytes", "parameters (backward order)")
    rows = []
    for b in buckets:
        names = list(b.param_names)
        shown = ", ".join(names[:max_names]) + (f", ... (+{len(names) - max_names})" if len(names) > max_names else "")
        rows.append(
            (
                str(b.index),
                str(b.dtype).replace("torch.", ""),
                str(b.device),
                str(len(names)),
                f"{b.numel:,}",
                _human_bytes(b.nbytes),
                shown,
            )
        )
    total_params = sum(len(b.param_names) for b in buckets)
    total_numel = sum(b.numel for b in buckets)
    total_bytes = sum(b.nbytes for b in buckets)
    rows.append(("total", "", "", str(total_params), f"{total_numel:,}", _human_bytes(total_bytes), f"{len(buckets)} buckets"))
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    right = {3, 4, 5}

    def fmt(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    lines = [fmt(header), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows[:-1]]
    lines += ["  ".join("-" * w for w in widths), fmt(rows[-1])]
    return "\n".join(lines)
