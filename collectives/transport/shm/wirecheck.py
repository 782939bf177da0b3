"""The wire check on shared memory: whether the ranks run the same call, at no message's cost.

:mod:`collectives.wire` gives every checked collective a header; a transport makes its traffic
say which collective it belongs to and compares the ranks' headers before trusting a payload.
Here that costs no message of its own:

* each checked collective is numbered; its *tag base* (:meth:`collectives.wire.Header.tag_base`)
  goes with each FIFO slot as the message's tag (:mod:`.fifo`) and is mixed into each piece's
  signature (:mod:`.regions`), so data of another call is never read: the receiver raises;
* each rank publishes its header in its control block (``CALL``; the all-to-all byte counts in
  each peer's pair lines) when the collective starts; at its end every rank waits until each
  peer has started the same collective number and compares headers (:meth:`WireCheck.confirm`,
  skipped when a step already compared every peer's piece signature), so a rank that read
  nothing of the peers' (a broadcast root, a sender whose messages fit the slots) raises too;
* ranks that wait on each other without moving data (one runs a region algorithm, the other
  messages) compare headers at each wake-up (:meth:`WireCheck.check_peers`).

The rank that finds a difference, in a checked call or not (sizes, signatures), sets its
``ABANDONED`` word and wakes its peers (:meth:`WireCheck.abandon`), which raise at their next
wake-up instead of at the deadline. The error describes both calls, as on p2p.
"""

from __future__ import annotations

import array
from typing import Callable, Iterable

import torch

from ... import wire
from ...errors import CollectiveError
from ..base import Peer, Transport
from .control import ABANDONED, BYTES, CALL, LINE, ON_ANY, ON_CALL, PAIR, fence
from .segment import Segments
from .waiting import Waiter, nobody


