"""Engines: what runs a collective once the public API has checked and flattened its arguments.

:class:`Engine` is the contract between ``api.py`` and a backend. Two implementations ship:

* :class:`AlgorithmEngine` — our algorithms (``ring.py``, ``tree.py``, ``direct.py``) over any
  :class:`~collectives.transport.base.Transport`. It also picks the algorithm by message size,
  and when the transport has shared regions (``shm``) runs ``auto`` all-reduce, broadcast,
  all-gather, reduce-scatter, scatter, gather and all-to-all by direct reads of the peers'
  regions (``shm_algorithms.py``).
  A backend that supplies only a transport (``register_backend(..., make_transport=...)``) gets
  this engine.
* :class:`TorchEngine` — torch's own collectives on the same process group: the reference
  backend, used as the oracle in tests and the baseline in benchmarks.

Each engine serves one group on one device, runs on that group's communication thread (one call
at a time), and owns its scratch buffers (a :class:`~collectives.buffers.Workspace`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from typing import Callable, ContextManager, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from . import adoption, direct, hierarchical, ring, shm_algorithms, tree, wire
from .buffers import Workspace
from .ops import ReduceOp, finish
from .topology import Layout
from .transport.base import SharedRegions, Transport
from .tuning import ALL_REDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS, Tuning

@runtime_checkable
class Engine(Protocol):
    """Runs the collectives of one group on one device.

    The contract, for every method:

    * Tensors are contiguous 1-D buffers on the engine's device, of one dtype, already checked by
      ``api.py`` (sizes agree, dtype/op supported). Ranks (``src``, ``dst``, ``peer``) are ranks
      *within the group*, ``0 .. size-1``.
    * Every rank of the group calls the same method with matching sizes, in the same order.
    * Results are written in place and are identical on every rank; AVG is SUM then one division
      by the group size (:func:`~collectives.ops.finish`).
    * Blocking waits end by the group's timeout with a
      :class:`~collectives.errors.CollectiveError` naming the collective and the peer.
    """

    def transport_op(self, name: str) -> ContextManager[None]:
        """Label the traffic inside the block with the collective's name (for error messages)."""

    def all_reduce(self, buf: torch.Tensor, op: ReduceOp, algorithm: str) -> None:
        """Reduce ``buf`` across ranks in place; ``algorithm`` is one of ``ALL_REDUCE_ALGORITHMS``."""

    def broadcast(self, buf: torch.Tensor, src: int, algorithm: str) -> None:
        """Copy ``buf`` of rank ``src`` into ``buf`` everywhere (``BROADCAST_ALGORITHMS``)."""

    def reduce(self, buf: torch.Tensor, dst: int, op: ReduceOp, algorithm: str) -> None:
        """Reduce onto rank ``dst`` in place; ``buf`` on the other ranks stays unchanged."""

    def all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[i]`` receives rank ``i``'s ``inp``. ``outs`` may be consecutive views of one buffer."""

    def reduce_scatter(self, out: torch.Tensor, ins: Sequence[torch.Tensor], op: ReduceOp) -> None:
        """Reduce ``ins[i]`` across ranks into ``out`` of rank ``i`` (``ins`` is left unchanged)."""

    def scatter(self, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int) -> None:
        """Rank ``src`` sends ``pieces[i]`` to rank ``i``'s ``out`` (``pieces`` is None elsewhere)."""

    def gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
        """Rank ``dst`` receives rank ``i``'s ``inp`` into ``outs[i]`` (``outs`` is None elsewhere)."""

    def all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """Send ``ins[j]`` to rank ``j``, receive rank ``j``'s piece into ``outs[j]`` (sizes may differ)."""

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def send(self, buf: torch.Tensor, peer: int) -> None:
        """Send ``buf`` to rank ``peer``; messages to one peer arrive in the order sent."""

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        """Receive the next message from rank ``peer`` into ``buf`` (sizes must match)."""

    def close(self) -> None:
        """Release the engine's resources; it is unusable afterwards."""


