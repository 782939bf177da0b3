"""Messages: one FIFO of slots per sender in each receiver's segment, moved chunk by chunk.

The FIFO from ``s`` to ``r`` lives in ``r``'s segment. Sender ``s`` owns ``head`` and receiver
``r`` owns ``tail``, both in ``r``'s control block (:mod:`.control`); both only grow (NCCL's
credits). The sender copies a chunk into slot ``head % slots`` when ``head - tail < slots``,
records the message's total size and its tag (what the message is, :mod:`.wirecheck`) next to
it, then publishes ``head + 1``; the receiver checks both against what it posted (a mismatch is
an error, never a silent misread), copies the chunk out and publishes ``tail + 1``. Counters are
written after the data they cover, behind a full fence. Messages between a pair therefore arrive
in the order posted, and a message larger than the FIFO streams through it in slot-sized chunks.

Progress happens inside :meth:`ShmRequest.wait` (and eagerly when a message is posted): a
waiting rank moves every pending chunk it can, to and from every peer, so a ring step's send and
receive advance together and every send/recv algorithm runs unchanged.
"""

from __future__ import annotations

import collections

import torch

from ... import wire
from ...errors import CollectiveError
from ..base import Peer, Request, Transport
from .config import ShmConfig
from .control import LINE, ON_MESSAGE, PAIR, fence
from .segment import Segments
from .waiting import Waiter
from .wirecheck import WireCheck


