"""The wire protocol of user point-to-point messages (``collectives.p2p``), over our transports.

Every user message travels as two transport messages: a 3-integer *header* (tag, element count,
dtype) and then the payload. The header exists because of two facts about the wire:

* transports match the messages of a pair of ranks by posting order only (``transport/base.py``);
  they have no tags and no any-source receive;
* gloo aborts the whole process when a message is longer than the receive posted for it.

So a receive first takes the header, compares it with what the caller asked for, and only then
posts the payload receive into the caller's tensor. A mismatch (other tag, size or dtype) raises
:class:`MessageMismatchError` on the receiver after the payload was drained into scratch, so the
wire stays in step and the sender is not left waiting. Cost: one extra small message (``α``) per
user message.

A receive started with ``irecv`` must not block the group's queue while it waits for its header
(``irecv`` then ``send`` on both ranks of a pair is a common pattern). So ``irecv`` only posts the
header receive and leaves an :class:`Incoming` in the group's :class:`Mailbox`. Its payload
receive is posted ("settled") by the pair's waiter thread as soon as the header arrives, or
earlier by whoever needs it first: the caller's ``wait``, a later receive from the same peer, or,
on a wire shared with the collectives, the group's next collective (:meth:`Mailbox.settle_shared`). Receives of
one pair are always settled in posting order, which keeps the order on the wire.
"""

from __future__ import annotations

import threading

import torch

from .errors import CollectiveError
from .ops import SUPPORTED_DTYPES
from .transport.base import Request, Transport

#: dtype <-> header code (stable across processes: sorted by name).
DTYPES: tuple[torch.dtype, ...] = tuple(sorted(SUPPORTED_DTYPES, key=str))
_CODES = {d: i for i, d in enumerate(DTYPES)}


class MessageMismatchError(CollectiveError):
    """A user message met a receive that asked for another tag, size or dtype.

    The payload was drained, so the wire is still in step and the group stays usable.
    """


def header(tag: int, tensor: torch.Tensor) -> torch.Tensor:
    """The header announcing ``tensor`` with ``tag`` (a CPU int64 tensor of 3 elements)."""
    return torch.tensor([tag, tensor.numel(), _CODES[tensor.dtype]], dtype=torch.int64)


class Incoming:
    """One receive: header posted; checked and payload posted by :meth:`settle`; :meth:`complete` waits.

    Args:
        transport: the wire; ``peer`` is a group rank of it and ``src`` the same rank, global.
        tensor: the caller's tensor (any layout); ``buf`` is a contiguous buffer for the payload,
            copied back into ``tensor`` by :meth:`complete` when it is not ``tensor`` itself.
    """

    def __init__(self, transport: Transport, tensor: torch.Tensor, peer: int, src: int, tag: int, op: str):
        self.transport, self.tensor, self.peer, self.src, self.tag, self.op = transport, tensor, peer, src, tag, op
        self.buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self.head = torch.empty(3, dtype=torch.int64)
        self.head_request: Request | None = None
        self.payload: Request | None = None
        self.mismatch: MessageMismatchError | None = None
        self.failure: CollectiveError | None = None
        self._head_lock = threading.Lock()  # wait a request once: gloo's second wait waits for another message
        self._head_done = False

    def wait_head(self) -> None:
        """Block until the header is here, or its wait failed (kept in ``failure``); never raises."""
        assert self.head_request is not None
        with self._head_lock:
            if self._head_done:
                return
            try:
                with self.transport.operation(self.op):
                    self.head_request.wait()
            except CollectiveError as exc:
                self.failure = exc
            self._head_done = True

    def check(self) -> tuple[torch.Tensor, int] | None:
        """Wait for the header and compare it; return the payload receive to post (or None).

        On a mismatch the payload is still received, into scratch, so the wire stays in step;
        :meth:`complete` then raises.
        """
        self.wait_head()
        if self.failure is not None:
            raise self.failure
        tag, numel, code = self.head.tolist()
        if (tag, numel, code) == (self.tag, self.tensor.numel(), _CODES[self.tensor.dtype]):
            return (self.buf.view(-1), self.peer) if numel else None
        dtype = DTYPES[code] if 0 <= code < len(DTYPES) else torch.uint8
        self.mismatch = MessageMismatchError(
            f"{self.op}: the message from rank {self.src} does not match this receive: it sent "
            f"tag={tag} numel={numel} dtype={dtype}, this rank expected tag={self.tag} "
            f"numel={self.tensor.numel()} dtype={self.tensor.dtype}. Messages between two ranks are "
            "matched in the order they are sent; tags are checked, not used to reorder",
            op=self.op,
            peer=self.peer,
        )
        return (torch.empty(numel, dtype=dtype, device=self.buf.device), self.peer) if numel else None

    def settle(self) -> None:
        """Wait for the header, then post the payload receive; a failure is kept for :meth:`complete`."""
        try:
            message = self.check()
            if message is not None:
                self.payload = self.transport.irecv(*message)
        except CollectiveError as exc:
            self.failure = exc

    def complete(self) -> None:
        """Wait for the payload and write it into the caller's tensor (or raise a mismatch)."""
        if self.failure is not None:
            raise self.failure
        if self.payload is not None:
            with self.transport.operation(self.op):
                self.payload.wait()
        if self.mismatch is not None:
            raise self.mismatch
        if self.buf is not self.tensor:
            self.tensor.copy_(self.buf)


