"""Hierarchical collectives: work inside each host first, cross the network once per host.

When a group spans ``H`` hosts with ``L`` ranks each (``n = H L``), its links are of two kinds:
inside a host (shared memory) and across hosts (the network: latency ``α_n``, seconds per byte
``β_n``, and one network interface shared by the host's ``L`` ranks). A flat ring over ranks laid
out host by host crosses the network at every host boundary, and every one of its ``2(n - 1)``
steps waits for its slowest link, a network one:

    flat ring all-reduce:   2(n - 1) α_n + 2(n - 1)/n · S β_n

The hierarchical all-reduce (as in NCCL's trees over rings and Horovod's hierarchical allreduce)
splits the buffer into ``L`` chunks and uses each local rank as a *rail*: local rank ``j`` of
every host owns chunk ``j``.

1. **Reduce-scatter inside each host** by direct reads of shared memory
   (``shm_algorithms.reduce_scatter``): every local rank copies the chunks of the others into its
   region, and local rank ``j`` combines chunk ``j`` of every region, in local-rank order.
   ``σ + (2 - 1/L) S γ``: one synchronisation ``σ`` and ``(L - 1)/L · S`` bytes copied plus ``S``
   combined per rank, at ``γ`` seconds per byte copied.
2. **All-reduce along each rail** (the ``H`` ranks with local rank ``j``, one per host) over the
   group's transport, by recursive doubling for small chunks and the ring for large ones; the
   ``L`` rails run at once and share each host's network interface, which carries
   ``2(H - 1)/H · S`` bytes in all: ``2(H - 1) α_n + 2(H - 1)/H · S β_n`` (ring).
3. **All-gather inside each host** by direct reads (``shm_algorithms.all_gather``): local rank
   ``j`` copies its finished chunk into its region and every other chunk out of its peers'.
   ``σ + S γ``.

Against the flat ring the network sees ``2(H - 1)`` instead of ``2(n - 1)`` latencies and
``(H - 1)/H`` instead of ``(n - 1)/n`` of the bytes per interface (2 hosts × 2 ranks: 2 instead of 6
network latencies, 0.5 S instead of 0.75 S), and the intra-host phases cost two synchronisations
and about three copies of the buffer per rank, instead of ``2(L - 1)`` loopback messages (each
copied into the kernel and out again, by gloo's I/O threads).

Identical bits on every rank: each element is reduced over its host by one rank, in one fixed
order (phase 1), then across hosts by the rail's algorithm, which is itself bitwise identical on
all rail members, and afterwards only copied. AVG sums throughout and divides once, by ``n``,
after phase 2.

The same split serves the other collectives (rank-major order: the ``H`` ranks of local rank 0,
then of local rank 1, ...):

* **all_gather**: ring all-gather along the rails, then inside each host; the network carries
  ``(H - 1)/H · S`` per host instead of ``(n - 1)/n · S``.
* **reduce_scatter**: reduce-scatter inside each host, then ring reduce-scatter along the rails.
* **broadcast**: along the root's rail (binomial tree or chain), then inside each host from the
  rail member: each host receives the data once.

These need every host to run the same number of ranks of the group (a *uniform* layout); the
engine uses them only then. Transports (:class:`Hierarchy`): the rail phases use a
:class:`SubsetTransport` view of the group's transport (ranks renumbered, messages forwarded). The
intra-host phases use the transport a :data:`HostTransport` makes for the host's ranks: the CPU
backends make a shared-memory one (``transport/shm/``, private to the host), and the phases
above run ``shm_algorithms.py`` on its regions. Where there is none (CUDA, a host of one rank, a
group on one host forced to ``"hierarchical"``) or shared memory could not be set up (every rank
of the host then agrees to fall back, with a logged warning), the intra-host phases are the ring
(``ring.py``) or tree (``tree.py``) algorithms on a view of the group's transport: over loopback,
``(L - 1) α_l + (L - 1)/L · S β_l`` each.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from . import ring, shm_algorithms, tree
from .buffers import Workspace
from .ops import ReduceOp, finish
from .topology import Layout
from .transport.base import Transport
from .transport.subset import SubsetTransport

#: ``(host, members, fallback) -> Transport``: a transport among the group ranks ``members`` of
#: host ``host`` (this rank among them), renumbered ``0 .. len(members) - 1``, for the intra-host
#: phases; ``fallback()`` builds the :class:`SubsetTransport` view to use if it cannot be set up.
HostTransport = Callable[[int, Sequence[int], Callable[[], Transport]], Transport]


@dataclasses.dataclass
class Hierarchy:
    """This rank's two transports: its host (``intra``) and its rail (``inter``).

    ``intra.rank`` is the local rank ``j``, ``inter.rank`` the host index ``h``. ``inter`` is a
    :class:`SubsetTransport` view of the group's transport; ``intra`` one too, unless a
    :data:`HostTransport` made it (shared memory), in which case :meth:`close` closes it.
    """

    layout: Layout
    intra: Transport
    inter: Transport

    @classmethod
    def of(cls, transport: Transport, layout: Layout, host_transport: HostTransport | None = None) -> "Hierarchy":
        """Views of ``transport`` for ``layout``; ``host_transport`` makes the intra transport of
        a host with more than one rank."""
        me = transport.rank
        host = layout.host_of(me)
        members = layout.hosts[host]

        def view() -> Transport:
            return SubsetTransport(transport, members)

        intra = host_transport(host, members, view) if host_transport is not None and len(members) > 1 else view()
        return cls(layout, intra, SubsetTransport(transport, layout.rail(me)))

    @property
    def size(self) -> int:
        return self.intra.world_size * self.inter.world_size

    def position(self, rank: int) -> int:
        """``rank``'s position in rank-major order (local rank, then host)."""
        h = self.layout.host_of(rank)
        return self.layout.hosts[h].index(rank) * self.inter.world_size + h

    def close(self) -> None:
        """Close the intra transport (closing a view is a no-op)."""
        self.intra.close()


