"""Point-to-point for users: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``.

The signatures are torch.distributed's, and the messages go over our own transports, so they work
on every backend::

    if rank == 0:
        dist.send(activations, dst=1)          # stage 0 of a pipeline
    else:
        dist.recv(activations, src=0)

The wire (``_wire``):

* **CPU tensors** (backends ``p2p``, ``torch``, and any CPU backend) travel on a *user channel*:
  our gloo transport (``TorchP2PTransport``) on the group's process group with its own tag
  (:data:`USER_TAG`). User messages therefore never meet collective messages, and a send and its
  receive may sit at different places relative to the collectives of the two ranks (as in torch).
* **CUDA tensors** (``nccl-cupy``) use the engine's NCCL transport, shared with the collectives
  (NCCL has no tags): a pending ``irecv`` takes its message before the group's next collective
  starts, so its sender must send before entering that collective. A single ``isend``/``irecv``
  is an NCCL group of its own: two ranks exchanging messages must use ``batch_isend_irecv``
  (as with NCCL in torch).

Every call is *posted* through the group's FIFO queue, so it keeps its place after the
collectives issued before it; ``wait`` then waits for the transfer itself.

Differences from torch, all raised as errors rather than left to hang or corrupt:

* **Tags are checked, not used to reorder.** Messages between two ranks are matched in the order
  they are sent. Each message carries its tag, element count and dtype in a small header
  (``collectives/mailbox.py``); if the receive that meets it asked for another tag, size or
  dtype, the receiver raises :class:`~collectives.mailbox.MessageMismatchError` (a
  ``CollectiveError``), after draining the payload so the pair stays usable. Code that relies on
  tags to pair messages sent in another order than they are received must send them in order.
* **Any-source receives match tags.** ``recv(tensor)`` / ``irecv(tensor)`` without ``src`` /
  ``group_src`` take the first message, among each sender's next one, whose tag is theirs
  (first come, first served: no sender starves; ``collectives/mailbox.py``), and report the
  sender: ``recv`` returns its global rank, the handle's ``source_rank()`` (torch's
  ``_source_rank()``) its group rank. Per sender, messages are still taken in the order sent.
  CPU tensors only: on NCCL (shared with the collectives) it raises ``ValueError``.
* **The dtype must match** (torch only compares byte counts). Non-contiguous tensors are
  accepted (torch refuses them).
* Bad peers (this rank, out of range, not an int) raise ``ValueError`` / ``TypeError`` before
  any traffic, where torch may wait for its store timeout.

Cost: one extra 24-byte message per user message (the header): ``2α + Sβ``. A rank's next header
from a peer is read once the previous one was taken, by a thread of the mailbox.

**Virtual ranks** (backend ``sim``, :mod:`collectives.sim`) have no threads: their user messages
travel on the simulation's user channel (``SimTransport.user_channel``: the same links as the
collectives, their own matching), where a receive posts its header and payload receives at once
and checks the header when waited for (so every message is a header and a payload, even an
empty one, and the pair stays in step after a mismatch). They take virtual time like any
message (header and payload share the path: ``α + (S + 24)β`` alone). An any-source receive
chooses its sender when waited for (any-source receives posted before it choose first, in
posting order): among the senders whose next message has its tag, the one whose header arrives
first in virtual time, ties to the lowest rank (deterministic; a receive from a given sender
posted before that choice takes that sender's next message first), then receives from it as
above.
"""

from __future__ import annotations

import collections
import datetime
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from . import validate
from .errors import CollectiveError, CollectiveTimeoutError, timed_out
from .group import Group, NonMember, get_group, is_non_member, member
from .mailbox import Incoming, MessageMismatchError, header
from .transport.base import Request, Transport, wait_all
from .transport.sim import SimTransport
from .work import Work