class Mailbox:
    """The receives of one group whose header is posted but whose payload is not yet (each
    :class:`~collectives.group.Group` owns one: ``group.mailbox``).

    Per pair of ranks the receives are settled strictly in posting order. While a pair has
    pending receives, a thread of its own waits for their headers and settles them as they
    arrive, so a sender waiting for its payload to be taken never depends on the receiver calling
    ``wait`` (gloo reports a receive complete only to a ``wait``, so this cannot be polled).
    Nobody holds the lock while waiting for a header.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[Incoming] = []
        self.channels: dict[str, Transport] = {}  # device type -> a wire of user messages only
        self._waiters: dict[tuple[int, int], threading.Thread] = {}

    def _first(self, pair: tuple[int, int] | None) -> Incoming | None:
        """The oldest pending receive of ``pair`` (of any pair if None): the only one settled next."""
        for rec in self.pending:
            if pair is None or _pair(rec) == pair:
                return rec
        return None

    def settle(self, until: Incoming | None = None, peer_of: Incoming | None = None) -> None:
        """Settle pending receives, blocking on their headers: all, those of one pair, or up to ``until``."""
        target = until or peer_of
        pair = _pair(target) if target is not None else None
        while True:
            with self.lock:
                first = self._first(pair)
                if first is None or (until is not None and until not in self.pending):
                    return
            first.wait_head()
            with self.lock:
                if first is self._first(_pair(first)):
                    self.pending.remove(first)
                    first.settle()

    def add(self, rec: Incoming) -> None:
        with self.lock:
            self.pending.append(rec)
            pair = _pair(rec)
            if pair not in self._waiters:
                waiter = threading.Thread(target=self._wait_pair, args=(pair,), name="ringddp-mailbox", daemon=True)
                self._waiters[pair] = waiter
                waiter.start()

    def settle_shared(self) -> None:
        """Post the payload receives pending on wires shared with the collectives: called by the
        group before each collective.

        On a wire shared with the collectives (NCCL), a collective may receive from the same peers;
        its messages come after the user's, so the user's receives must claim theirs first.
        Receives on a user channel (CPU) are left alone: no collective message can meet them.
        """
        if not self.pending:
            return
        channels = set(map(id, self.channels.values()))
        for rec in list(self.pending):
            if id(rec.transport) not in channels:
                self.settle(until=rec)

    def _wait_pair(self, pair: tuple[int, int]) -> None:
        while True:
            with self.lock:
                first = self._first(pair)
                if first is None:
                    del self._waiters[pair]
                    return
            self.settle(until=first)


def _pair(rec: Incoming) -> tuple[int, int]:
    return (id(rec.transport), rec.peer)