def _intra_reduce_scatter(
    hier: Hierarchy, buf: torch.Tensor, bounds: Sequence[int], op: ReduceOp, workspace: Workspace,
    segment_elems: int, depth: int,
) -> torch.Tensor:
    """Reduce chunk ``bounds[j]:bounds[j + 1]`` of ``buf`` over the host onto local rank ``j``
    (``op`` not finished); returns it: a view of ``buf`` (ring), or of scratch (shared memory,
    where ``buf`` is left unchanged)."""
    j = hier.intra.rank
    regions = hier.intra.shared_regions()
    if regions is None:
        ring.reduce_scatter(hier.intra, buf, bounds, op, workspace, segment_elems, depth)
        return buf[bounds[j] : bounds[j + 1]]
    out = workspace.get("hierarchical-chunk", bounds[j + 1] - bounds[j], buf.dtype, buf.device)
    shm_algorithms.reduce_scatter(regions, out, [buf[a:b] for a, b in zip(bounds, bounds[1:])], op)
    return out


def _intra_all_gather(
    hier: Hierarchy, buf: torch.Tensor, bounds: Sequence[int], mine: torch.Tensor, segment_elems: int, depth: int
) -> None:
    """Every local rank ``q``'s ``mine`` into chunk ``bounds[q]:bounds[q + 1]`` of ``buf``
    (``mine`` may be that chunk itself)."""
    j = hier.intra.rank
    chunks = [buf[a:b] for a, b in zip(bounds, bounds[1:])]
    regions = hier.intra.shared_regions()
    if regions is not None:
        shm_algorithms.all_gather(regions, chunks, mine)
        return
    if mine.data_ptr() != chunks[j].data_ptr():
        chunks[j].copy_(mine)
    ring.all_gather(hier.intra, buf, bounds, segment_elems, depth)


