"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in a row.

Picture the ``n`` ranks of a group sitting in a circle. Each rank only ever sends to its right
neighbour ``(rank + 1) % n`` and receives from its left neighbour ``(rank - 1) % n``. The flat
buffer every rank holds is cut into ``n`` chunks; chunk ``c`` is *owned* by rank ``c``.

Reduce-scatter (``n - 1`` steps)
    At step ``s`` rank ``r`` sends chunk ``(r - s - 1) % n`` to the right and receives chunk
    ``(r - s - 2) % n`` from the left, combining it into its own copy of that chunk. A chunk
    therefore travels once around the ring, picking up one rank's contribution per hop; after
    ``n - 1`` hops it arrives complete at its owner. Rank ``r`` ends with chunk ``r`` reduced over
    all ranks (the other chunks hold partial results).

All-gather (``n - 1`` steps)
    At step ``s`` rank ``r`` sends chunk ``(r - s) % n`` to the right and receives chunk
    ``(r - s - 1) % n`` from the left, storing it. Each owner's chunk travels around the ring once,
    so every rank ends with every chunk.

All-reduce = reduce-scatter, then all-gather. Every element is combined exactly once, by one
rank, in one order, and then only copied, so the result is **bitwise identical on every rank**,
even for floating-point sums whose value depends on the order of additions.

Cost, with ``α`` the latency of one message, ``β`` the seconds per byte and ``S`` the buffer's
bytes: each phase is ``(n - 1)`` steps that each move ``S / n`` bytes per rank, so

    reduce-scatter, all-gather:  (n - 1) α + (n - 1)/n · S β
    all-reduce:                 2(n - 1) α + 2(n - 1)/n · S β

The bandwidth term does not grow with ``n``: this is the bandwidth-optimal all-reduce. The
latency term does, which is why small messages use recursive doubling instead (``tree.py``).

Pipelining
    A step is not one message but ``k`` *segments*. Segment ``j`` received at step ``s`` is
    combined and immediately sent on as segment ``j`` of step ``s + 1``, while later segments are
    still on the wire; ``depth`` receives are kept posted ahead into a small reusable staging
    buffer. The wire, the peer's wire and the local adder all work at once, and a large step no
    longer waits for its whole chunk before forwarding any of it. All-reduce runs its two phases
    as *one* stream of messages: a segment of the owner's chunk starts its all-gather trip as
    soon as its last contribution is in, instead of after the whole reduce-scatter has drained.

    Each message also costs a fixed overhead (posting, waking the receiver, Python), which on a
    busy loopback host is worth a few hundred KB of transfer; hence few, large segments
    (``Tuning.segment_bytes``, 4 MiB by default) rather than many small ones.

Every function takes a contiguous 1-D ``buf`` and ``bounds``, the ``n + 1`` offsets that cut it
into chunks (chunk ``c`` is ``buf[bounds[c]:bounds[c + 1]]``); chunks may differ in size or be
empty. All ranks must call with the same sizes and the same ``segment_elems``.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

import torch

from .buffers import Workspace
from .ops import ReduceOp, combine, finish
from .transport.base import Request, Transport


