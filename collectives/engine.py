"""Engines: what runs a collective once the public API has checked and flattened its arguments.

Every method takes contiguous 1-D tensors. Two engines share this shape:

* :class:`AlgorithmEngine` — our algorithms (``ring.py``, ``tree.py``, ``direct.py``) over any
  :class:`~collectives.transport.base.Transport`. It also picks the algorithm by message size.
* :class:`TorchEngine` — torch's own collectives on the same process group: the reference
  backend, used as the oracle in tests and the baseline in benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Sequence

import torch
import torch.distributed as dist

from . import direct, hierarchical, ring, tree
from .buffers import Workspace
from .ops import ReduceOp, finish
from .topology import Layout
from .transport.base import Transport

ALL_REDUCE_ALGORITHMS = ("auto", "ring", "recursive_doubling", "hierarchical")
BROADCAST_ALGORITHMS = ("auto", "chain", "binomial", "hierarchical")
REDUCE_ALGORITHMS = ("auto", "ring", "binomial")


@dataclasses.dataclass
class Tuning:
    """Algorithm choices of a group; must be the same on every rank.

    Attributes:
        small_bytes: messages up to this size use the latency-optimal algorithms (recursive
            doubling, binomial reduce, direct all-gather); larger ones the bandwidth-optimal ring.
        chain_bytes: broadcasts up to this size use the binomial tree, larger ones the pipelined
            chain. The tree sends ``n - 1`` messages, the chain ``(n - 1) k``; when ranks share
            cores (the loopback benchmarks) every message costs CPU and the tree wins up to at
            least 64 MiB at 4 ranks. On a real network set it to ``small_bytes``.
        segment_bytes: pipelining segment of the ring and chain algorithms.
        depth: how many segments a ring keeps on the wire ahead of the one being reduced.
    """

    small_bytes: int = 4 << 20
    chain_bytes: int = 64 << 20
    segment_bytes: int = 4 << 20
    depth: int = 4

    @classmethod
    def from_alpha_beta(cls, alpha: float, beta: float, world_size: int) -> "Tuning":
        """Thresholds where the cost formulas cross for a link of latency ``alpha`` seconds and
        ``beta`` seconds per byte (see :func:`collectives.costmodel.tuning`)."""
        from .costmodel import Link, tuning

        return tuning(Link(alpha, beta), world_size, cls())


class AlgorithmEngine:
    """Collectives built from the point-to-point calls of one transport.

    ``layout`` (which ranks share a host) makes ``auto`` pick the hierarchical algorithms
    (``hierarchical.py``) when the group spans hosts with the same number of ranks on each.
    """

    def __init__(self, transport: Transport, workspace: Workspace, tuning: Tuning, layout: Layout | None = None):
        self.transport = transport
        self.workspace = workspace
        self.tuning = tuning
        self.layout = layout or Layout((tuple(range(transport.world_size)),))
        self._hierarchy: hierarchical.Hierarchy | None = None

    @property
    def name(self) -> str:
        return type(self.transport).__name__

    def transport_op(self, name: str) -> ContextManager[None]:
        """Label the traffic inside the block with the collective's name (for error messages)."""
        return self.transport.operation(name)

    def _segment_elems(self, buf: torch.Tensor) -> int:
        return max(1, self.tuning.segment_bytes // buf.element_size())

    def _is_small(self, buf: torch.Tensor, limit: int | None = None) -> bool:
        """``buf`` holds at most ``limit`` bytes (default: ``tuning.small_bytes``)."""
        return buf.numel() * buf.element_size() <= (self.tuning.small_bytes if limit is None else limit)

    def _spans_hosts(self) -> bool:
        return self.layout.spans_hosts and self.layout.uniform

    def hierarchy(self) -> hierarchical.Hierarchy:
        """This rank's host and rail views of the transport; the layout must be uniform."""
        if not self.layout.uniform:
            sizes = [len(h) for h in self.layout.hosts]
            raise ValueError(f"hierarchical algorithms need the same number of ranks on every host, got {sizes}")
        if self._hierarchy is None:
            self._hierarchy = hierarchical.Hierarchy.of(self.transport, self.layout)
        return self._hierarchy

    def all_reduce(self, buf: torch.Tensor, op: ReduceOp, algorithm: str) -> None:
        if algorithm == "auto":
            algorithm = "hierarchical" if self._spans_hosts() else "recursive_doubling" if self._is_small(buf) else "ring"
        if algorithm == "hierarchical":
            hierarchical.all_reduce(
                self.hierarchy(), buf, op, self.workspace, self._segment_elems(buf), self.tuning.depth,
                self.tuning.small_bytes // buf.element_size(),
            )
        elif algorithm == "ring":
            ring.all_reduce(self.transport, buf, op, self.workspace, self._segment_elems(buf), self.tuning.depth)
        else:
            tree.recursive_doubling_all_reduce(self.transport, buf, op, self.workspace)

    def broadcast(self, buf: torch.Tensor, src: int, algorithm: str) -> None:
        large = not self._is_small(buf, self.tuning.chain_bytes)
        chain = algorithm == "chain" or (algorithm in ("auto", "hierarchical") and large)
        if algorithm == "hierarchical" or (algorithm == "auto" and self._spans_hosts()):
            hierarchical.broadcast(self.hierarchy(), buf, src, self._segment_elems(buf), self.tuning.depth, chain)
        elif chain:
            ring.chain_broadcast(self.transport, buf, src, self._segment_elems(buf), self.tuning.depth)
        else:
            tree.binomial_broadcast(self.transport, buf, src)

    def reduce(self, buf: torch.Tensor, dst: int, op: ReduceOp, algorithm: str) -> None:
        """Reduce onto ``dst``; ``buf`` on the other ranks is used as scratch."""
        if algorithm == "auto":
            algorithm = "binomial" if self._is_small(buf) else "ring"
        if algorithm == "binomial":
            tree.binomial_reduce(self.transport, buf, dst, op, self.workspace)
            return
        n, r = self.transport.world_size, self.transport.rank
        bounds = ring.balanced_bounds(buf.numel(), n)
        ring.reduce_scatter(self.transport, buf, bounds, op, self.workspace, self._segment_elems(buf), self.tuning.depth)
        chunks = [buf[a:b] for a, b in zip(bounds, bounds[1:])]
        direct.gather(self.transport, chunks[r], chunks if r == dst else None, dst)
        if r == dst:
            finish(op, buf, n)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        n, r, m = self.transport.world_size, self.transport.rank, inp.numel()
        if self._is_small(out):  # one round of direct exchanges instead of n - 1 ring steps
            direct.all_to_all(self.transport, [out[i * m : (i + 1) * m] for i in range(n)], [inp] * n)
            return
        if self._spans_hosts():
            hierarchical.all_gather(self.hierarchy(), out, inp, self.workspace, self._segment_elems(out), self.tuning.depth)
            return
        out[r * m : (r + 1) * m].copy_(inp)
        ring.all_gather(self.transport, out, [i * m for i in range(n + 1)], self._segment_elems(out), self.tuning.depth)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> None:
        n, r, m = self.transport.world_size, self.transport.rank, out.numel()
        if self._spans_hosts():
            hierarchical.reduce_scatter(
                self.hierarchy(), out, inp, op, self.workspace, self._segment_elems(inp), self.tuning.depth
            )
            return
        work = self.workspace.get("reduce-scatter", inp.numel(), inp.dtype, inp.device)
        work.copy_(inp)
        ring.reduce_scatter(
            self.transport, work, [i * m for i in range(n + 1)], op, self.workspace,
            self._segment_elems(work), self.tuning.depth,
        )
        out.copy_(work[r * m : (r + 1) * m])
        finish(op, out, n)

    def scatter(self, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int) -> None:
        direct.scatter(self.transport, out, pieces, src)

    def gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
        direct.gather(self.transport, inp, outs, dst)

    def all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        direct.all_to_all(self.transport, outs, ins)

    def barrier(self) -> None:
        direct.barrier(self.transport, self.workspace.get("barrier", 2, torch.uint8, torch.device("cpu")))

    def close(self) -> None:
        self.transport.close()


class TorchEngine:
    """torch.distributed's built-in collectives on a process group (the reference backend).

    gloo has no AVG, so AVG runs as SUM followed by one division, exactly as we define AVG.
    """

    name = "torch"

    def __init__(self, process_group: dist.ProcessGroup, rank: int, world_size: int):
        self.pg = process_group
        self.rank = rank
        self.world_size = world_size

    def transport_op(self, name: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank)

    def _reduce_op(self, op: ReduceOp) -> dist.ReduceOp:
        return dist.ReduceOp.SUM if op is ReduceOp.AVG else op.to_torch()

    def all_reduce(self, buf: torch.Tensor, op: ReduceOp, algorithm: str) -> None:
        dist.all_reduce(buf, self._reduce_op(op), group=self.pg)
        finish(op, buf, self.world_size)

    def broadcast(self, buf: torch.Tensor, src: int, algorithm: str) -> None:
        dist.broadcast(buf, self._global(src), group=self.pg)

    def reduce(self, buf: torch.Tensor, dst: int, op: ReduceOp, algorithm: str) -> None:
        dist.reduce(buf, self._global(dst), self._reduce_op(op), group=self.pg)
        if self.rank == dst:
            finish(op, buf, self.world_size)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_gather(list(out.chunk(self.world_size)), inp, group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> None:
        # gloo implements neither reduce_scatter nor AVG: all-reduce a copy, keep our chunk.
        full = inp.clone()
        dist.all_reduce(full, self._reduce_op(op), group=self.pg)
        m = out.numel()
        out.copy_(full[self.rank * m : (self.rank + 1) * m])
        finish(op, out, self.world_size)

    def scatter(self, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int) -> None:
        dist.scatter(out, list(pieces) if pieces is not None else None, self._global(src), group=self.pg)

    def gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
        dist.gather(inp, list(outs) if outs is not None else None, self._global(dst), group=self.pg)

    def all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        # gloo's all_to_all takes one tensor each way; pack, exchange, unpack.
        sizes = [t.numel() for t in ins]
        out_sizes = [t.numel() for t in outs]
        send = torch.cat(list(ins)) if ins else ins
        recv = torch.empty(sum(out_sizes), dtype=outs[0].dtype, device=outs[0].device)
        dist.all_to_all_single(recv, send, out_sizes, sizes, group=self.pg)
        for o, piece in zip(outs, recv.split(out_sizes)):
            o.copy_(piece)

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def close(self) -> None:
        pass