def as_one_buffer(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` as one flat tensor if they are consecutive views of one buffer, else ``None``.

    ``all_gather_into_tensor`` hands its output this way, so the engine gathers in place; the
    output list of ``all_gather`` is usually separate tensors and is staged.
    """
    if not parts:
        return None
    first = parts[0]
    storage, itemsize, at = first.untyped_storage().data_ptr(), first.element_size(), first.data_ptr()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.data_ptr() != at:
            return None
        at += p.numel() * itemsize
    total = sum(p.numel() for p in parts)
    return first.as_strided((total,), (1,), first.storage_offset())


class AlgorithmEngine:
    """Collectives built from the point-to-point calls of one transport.

    Args:
        transport: the wire; its ranks are the group's ranks.
        tuning: the group's :class:`Tuning`, shared and read at every call.
        device: the device of the tensors (scratch buffers live there).
        layout: which ranks share a host (default: one host). When the group spans hosts with
            the same number of ranks on each, ``auto`` picks the hierarchical algorithms
            (``hierarchical.py``) for all_reduce, broadcast and large all_gather / reduce_scatter.
        host_transport: makes the transport among the ranks of this rank's host that the
            intra-host phases of those algorithms use (the CPU backends pass shared memory);
            default: a view of ``transport``. Made with the engine when the group spans hosts;
            the engine labels and closes it.
    """

    def __init__(
        self, transport: Transport, tuning: Tuning, device: torch.device, layout: Layout | None = None,
        host_transport: hierarchical.HostTransport | None = None,
    ):
        self.transport = transport
        self.tuning = tuning
        self.device = torch.device(device)
        self.workspace = Workspace()
        self.layout = layout or Layout((tuple(range(transport.world_size)),))
        self._hierarchy: hierarchical.Hierarchy | None = None
        if host_transport is not None and self._spans_hosts():  # made now, so that transport_op labels it
            self._hierarchy = hierarchical.Hierarchy.of(transport, self.layout, host_transport)
        self._symmetric: list[list[torch.Tensor]] = []  # per allocation: every rank's memory
        self._adopter = adoption.Adopter()
        self._shared: SharedRegions | None = None  # the transport's regions, once it has them

    def transport_op(self, name: str) -> ContextManager[None]:
        if self._hierarchy is None:
            return self.transport.operation(name)
        labels = contextlib.ExitStack()
        labels.enter_context(self.transport.operation(name))
        labels.enter_context(self._hierarchy.intra.operation(name))
        return labels

    def _regions(self) -> SharedRegions | None:
        """The transport's shared regions (``shm``), if it has them and there are peers (kept
        once found: a transport that has them keeps them until it closes, with the engine)."""
        if self._shared is None and self.transport.world_size > 1:
            self._shared = self.transport.shared_regions()
        return self._shared

    def _segment_elems(self, buf: torch.Tensor) -> int:
        return max(1, self.tuning.segment_bytes // buf.element_size())

    def _is_small(self, buf: torch.Tensor, limit: int | None = None) -> bool:
        """``buf`` holds at most ``limit`` bytes (default: ``tuning.small_bytes``)."""
        return buf.numel() * buf.element_size() <= (self.tuning.small_bytes if limit is None else limit)

    def _spans_hosts(self) -> bool:
        return self.layout.spans_hosts and self.layout.uniform

    def hierarchy(self) -> hierarchical.Hierarchy:
        """This rank's host and rail transports (:class:`~collectives.hierarchical.Hierarchy`); the
        layout must be uniform."""
        if not self.layout.uniform:
            sizes = [len(h) for h in self.layout.hosts]
            raise ValueError(f"hierarchical algorithms need the same number of ranks on every host, got {sizes}")
        if self._hierarchy is None:  # no host transport (one host, CUDA): views of the transport only
            self._hierarchy = hierarchical.Hierarchy.of(self.transport, self.layout)
        return self._hierarchy

    def symmetric_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``numel`` elements of symmetric memory (``SharedRegions.allocate``), or None without it.

        Collective. The memory stays mapped until :meth:`close`.
        """
        regions = self._regions()
        views = None if regions is None else regions.allocate(numel * dtype.itemsize)
        if views is None:
            return None
        self._symmetric.append(views)
        return views[self.transport.rank].view(dtype)

    def _where(self, buf: torch.Tensor) -> tuple[int, int] | None:
        """(allocation index, byte offset) of ``buf`` if it lies in this rank's symmetric memory."""
        if not self._symmetric or not buf.is_contiguous():
            return None
        ptr, nbytes, me = buf.data_ptr(), buf.numel() * buf.element_size(), self.transport.rank
        for i, views in enumerate(self._symmetric):
            base = views[me].data_ptr()
            if base <= ptr and ptr + nbytes <= base + views[me].numel():
                return i, ptr - base
        return None

    def _in_symmetric(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], int] | None:
        """Every rank's copy of ``buf`` and its byte offset, if ``buf`` lies in symmetric memory
        (every rank's at the same place: ranks that pass other places raise in the algorithm)."""
        if (where := self._where(buf)) is None:
            return None
        i, at = where
        nbytes = buf.numel() * buf.element_size()
        return [v[at : at + nbytes].view(buf.dtype) for v in self._symmetric[i]], at

    def _agree_symmetric(self, regions: SharedRegions, buf: torch.Tensor) -> tuple[list[torch.Tensor], int] | None:
        """With adoption on: every rank's buffer as mapped here if all of them lie in symmetric
        memory (adopting them now if all are candidates), with offset 0 for the signature (ranks
        may hold theirs at different places), else None on every rank alike
        (:mod:`collectives.adoption`). One step: the ranks exchange where their buffers lie."""
        n, r, nbytes = regions.world_size, regions.rank, buf.numel() * buf.element_size()
        where = self._where(buf)
        if where is None:
            kind = adoption.CANDIDATE if self._adopter.candidate(buf, self.tuning.adopt_bytes) else adoption.PRIVATE
            where = (kind, 0)
        cpu = torch.device("cpu")
        mine = self.workspace.get("adopt-record", adoption.WORDS, torch.int64, cpu)
        mine.copy_(torch.tensor([*where, nbytes]))
        records = self.workspace.get("adopt-records", n * adoption.WORDS, torch.int64, cpu)
        shm_algorithms.all_gather(regions, list(records.split(adoption.WORDS)), mine)
        table = records.view(n, adoption.WORDS).tolist()
        if any(row[2] != nbytes for row in table):  # different calls: the two-shot raises
            return None
        if all(row[0] == adoption.CANDIDATE for row in table):
            views = regions.allocate(nbytes)
            if views is None:  # logged; the same on every rank
                self._adopter.failed = True
                return None
            views[r] = self._adopter.adopt(buf, views[r])
            self._symmetric.append(views)
            table = [[len(self._symmetric) - 1, 0, nbytes]] * n
        if any(row[0] < 0 for row in table):
            return None
        return [self._symmetric[i][q][at : at + nbytes].view(buf.dtype) for q, (i, at, _) in enumerate(table)], 0

    def all_reduce(self, buf: torch.Tensor, op: ReduceOp, algorithm: str) -> None:
        if algorithm == "auto" and (regions := self._regions()) is not None:
            found = None
            if buf.numel() * buf.element_size() > shm_algorithms.one_shot_limit(regions.world_size):
                adopt = self.tuning.adopt_bytes > 0
                found = self._agree_symmetric(regions, buf) if adopt else self._in_symmetric(buf)
            if found is not None:
                shm_algorithms.all_reduce_symmetric(regions, found[0], op, found[1])
            else:
                shm_algorithms.all_reduce(regions, buf, op)
            return
        if algorithm == "auto":
            small = "recursive_doubling" if self._is_small(buf) else "ring"
            algorithm = "hierarchical" if self._spans_hosts() else small
        if algorithm == "hierarchical":
            hierarchical.all_reduce(
                self.hierarchy(), buf, op, self.workspace, self._segment_elems(buf), self.tuning.depth,
                self.tuning.small_bytes // buf.element_size(),
            )
        elif algorithm == "ring":
            ring.all_reduce(self.transport, buf, op, self.workspace, self._segment_elems(buf), self.tuning.depth)
        else:
            tree.recursive_doubling_all_reduce(self.transport, buf, op, self.workspace)

    def checked_all_reduce(self, numel: int, dtype: torch.dtype, op: ReduceOp,
                           header: wire.Header) -> Callable[[torch.Tensor], None] | None:
        """An ``auto`` :meth:`all_reduce` of any contiguous buffer of ``numel`` ``dtype``
        elements as the collective ``all_reduce`` with ``header``, the transport's operation
        included, in one call made now, where the transport offers that
        (:func:`~collectives.shm_algorithms.checked_all_reduce`); else None. It records nothing
        in autograd, whatever the grad mode. Call it only after a collective has run on this
        engine (the first sets the regions up)."""
        regions = self._regions() if self._hierarchy is None else None
        return None if regions is None else shm_algorithms.checked_all_reduce(regions, numel, dtype, op, header)

    def plan_all_reduce(self, buf: torch.Tensor, op: ReduceOp, algorithm: str,
                        header: wire.Header | None) -> tuple[Callable[[], None], bool]:
        """:meth:`all_reduce` of this very ``buf`` as the collective ``all_reduce``, its transport
        operation included, planned once to run many times (a persistent collective,
        :mod:`collectives.persistent`); with it, whether that function reads ``header`` from
        :func:`collectives.wire.current` (else it was given it here): :meth:`checked_all_reduce`
        where it offers a call; else on shared regions a one-shot with its views and signature
        computed now (:func:`~collectives.shm_algorithms.plan_all_reduce`); anything else
        chooses at each call as :meth:`all_reduce` does. Call it only after a collective has
        run on this engine."""
        if algorithm == "auto" and header is not None:
            checked = self.checked_all_reduce(buf.numel(), buf.dtype, op, header)
            if checked is not None:
                return functools.partial(checked, buf), False
        planned = None
        if algorithm == "auto" and (regions := self._regions()) is not None:
            planned = shm_algorithms.plan_all_reduce(regions, buf, op)
        body = planned if planned is not None else functools.partial(self.all_reduce, buf, op, algorithm)
        transport_op = self.transport_op

        def run() -> None:
            with transport_op("all_reduce"):
                body()

        return run, True

    def broadcast(self, buf: torch.Tensor, src: int, algorithm: str) -> None:
        if algorithm == "auto" and (regions := self._regions()) is not None:
            shm_algorithms.broadcast(regions, buf, src)
            return
        large = not self._is_small(buf, self.tuning.chain_bytes)
        chain = algorithm == "chain" or (algorithm in ("auto", "hierarchical") and large)
        if algorithm == "hierarchical" or (algorithm == "auto" and self._spans_hosts()):
            hierarchical.broadcast(self.hierarchy(), buf, src, self._segment_elems(buf), self.tuning.depth, chain)
        elif chain:
            ring.chain_broadcast(self.transport, buf, src, self._segment_elems(buf), self.tuning.depth)
        else:
            tree.binomial_broadcast(self.transport, buf, src)

    def reduce(self, buf: torch.Tensor, dst: int, op: ReduceOp, algorithm: str) -> None:
        n, r = self.transport.world_size, self.transport.rank
        if r != dst:  # the algorithms use the buffer as scratch off the root: work on a copy
            buf = self.workspace.get("reduce-scratch", buf.numel(), buf.dtype, buf.device).copy_(buf)
        if algorithm == "auto":
            algorithm = "binomial" if self._is_small(buf) else "ring"
        if algorithm == "binomial":
            tree.binomial_reduce(self.transport, buf, dst, op, self.workspace)
            return
        bounds = ring.balanced_bounds(buf.numel(), n)
        ring.reduce_scatter(self.transport, buf, bounds, op, self.workspace, self._segment_elems(buf), self.tuning.depth)
        chunks = [buf[a:b] for a, b in zip(bounds, bounds[1:])]
        direct.gather(self.transport, chunks[r], chunks if r == dst else None, dst)
        if r == dst:
            finish(op, buf, n)

    def all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        n, r, m = self.transport.world_size, self.transport.rank, inp.numel()
        if (regions := self._regions()) is not None:
            shm_algorithms.all_gather(regions, outs, inp)
            return
        out = as_one_buffer(outs)
        if out is None:  # separate output tensors: gather into staging, then copy out
            out = self.workspace.get("all-gather", n * m, inp.dtype, inp.device)
            self._all_gather(out, inp, n, r, m)
            for i, o in enumerate(outs):
                o.copy_(out[i * m : (i + 1) * m])
        else:
            self._all_gather(out, inp, n, r, m)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, n: int, r: int, m: int) -> None:
        if self._is_small(out):  # one round of direct exchanges instead of n - 1 ring steps
            direct.all_to_all(self.transport, [out[i * m : (i + 1) * m] for i in range(n)], [inp] * n)
            return
        if self._spans_hosts():
            seg = self._segment_elems(out)
            hierarchical.all_gather(self.hierarchy(), out, inp, self.workspace, seg, self.tuning.depth)
            return
        out[r * m : (r + 1) * m].copy_(inp)
        ring.all_gather(self.transport, out, [i * m for i in range(n + 1)], self._segment_elems(out), self.tuning.depth)

    def reduce_scatter(self, out: torch.Tensor, ins: Sequence[torch.Tensor], op: ReduceOp) -> None:
        n, r, m = self.transport.world_size, self.transport.rank, out.numel()
        if (regions := self._regions()) is not None:
            shm_algorithms.reduce_scatter(regions, out, ins, op)
            return
        if self._spans_hosts():
            hierarchical.reduce_scatter(
                self.hierarchy(), out, ins, op, self.workspace, self._segment_elems(out), self.tuning.depth
            )
            return
        work = self.workspace.get("reduce-scatter", n * m, out.dtype, out.device)
        source = as_one_buffer(ins)
        if source is not None:
            work.copy_(source)
        else:
            for i, piece in enumerate(ins):
                work[i * m : (i + 1) * m].copy_(piece)
        ring.reduce_scatter(
            self.transport, work, [i * m for i in range(n + 1)], op, self.workspace,
            self._segment_elems(work), self.tuning.depth,
        )
        out.copy_(work[r * m : (r + 1) * m])
        finish(op, out, n)

    def _slotted_regions(self) -> SharedRegions | None:
        """The shared regions if their halves hold a slot per peer (scatter, gather, all-to-all)."""
        regions = self._regions()
        return regions if regions is not None and shm_algorithms.fits_slots(regions) else None

    def scatter(self, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int) -> None:
        if (regions := self._slotted_regions()) is not None:
            shm_algorithms.scatter(regions, out, pieces, src)
            return
        direct.scatter(self.transport, out, pieces, src)

    def gather(self, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
        if (regions := self._slotted_regions()) is not None:
            shm_algorithms.gather(regions, inp, outs, dst)
            return
        direct.gather(self.transport, inp, outs, dst)

    def all_to_all(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        if (regions := self._slotted_regions()) is not None:
            shm_algorithms.all_to_all(regions, outs, ins)
            return
        direct.all_to_all(self.transport, outs, ins)

    def barrier(self) -> None:
        direct.barrier(self.transport, self.workspace.get("barrier", 2, torch.uint8, self.device))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self.transport.send(buf, peer)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self.transport.recv(buf, peer)

    def close(self) -> None:
        if self._hierarchy is not None:
            self._hierarchy.close()
        self._symmetric.clear()
        self.transport.close()
        self.workspace.clear()


class TorchEngine:
    """torch.distributed's built-in collectives on a process group (the reference backend).

    AVG runs as SUM followed by one division, exactly as we define AVG, so it rounds as ours does.
    """

    def __init__(self, process_group: dist.ProcessGroup, timeout: float):
        self.pg = process_group
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.timeout = timeout
        self.workspace = Workspace()

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
        if self.rank != dst:  # gloo leaves partial results in non-root buffers: reduce a copy
            buf = self.workspace.get("reduce-scratch", buf.numel(), buf.dtype, buf.device).copy_(buf)
        dist.reduce(buf, self._global(dst), self._reduce_op(op), group=self.pg)
        if self.rank == dst:
            finish(op, buf, self.world_size)

    def all_gather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        dist.all_gather(list(outs), inp, group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, ins: Sequence[torch.Tensor], op: ReduceOp) -> None:
        # All-reduce a concatenated copy and keep our chunk: one path for every list form and for AVG.
        full = torch.cat(list(ins))
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
        send = torch.cat(list(ins))
        recv = torch.empty(sum(out_sizes), dtype=outs[0].dtype, device=outs[0].device)
        dist.all_to_all_single(recv, send, out_sizes, sizes, group=self.pg)
        for o, piece in zip(outs, recv.split(out_sizes)):
            o.copy_(piece)

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self.pg.send([buf], peer, 0).wait(datetime.timedelta(seconds=self.timeout))

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self.pg.recv([buf], peer, 0).wait(datetime.timedelta(seconds=self.timeout))

    def close(self) -> None:
        self.workspace.clear()