def balanced_bounds(numel: int, parts: int) -> list[int]:
    """Offsets cutting ``numel`` elements into ``parts`` pieces whose sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segments(bounds: list[int], segment_elems: int) -> list[list[tuple[int, int]]]:
    """Cut every chunk into the same number ``k`` of segments, as ``(start, stop)`` into ``buf``.

    The same ``k`` for every chunk lets segment ``j`` of one step feed segment ``j`` of the next.
    Every rank of a group computes the same cuts: they are kept (:func:`_segments`), so a
    simulation of 1,024 ranks in one process cuts ``n`` chunks once, not once per rank. Treat
    the result as read-only.
    """
    return _segments(tuple(bounds), segment_elems)[0]


@functools.lru_cache(maxsize=32)
def _segments(bounds: tuple[int, ...], segment_elems: int) -> tuple[list[list[tuple[int, int]]], int]:
    """:func:`segments`' cuts and the largest segment's elements."""
    largest = max(b - a for a, b in zip(bounds, bounds[1:]))
    k = max(1, -(-largest // max(1, segment_elems)))
    result = []
    for a, b in zip(bounds, bounds[1:]):
        cuts = balanced_bounds(b - a, k)
        result.append([(a + lo, a + hi) for lo, hi in zip(cuts, cuts[1:])])
    return result, max(hi - lo for chunk in result for lo, hi in chunk)


def _pipeline(
    transport: Transport,
    count: int,
    message: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]],
    arrived: Callable[[int], None],
    lag: int,
) -> None:
    """Stream ``count`` messages right while receiving ``count`` from the left.

    ``message(m)`` is message ``m``'s ``(tensor sent, tensor received into)``; either may be
    None (nothing to send or receive). Its send and receive are posted *together* (one
    :meth:`Transport.post`), which NCCL needs to avoid a ring-wide deadlock. Up to ``lag`` later
    messages are posted before ``arrived(m)`` runs for message ``m``, so the wire works ahead
    while the host reduces. ``message(m)`` may depend on ``arrived`` having run for messages
    ``<= m - lag - 1``.
    """
    right, left = (transport.rank + 1) % transport.world_size, (transport.rank - 1) % transport.world_size
    in_flight: collections.deque[list[Request]] = collections.deque()
    for m in range(count + lag):
        if m < count:
            out, inc = message(m)
            in_flight.append(
                transport.post(
                    sends=[(out, right)] if out is not None else [],
                    recvs=[(inc, left)] if inc is not None else [],
                )
            )
        if m >= lag:
            for request in in_flight.popleft():  # wait_all, without its call: a ring's hot loop
                request.wait()
            arrived(m - lag)


def _piece(buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
    return buf[lo:hi] if hi > lo else None


def _ring(
    transport: Transport,
    buf: torch.Tensor,
    bounds: list[int],
    segment_elems: int,
    depth: int,
    reduce_steps: int,
    gather_steps: int,
    op: ReduceOp = ReduceOp.SUM,
    workspace: Workspace | None = None,
) -> None:
    """Run ``reduce_steps`` reduce-scatter steps then ``gather_steps`` all-gather steps as one stream.

    Message ``m`` is segment ``j = m % k`` of step ``s = m // k``. The two phases share one
    pipeline, so the all-gather does not wait for the whole reduce-scatter to drain: segment
    ``j`` of the owner's chunk is forwarded as soon as its last contribution has been combined
    (and, for AVG in a full all-reduce, divided), while later segments are still being reduced.

    Reduce-scatter arrivals land in ``lag + 1`` reusable staging slots taken from ``workspace``
    and are combined into ``buf``; all-gather arrivals land directly in their final place. A
    segment sent at step ``s + 1`` is the one that arrived at step ``s`` (``k`` messages earlier),
    hence ``lag < k``.
    """
    n, r = transport.world_size, transport.rank
    segs, seg_cap = _segments(tuple(bounds), segment_elems)
    k = len(segs[0])
    lag = min(depth, k - 1)
    finishes = reduce_steps == n - 1 and gather_steps > 0  # full all-reduce: owner finishes AVG
    if reduce_steps:  # all-gather needs no staging (and gets no workspace)
        staging = workspace.get("ring-staging", (lag + 1) * seg_cap, buf.dtype, buf.device)

    # A segment's view is made when it is first received (or sent) and reused until it is sent
    # on: a Python slice costs about a microsecond, and each message would otherwise cut three.
    # Sent segments leave the cache, so it holds about k + lag views, not n·k. Every message is
    # worked out once, when posted (a simulation of 1,024 ranks runs this two million times):
    # what its arrival combines waits in ``landing`` (None: nothing to combine).
    cache: dict[int, torch.Tensor | None] = {}
    slots: dict[tuple[int, int], torch.Tensor] = {}  # (slot, elements): its staging view
    landing: collections.deque[tuple[torch.Tensor, torch.Tensor, bool] | None] = collections.deque()

    def message(m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(segment sent, buffer received into) by message ``m``: chunk ``(r - s - 1) % n`` goes
        and ``(r - s - 2) % n`` comes at reduce-scatter step ``s``, ``(r - s) % n`` and
        ``(r - s - 1) % n`` at all-gather step ``s``."""
        s, j = divmod(m, k)
        reducing = s < reduce_steps
        sent = (r - s - 1) % n if reducing else (r - s + reduce_steps) % n
        got = (sent - 1) % n
        out = cache.pop(sent * k + j, buf)  # buf: not cut yet (None is an empty segment's view)
        if out is buf:  # sent on: no later message of this call touches it
            lo, hi = segs[sent][j]
            out = buf[lo:hi] if hi > lo else None
        piece = cache.get(got * k + j, buf)  # kept until message m + k sends it on
        if piece is buf:
            lo, hi = segs[got][j]
            piece = cache[got * k + j] = buf[lo:hi] if hi > lo else None
        if not reducing or piece is None:
            landing.append(None)
            return out, piece if not reducing else None
        slot = (m % (lag + 1), piece.numel())
        staged = slots.get(slot)
        if staged is None:
            staged = slots[slot] = staging[slot[0] * seg_cap : slot[0] * seg_cap + slot[1]]
        landing.append((piece, staged, finishes and s == n - 2))  # last: our own chunk complete
        return out, staged

    def arrived(m: int) -> None:
        entry = landing.popleft()
        if entry is not None:
            piece, staged, complete = entry
            combine(op, piece, staged, out=piece)
            if complete:
                finish(op, piece, n)

    _pipeline(transport, (reduce_steps + gather_steps) * k, message, arrived, lag)