class WireCheck:
    """The checked collective under way on this rank, and the comparisons with the peers'.

    Numbering starts with the transport (:meth:`begin`, from its ``operation``); publishing and
    comparing need the control blocks, from :meth:`attach` at set-up (the first collective).

    Attributes:
        seq: checked collectives so far.
        tag_base: the tag base of the checked collective under way; 0: the call is unchecked.
        verified: the last ``seq`` whose pieces matched every peer's signature (a region
            algorithm's step sets it; then :meth:`confirm` has nothing left to compare).
    """

    def __init__(self, transport: Transport):
        self._transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self._peers = [q for q in range(self.world_size) if q != self.rank]
        self.seq = 0
        self.tag_base = 0
        self.verified = 0
        self._header: wire.Header | None = None  # of the checked collective under way
        self._published_header: wire.Header | None = None  # the one whose fields are in shared memory
        self._ctrl: list[memoryview] = []
        self._wake: Callable[..., None] | None = None
        self._wait: Callable[..., None] | None = None

    def attach(self, segments: Segments, waiter: Waiter) -> None:
        """From set-up on: publish and compare through ``segments``, wait and wake with ``waiter``.
        Publishes the checked collective under way (set-up happens inside the first one)."""
        self._ctrl, self._wake, self._wait = segments.ctrl, waiter.wake, waiter.wait
        if self.tag_base:
            self._publish()

    def begin(self, header: wire.Header | None) -> None:
        """A collective starts: checked with ``header``, or unchecked (None). A checked one is
        numbered and, once attached, published."""
        if header is None:
            self.tag_base = 0
            return
        self.seq += 1
        self.tag_base = header.tag_base(self.seq)
        self._header = header
        if self._wake is not None:
            self._publish()

    def begin_native(self, header: wire.Header) -> int:
        """:meth:`begin` of a checked collective run by a native kernel that publishes the
        call's number and wakes the peers itself (:mod:`.native`): returns that number, or 0 when
        it was published here (the header in shared memory is another: its fields change under
        the seqlock first). Attached only."""
        self.seq = seq = self.seq + 1
        self.tag_base = header.tag_base(seq)
        self._header = header
        if header is self._published_header:
            return seq
        self._publish()
        return 0

    def _publish(self) -> None:
        """Publish the header of the checked collective: byte counts and fields, then its number."""
        me, h = self.rank, self._header
        mine = self._ctrl[me]
        if h is not self._published_header:  # a loop repeating one call only bumps the number
            mine[CALL] = 0  # a seqlock: readers that see the number change meanwhile discard what they read
            fence()
            if h.sends is not None and h.recvs is not None:
                for q in self._peers:
                    pair = PAIR + me * PAIR + BYTES
                    self._ctrl[q][pair : pair + 2] = array.array("q", (h.sends[q], h.recvs[q]))
            mine[CALL + 1 : CALL + LINE] = array.array("q", h.fields(0, 0)[1:LINE])
            self._published_header = h
            fence()  # the fields before the number (unchanged fields need no fence)
        mine[CALL] = self.seq
        self._wake(ON_CALL)

    def _header_of(self, q: Peer) -> list[int] | None:
        """Peer ``q``'s header message if it runs our checked collective (by number), else None."""
        theirs, seq = self._ctrl[q], self.seq
        if theirs[CALL] != seq:
            return None
        fence()
        fields = theirs[CALL : CALL + LINE].tolist()
        pair = PAIR + q * PAIR + BYTES
        sizes = self._ctrl[self.rank][pair : pair + 2].tolist() if self._header.sends is not None else [-1, -1]
        fence()
        return fields + sizes if theirs[CALL] == seq else None  # else it moved on meanwhile

    def _mine(self, q: Peer) -> list[int]:
        return self._header.fields(self.seq, q)

    def check(self, peers: Iterable[Peer]) -> None:
        """Raise if a peer in our checked collective (by number) runs a different call."""
        if not self.tag_base:
            return
        for q in peers:
            theirs = self._header_of(q)
            if theirs is not None and wire.compare(self._mine(q), theirs):
                raise self.abandon(self.error(q))

    def check_peers(self) -> None:
        """After a wake-up (:class:`.waiting.Waiter`): raise if a peer runs a different call, or
        abandoned the call because it found one."""
        # the abandoned words first: a peer that abandoned compared a header that, after the
        # fence, this check sees too, so the rank that differs is named with both calls
        abandoned = [q for q in range(self.world_size) if q != self.rank and self._ctrl[q][ABANDONED]]
        fence()
        self.check(self._peers)
        if abandoned and self.tag_base and self._header_of(abandoned[0]) is not None:
            raise self.error(abandoned[0])
        if abandoned:
            op = self._transport.op
            raise CollectiveError(
                f"{op}: rank {abandoned[0]} found that the ranks called different collectives or sizes "
                f"and abandoned the call (this is rank {self.rank} of {self.world_size})",
                op=op,
                peer=abandoned[0],
            )

    def confirm(self) -> None:
        """End of the checked collective: wait until every peer has started it, compare headers."""
        seq = self.seq
        for q in self._peers:
            theirs = self._ctrl[q]
            if theirs[CALL] < seq:
                self._wait(lambda: theirs[CALL] >= seq, nobody, "waiting for", q, ON_CALL)
        self.check(self._peers)

    def mismatch(self, peer: Peer, detail: str) -> CollectiveError:
        """See :meth:`~collectives.transport.base.SharedRegions.mismatch`: the wire check's
        description when ``peer``'s header differs from ours, else ``detail``; either way the
        peers stop waiting."""
        theirs = self._header_of(peer) if self.tag_base else None
        if theirs is not None and wire.compare(self._mine(peer), theirs):
            return self.abandon(self.error(peer))
        op = self._transport.op
        return self.abandon(CollectiveError(f"{op}: {detail}", op=op, peer=peer))

    def error(self, q: Peer) -> CollectiveError:
        """The error for a peer whose message, piece or header says it runs another call than ours."""
        if not self.tag_base:  # unchecked traffic (no header): sizes or signatures differed
            what = f"rank {q} is running a different collective or size than this rank (rank {self.rank})"
        else:
            theirs, mine = self._header_of(q), self._mine(q)
            if theirs is not None and wire.compare(mine, theirs):
                what = wire.disagreement(self.rank, mine, q, theirs)
            else:
                what = f"this rank ({self.rank}) called {wire.describe(torch.tensor(mine))}; rank {q} called "
                if theirs is not None:  # equal headers, different pieces (symmetric memory on one rank, offsets)
                    what += "the same; yet their pieces say they ran a different collective or size (a tensor in "
                    what += "symmetric memory on some ranks only, or at different offsets in it)"
                else:
                    what += "another collective"
        op = self._transport.op
        return CollectiveError(
            f"{op}: rank {q} called a different collective (wire check): {what}. Every rank must "
            "issue the same collectives with matching arguments and sizes, in the same order",
            op=op,
            peer=q,
        )

    def abandon(self, error: CollectiveError) -> CollectiveError:
        """Publish that this rank found a mismatch, so peers waiting on it raise at once instead of
        at the deadline; returns ``error`` for the caller to raise."""
        self._ctrl[self.rank][ABANDONED] = 1
        self._wake(ON_ANY)
        return error
