"""Direct algorithms: every rank talks to its peers without relaying.

Scatter, gather and all-to-all move *different* data to each peer, so nothing can be saved by
relaying through other ranks on a full-bisection network: the root of a scatter or gather posts
all ``n - 1`` messages at once and the transport runs them concurrently.

    scatter / gather:  (n - 1)(α + S β / n)   (``S`` = the root's total bytes)
    all-to-all:        (n - 1)(α + S β / n)   per rank, all ranks at once

The barrier is a *dissemination* barrier: in round ``i`` rank ``r`` signals ``r + 2^i`` and
waits for ``r - 2^i``; after ``ceil(log2 n)`` rounds every rank has heard, directly or
transitively, from every other, so none can leave before all have arrived.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .transport.base import Transport, wait_all


def scatter(
    transport: Transport, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int
) -> None:
    """Root ``src`` sends ``pieces[i]`` to rank ``i``; every rank receives its piece into ``out``."""
    r = transport.rank
    if r != src:
        if out.numel():
            transport.recv(out, src)
        return
    assert pieces is not None
    sends = [(piece, i) for i, piece in enumerate(pieces) if i != r and piece.numel()]
    requests = transport.post(sends=sends)
    out.copy_(pieces[r])
    wait_all(requests)


def gather(transport: Transport, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
    """Every rank sends ``inp`` to ``dst``, which stores rank ``i``'s in ``outs[i]``."""
    r = transport.rank
    if r != dst:
        if inp.numel():
            transport.send(inp, dst)
        return
    assert outs is not None
    recvs = [(o, i) for i, o in enumerate(outs) if i != r and o.numel()]
    requests = transport.post(recvs=recvs)
    outs[r].copy_(inp)
    wait_all(requests)


def all_to_all(transport: Transport, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """Rank ``r`` sends ``ins[j]`` to rank ``j`` and receives rank ``j``'s ``ins[r]`` into ``outs[j]``.

    Peers are visited in the order ``r + 1, r + 2, ...`` so that at every moment the ranks form
    disjoint pairs of traffic rather than all sending to rank 0 first.
    """
    n, r = transport.world_size, transport.rank
    order = [(r + i) % n for i in range(1, n)]
    recvs = [(outs[(r - i) % n], (r - i) % n) for i in range(1, n) if outs[(r - i) % n].numel()]
    sends = [(ins[j], j) for j in order if ins[j].numel()]
    requests = transport.post(sends=sends, recvs=recvs)
    outs[r].copy_(ins[r])
    wait_all(requests)


def barrier(transport: Transport, token: torch.Tensor) -> None:
    """Dissemination barrier: in round ``k`` of ``⌈log2 n⌉``, send 1 byte to ``r + 2^k``, receive from ``r - 2^k``.

    ``token`` is a 2-element scratch tensor on the transport's device: element 0 is sent,
    element 1 receives.
    """
    n, r = transport.world_size, transport.rank
    step = 1
    while step < n:
        incoming = token[1:2]
        wait_all(transport.post(sends=[(token[0:1], (r + step) % n)], recvs=[(incoming, (r - step) % n)]))
        step <<= 1