def reduce_scatter(
    transport: Transport,
    buf: torch.Tensor,
    bounds: list[int],
    op: ReduceOp,
    workspace: Workspace,
    segment_elems: int,
    depth: int = 4,
) -> None:
    """Ring reduce-scatter in place: rank ``r`` ends with chunk ``r`` of ``buf`` fully reduced.

    Cost ``(n - 1) α + (n - 1)/n · S β``. AVG is left as a SUM here; the caller applies
    :func:`~collectives.ops.finish` to its chunk.
    """
    if transport.world_size > 1:
        _ring(transport, buf, bounds, segment_elems, depth, transport.world_size - 1, 0, op, workspace)


def all_gather(
    transport: Transport, buf: torch.Tensor, bounds: list[int], segment_elems: int, depth: int = 4
) -> None:
    """Ring all-gather in place: on entry rank ``r`` holds chunk ``r``; on exit every chunk.

    Cost ``(n - 1) α + (n - 1)/n · S β``; nothing is combined, received segments land in place.
    """
    if transport.world_size > 1:
        _ring(transport, buf, bounds, segment_elems, depth, 0, transport.world_size - 1)


def all_reduce(
    transport: Transport,
    buf: torch.Tensor,
    op: ReduceOp,
    workspace: Workspace,
    segment_elems: int,
    depth: int = 4,
) -> None:
    """Ring all-reduce of ``buf`` in place: reduce-scatter, then all-gather, as one pipeline.

    Cost ``2(n - 1) α + 2(n - 1)/n · S β``; results are bitwise identical on all ranks because
    each chunk is reduced (and, for AVG, divided) once by its owner before being copied around.
    """
    n = transport.world_size
    if n == 1:
        finish(op, buf, n)
        return
    _ring(transport, buf, balanced_bounds(buf.numel(), n), segment_elems, depth, n - 1, n - 1, op, workspace)


def chain_broadcast(
    transport: Transport, buf: torch.Tensor, src: int, segment_elems: int, depth: int = 4
) -> None:
    """Pipelined broadcast along the ring from ``src`` (the ring minus its last hop).

    The root streams ``k`` segments to its right neighbour; every other rank receives segment
    ``j`` while forwarding segment ``j - 1``. Cost ``(n - 2 + k)(α + S β / k)``: for large ``S``
    close to ``S β`` whatever ``n``, where a binomial tree pays ``log2(n) · S β``. With two ranks
    nobody forwards, so segments would only add ``α`` each: the buffer goes as one message.
    """
    n, r = transport.world_size, transport.rank
    if n == 1 or buf.numel() == 0:
        return
    pieces = segments([0, buf.numel()], segment_elems if n > 2 else buf.numel())[0]
    k = len(pieces)
    if r == src:
        _pipeline(transport, k, lambda m: (_piece(buf, *pieces[m]), None), lambda m: None, depth)
        return
    forwards = (r + 1) % n != src
    _pipeline(
        transport,
        k + 1,  # message m: receive segment m, forward segment m - 1
        message=lambda m: (
            _piece(buf, *pieces[m - 1]) if forwards and m >= 1 else None,
            _piece(buf, *pieces[m]) if m < k else None,
        ),
        arrived=lambda m: None,
        lag=0,
    )
