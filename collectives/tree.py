"""Latency-optimal algorithms for small messages: recursive doubling and binomial trees.

For a small buffer the cost of a collective is dominated by the number of messages in sequence
(``α``), not by bytes (``β``). The ring needs ``2(n - 1)`` steps; the algorithms here need about
``log2(n)``.

Recursive doubling all-reduce
    With ``n = 2^d`` ranks: at round ``i`` rank ``r`` swaps its whole buffer with rank
    ``r XOR 2^i`` and both combine. After ``d`` rounds every rank holds the full reduction.
    Cost: ``log2(n) α + log2(n) · S β`` — fewer steps than the ring, but the whole buffer moves at
    every step, so it only wins for small ``S``.
    When ``n`` is not a power of two, the ``n - p`` ranks above the largest power of two ``p``
    first hand their buffers to partners ``r - p`` (and get the result back at the end): two more
    steps.
    Identical results on every rank: partners always combine ``(lower-ranked side) op
    (higher-ranked side)``, so both sides evaluate the same expression on the same bits.

Binomial broadcast / reduce
    The set of ranks holding the data doubles every round: ``log2(n) (α + S β)``. Reduce runs the
    same tree the other way.
"""

from __future__ import annotations

import torch

from .buffers import Workspace
from .ops import ReduceOp, combine, finish
from .transport.base import Transport, wait_all


def recursive_doubling_all_reduce(
    transport: Transport, buf: torch.Tensor, op: ReduceOp, workspace: Workspace
) -> None:
    """All-reduce ``buf`` in place in ``ceil(log2 n)`` (+2 if n is not a power of two) steps."""
    n, r = transport.world_size, transport.rank
    if n > 1 and buf.numel() > 0:
        incoming = workspace.get("tree-incoming", buf.numel(), buf.dtype, buf.device)
        p = 1 << (n.bit_length() - 1)  # largest power of two <= n
        if r >= p:  # extra rank: hand the data to a partner, get the result back
            transport.send(buf, r - p)
            transport.recv(buf, r - p)
        else:
            if r + p < n:
                transport.recv(incoming, r + p)
                combine(op, buf, incoming, out=buf)
            mask = 1
            while mask < p:
                partner = r ^ mask
                wait_all(transport.post(sends=[(buf, partner)], recvs=[(incoming, partner)]))
                low, high = (buf, incoming) if r < partner else (incoming, buf)
                combine(op, low, high, out=buf)
                mask <<= 1
            if r + p < n:
                transport.send(buf, r + p)
    finish(op, buf, n)


def binomial_broadcast(transport: Transport, buf: torch.Tensor, src: int) -> None:
    """Broadcast ``buf`` from ``src`` along a binomial tree: ``ceil(log2 n)`` rounds."""
    n = transport.world_size
    if n == 1 or buf.numel() == 0:
        return
    vr = (transport.rank - src) % n  # rank relative to the root
    mask = 1
    while mask <= vr:
        mask <<= 1
    if vr > 0:  # receive from the rank that covers us in the round where our bit first appears
        transport.recv(buf, (vr - (mask >> 1) + src) % n)
    sends = []
    while mask < n:
        if vr + mask < n:
            sends.append(transport.isend(buf, (vr + mask + src) % n))
        mask <<= 1
    wait_all(sends)


def binomial_reduce(
    transport: Transport, buf: torch.Tensor, dst: int, op: ReduceOp, workspace: Workspace
) -> None:
    """Reduce ``buf`` onto ``dst`` along a binomial tree; ``buf`` on other ranks is scratch."""
    n = transport.world_size
    if n > 1 and buf.numel() > 0:
        incoming = workspace.get("tree-incoming", buf.numel(), buf.dtype, buf.device)
        vr = (transport.rank - dst) % n
        mask = 1
        while mask < n:
            if vr & mask:  # our subtree is complete: pass it up and stop
                transport.send(buf, (vr - mask + dst) % n)
                break
            if vr + mask < n:
                transport.recv(incoming, (vr + mask + dst) % n)
                combine(op, buf, incoming, out=buf)
            mask <<= 1
    if transport.rank == dst:
        finish(op, buf, n)
