"""Collectives on shared regions: every rank reads its peers' data where it lies.

When the ranks of a group share memory (:class:`~collectives.transport.base.SharedRegions`,
the ``shm`` transport), nothing has to be *sent*: a rank copies its input into its own region
once and every peer reads it directly. The buffer is processed in pieces of at most
``regions.piece_bytes`` (half a region); consecutive pieces alternate between the two halves,
so a rank fills the next piece while slower peers still read the last one (see ``base.py``).

Costs below count memory traffic per rank in copies of the buffer (``S`` bytes; a copy reads
and writes ``S``) and synchronisations (``σ``: publish a counter, wait for the peers' counters).

All-reduce, two-shot (after DeepSpeed's CPU ``inference_all_reduce``)
    1. copy in: every rank copies its input into its region, except its own slice ``r``
       (only rank ``r`` reads it, straight from the input); step.
    2. reduce-scatter by direct reads: rank ``r`` combines slice ``r`` of every rank, in rank
       order ``0, 1, ..., n-1``, into its region's slice ``r`` (AVG divides there), and copies
       it to its output; step. Where the transport has the native kernel
       (:meth:`~collectives.transport.base.SharedRegions.fold_kernel`), the fold and the copy
       are one pass, block by block while the block is in cache (the same bits).
    3. all-gather by direct reads: rank ``r`` copies every peer's reduced slice into its output;
       end the piece.

    Cost ``2σ + S((n-1)/n + 1 + 2/n + (n-1)/n)`` ≈ ``2σ + 2.5 S`` copies at ``n = 2``, independent
    of ``n`` apart from ``σ``. Each element is reduced once, by one rank, in one fixed order,
    then only copied: results are bitwise identical on every rank.

All-reduce, one-shot (up to :func:`one_shot_limit`: ``ONE_SHOT_BYTES / n``)
    Copy in, step, then every rank combines *all* regions in rank order into its output. One
    ``σ`` instead of two, ``n`` reads of ``S``: below the limit the saved synchronisation (a
    wake-up can cost ~200 µs) outweighs the extra reads. Measured on 2 cores, median µs after a
    barrier, one-shot vs two-shot: 2 ranks 64 KiB 160 vs 260, 256 KiB 176 vs 292, 1 MiB 399 vs
    452, 2 MiB 703 vs 756; 4 ranks 64 KiB 583 vs 789, 256 KiB 777 vs 950, 1 MiB 1427 vs 1433,
    2 MiB 2086 vs 1916. Every rank evaluates the same expression on the same bits, so results
    still agree bitwise (and equal the two-shot's: same rank order). Ranks 0 and 1 take their
    own operand from their input (the same bits as their region), which the result overwrites
    only where it has been read: rank 0 then adds in place (``buf += region 1``), one torch call
    without ``out=`` checks. In loop timing (``--timing loop``, alternating sample by sample in
    one run, 2 ranks) one-shot still won over two-shot at every size up to 2 MiB: 64 KiB 155 vs
    375 µs, 1 MiB 820 vs 961, 2 MiB 1349 vs 1658 (a busy machine, load 3-5).
    On ``shm`` the whole one-shot runs as one native call where the transport has the kernel
    (``transport/shm/oneshot.c``, the same steps and bits; :func:`_one_shot` is the reference).

    At 2 ranks (:data:`ONE_SHOT_PIECES_RANKS`) every all-reduce of a private buffer runs
    one-shot, one piece (half a region) at a time: ``σ`` per piece instead of the two-shot's
    ``2σ``, for ``S`` more reads of local memory (a pair reads one peer's region either way).
    On this machine (2 cores of an Intel Xeon since 2026-11-28; memcpy ~8-10 GB/s beyond 1 MiB)
    the synchronisations cost more than the reads: 2 ranks, both algorithms alternating in the
    same processes, median ms of 10 samples at load 5: 8 MiB 6.1 against 7.6 (two-shot with
    the native fold; 10.0 without it), 16 MiB 12.8 / 14.8 / 17.2, 64 MiB 54 / 64 / 80, and
    2-4 MiB 0.80-0.89x the two-shot's time. At 3 ranks it measured 0.78-0.90x, at 4 ranks
    0.85-1.07x (reads grow with ``n``); both keep the two-shot for now (DESIGN §3). A buffer in
    symmetric memory above :func:`one_shot_limit` still takes :func:`all_reduce_symmetric`.

Reduce-scatter
    Copy every chunk but one's own into the region; step; rank ``r`` combines chunk ``r`` of
    every region in rank order into its output. ``σ + S((n-1)/n + 1)``.

All-gather
    Copy the input into the region; step; copy every peer's piece into the output.
    ``σ + S/n + S (n-1)/n``.

Broadcast
    The root copies a piece into its region; step (the others wait for the root only); every
    other rank copies it out. ``σ + S`` per rank, whatever ``n``: no relaying.

Scatter, gather and all-to-all: per-peer slots
    These move *different* bytes to each peer, so a half is divided into ``n - 1`` slots, one
    per peer (:func:`fits_slots`: at least one element each, else the engine uses messages).
    As in broadcast, a step waits only for the ranks whose region it reads, so a sender (the
    root of a scatter, the others in a gather) returns as soon as its copies are in, as with
    messages through a FIFO. The readers compare the signatures: a mismatch raises there at
    once, and on a sender at its next wait (the reader abandons the call; ``base.py``).
    Making every rank wait for every rank at the last step would raise on all ranks in the
    same call, but cost the senders a wait behind late peers, often a sleep and a wake-up.
    (Tried: that, and streaming broadcast/scatter/gather in 4 pieces so the copies in and out
    overlap; together a 1 MB broadcast took 740–820 µs instead of 300–390 µs, 2 ranks on 2
    cores under the bench's barrier skew.)

    * Scatter: the root copies piece ``q`` into slot ``q`` of its region; step; rank ``q``
      copies its slot out (the root copies its own piece locally meanwhile). The root copies
      ``S (n-1)/n``, every other rank ``S/n``: ``σ`` per piece, one copy of each byte in and
      one out, as through a FIFO, but in pieces of up to half a region instead of slot-sized
      chunks, and with one counter per piece instead of one per chunk and peer.
    * Gather, the mirror image: every other rank copies its input into its region; step; the
      root copies each out. ``σ + S/n`` per sender, ``σ + S (n-1)/n`` at the root.
    * All-to-all: every rank copies its ``n - 1`` outgoing chunks into its slots; step; every
      rank copies its chunk out of every peer's region. ``σ + 2 S (n-1)/n`` per rank (``S`` a
      rank's input). Chunk sizes may differ between pairs: piece 0 also carries every rank's
      counts to and from each peer, read by all ranks, so they agree on the number of pieces
      and raise together when two counts disagree.

Single-copy variants (``regions.cma``: Linux cross-memory attach, see ``base.py``)
    Broadcast, scatter, gather, all-gather and all-to-all only *move* bytes, each from one
    owner to one reader, and from ``CMA_BYTES[op]`` (bytes one reader takes from one owner;
    gather above 2 ranks only) they skip the regions: in a single piece, the owners publish
    their tensors, step, every reader copies what it needs straight out of the owners' memory
    into its output, ends the piece, and each owner waits for its readers before it returns
    (its tensor must not change while they read). Per transfer of ``S`` bytes one copy
    instead of two (into the region, out of it), for ``2σ`` (the owner's final wait) instead
    of ``σ`` per piece: the owner's copy disappears entirely, and the call is no longer cut
    into half-region pieces. The owners'
    wait costs a wake-up (~200 µs on a VM) where it sleeps, so small transfers keep the
    regions. Every rank decides alike: from sizes all ranks know (all-to-all: per pair, from
    the count both ends of the pair pass; the header check then confirms they agree before
    anyone reads). Readers check the bytes an owner published against their own, so a
    mismatch raises on every rank.

    All-reduce stays on the regions: reading the peers' slices out of their private buffers
    saves a copy on paper but measured slower (docs/DESIGN.md §3 has the numbers).

All functions take contiguous 1-D tensors; every rank calls with the same sizes (all-to-all:
matching sizes between each pair), and ``n >= 2`` for the per-peer slots.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable, Mapping, Sequence

import torch

from . import wire
from .ops import ReduceOp, combine, finish
from .ring import balanced_bounds
from .transport.base import SharedRegions

#: all-reduce buffers up to this size divided by the world size use the one-shot algorithm.
ONE_SHOT_BYTES = 2 << 20
#: up to this many ranks, larger all-reduces of private buffers run one one-shot per piece
#: instead of the two-shot (see the module docstring: a pair reads one peer's region).
ONE_SHOT_PIECES_RANKS = 2


#: single-copy transfers (``regions.cma``) from this many bytes per reader and owner, by op.
#: Measured on 2 cores, single-copy on and off alternating call by call in the same processes
#: (medians of 20): scatter gains from 128 KiB a transfer (the root's serial copy-in goes:
#: 0.87-0.55x the time at 2 and 4 ranks), all-to-all from 256 KiB (half of every rank's
#: copies go: 0.96-0.59x), all-gather from 512 KiB at 2 ranks (0.93-0.80x; even at 4),
#: broadcast from 256 KiB at 2 ranks (0.87-0.71x up to 4 MiB; at 16 MiB the halves already
#: overlap the root's copy-in with the reader's copy-out: 1.0x) but not at 4 ranks (0.96-1.15x:
#: three readers of one owner), hence 1 MiB. Gather: see :func:`gather`.
CMA_BYTES = {
    "broadcast": 1 << 20, "scatter": 256 << 10, "gather": 4 << 20, "all_gather": 512 << 10, "all_to_all": 256 << 10,
}


def _single_copy(regions: SharedRegions, op: str, nbytes: int) -> bool:
    """Whether a transfer of ``nbytes`` from one owner to one reader in ``op`` skips the regions."""
    return regions.cma and nbytes >= CMA_BYTES[op]


def _exchange_directly(
    regions: SharedRegions,
    signature: int,
    sends: Mapping[int, torch.Tensor],
    recvs: Mapping[int, torch.Tensor],
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One piece of single-copy reads: rank ``q`` in ``sends`` reads ``sends[q]`` from this rank,
    and this rank reads ``recvs[q]`` from rank ``q``. ``local`` (out, in) is copied while the
    readers read, before this rank waits for them."""
    regions.begin_piece(signature)
    regions.publish(sends)
    regions.step(list(recvs))  # the owners we read from have published
    for q, out in recvs.items():
        regions.read(q, out)
    regions.end_piece()
    if local is not None:
        local[0].copy_(local[1])
    regions.wait_readers(sends)