class P2PWork(Work):
    """Handle of ``isend`` / ``irecv``: complete once the message has been delivered.

    The group's queue *posts* the message; the transfer itself is waited for in :meth:`wait`, and
    :meth:`is_completed` turns true once a ``wait`` has returned (as with gloo's ``Work`` in torch,
    which reports a point-to-point transfer complete only to ``wait``). ``wait(timeout)`` bounds
    the wait for the post; the transfer obeys the group's timeout.
    """

    def __init__(self, name: str, group: Group, incoming: Incoming | None = None):
        super().__init__(name)
        self._group = group
        self._incoming = incoming  # None for a send
        self._posted = threading.Event()
        self._post_error: BaseException | None = None
        self._complete: Callable[[], None] = lambda: None
        self._finishing = threading.Lock()

    def source_rank(self) -> int:
        """The sender's group rank (torch's ``Work.source_rank``): known at once for a receive
        from a given rank, after ``wait`` for an any-source one (-1 before). A send raises."""
        if self._incoming is None:
            raise RuntimeError(f"{self.name}: source_rank() is only for receives")
        peer = self._incoming.peer
        return -1 if peer is None else peer

    _source_rank = source_rank  # torch's spelling, which torch.distributed.recv calls

    def finish(self, error: BaseException | None) -> None:  # the group's queue ran the post
        self._post_error = error
        self._posted.set()

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._posted.wait(seconds):
            raise CollectiveTimeoutError(f"{self.name}: Work.wait: {timed_out(seconds)}", op=self.name)
        with self._finishing:
            if not self.is_completed():
                error = self._post_error
                if error is None:
                    try:
                        self._complete()
                    except MessageMismatchError as exc:  # drained: the wire is still in step
                        error = exc
                    except CollectiveError as exc:
                        error = exc
                        self._group.mark_broken(exc)
                Work.finish(self, error)
        return super().wait(0)

    def get_future(self) -> torch.futures.Future:
        """Not available for point-to-point, as with torch's gloo ``Work``: call :meth:`wait`."""
        raise RuntimeError(f"{self.name}: get_future is not implemented for point-to-point work; use wait()")


class P2POp:
    """One operation of :func:`batch_isend_irecv` (torch's signature).

    ``op`` is :func:`isend` or :func:`irecv` (torch's own ``dist.isend`` / ``dist.irecv`` are
    accepted too, so a script that builds ops before its import is swapped keeps working).
    """

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: Group | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ):
        kind = getattr(op, "__name__", None)
        if kind not in ("isend", "irecv"):
            raise ValueError(f"P2POp: op must be isend or irecv, got {op!r}")
        self.op, self.kind = op, kind
        self.tensor, self.peer, self.group, self.tag, self.group_peer = tensor, peer, group, tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.kind}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


# ---------------------------------------------------------------------------- argument checks


