"""A student's ring all-reduce, written on point-to-point ``send``/``recv`` only.

Property-test it against torch's built-in all_reduce (from the repository root)::

    python -m collectives.testing examples.ring_all_reduce:ring_all_reduce --collective all_reduce --world-size 4

The ring: the tensor is cut into ``n`` chunks. In ``n - 1`` reduce-scatter steps every rank
sends one chunk to its right neighbour and combines the chunk arriving from its left one, so
that afterwards rank ``r`` holds the fully reduced chunk ``(r + 1) % n``. In ``n - 1``
all-gather steps the reduced chunks travel once more around the ring. Every chunk is reduced by
one chain of additions and then copied, so every rank ends with the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def combine(op: dist.ReduceOp, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bool:  # torch: SUM/MAX are OR, PRODUCT/MIN are AND on bools
        return a | b if op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) else a & b
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return a + b
    if op == dist.ReduceOp.PRODUCT:
        return a * b
    return torch.minimum(a, b) if op == dist.ReduceOp.MIN else torch.maximum(a, b)


def ring_all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group=None) -> None:
    """All-reduce ``tensor`` in place over ``group`` (torch's signature)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    buf = tensor.reshape(-1).clone()  # contiguous work copy (the tensor may be a strided view)
    chunks = list(buf.tensor_split(n))
    incoming = torch.empty_like(buf)

    def exchange(send_index: int, recv_index: int) -> torch.Tensor:
        got = incoming[: chunks[recv_index].numel()]
        request = dist.isend(chunks[send_index], right, group=group)
        dist.recv(got, left, group=group)
        request.wait()
        return got

    for step in range(n - 1):  # reduce-scatter
        send_index, recv_index = (rank - step) % n, (rank - step - 1) % n
        chunks[recv_index].copy_(combine(op, exchange(send_index, recv_index), chunks[recv_index]))
    for step in range(n - 1):  # all-gather
        send_index, recv_index = (rank + 1 - step) % n, (rank - step) % n
        chunks[recv_index].copy_(exchange(send_index, recv_index))
    if op == dist.ReduceOp.AVG:
        buf.div_(n)
    tensor.copy_(buf.view(tensor.shape))
