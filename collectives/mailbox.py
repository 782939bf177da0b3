"""The wire protocol of user point-to-point messages (``collectives.p2p``), over our transports.

Every user message travels as two transport messages: a 3-integer *header* (tag, element count,
dtype) and then the payload. The header exists because of two facts about the wire:

* transports match the messages of a pair of ranks by posting order only (``transport/base.py``);
  they have no tags and no any-source receive;
* gloo aborts the whole process when a message is longer than the receive posted for it.

So a receive first takes a header, compares it with what the caller asked for, and only then
posts the payload receive into the caller's tensor. A mismatch (other tag, size or dtype) raises
:class:`MessageMismatchError` on the receiver after the payload was drained into scratch, so the
wire stays in step and the sender is not left waiting. Cost: one extra small message (``α``) per
user message.

**Streams.** The :class:`Mailbox` of a group keeps, per wire and peer, a *stream*: at most one
header receive posted at a time, read by a thread of its own (alive while a header receive is
posted). A header that arrives is *parked* at the head of its stream until a receive claims it;
claiming it posts the payload receive at once, and only then may the stream read its next header
(on the wire, a header's payload comes before the next header). A stream reads when some pending
receive could take its next message. Nobody waits for a header while holding the mailbox lock, and
``irecv`` never blocks the group's queue: posting a receive only records it.

**Matching.** Pending receives are kept in posting order. A header goes to the earliest-posted
pending receive that accepts it: a receive from its sender (whatever its tag: a different tag,
size or dtype is then a mismatch, as above), or an any-source receive (``src=None``) with the
same tag. A header nobody accepts stays parked, and its stream is blocked until a receive that
accepts it is posted. So messages from one sender are taken in the order they were sent, by
receives in the order they were posted.

**Any-source receives: what "first" means, and fairness.** An any-source receive makes every
stream of the group read. The mailbox numbers headers in the order their arrival is seen (each
stream's thread takes a number under the mailbox lock as its wait returns), and an any-source
receive takes, among the headers parked (one per stream at most) whose tag it asks for, the one
that arrived first; if there is none, the next such header to arrive. "First" is therefore
first-come, first-served across senders. No sender starves: a sender's message, once its header
has arrived, is older than every header that arrives after it, and each other stream holds at
most one older header, so at most ``world_size - 2`` any-source receives of its tag are served
before it. (gloo's own any-source receive prefers the lowest rank with a message waiting, which
can starve a higher rank while a lower one keeps sending.)

**Probes and their deadlines.** A stream that read for an any-source receive may end up with a
header receive nobody waits for (another sender's message came first): a *probe*, kept for the
stream's next message. A gloo wait that times out closes every connection of its process group,
so probes are waited for without a deadline (``TorchP2PTransport.probe``); the deadline is the caller's,
in :meth:`Mailbox.complete` (``timeout`` seconds from the start of the wait, as gloo counts).
A sender that dies fails its stream at once (gloo reports the closed connection), and with it
the receives from that sender and the pending any-source receives. Only the user channel (CPU
tensors: a gloo channel of its own) probes. A wire shared with the collectives (NCCL) has no
any-source receive, since a header receive left posted there would take a collective's message;
its streams read only for receives from their own peer, with the transport's own deadline.

**Closing.** A probe would stay blocked in gloo until its peer's process exits, and a thread
woken in gloo while its own interpreter shuts down aborts the process. So :meth:`Mailbox.close`
(from ``Group.close``: ``destroy_process_group``) sends every peer a *goodbye* header on the user
channel, which ends the peer's probe on this rank, and waits a few seconds (:data:`CLOSE_GRACE`)
for this rank's own probes to end the same way. A receive that meets a goodbye fails: the sender
closed the group.

On a wire shared with the collectives (NCCL), a collective may receive from the same peers; the
user's messages come before its own, so the group waits before each collective until every
pending receive on such a wire has claimed its message (:meth:`Mailbox.settle_shared`).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Sequence

import torch

from .errors import CollectiveError, CollectiveTimeoutError, timed_out
from .ops import SUPPORTED_DTYPES
from .transport.base import Request, Transport
from .transport.torch_p2p import TorchP2PTransport

#: dtype <-> header code (stable across processes: sorted by name).
DTYPES: tuple[torch.dtype, ...] = tuple(sorted(SUPPORTED_DTYPES, key=str))
_CODES = {d: i for i, d in enumerate(DTYPES)}
#: gloo tag of the user channel (collectives use 0, the NCCL id exchange uses its own).
USER_TAG = 1
#: the dtype code of a goodbye header (:meth:`Mailbox.close`).
GOODBYE = -1
#: seconds ``Mailbox.close`` waits for the peers' goodbyes to end this rank's probes.
CLOSE_GRACE = 5.0


class MessageMismatchError(CollectiveError):
    """A user message met a receive that asked for another tag, size or dtype.

    The payload was drained, so the wire is still in step and the group stays usable.
    """


def header(tag: int, tensor: torch.Tensor) -> torch.Tensor:
    """The header announcing ``tensor`` with ``tag`` (a CPU int64 tensor of 3 elements)."""
    return torch.tensor([tag, tensor.numel(), _CODES[tensor.dtype]], dtype=torch.int64)


def _describe(tag: int, numel: int, code: int) -> str:
    dtype = DTYPES[code] if 0 <= code < len(DTYPES) else "?"
    return f"tag={tag} numel={numel} dtype={dtype}"


class Incoming:
    """One receive: recorded in the mailbox, then given a header (:meth:`take`), then completed.

    Args:
        transport: the wire.
        tensor: the caller's tensor (any layout); ``buf`` is a contiguous buffer for the payload,
            copied back into ``tensor`` by :meth:`complete` when it is not ``tensor`` itself.
        peer: the sender's group rank, or ``None`` for an any-source receive (then set by
            :meth:`take`); ``src`` the same rank, global.
        tag: the tag asked for.
        op: the call's name, for messages.
    """

    def __init__(self, transport: Transport, tensor: torch.Tensor, peer: int | None, src: int | None, tag: int, op: str):
        self.transport, self.tensor, self.peer, self.src, self.tag, self.op = transport, tensor, peer, src, tag, op
        self.any_source = peer is None
        self.buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self.payload: Request | None = None
        self.mismatch: MessageMismatchError | None = None
        self.failure: CollectiveError | None = None
        self.done = False  # a header was taken (payload posted) or the receive failed

    def accepts(self, peer: int, tag: int) -> bool:
        """Whether a header from ``peer`` with ``tag`` is this receive's to take."""
        return tag == self.tag if self.any_source else peer == self.peer

    def expect(self, peer: int, src: int, values: Sequence[int]) -> tuple[torch.Tensor, int] | None:
        """Take the header ``values`` from ``peer`` (global rank ``src``); return the payload
        receive to post (or None: nothing to receive). On a mismatch the payload is still
        received, into scratch, so the wire stays in step; :meth:`complete` then raises."""
        self.peer, self.src = peer, src
        tag, numel, code = values
        if (tag, numel, code) == (self.tag, self.tensor.numel(), _CODES[self.tensor.dtype]):
            return (self.buf.view(-1), peer) if numel else None
        self.mismatch = MessageMismatchError(
            f"{self.op}: the message from rank {src} does not match this receive: it sent "
            f"{_describe(tag, numel, code)}, this rank expected tag={self.tag} "
            f"numel={self.tensor.numel()} dtype={self.tensor.dtype}. Messages between two ranks are "
            "matched in the order they are sent; tags are checked, not used to reorder",
            op=self.op,
            peer=peer,
        )
        dtype = DTYPES[code] if 0 <= code < len(DTYPES) else torch.uint8
        return (torch.empty(numel, dtype=dtype, device=self.buf.device), peer) if numel else None

    def take(self, peer: int, src: int, values: Sequence[int]) -> None:
        """:meth:`expect`, then post the payload receive; a failure is kept for :meth:`complete`."""
        message = self.expect(peer, src, values)
        try:
            if message is not None:
                with self.transport.operation(self.op):
                    self.payload = self.transport.irecv(*message)
        except CollectiveError as exc:
            self.failure = exc
        self.done = True

    def fail(self, error: CollectiveError) -> None:
        self.failure, self.done = error, True

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