def _check_tag(tag: object, name: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{name}: tag must be an int, got {type(tag).__name__}")
    return tag


def _wire(g: Group, tensor: torch.Tensor, name: str) -> Transport:
    """The wire of user messages of ``tensor``'s device on ``g``.

    CPU tensors (every CPU backend, the torch reference included) travel on a channel of their
    own, the mailbox's user channel: our gloo transport on the group's process group with its own
    tag (:data:`~collectives.mailbox.USER_TAG`), so user messages never meet collective ones and
    need no particular order relative to collectives. Other devices use the engine's own transport
    (NCCL has no tags), shared with the collectives.
    """
    engine = g.engine(tensor.device, name)  # also checks that the backend takes this device
    transport = getattr(engine, "transport", None)
    if isinstance(transport, SimTransport):  # virtual ranks (module docstring)
        return transport.user_channel()
    if tensor.device.type != "cpu":
        if transport is None:
            raise ValueError(f"{name}: the {g.backend} backend has no transport for {tensor.device} tensors")
        return transport
    return g.mailbox.user_channel()


# ---------------------------------------------------------------------------- posting


def _post_send(transport: Transport, tensor: torch.Tensor, peer: int, tag: int, name: str) -> list[Request]:
    buf = tensor.contiguous().view(-1)
    if isinstance(transport, SimTransport):  # always a payload, as bytes (module docstring)
        sends = [(header(tag, tensor), peer), (buf.view(torch.uint8), peer)]
    else:
        sends = [(header(tag, tensor), peer)] + ([(buf, peer)] if buf.numel() else [])
    with transport.operation(name):
        return transport.post(sends=sends)


def _finish_send(work: P2PWork, transport: Transport, requests: list[Request], name: str) -> None:
    def complete() -> None:
        with transport.operation(name):
            wait_all(requests)

    work._complete = complete


def _post_recv(work: P2PWork, g: Group, rec: Incoming) -> None:
    """Post ``rec``: record it in the mailbox, whose streams bring its message; on virtual ranks
    post its messages' receives (:func:`_post_simulated_recv`)."""
    if isinstance(rec.transport, SimTransport):
        _post_simulated_recv(work, g, rec)
        return
    g.mailbox.post(rec)
    work._complete = lambda: g.mailbox.complete(rec)


#: virtual ranks: per user channel, the any-source receives posted and not yet given a sender,
#: in posting order (each entry chooses and posts; :func:`_post_simulated_recv`)
_unchosen: weakref.WeakKeyDictionary[SimTransport, collections.deque[Callable[[], None]]] = weakref.WeakKeyDictionary()


def _post_simulated_recv(work: P2PWork, g: Group, rec: Incoming) -> None:
    """Virtual ranks: post the header and payload receives of ``rec`` at once; the wait checks the
    header (module docstring) and copies the payload's bytes into the caller's tensor.

    An any-source receive chooses its sender when it is waited for, or when an any-source
    receive posted after it is (they choose in posting order, as the mailbox serves them): the
    sender whose next message of its tag arrives first (``SimTransport.first_arrival``)."""
    transport, op = rec.transport, rec.op
    assert isinstance(transport, SimTransport)
    posted: list[Any] = []  # head and body requests and buffers, or the error of the choice

    def post() -> None:
        head, raw = torch.empty(3, dtype=torch.int64), torch.empty(rec.tensor.nbytes, dtype=torch.uint8)
        try:
            with transport.operation(op):
                if rec.peer is None:
                    rec.peer = transport.first_arrival(lambda header: int(header[0]) == rec.tag)
                    rec.src = g.ranks[rec.peer]
                posted.extend([*transport.post(recvs=[(head, rec.peer), (raw, rec.peer)]), head, raw])
        except CollectiveError as exc:  # no sender can come: this receive's wait raises it
            posted.append(exc)

    if rec.peer is None:
        _unchosen.setdefault(transport, collections.deque()).append(post)
    else:
        post()

    def complete() -> None:
        queue = _unchosen.get(transport)
        while not posted and queue:
            queue.popleft()()
        if isinstance(posted[0], CollectiveError):
            raise posted[0]
        head_req, body_req, head, raw = posted
        assert rec.peer is not None and rec.src is not None
        with transport.operation(op):
            head_req.wait()
            rec.expect(rec.peer, rec.src, head.tolist())  # a mismatch is kept on rec
            try:
                body_req.wait()
            except CollectiveError:  # a payload of another size: the header says why
                if rec.mismatch is None:
                    raise
        if rec.mismatch is not None:
            raise rec.mismatch
        rec.tensor.copy_(raw.view(rec.tensor.dtype).view(rec.tensor.shape))

    work._complete = complete


def isend(
    tensor: torch.Tensor, dst: int | None = None, group: Group | NonMember | None = None, tag: int = 0,
    group_dst: int | None = None,
) -> Work | None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``); returns a handle.

    ``tensor`` must not be modified until ``wait()`` returns. On a rank outside ``group``: nothing
    (``None``, with torch's warning).
    """
    if is_non_member(group):
        return member(group, "isend")  # warns; None
    return _send(tensor, dst, group, tag, group_dst, "isend", async_op=True)


def send(
    tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``) and wait until it is received.

    On a rank outside ``group`` it raises ``ValueError`` (as torch does).
    """
    _send(tensor, dst, group, tag, group_dst, "send", async_op=False).wait()


def _prepare(tensor, group, tag, name: str):
    """Check a point-to-point call before any traffic: its group, tensor and tag, and the transport
    that will carry it."""
    g = get_group(group, name)
    validate.tensor(tensor, name)
    tag = _check_tag(tag, name)
    return g, tag, _wire(g, tensor, name)


def _send(tensor, dst, group, tag, group_dst, name: str, async_op: bool) -> P2PWork:
    g, tag, transport = _prepare(tensor, group, tag, name)
    peer, _ = g.peer(name, "dst", dst, group_dst)
    g.check_usable(name)
    work = P2PWork(name, g)

    def post() -> None:
        _finish_send(work, transport, _post_send(transport, tensor, peer, tag, name), name)

    g.enqueue(work, post, async_op)
    return work


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Group | NonMember | None = None, tag: int = 0,
    group_src: int | None = None,
) -> Work | None:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``); returns a handle.

    Without ``src`` / ``group_src``: from any rank (the module docstring); the handle's
    ``source_rank()`` then names the sender after ``wait()``. Read ``tensor`` only after ``wait()``.
    On a rank outside ``group``: nothing (``None``, with torch's warning).
    """
    if is_non_member(group):
        return member(group, "irecv")  # warns; None
    return _recv(tensor, src, group, tag, group_src, "irecv", async_op=True)[0]


def recv(
    tensor: torch.Tensor, src: int | None = None, group: Group | NonMember | None = None, tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``); returns the
    sender's global rank. Without either: from any rank (the module docstring).

    On a rank outside ``group``: nothing; returns -1 (with torch's warning).
    """
    if is_non_member(group):
        member(group, "recv")  # warns
        return -1
    work, rec = _recv(tensor, src, group, tag, group_src, "recv", async_op=False)
    work.wait()
    assert rec.src is not None  # the wait took a message
    return rec.src


def _recv(tensor, src, group, tag, group_src, name: str, async_op: bool) -> tuple[P2PWork, Incoming]:
    g, tag, transport = _prepare(tensor, group, tag, name)
    peer, source = g.source(name, src, group_src)
    if peer is None and tensor.device.type != "cpu":
        raise ValueError(
            f"{name}: no any-source receive of {tensor.device} tensors on the {g.backend} backend (its wire "
            "is shared with the collectives, where a receive left posted would take their messages); pass src"
        )
    g.check_usable(name)
    rec = Incoming(transport, tensor, peer, source, tag, name)
    work = P2PWork(name, g, rec)

    g.enqueue(work, lambda: _post_recv(work, g, rec), async_op)
    return work, rec


class _Batch(Work):
    """The executor's handle of a batch: passes the outcome of the post to every op's handle."""

    def __init__(self, works: Sequence[P2PWork]):
        super().__init__("batch_isend_irecv")
        self._works = works

    def finish(self, error: BaseException | None) -> None:
        super().finish(error)
        for w in self._works:
            w.finish(error)


#: one send of a batch: its handle, tensor, peer (group rank) and tag.
_Send = tuple[P2PWork, torch.Tensor, int, int]


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every send and receive of the list together; returns one handle per op, in order.

    All ops must use the same group and device, and name their peers. On CPU the sends and
    receives are posted as ``isend`` / ``irecv`` post them. On a wire shared with the collectives
    (NCCL) the headers of the whole batch are exchanged in one post, then the payloads in another
    (one NCCL group each), so two ranks can exchange messages there too; the group's queue then
    waits for the headers of the batch's receives.
    """
    name = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"{name}: expected a non-empty list of P2POp")
    for i, op in enumerate(p2p_op_list):
        if not isinstance(op, P2POp):
            raise TypeError(f"{name}: item {i} is a {type(op).__name__}, not a P2POp")
    groups = {id(op.group) for op in p2p_op_list}
    if len(groups) != 1:
        raise ValueError(f"{name}: all ops must use the same group")
    if is_non_member(p2p_op_list[0].group):
        member(p2p_op_list[0].group, name)  # warns
        return []
    g = get_group(p2p_op_list[0].group)
    for op in p2p_op_list:
        validate.tensor(op.tensor, name)
    devices = {op.tensor.device for op in p2p_op_list}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    transport = _wire(g, p2p_op_list[0].tensor, name)
    sends: list[_Send] = []
    recvs: list[tuple[P2PWork, Incoming]] = []
    works: list[P2PWork] = []
    for op in p2p_op_list:
        tag = _check_tag(op.tag, name)
        if op.kind == "isend":
            works.append(P2PWork(name, g))
            sends.append((works[-1], op.tensor, g.peer(name, "dst", op.peer, op.group_peer)[0], tag))
        else:
            peer, source = g.peer(name, "src", op.peer, op.group_peer)
            rec = Incoming(transport, op.tensor, peer, source, tag, name)
            works.append(P2PWork(name, g, rec))
            recvs.append((works[-1], rec))
    g.check_usable(name)
    post = _post_each if p2p_op_list[0].tensor.device.type == "cpu" else _post_grouped
    g.enqueue(_Batch(works), lambda: post(g, transport, sends, recvs), async_op=True)
    return list(works)


def _post_each(g: Group, transport: Transport, sends: list[_Send], recvs: list[tuple[P2PWork, Incoming]]) -> None:
    """A batch on the user channel: each send and receive as ``isend`` / ``irecv`` post them."""
    name = "batch_isend_irecv"
    for work, tensor, peer, tag in sends:
        _finish_send(work, transport, _post_send(transport, tensor, peer, tag, name), name)
    for work, rec in recvs:
        _post_recv(work, g, rec)


def _post_grouped(g: Group, transport: Transport, sends: list[_Send], recvs: list[tuple[P2PWork, Incoming]]) -> None:
    """A batch on a wire shared with the collectives: headers in one post, payloads in another."""
    name = "batch_isend_irecv"
    g.mailbox.settle_shared()  # earlier receives on this wire take their messages first
    heads = [torch.empty(3, dtype=torch.int64) for _ in recvs]
    with transport.operation(name):
        requests = transport.post(
            sends=[(header(tag, t), peer) for _, t, peer, tag in sends],
            recvs=[(head, rec.peer) for head, (_, rec) in zip(heads, recvs)],
        )
        wait_all(requests[: len(recvs)])
        expected = [(rec, rec.expect(rec.peer, rec.src, head.tolist())) for head, (_, rec) in zip(heads, recvs)]
        posted = [(rec, m) for rec, m in expected if m is not None]
        out = [(b, p) for b, p in ((t.contiguous().view(-1), peer) for _, t, peer, _ in sends) if b.numel()]
        data = transport.post(sends=out, recvs=[m for _, m in posted])
    for (rec, _), request in zip(posted, data):
        rec.payload = request
    header_sends, data_sends = iter(requests[len(recvs) :]), iter(data[len(posted) :])
    for work, tensor, _, _ in sends:
        mine = [next(header_sends)] + ([next(data_sends)] if tensor.numel() else [])
        _finish_send(work, transport, mine, name)
    for work, rec in recvs:
        work._complete = rec.complete
