"""Adoption: a buffer that is all-reduced again and again moves into symmetric memory, in place.

Why. On shared memory, an all-reduce of a buffer the peers can read where it lies
(``shm_algorithms.all_reduce_symmetric``) moves ``2S`` bytes per rank at two ranks; a private
buffer costs ``3S`` (it is copied into the regions and its reduced slice copied back out).
Our own DDP allocates its buckets in symmetric memory (``collectives.symmetric_empty``), but
torch's ``DistributedDataParallel`` on ``backend="ringddp"`` hands the backend buckets it
allocated itself, the same ones every step. Adoption gives those the symmetric path.

How. When a group's ``tuning.adopt_bytes`` is above zero (opt-in: the torch backend's
``Options.adopt_bytes`` / ``$RINGDDP_ADOPT_BYTES``), every all-reduce past the one-shot limit
first exchanges one small record per rank (one step): where its buffer lies in symmetric memory,
or whether it is a *candidate*: a contiguous tensor that is its storage's whole extent, in
memory torch allocated (not NumPy's, DLPack's or a buffer's: their owners hold the old address),
whose storage this group all-reduced before (the same storage object, held by a weak reference),
within the byte budget. Every rank reads the same records and decides alike:

* all buffers in symmetric memory: the symmetric algorithm, each rank's buffer wherever it lies;
* all candidates: the ranks allocate symmetric memory together (``SharedRegions.allocate``),
  each copies its buffer there and swaps its storage's memory with it (every tensor and view
  of that storage, e.g. DDP's per-parameter bucket views, follows), then the symmetric
  algorithm; the old private memory is freed;
* anything else (a rank with a fresh tensor, a slice, a budget spent): the two-shot algorithm,
  as without adoption. So ranks need not reuse their buffers alike; nothing fails if they do not.

Costs: the exchange is one step per large all-reduce (a few µs beside the ≥ 1 MiB it moves);
an adoption copies the buffer once and maps it on every peer. Adopted memory stays mapped until
the group is destroyed, counted against ``adopt_bytes``; the tensor stays valid afterwards (the
mapping lives as long as a view of it). The swap uses torch's ``UntypedStorage._swap_data_ptr_``;
where that is missing, adoption stays off (:data:`SWAP_WORKS`).

Why opt-in. Tensors and views follow the move, raw aliases cannot: a NumPy array from
``t.numpy()``, a DLPack capsule or a pointer taken before the move keeps the old address, whose
memory is freed. Nothing in Python can see such an alias, so the user says when there is none
(torch's DDP buckets: the reducer's own tensors and their views).
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)

#: a record's kind when the buffer is not in symmetric memory (else it is the allocation's index).
PRIVATE, CANDIDATE = -1, -2
#: int64 words per rank in the exchange: kind (an allocation index, PRIVATE or CANDIDATE),
#: byte offset in that allocation, byte count (ranks that disagree run the two-shot, which raises).
WORDS = 3
#: storages remembered as seen (a DDP has a few buckets; a loop a few tensors).
_SEEN = 64


def _swap_works() -> bool:
    """Whether this torch can point a storage at other memory in place (checked once, on a mapping
    like the ones adoption uses)."""
    try:
        mapping = mmap.mmap(-1, mmap.PAGESIZE)
        theirs = torch.frombuffer(mapping, dtype=torch.uint8, count=16)  # type: ignore[arg-type]
        mine = torch.arange(16, dtype=torch.uint8)
        view, target = mine[4:], theirs.data_ptr()
        theirs.copy_(mine)
        mine.untyped_storage()._swap_data_ptr_(theirs.untyped_storage())
        return mine.data_ptr() == target and view.data_ptr() == target + 4 and int(view[0]) == 4
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        log.info("adoption off: this torch cannot swap a storage's memory (%s)", exc)
        return False


SWAP_WORKS = _swap_works()


class Adopter:
    """One engine's adoption state: the storages seen and the bytes adopted."""

    def __init__(self) -> None:
        self.adopted = 0  # bytes moved into symmetric memory so far
        self.failed = False  # an allocation failed (the file system is full): stop trying
        self._seen: dict[int, StorageWeakRef] = {}

    def candidate(self, buf: torch.Tensor, limit: int) -> bool:
        """Whether ``buf`` may be adopted now: it is its storage, that storage was all-reduced
        before, and ``limit`` bytes are not spent. Remembers the storage otherwise."""
        nbytes = buf.numel() * buf.element_size()
        storage = buf.untyped_storage()
        if (not SWAP_WORKS or self.failed or self.adopted + nbytes > limit or buf.device.type != "cpu"
                or buf.storage_offset() != 0 or storage.nbytes() != nbytes or not buf.is_contiguous()
                or not storage.resizable()):  # not torch's memory (NumPy, DLPack, a buffer)
            return False
        ref = StorageWeakRef(storage)
        seen = self._seen.get(ref.cdata)
        if seen is not None and not seen.expired():
            return True
        if len(self._seen) >= _SEEN:
            self._seen = {k: v for k, v in self._seen.items() if not v.expired()}
            if len(self._seen) >= _SEEN:
                self._seen.clear()
        self._seen[ref.cdata] = ref
        return False

    def adopt(self, buf: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Move ``buf``'s storage into ``memory`` (this rank's symmetric memory, a ``uint8``
        tensor that is exactly its own storage, of ``buf``'s bytes): copy, then swap. Returns the
        ``uint8`` view of ``buf`` that now stands for this rank's memory."""
        memory.copy_(buf.view(torch.uint8))
        buf.untyped_storage()._swap_data_ptr_(memory.untyped_storage())
        self.adopted += memory.numel()
        self._seen.pop(StorageWeakRef(buf.untyped_storage()).cdata, None)
        log.debug("adopted a buffer of %d bytes into symmetric memory (%d in all)", memory.numel(), self.adopted)
        return buf.view(torch.uint8)