def one_shot_limit(world_size: int) -> int:
    """The largest all-reduce (bytes) that runs one-shot at ``world_size`` ranks whatever its
    buffer (1 MiB at 2); above it a buffer in symmetric memory takes :func:`all_reduce_symmetric`,
    a private one the two-shot (at up to :data:`ONE_SHOT_PIECES_RANKS` ranks: one-shots)."""
    return ONE_SHOT_BYTES // max(1, world_size)


def _pieces(numel: int, per_piece: int) -> list[tuple[int, int]]:
    per_piece = max(1, per_piece)
    return [(lo, min(numel, lo + per_piece)) for lo in range(0, numel, per_piece)]


def _at_least_one(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """An empty buffer still runs one (empty) piece: its step compares the ranks' signatures."""
    return pieces or [(0, 0)]


@functools.lru_cache(maxsize=1024)
def _signature(name: str, numel: int | tuple[int, ...], dtype: torch.dtype, *extra: object) -> int:
    """An int naming a call, equal on ranks that made the same call (``hash`` varies per process).
    Cached: a training loop repeats a few calls."""
    return zlib.crc32(f"{name}:{numel}:{dtype}:{extra}".encode())


def _reduce_into(op: ReduceOp, out: torch.Tensor, operands: list[torch.Tensor]) -> None:
    """``out = ((operands[0] op operands[1]) op operands[2]) ...``: one fixed order."""
    combine(op, operands[0], operands[1], out=out)
    for operand in operands[2:]:
        combine(op, out, operand, out=out)


def _one_shot_operands(regions: SharedRegions, buf: torch.Tensor, half: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The one-shot's tensors in ``half``: this rank's region view of ``buf``'s size, and the
    operands in rank order (every rank's view; ranks 0 and 1 take their own from ``buf``)."""
    r, numel, dtype = regions.rank, buf.numel(), buf.dtype
    operands = [regions.view(q, half, dtype, numel) for q in range(regions.world_size)]
    mine = operands[r]
    if r <= 1:  # our operand is the input itself: ranks 0 and 1 write it no earlier than they read it
        operands[r] = buf
    return mine, operands


def _one_shot(regions: SharedRegions, buf: torch.Tensor, op: ReduceOp, signature: int,
              planned: list[tuple[torch.Tensor, list[torch.Tensor]]] | None = None) -> None:
    """The one-shot all-reduce of ``buf`` (see the module docstring); ``planned``: both halves'
    :func:`_one_shot_operands`, made once (else made here for the half in use).

    This is the reference: where the transport has a native kernel for the call
    (:meth:`~collectives.transport.base.SharedRegions.one_shot_kernel`), the callers run that
    instead, which does the same steps with the same bits."""
    n = regions.world_size
    half = regions.begin_piece(signature)
    mine, operands = planned[half] if planned is not None else _one_shot_operands(regions, buf, half)
    mine.copy_(buf)
    regions.step(range(n))
    _reduce_into(op, buf, operands)
    regions.end_piece()
    finish(op, buf, n)


def one_shot_fits(regions: SharedRegions, nbytes: int) -> bool:
    """Whether an all-reduce of ``nbytes`` runs one-shot on ``regions`` in one piece
    (:func:`one_shot_limit`, or any piece at up to :data:`ONE_SHOT_PIECES_RANKS` ranks)."""
    n = regions.world_size
    return nbytes <= regions.piece_bytes and (n <= ONE_SHOT_PIECES_RANKS or nbytes <= ONE_SHOT_BYTES // n)


def _planned_one_shot(regions: SharedRegions, numel: int, dtype: torch.dtype) -> bool:
    """Whether a planned all-reduce of ``numel`` ``dtype`` elements is a one-shot with peers."""
    return regions.world_size > 1 and numel > 0 and one_shot_fits(regions, numel * dtype.itemsize)


def checked_all_reduce(regions: SharedRegions, numel: int, dtype: torch.dtype, op: ReduceOp,
                       header: wire.Header) -> Callable[[torch.Tensor], None] | None:
    """The whole checked all-reduce of any contiguous buffer of ``numel`` ``dtype`` elements as
    one native call, the transport's operation for ``header`` included
    (:meth:`~collectives.transport.base.SharedRegions.checked_one_shot`; AVG divides after it),
    where it runs one-shot and the transport offers that; else None. What the planned calls run
    (a persistent start, a plain :func:`collectives.all_reduce` whose shape ran before). It runs
    no torch operation autograd could record (AVG's division runs without autograd), so it may
    run in grad mode."""
    n = regions.world_size
    if not _planned_one_shot(regions, numel, dtype):
        return None
    run = regions.checked_one_shot("all_reduce", numel, dtype, op, _signature("all_reduce", numel, dtype, op), header)
    if run is None or op is not ReduceOp.AVG:
        return run
    return functools.partial(_finished, run, n)


def plan_all_reduce(regions: SharedRegions, buf: torch.Tensor, op: ReduceOp) -> Callable[[], None] | None:
    """All-reduce of this very ``buf`` planned once, to be run many times inside the transport's
    operation (a persistent collective, :mod:`collectives.persistent`, where
    :func:`checked_all_reduce` offers nothing): the one-shot as the transport's native call
    where it has one (:meth:`~collectives.transport.base.SharedRegions.one_shot_kernel`), else
    with its signature and both halves' tensors computed now; None where ``buf`` does not run
    one-shot."""
    n, numel, dtype = regions.world_size, buf.numel(), buf.dtype
    if not _planned_one_shot(regions, numel, dtype):
        return None
    signature = _signature("all_reduce", numel, dtype, op)
    if (native := regions.one_shot_kernel(numel, dtype, op, signature)) is not None:
        return functools.partial(_finished, native, n, buf) if op is ReduceOp.AVG else functools.partial(native, buf)
    halves = [_one_shot_operands(regions, buf, h) for h in (0, 1)]
    return functools.partial(_one_shot, regions, buf, op, signature, halves)


def _finished(native: Callable[[torch.Tensor], None], n: int, buf: torch.Tensor) -> None:
    """An AVG through a native one-shot: the sum, then the division (:func:`finish`), which
    autograd does not record (a planned call may run with grad mode on:
    :func:`checked_all_reduce`)."""
    native(buf)
    with torch.no_grad():
        finish(ReduceOp.AVG, buf, n)


def all_reduce(regions: SharedRegions, buf: torch.Tensor, op: ReduceOp) -> None:
    """All-reduce ``buf`` in place: one-shot up to :func:`one_shot_limit`, two-shot above; at up
    to :data:`ONE_SHOT_PIECES_RANKS` ranks one-shot, one piece at a time."""
    n, r = regions.world_size, regions.rank
    if n == 1 or buf.numel() == 0:
        finish(op, buf, n)
        return
    everyone = range(n)
    numel, dtype = buf.numel(), buf.dtype
    signature = _signature("all_reduce", numel, dtype, op)
    if n <= ONE_SHOT_PIECES_RANKS or one_shot_fits(regions, numel * dtype.itemsize):
        for lo, hi in _pieces(numel, regions.piece_bytes // dtype.itemsize):
            piece = buf[lo:hi]
            if (native := regions.one_shot_kernel(hi - lo, dtype, op, signature)) is not None:
                native(piece)
                finish(op, piece, n)
            else:
                _one_shot(regions, piece, op, signature)
        return
    fold = regions.fold_kernel(dtype, op)
    for lo, hi in _pieces(buf.numel(), regions.piece_bytes // buf.element_size()):
        piece = buf[lo:hi]
        bounds = balanced_bounds(hi - lo, n)
        h = regions.begin_piece(signature)
        mine = regions.view(r, h, buf.dtype, hi - lo)
        a, b = bounds[r], bounds[r + 1]
        mine[:a].copy_(piece[:a])
        mine[b:].copy_(piece[b:])
        regions.step(everyone)
        if b > a:
            operands = [piece[a:b] if q == r else regions.view(q, h, buf.dtype, b)[a:b] for q in everyone]
            if fold is None:
                _reduce_into(op, mine[a:b], operands)
                finish(op, mine[a:b], n)
                piece[a:b].copy_(mine[a:b])
            else:  # the same bits, folded into the region and copied out block by block in one pass
                fold(mine[a:b], piece[a:b], operands)
                finish(op, mine[a:b], n)
                finish(op, piece[a:b], n)
        regions.step(everyone)
        for q in everyone:
            qa, qb = bounds[q], bounds[q + 1]
            if q != r and qb > qa:
                piece[qa:qb].copy_(regions.view(q, h, buf.dtype, qb)[qa:qb])
        regions.end_piece()


def reduce_scatter(regions: SharedRegions, out: torch.Tensor, ins: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """Rank ``r`` gets ``ins[r]`` reduced over all ranks into ``out`` (of ``ins[r]``'s size).

    The ``n`` chunks ``ins`` may differ in size (the same sizes on every rank); ``out`` must not
    overlap ``ins``. Each piece moves the same offsets ``lo:hi`` of every chunk.
    """
    n, r = regions.world_size, regions.rank
    longest = max(t.numel() for t in ins)
    signature = _signature("reduce_scatter", tuple(t.numel() for t in ins), out.dtype, op)
    for lo, hi in _pieces(longest, regions.piece_bytes // out.element_size() // n):
        k = hi - lo
        h = regions.begin_piece(signature)
        mine = regions.view(r, h, out.dtype, n * k)
        for c in range(n):
            if c != r:
                part = ins[c][lo:hi]
                mine[c * k : c * k + part.numel()].copy_(part)
        regions.step(range(n))
        part = out[lo:hi]
        if part.numel():
            operands = [ins[r][lo:hi] if q == r else regions.view(q, h, out.dtype, n * k)[r * k : r * k + part.numel()]
                        for q in range(n)]
            _reduce_into(op, part, operands)
        regions.end_piece()
    finish(op, out, n)


def all_gather(regions: SharedRegions, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
    """``outs[q]`` gets rank ``q``'s ``inp``; the sizes may differ by rank (the same list on every
    rank), and ``inp`` may be ``outs[r]`` itself."""
    n, r = regions.world_size, regions.rank
    own = None if outs[r].data_ptr() == inp.data_ptr() else (outs[r], inp)
    signature = _signature("all_gather", tuple(o.numel() for o in outs), inp.dtype)
    if _single_copy(regions, "all_gather", max(o.numel() for o in outs) * inp.element_size()):
        peers = [q for q in range(n) if q != r]
        _exchange_directly(regions, signature, {q: inp for q in peers}, {q: outs[q] for q in peers}, own)
        return
    if own is not None:
        outs[r].copy_(inp)
    for lo, hi in _pieces(max(o.numel() for o in outs), regions.piece_bytes // inp.element_size()):
        h = regions.begin_piece(signature)
        part = inp[lo:hi]
        regions.view(r, h, inp.dtype, part.numel()).copy_(part)
        regions.step(range(n))
        for q in range(n):
            part = outs[q][lo:hi]
            if q != r and part.numel():
                part.copy_(regions.view(q, h, inp.dtype, part.numel()))
        regions.end_piece()


def broadcast(regions: SharedRegions, buf: torch.Tensor, src: int) -> None:
    """Copy ``buf`` of rank ``src`` into ``buf`` on every rank."""
    n, r = regions.world_size, regions.rank
    signature = _signature("broadcast", buf.numel(), buf.dtype, src)
    if _single_copy(regions, "broadcast", buf.numel() * buf.element_size()):
        readers = {q: buf for q in range(n) if q != src} if r == src else {}
        _exchange_directly(regions, signature, readers, {} if r == src else {src: buf})
        return
    for lo, hi in _at_least_one(_pieces(buf.numel(), regions.piece_bytes // buf.element_size())):
        h = regions.begin_piece(signature)
        if r == src:
            regions.view(r, h, buf.dtype, hi - lo).copy_(buf[lo:hi])
        regions.step([src])
        if r != src:
            buf[lo:hi].copy_(regions.view(src, h, buf.dtype, hi - lo))
        regions.end_piece()


#: the widest element of any dtype: slot offsets are multiples of it (a cache line when there is room).
_ELEMENT_ALIGN = 16


def fits_slots(regions: SharedRegions) -> bool:
    """A half holds one slot per peer of at least one element, plus the all-to-all header.

    Scatter, gather and all-to-all divide a half into per-peer slots; a group whose regions are
    too small for that (``RINGDDP_SHM_REGION_BYTES`` tiny, many ranks) uses the messages instead.
    The answer depends only on the group, so every rank chooses alike.
    """
    n = regions.world_size
    return regions.piece_bytes - _header_bytes(n) >= _ELEMENT_ALIGN * (n - 1)


def _header_bytes(n: int) -> int:
    """The all-to-all header: ``n`` send counts and ``n`` receive counts (int64)."""
    return 2 * n * 8


def _slot_bytes(space: int, count: int) -> int:
    """Bytes of each of ``count`` slots in ``space``: aligned to a cache line, or 16 if tiny."""
    per = space // count
    return per - per % (64 if per >= 64 else _ELEMENT_ALIGN)


def _slot(regions: SharedRegions, q: int, h: int, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of rank ``q``'s half ``h``."""
    return regions.view(q, h, torch.uint8, offset + numel * dtype.itemsize)[offset:].view(dtype)


def scatter(regions: SharedRegions, out: torch.Tensor, pieces: Sequence[torch.Tensor] | None, src: int) -> None:
    """Rank ``src`` hands ``pieces[q]`` (each of ``out``'s size) to rank ``q``'s ``out``.

    The root's half holds one slot per peer; ``pieces`` is None off the root.
    """
    n, r, m, dtype = regions.world_size, regions.rank, out.numel(), out.dtype
    peers = [q for q in range(n) if q != src]
    slot = _slot_bytes(regions.piece_bytes, n - 1)
    per_piece = slot // out.element_size()
    signature = _signature("scatter", m, dtype, src)
    if _single_copy(regions, "scatter", m * out.element_size()):
        if r == src:
            assert pieces is not None
            _exchange_directly(regions, signature, {q: pieces[q] for q in peers}, {}, (out, pieces[src]))
        else:
            _exchange_directly(regions, signature, {}, {src: out})
        return
    for lo, hi in _at_least_one(_pieces(m, per_piece)):
        h = regions.begin_piece(signature)
        if r == src:
            assert pieces is not None
            for i, q in enumerate(peers):
                _slot(regions, r, h, i * slot, dtype, hi - lo).copy_(pieces[q][lo:hi])
        regions.step([src])
        if r != src:
            out[lo:hi].copy_(_slot(regions, src, h, peers.index(r) * slot, dtype, hi - lo))
        regions.end_piece()
    if r == src:  # while the peers copy out the last piece
        assert pieces is not None
        out.copy_(pieces[src])


def gather(regions: SharedRegions, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int) -> None:
    """Rank ``dst`` gets every rank's ``inp`` in ``outs[q]``; ``outs`` is None off the root."""
    n, r, m, dtype = regions.world_size, regions.rank, inp.numel(), inp.dtype
    per_piece = regions.piece_bytes // inp.element_size()
    signature = _signature("gather", m, dtype, dst)
    # Single-copy saves only the senders' copies, which run beside the root's anyway, so the
    # time (the root's copies) stays: at 2 ranks it measured 1.06-1.19x slower at every size,
    # at 4 ranks on 2 cores, where the senders' copies compete for the cores, 0.92-0.85x
    # from 4 MiB a transfer. It still halves the senders' CPU.
    if n > 2 and _single_copy(regions, "gather", m * inp.element_size()):
        if r == dst:
            assert outs is not None
            _exchange_directly(regions, signature, {}, {q: outs[q] for q in range(n) if q != dst}, (outs[dst], inp))
        else:
            _exchange_directly(regions, signature, {dst: inp}, {})
        return
    if r == dst:  # while the peers copy in the first piece
        assert outs is not None
        outs[dst].copy_(inp)
    wait_for = range(n) if r == dst else []
    for lo, hi in _at_least_one(_pieces(m, per_piece)):
        h = regions.begin_piece(signature)
        if r != dst:
            regions.view(r, h, dtype, hi - lo).copy_(inp[lo:hi])
        regions.step(wait_for)
        if r == dst:
            assert outs is not None
            for q in range(n):
                if q != dst:
                    outs[q][lo:hi].copy_(regions.view(q, h, dtype, hi - lo))
        regions.end_piece()


def all_to_all(regions: SharedRegions, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """Rank ``r`` sends ``ins[j]`` to rank ``j`` and receives rank ``j``'s into ``outs[j]``.

    Sizes may differ between pairs, so no rank knows how many pieces the call takes until it has
    read every rank's header: piece 0 carries, after the slots, each rank's element counts to
    and from every peer. All ranks read the same headers, so they agree on the piece count and,
    when two counts disagree, all raise :class:`~collectives.errors.CollectiveError`.

    A pair whose count reaches ``CMA_BYTES`` (with ``regions.cma``) skips the slots: its sender
    publishes ``ins[j]`` in piece 0, the receiver reads it right after piece 0's header check,
    and the sender waits for those readers at the end. Both ends decide from the pair's count,
    which the header check has confirmed equal before anyone reads.
    """
    n, r, dtype = regions.world_size, regions.rank, ins[0].dtype
    header = regions.piece_bytes - _header_bytes(n)
    slot = _slot_bytes(header, n - 1)
    per_piece = slot // dtype.itemsize
    signature = _signature("all_to_all", -1, dtype)

    def where(q: int, j: int) -> int:
        """Byte offset of rank ``q``'s slot for rank ``j`` (no slot for itself)."""
        return (j if j < q else j - 1) * slot

    def direct(numel: int) -> bool:
        return _single_copy(regions, "all_to_all", numel * dtype.itemsize)

    sends = {j: ins[j] for j in range(n) if j != r and direct(ins[j].numel())}
    recvs = {j: outs[j] for j in range(n) if j != r and direct(outs[j].numel())}
    count, p = 1, 0
    while p < count:
        lo = p * per_piece
        h = regions.begin_piece(signature)
        if p == 0:
            sizes = [t.numel() for t in ins] + [t.numel() for t in outs]
            _slot(regions, r, h, header, torch.int64, 2 * n).copy_(torch.tensor(sizes, dtype=torch.int64))
            if sends:
                regions.publish(sends)
        for j in range(n):
            hi = min(ins[j].numel(), lo + per_piece)
            if j != r and j not in sends and hi > lo:
                _slot(regions, r, h, where(r, j), dtype, hi - lo).copy_(ins[j][lo:hi])
        regions.step(range(n))
        if p == 0:
            count = _agree_on_pieces(regions, h, header, per_piece, direct)
            for j, out in recvs.items():
                regions.read(j, out)
        for j in range(n):
            hi = min(outs[j].numel(), lo + per_piece)
            if j != r and j not in recvs and hi > lo:
                outs[j][lo:hi].copy_(_slot(regions, j, h, where(j, r), dtype, hi - lo))
        regions.end_piece()
        p += 1
    outs[r].copy_(ins[r])
    if sends:
        regions.wait_readers(sends)


def _agree_on_pieces(regions: SharedRegions, h: int, header: int, per_piece: int, direct: Callable[[int], bool]) -> int:
    """Check every rank's all-to-all header against its peers'; the pieces the call takes (pairs
    for which ``direct(count)`` holds need none)."""
    n, r = regions.world_size, regions.rank
    table = [_slot(regions, q, h, header, torch.int64, 2 * n).tolist() for q in range(n)]
    for q in range(n):
        for j in range(n):
            sends, expected = table[q][j], table[j][n + q]
            if j != q and sends != expected:
                raise regions.mismatch(
                    j if q == r else q,
                    f"rank {q} sends {sends} elements to rank {j}, which expects {expected} "
                    f"(this is rank {r}): every rank must make the same calls with matching sizes",
                )
    most = max([table[q][j] for q in range(n) for j in range(n) if j != q and not direct(table[q][j])], default=0)
    return max(1, -(-most // per_piece))


#: the in-place reduction of :func:`all_reduce_symmetric` streams through chunks of this size.
_SCRATCH_BYTES = 256 << 10


def all_reduce_symmetric(regions: SharedRegions, bufs: Sequence[torch.Tensor], op: ReduceOp, where: int) -> None:
    """All-reduce ``bufs[r]`` in place, where every rank's buffer lies in symmetric memory.

    ``bufs[q]`` is rank ``q``'s buffer as mapped on this rank (``SharedRegions.allocate``):
    peers read the input where the user computed it, so nothing is copied into the regions.

    1. step: every rank's input is in place.
    2. rank ``r`` reduces slice ``r`` of every rank's buffer, in rank order, into its own
       buffer's slice ``r`` (AVG divides there); step.
    3. rank ``r`` copies every peer's reduced slice into its buffer; step: nobody reads this
       rank's buffer any more, so the caller may overwrite it when this returns.

    Cost ``3σ + S(1 + 1/n + (n-1)/n) = 3σ + 2S``, counted as for :func:`all_reduce`, whose
    ``S((n-1)/n + 1 + 2/n + (n-1)/n)`` is ``3S`` at ``n = 2``: the copy into the region and the
    copy of the reduced slice back out are gone (ranks ``r ≥ 2`` reduce through a small,
    cache-resident scratch, since their own slice is read after the first write). Each slice
    is reduced once, by one rank, in rank order: bitwise the same result as :func:`all_reduce`.
    ``where`` (the buffer's byte offset in its allocation) joins the signature, so ranks passing
    different parts of their memory raise instead of mixing them.
    """
    n, r = regions.world_size, regions.rank
    buf = bufs[r]
    if n == 1 or buf.numel() == 0:
        finish(op, buf, n)
        return
    everyone = range(n)
    bounds = balanced_bounds(buf.numel(), n)
    a, b = bounds[r], bounds[r + 1]
    h = regions.begin_piece(_signature("all_reduce_symmetric", buf.numel(), buf.dtype, op, where))
    regions.step(everyone)
    if b > a:
        operands = [bufs[q][a:b] for q in everyone]
        if r <= 1:  # out aliases the first or second operand: elementwise ops allow that
            _reduce_into(op, buf[a:b], operands)
        else:  # out is a later operand, read after out is written: go through a scratch
            k = max(1, min(_SCRATCH_BYTES, regions.piece_bytes) // buf.element_size())
            scratch = regions.view(r, h, buf.dtype, k)
            for lo in range(0, b - a, k):
                hi = min(b - a, lo + k)
                _reduce_into(op, scratch[: hi - lo], [x[lo:hi] for x in operands])
                buf[a + lo : a + hi].copy_(scratch[: hi - lo])
        finish(op, buf[a:b], n)
    regions.step(everyone)
    for q in everyone:
        qa, qb = bounds[q], bounds[q + 1]
        if q != r and qb > qa:
            buf[qa:qb].copy_(bufs[q][qa:qb])
    regions.step(everyone)
    regions.end_piece()