class _Stream:
    """The headers of one wire from one peer (see the module docstring)."""

    __slots__ = ("transport", "peer", "head", "request", "arrival", "failure", "closed", "reader")

    def __init__(self, transport: Transport, peer: int):
        self.transport, self.peer = transport, peer
        self.head = torch.empty(3, dtype=torch.int64)
        self.request: Request | None = None  # the header receive posted, not yet arrived
        self.arrival: int | None = None  # the arrival number of the parked header, if one is
        self.failure: CollectiveError | None = None  # the read failed: the peer died
        self.closed = False  # the peer said goodbye
        self.reader: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        return self.request is None and self.arrival is None and self.failure is None and not self.closed


def _no_channel() -> TorchP2PTransport:
    raise RuntimeError("the group was closed")


class Mailbox:
    """The pending receives and the streams of one group (each
    :class:`~collectives.group.Group` owns one: ``group.mailbox``); see the module docstring.

    Args:
        ranks: the group's members' global ranks (for messages and ``src``).
        user_channel: builds the group's user channel, the wire of CPU user messages
            (:meth:`user_channel`): a gloo channel of its own, which can probe.
    """

    def __init__(self, ranks: Sequence[int], user_channel: Callable[[], TorchP2PTransport]):
        self.ranks = list(ranks)
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.pending: list[Incoming] = []
        self._make_channel = user_channel
        self._channel: TorchP2PTransport | None = None
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._arrivals = itertools.count()
        self._goodbyes: list[Request] | None = None  # sent by close(): kept alive, never waited

    def user_channel(self) -> TorchP2PTransport:
        """The wire of CPU user messages, built on first use (one, even when two threads send
        at once: messages of a pair are ordered per wire)."""
        with self.lock:
            if self._channel is None:
                self._channel = self._make_channel()
            return self._channel

    # ------------------------------------------------------------------------ receiving

    def post(self, rec: Incoming) -> None:
        """Record ``rec`` (in the group's queue order) and let it take a parked header or make its
        streams read. Never blocks."""
        with self.lock:
            self.pending.append(rec)
            self._pump()

    def complete(self, rec: Incoming) -> None:
        """Wait until ``rec`` has its message (at most ``timeout`` seconds of its wire), then for
        the payload; raise what failed."""
        seconds = rec.transport.timeout
        with self.lock:
            if not self._changed.wait_for(lambda: rec.done, seconds):
                self.pending.remove(rec)  # a header arriving later must not land in the caller's tensor
                raise self._late(rec, seconds)
        rec.complete()

    def settle_shared(self) -> None:
        """Wait until no receive on a wire shared with the collectives is pending (called by the
        group before each collective; see the module docstring)."""
        if not self.pending:  # the common case, without the lock
            return
        with self.lock:
            shared = [r for r in self.pending if r.transport is not self._channel]
            if not shared:
                return
            seconds = max(r.transport.timeout for r in shared)
            if not self._changed.wait_for(lambda: all(r.done for r in shared), seconds):
                rec = next(r for r in shared if not r.done)
                self.pending.remove(rec)
                rec.fail(self._late(rec, seconds))
                raise rec.failure

    def _pump(self) -> None:
        """Match parked headers to receives, make streams with demand read, fail receives that can
        no longer be served. Hold the lock."""
        for stream in sorted((s for s in self._streams.values() if s.arrival is not None), key=lambda s: s.arrival):
            values = stream.head.tolist()
            rec = next((r for r in self.pending if r.transport is stream.transport and r.accepts(stream.peer, values[0])), None)
            if rec is not None:
                self.pending.remove(rec)
                stream.arrival = None
                rec.take(stream.peer, self.ranks[stream.peer], values)
        for rec in self.pending:
            for stream in self._candidates(rec):
                if stream.idle:
                    self._read(stream)
        for rec in list(self.pending):
            error = self._hopeless(rec)
            if error is not None:
                self.pending.remove(rec)
                rec.fail(error)
        self._changed.notify_all()

    def _stream(self, transport: Transport, peer: int) -> _Stream:
        key = (id(transport), peer)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream(transport, peer)
        return stream

    def _candidates(self, rec: Incoming) -> list[_Stream]:
        """The streams whose next message ``rec`` could take."""
        if not rec.any_source:
            return [self._stream(rec.transport, rec.peer)]
        me = rec.transport.rank
        return [self._stream(rec.transport, q) for q in range(rec.transport.world_size) if q != me]

    def _read(self, stream: _Stream) -> None:
        """Post ``stream``'s next header receive and make sure a thread waits for it. Hold the lock."""
        transport = stream.transport
        try:
            with transport.operation("recv"):
                read = transport.probe if transport is self._channel else transport.irecv
                stream.request = read(stream.head, stream.peer)
        except CollectiveError as exc:  # gloo refuses to post once the connection is closed
            stream.failure = exc
            return
        if stream.reader is None:
            stream.reader = threading.Thread(target=self._reader, args=(stream,), name="ringddp-mailbox", daemon=True)
            stream.reader.start()

    def _reader(self, stream: _Stream) -> None:
        """A stream's thread: wait for each header it posts, then let the mailbox act on it."""
        while True:
            with self.lock:
                request = stream.request
                if request is None:
                    stream.reader = None
                    self._changed.notify_all()  # close() waits for the readers to end
                    return
            failure = None
            try:
                with stream.transport.operation("recv"):
                    request.wait()
            except CollectiveError as exc:
                failure = exc
            with self.lock:
                stream.request = None
                if failure is not None:
                    stream.failure = failure
                elif int(stream.head[2]) == GOODBYE:
                    stream.closed = True
                else:
                    stream.arrival = next(self._arrivals)
                self._pump()

    def _hopeless(self, rec: Incoming) -> CollectiveError | None:
        """Why ``rec`` can no longer get a message (its sender died or closed the group), or None."""
        streams = self._candidates(rec)
        failed = next((s for s in streams if s.failure is not None), None)
        if failed is not None:
            return self._peer_error(rec, failed)
        if all(s.closed for s in streams):
            return self._peer_error(rec, streams[0])
        return None

    @staticmethod
    def _where(rec: Incoming) -> str:
        return f"(this is rank {rec.transport.rank} of {rec.transport.world_size})"

    def _peer_error(self, rec: Incoming, stream: _Stream) -> CollectiveError:
        src = self.ranks[stream.peer]
        whom = "any rank" if rec.any_source else f"rank {src}"
        if stream.failure is not None:
            cause = stream.failure.__cause__ or stream.failure
            text = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
            cls = type(stream.failure) if isinstance(stream.failure, CollectiveTimeoutError) else CollectiveError
            return cls(f"{rec.op}: recv from {whom}: rank {src} failed {self._where(rec)}: {text}", op=rec.op, peer=stream.peer)
        closed = "every peer closed" if rec.any_source else f"rank {src} closed"
        return CollectiveError(
            f"{rec.op}: recv from {whom}: {closed} the group (destroy_process_group) before sending a "
            f"message for this receive {self._where(rec)}",
            op=rec.op,
            peer=None if rec.any_source else stream.peer,
        )

    def _late(self, rec: Incoming, seconds: float) -> CollectiveTimeoutError:
        """The deadline error of a receive that got no message, naming whom it waited for."""
        if not rec.any_source:
            return CollectiveTimeoutError(
                f"{rec.op}: recv from rank {rec.src}: {timed_out(seconds)} {self._where(rec)}", op=rec.op, peer=rec.peer
            )
        streams = [s for s in self._candidates(rec) if not s.closed]
        parked = [
            f"rank {self.ranks[s.peer]}'s next message has {_describe(*s.head.tolist())}"
            for s in streams
            if s.arrival is not None
        ]
        return CollectiveTimeoutError(
            f"{rec.op}: recv from any rank: {timed_out(seconds)} with no message of tag={rec.tag} from ranks "
            f"{[self.ranks[s.peer] for s in streams]} {self._where(rec)}" + (f"; {'; '.join(parked)}" if parked else ""),
            op=rec.op,
        )

    # ------------------------------------------------------------------------ closing

    def close(self) -> None:
        """Say goodbye to every peer on the user channel, then wait up to :data:`CLOSE_GRACE`
        seconds for the peers' goodbyes to end this rank's own probes (module docstring)."""
        if self._goodbyes is not None:
            return
        self._goodbyes = []
        try:
            channel = self.user_channel()
        except RuntimeError:  # the process group was destroyed first: nothing can be sent
            return
        goodbye = torch.tensor([0, 0, GOODBYE], dtype=torch.int64)
        for peer in range(channel.world_size):
            if peer != channel.rank:
                try:
                    with channel.operation("destroy_process_group"):
                        self._goodbyes.append(channel.isend(goodbye, peer))
                except RuntimeError:  # that peer is gone already (a CollectiveError), or the group
                    pass
        deadline = time.monotonic() + min(CLOSE_GRACE, channel.timeout)
        with self.lock:
            probing = [s for s in self._streams.values() if s.transport is channel]
            self._changed.wait_for(lambda: all(s.reader is None for s in probing), max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        """After :meth:`close`: drop the user channel and every transfer that holds the process
        group (a broken group lets it go, ``Group.close``); the mailbox is unusable afterwards."""
        with self.lock:
            if self._channel is not None:
                self._channel.close()
            self._channel, self._make_channel = None, _no_channel
            self.pending, self._goodbyes = [], []
            self._streams.clear()