class _Message:
    """A posted send or receive: ``data`` (bytes of the tensor) moved chunk by chunk."""

    __slots__ = ("data", "tensor", "nbytes", "offset", "chunks", "peer", "kind", "tag")

    def __init__(self, tensor: torch.Tensor, peer: Peer, kind: str, slot_bytes: int, tag_base: int):
        self.tensor = tensor  # keeps the caller's storage alive
        # as_strided: a contiguous tensor of one element may still carry an odd stride
        flat = tensor.as_strided((tensor.numel(),), (1,)) if tensor.numel() else tensor.new_empty(0)
        self.data = flat.view(torch.uint8)
        self.nbytes = self.data.numel()
        self.offset = 0
        self.chunks = max(1, -(-self.nbytes // slot_bytes))  # an empty message is one empty chunk
        self.peer = peer
        self.kind = kind
        self.tag = wire.tag(tag_base, self.nbytes) if tag_base else 0  # what the message is (wire check)

    def chunk(self, slot_bytes: int) -> tuple[int, int]:
        """``(offset, size)`` of the next chunk of at most ``slot_bytes``."""
        return self.offset, min(slot_bytes, self.nbytes - self.offset)

    def advance(self, size: int) -> bool:
        """Count one chunk of ``size`` bytes as moved; True when the whole message has moved."""
        self.offset += size
        self.chunks -= 1
        return not self.chunks


class ShmRequest(Request):
    __slots__ = ("_fifos", "_message")

    def __init__(self, fifos: "Fifos", message: _Message):
        self._fifos = fifos
        self._message = message

    def wait(self) -> None:
        if self._message.chunks:
            self._fifos.wait(self._message)

    def is_completed(self) -> bool:
        if self._message.chunks:
            self._fifos.progress()
        return not self._message.chunks


class Fifos:
    """This rank's posted sends and receives, and the FIFOs they move through.

    Args:
        transport: gives the rank, the group's size and the collective under way (its ``op``,
            which errors name).
        segments, config: where the FIFOs are, their number of slots and slot size.
        waiter: to wake the peer a chunk was moved for, and to wait for free or full slots.
        check: the wire check: the tag of each message, and the error for one of another call.
    """

    def __init__(self, transport: Transport, segments: Segments, config: ShmConfig, waiter: Waiter, check: WireCheck):
        self._transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self._ctrl, self._data, self._start = segments.ctrl, segments.data, segments.fifo_start
        self._slots, self._slot_bytes = config.slots, config.slot_bytes
        self._wake, self._wait = waiter.wake, waiter.wait
        self._check = check
        n = self.world_size
        self._head = [0] * n  # my sends to q: chunks published (mirror of q's head[me])
        self._tail = [0] * n  # my receives from q: chunks consumed
        peers = [q for q in range(n) if q != self.rank]
        self._sends: dict[Peer, collections.deque[_Message]] = {q: collections.deque() for q in peers}
        self._recvs: dict[Peer, collections.deque[_Message]] = {q: collections.deque() for q in peers}

    def queue(self, tensor: torch.Tensor, peer: Peer, kind: str) -> Request:
        """Queue one message to (``kind`` ``"send"``) or from (``"recv"``) ``peer``; the first of
        its queue starts moving at once."""
        if not 0 <= peer < self.world_size or peer == self.rank:
            op = self._transport.op
            raise ValueError(f"{op}: peer {peer} is not another rank of 0..{self.world_size - 1}")
        m = _Message(tensor, peer, kind, self._slot_bytes, self._check.tag_base)
        sending = kind == "send"
        queue = (self._sends if sending else self._recvs)[peer]
        queue.append(m)
        if len(queue) == 1:
            (self._push if sending else self._pull)(peer)
        return ShmRequest(self, m)

    def _slot(self, owner: Peer, sender: Peer, slot: int, nbytes: int) -> torch.Tensor:
        index = sender if sender < owner else sender - 1
        start = self._start + (index * self._slots + slot) * self._slot_bytes
        return self._data[owner][start : start + nbytes]

    def _push(self, q: Peer) -> bool:
        """Copy pending chunks to ``q`` while it has free slots; True if any moved."""
        queue, ctrl, base = self._sends[q], self._ctrl[q], PAIR + self.rank * PAIR
        slots, slot_bytes = self._slots, self._slot_bytes
        moved = False
        while queue:
            head = self._head[q]
            if head - ctrl[base + LINE] >= slots:
                break
            m = queue[0]
            offset, size = m.chunk(slot_bytes)
            if size:
                self._slot(q, self.rank, head % slots, size).copy_(m.data[offset : offset + size])
            ctrl[base + 2 * LINE + head % slots] = m.nbytes
            ctrl[base + 3 * LINE + head % slots] = m.tag
            fence()
            ctrl[base] = self._head[q] = head + 1
            if m.advance(size):
                queue.popleft()
            moved = True
        if moved:
            self._wake(ON_MESSAGE, (q,))
        return moved

    def _pull(self, q: Peer) -> bool:
        """Copy arrived chunks from ``q`` into posted receives; True if any moved."""
        queue, ctrl, base = self._recvs[q], self._ctrl[self.rank], PAIR + q * PAIR
        slots, slot_bytes = self._slots, self._slot_bytes
        moved = False
        while queue:
            tail = self._tail[q]
            if ctrl[base] == tail:
                break
            fence()
            m = queue[0]
            sent = ctrl[base + 2 * LINE + tail % slots]
            if sent != m.nbytes:  # checked calls: the wire check's account of both; else the sizes
                raise self._size_mismatch(q, sent, m.nbytes)
            if ctrl[base + 3 * LINE + tail % slots] != m.tag:
                raise self._check.abandon(self._check.error(q))
            offset, size = m.chunk(slot_bytes)
            if size:
                m.data[offset : offset + size].copy_(self._slot(self.rank, q, tail % slots, size))
            fence()
            ctrl[base + LINE] = self._tail[q] = tail + 1
            if m.advance(size):
                queue.popleft()
            moved = True
        if moved:
            self._wake(ON_MESSAGE, (q,))
        return moved

    def _size_mismatch(self, q: Peer, sent: int, expected: int) -> CollectiveError:
        """``q`` sent a message of ``sent`` bytes where ``expected`` were posted: the error, the
        peers told to stop waiting."""
        check = self._check
        if check.tag_base:
            return check.abandon(check.error(q))
        op = self._transport.op
        return check.abandon(CollectiveError(
            f"{op}: rank {q} sent a {sent}-byte message where this rank (rank {self.rank}) "
            f"expected {expected} bytes: the ranks called different collectives or sizes",
            op=op,
            peer=q,
        ))

    def progress(self) -> None:
        """Move every chunk that can move now."""
        for q in self._sends:
            if self._sends[q]:
                self._push(q)
            if self._recvs[q]:
                self._pull(q)

    def _pending_peers(self) -> list[Peer]:
        return [q for q in self._sends if self._sends[q] or self._recvs[q]]

    def wait(self, m: _Message) -> None:
        """Move chunks (waiting when none can move) until ``m`` has moved entirely."""

        def ready() -> bool:
            self.progress()
            return not m.chunks

        self._wait(ready, self._pending_peers, "send to" if m.kind == "send" else "recv from", m.peer, ON_MESSAGE)