def all_reduce(
    hier: Hierarchy, buf: torch.Tensor, op: ReduceOp, workspace: Workspace,
    segment_elems: int, depth: int, small_elems: int,
) -> None:
    """Reduce-scatter in the host, all-reduce along the rail, all-gather in the host (in place)."""
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op
    bounds = ring.balanced_bounds(buf.numel(), hier.intra.world_size)
    chunk = _intra_reduce_scatter(hier, buf, bounds, inner, workspace, segment_elems, depth)
    if chunk.numel() <= small_elems:
        tree.recursive_doubling_all_reduce(hier.inter, chunk, inner, workspace)
    else:
        ring.all_reduce(hier.inter, chunk, inner, workspace, segment_elems, depth)
    finish(op, chunk, hier.size)
    _intra_all_gather(hier, buf, bounds, chunk, segment_elems, depth)


def all_gather(
    hier: Hierarchy, out: torch.Tensor, inp: torch.Tensor, workspace: Workspace, segment_elems: int, depth: int
) -> None:
    """All-gather along the rail, then in the host, in rank-major order; then reorder into ``out``."""
    m, hosts = inp.numel(), hier.inter.world_size
    stage = workspace.get("hierarchical", out.numel(), out.dtype, out.device)
    mine = stage[hier.intra.rank * hosts * m : (hier.intra.rank + 1) * hosts * m]  # this rail's block
    mine[hier.inter.rank * m : (hier.inter.rank + 1) * m].copy_(inp)
    ring.all_gather(hier.inter, mine, [h * m for h in range(hosts + 1)], segment_elems, depth)
    blocks = [j * hosts * m for j in range(hier.intra.world_size + 1)]
    _intra_all_gather(hier, stage, blocks, mine, segment_elems, depth)
    for r in range(hier.size):
        p = hier.position(r)
        out[r * m : (r + 1) * m].copy_(stage[p * m : (p + 1) * m])


def reduce_scatter(
    hier: Hierarchy, out: torch.Tensor, ins: Sequence[torch.Tensor], op: ReduceOp, workspace: Workspace,
    segment_elems: int, depth: int,
) -> None:
    """Stage ``ins`` rank-major, reduce-scatter in the host, then along the rail (``ins`` unchanged)."""
    m, hosts = out.numel(), hier.inter.world_size
    stage = workspace.get("hierarchical", hier.size * m, out.dtype, out.device)
    for r, piece in enumerate(ins):
        p = hier.position(r)
        stage[p * m : (p + 1) * m].copy_(piece)
    blocks = [j * hosts * m for j in range(hier.intra.world_size + 1)]
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op  # AVG divides once, at the end
    mine = _intra_reduce_scatter(hier, stage, blocks, inner, workspace, segment_elems, depth)
    ring.reduce_scatter(hier.inter, mine, [h * m for h in range(hosts + 1)], op, workspace, segment_elems, depth)
    out.copy_(mine[hier.inter.rank * m : (hier.inter.rank + 1) * m])
    finish(op, out, hier.size)


def broadcast(hier: Hierarchy, buf: torch.Tensor, src: int, segment_elems: int, depth: int, chain: bool) -> None:
    """Broadcast along ``src``'s rail (chain or binomial tree), then inside every host (by direct
    reads of the rail member's region when the host shares memory)."""
    layout = hier.layout
    local_src = layout.local(src).index(src)
    if hier.intra.rank == local_src:
        if chain:
            ring.chain_broadcast(hier.inter, buf, layout.host_of(src), segment_elems, depth)
        else:
            tree.binomial_broadcast(hier.inter, buf, layout.host_of(src))
    regions = hier.intra.shared_regions()
    if regions is not None:
        shm_algorithms.broadcast(regions, buf, local_src)
    elif chain:
        ring.chain_broadcast(hier.intra, buf, local_src, segment_elems, depth)
    else:
        tree.binomial_broadcast(hier.intra, buf, local_src)
