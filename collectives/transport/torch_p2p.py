"""Transport over torch.distributed point-to-point calls (``isend`` / ``irecv``), gloo on CPU.

This is the default transport. torch's process group is used only as a wire: we never call its
collectives here. gloo runs every posted send/receive on its own I/O threads, so a Python
algorithm can reduce one segment while the next ones are on the wire.

It implements the wire check of :mod:`collectives.wire`: gloo tags that name each payload message
of a collective (a mismatched message is never paired, so gloo never aborts on a size
difference), and, at ``RINGDDP_DEBUG=CHECK`` (the default), a header exchange with the ring
neighbours at the start of each collective, compared before the first payload wait.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from .. import wire
from ..errors import CollectiveError, CollectiveTimeoutError, timed_out
from .base import GroupInfo, Peer, Request, Transport

#: seconds a rank that found a mismatch still waits for its other header transfers before raising.
MISMATCH_GRACE = 1.0


#: how long a probe's wait may block, as far as gloo is concerned: unbounded.
FOREVER = datetime.timedelta(days=3650)


class TorchP2PRequest(Request):
    __slots__ = ("_work", "_transport", "_kind", "_peer", "_done", "_timeout")

    def __init__(
        self, work: dist.Work, transport: "TorchP2PTransport", kind: str, peer: Peer, timeout: datetime.timedelta | None = None
    ):
        self._work = work
        self._transport = transport
        self._kind = kind
        self._peer = peer
        self._done = False
        self._timeout = transport.wait_timeout if timeout is None else timeout

    def wait(self) -> None:
        if self._done:
            return
        if self._transport.headers_pending():
            self._transport.check_headers()  # never trust a payload before the headers matched
        try:
            self._work.wait(self._timeout)
        except RuntimeError as exc:
            raise self._transport.error(exc, self._kind, self._peer) from exc
        self._done = True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


class TorchP2PTransport(Transport):
    """Point-to-point over a torch.distributed process group (gloo for CPU tensors).

    Args:
        process_group: the torch group whose members form this transport; peer ``i`` is rank
            ``i`` of that group.
        rank: this process's rank within the group.
        timeout: seconds every wait may block before raising.
        tag: gloo tag of every message. Messages of different tags never match each other, so a
            transport with its own tag is a channel of its own on the same process group (user
            point-to-point uses one, see ``collectives/mailbox.py``).
    """

    def __init__(self, process_group: dist.ProcessGroup, rank: int, timeout: float, tag: int = 0):
        super().__init__(rank, process_group.size(), timeout)
        self._pg = process_group
        self._channel = tag
        self.wait_timeout = datetime.timedelta(seconds=timeout)
        self._seq = 0  # collectives so far: part of every tag, so stale messages never pair
        self._tag_base: int | None = None  # of the collective under way; None (point-to-point): tag 0
        self._headers: list[tuple[Peer, torch.Tensor, torch.Tensor, dist.Work]] | None = None
        self._header_sends: list[dist.Work] = []  # kept alive until the next collective, never waited

    @contextmanager
    def operation(self, name: str) -> Iterator[None]:
        """Label the traffic; if the API made a :class:`~collectives.wire.Header` current, check it."""
        header = wire.current()
        with super().operation(name):
            if header is None or self.world_size == 1:
                yield
                return
            self._seq += 1
            self._tag_base = header.tag_base(self._seq)
            self._headers, self._header_sends = [], []
            neighbours = ((self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size) if header.exchange else ()
            try:
                for peer in dict.fromkeys(neighbours):
                    mine, theirs = header.encode(self._seq, peer), torch.empty(wire.FIELDS, dtype=torch.int64)
                    recv = self._post(self._pg.recv, theirs, peer, wire.HEADER_TAG, "recv")
                    self._header_sends.append(self._post(self._pg.send, mine, peer, wire.HEADER_TAG, "send"))
                    self._headers.append((peer, mine, theirs, recv))
                yield
                self.check_headers()  # a collective that moved no payload still compares
            finally:
                self._tag_base, self._headers = None, None

    def headers_pending(self) -> bool:
        return bool(self._headers)

    def check_headers(self) -> None:
        """Wait for the neighbours' headers; raise ``CollectiveError`` if a call differs from ours.

        Before raising, the other neighbour's header is still read and this rank's header sends
        are let finish (each for up to :data:`MISMATCH_GRACE` seconds): a rank that raises here
        often exits next, and a process that exits with bytes unread on a connection resets it,
        which can cost a neighbour the header it was about to read; it would then report a
        closed connection instead of the description of both calls.
        """
        pending, self._headers = self._headers, None
        mismatch: CollectiveError | None = None
        for peer, mine, theirs, recv in pending or ():
            if mismatch is not None:
                self._settle(recv)
                continue
            TorchP2PRequest(recv, self, "recv (header)", peer).wait()
            diffs = wire.compare(mine, theirs)
            if diffs:
                mismatch = CollectiveError(
                    f"{self.op}: rank {peer} called a different collective (wire check, RINGDDP_DEBUG=CHECK): "
                    f"{wire.disagreement(self.rank, mine, peer, theirs)}. Every rank must issue the "
                    "same collectives in the same order with matching dtype, size, op, root, algorithm and "
                    "Tuning. No payload was delivered, but this group is unusable now",
                    op=self.op,
                    peer=peer,
                )
        if mismatch is not None:
            for send in self._header_sends:
                self._settle(send)
            raise mismatch

    def _settle(self, work: dist.Work) -> None:
        """Let a header transfer finish, for up to :data:`MISMATCH_GRACE` seconds; its failure does not matter."""
        try:
            work.wait(datetime.timedelta(seconds=min(MISMATCH_GRACE, self.timeout)))
        except RuntimeError:
            pass

    def close(self) -> None:
        """Drop the references to the process group and to header transfers, so that a broken
        group's close lets the process group (and its connections) go (``Group.close``)."""
        self._pg = None
        self._header_sends = []

    def _post(self, method, tensor: torch.Tensor, peer: Peer, tag: int, kind: str) -> dist.Work:
        try:  # the process group's own methods take group ranks and skip torch's Python-side checks
            return method([tensor], peer, tag)
        except RuntimeError as exc:  # gloo refuses to post once the pair to the peer is closed
            raise self.error(exc, kind, peer) from exc

    def _tag(self, tensor: torch.Tensor) -> int:
        return self._channel if self._tag_base is None else wire.tag(self._tag_base, tensor.numel() * tensor.element_size())

    @classmethod
    def for_group(cls, group: GroupInfo, device: torch.device) -> "TorchP2PTransport":
        """The transport of a collectives group (the ``p2p`` backend's factory)."""
        return cls(group.process_group, group.rank(), group.timeout)

    def error(self, exc: RuntimeError, kind: str, peer: Peer) -> CollectiveError:
        """Turn a gloo failure into an error naming the collective, the peer and this rank."""
        text = str(exc)
        late = "Timed out" in text or "timeout" in text.lower()
        cls = CollectiveTimeoutError if late else CollectiveError
        what = f": {timed_out(self.timeout)}" if late else " failed"
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
        return cls(
            f"{self.op}: {kind} {'to' if kind.startswith('send') else 'from'} rank {peer}{what} "
            f"(this is rank {self.rank} of {self.world_size}): {first_line}",
            op=self.op,
            peer=peer,
        )

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return TorchP2PRequest(self._post(self._pg.send, tensor, peer, self._tag(tensor), "send"), self, "send", peer)

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return TorchP2PRequest(self._post(self._pg.recv, tensor, peer, self._tag(tensor), "recv"), self, "recv", peer)

    def probe(self, tensor: torch.Tensor, peer: Peer) -> Request:
        """Post a receive like :meth:`irecv` whose ``wait`` has *no* deadline: it may stay posted
        with nobody waiting for it, and takes whatever ``peer`` sends next on this channel. A gloo
        wait that times out closes every connection of the process group, so a receive that may
        legitimately wait forever must not have one; its user enforces deadlines itself. Only on
        a channel of its own (no collective traffic): user point-to-point reads its headers this
        way (``collectives/mailbox.py``). A dead peer still fails the wait."""
        work = self._post(self._pg.recv, tensor, peer, self._tag(tensor), "recv")
        return TorchP2PRequest(work, self, "recv", peer, FOREVER)
