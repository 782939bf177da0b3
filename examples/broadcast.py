"""A student's broadcast, written on point-to-point ``send``/``recv`` only.

Property-test it against torch's built-in broadcast (from the repository root)::

    python -m collectives.testing examples.broadcast:broadcast --collective broadcast --world-size 4

A binomial tree: in round ``k`` every rank that already has the data (relative rank
``< 2**k``) sends it to the rank ``2**k`` further on, so ``n`` ranks are done after
``ceil(log2 n)`` rounds instead of the root sending ``n - 1`` messages itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every rank of ``group`` (torch's signature)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    root = dist.get_group_rank(group, src) if group is not None else src
    me = (rank - root) % n  # rank relative to the root

    def peer(relative: int) -> int:  # relative rank -> the global rank send/recv expect
        r = (relative + root) % n
        return dist.get_global_rank(group, r) if group is not None else r

    buf = tensor.contiguous()  # send/recv need contiguous memory; a copy if tensor is a view
    step = 1
    while step < n:
        if me < step and me + step < n:
            dist.send(buf, peer(me + step), group=group)
        elif step <= me < 2 * step:
            dist.recv(buf, peer(me - step), group=group)
        step *= 2
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf)
