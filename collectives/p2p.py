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
* **No any-source receive.** ``recv(tensor)`` without ``src`` / ``group_src`` raises
  ``ValueError`` before any traffic; pass the sender's rank. (The wire matches by sender and
  order; an any-source receive would need a probe the transports do not have.)
* **The dtype must match** (torch only compares byte counts). Non-contiguous tensors are
  accepted (torch refuses them).
* Bad peers (this rank, out of range, not an int) raise ``ValueError`` / ``TypeError`` before
  any traffic, where torch may wait for its store timeout.

Cost: one extra 24-byte message per user message (the header): ``2α + Sβ``.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable, Sequence

import torch

from . import validate
from .errors import CollectiveError, CollectiveTimeoutError, timed_out
from .group import Group, NonMember, get_group, get_rank, is_non_member, member
from .mailbox import Incoming, MessageMismatchError, header
from .transport.base import Request, Transport, wait_all
from .transport.torch_p2p import TorchP2PTransport
from .work import Work


class P2PWork(Work):
    """Handle of ``isend`` / ``irecv``: complete once the message has been delivered.

    The group's queue *posts* the message; the transfer itself is waited for in :meth:`wait`, and
    :meth:`is_completed` turns true once a ``wait`` has returned (as with gloo's ``Work`` in torch,
    which reports a point-to-point transfer complete only to ``wait``). ``wait(timeout)`` bounds
    the wait for the post; the transfer obeys the group's timeout.
    """

    def __init__(self, name: str, group: Group):
        super().__init__(name)
        self._group = group
        self._posted = threading.Event()
        self._post_error: BaseException | None = None
        self._complete: Callable[[], None] = lambda: None
        self._finishing = threading.Lock()

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


#: gloo tag of the user channel (collectives use 0, the NCCL id exchange uses its own).
USER_TAG = 1


def _wire(g: Group, tensor: torch.Tensor, name: str) -> Transport:
    """The wire of user messages of ``tensor``'s device on ``g``.

    CPU tensors (every CPU backend, the torch reference included) travel on a channel of their
    own: our gloo transport on the group's process group with tag :data:`USER_TAG`, so user
    messages never meet collective ones and need no particular order relative to collectives.
    Other devices use the engine's own transport (NCCL has no tags), shared with the collectives.
    """
    engine = g.engine(tensor.device, name)  # also checks that the backend takes this device
    if tensor.device.type != "cpu":
        transport = getattr(engine, "transport", None)
        if transport is None:
            raise ValueError(f"{name}: the {g.backend} backend has no transport for {tensor.device} tensors")
        return transport
    box = g.mailbox
    with box.lock:  # one channel even when two threads send at once: pairs are ordered per channel
        if "cpu" not in box.channels:
            box.channels["cpu"] = TorchP2PTransport(g.process_group, get_rank(g), g.timeout, tag=USER_TAG)
        return box.channels["cpu"]


# ---------------------------------------------------------------------------- posting


def _post_send(transport: Transport, tensor: torch.Tensor, peer: int, tag: int, name: str) -> list[Request]:
    buf = tensor.contiguous().view(-1)
    sends = [(header(tag, tensor), peer)] + ([(buf, peer)] if buf.numel() else [])
    with transport.operation(name):
        return transport.post(sends=sends)


def _finish_send(work: P2PWork, transport: Transport, requests: list[Request], name: str) -> None:
    def complete() -> None:
        with transport.operation(name):
            wait_all(requests)

    work._complete = complete


def _finish_recv(work: P2PWork, g: Group, rec: Incoming) -> None:
    box = g.mailbox

    def complete() -> None:
        box.settle(until=rec)
        rec.complete()

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


def _prepare(tensor, group, tag, what: str, rank, group_rank, name: str):
    """Check a point-to-point call before any traffic: its group, peer (group rank and global rank),
    tag and the transport that will carry it; returns them with a fresh handle."""
    g = get_group(group, name)
    validate.tensor(tensor, name)
    peer, global_rank = g.peer(name, what, rank, group_rank)
    tag = _check_tag(tag, name)
    transport = _wire(g, tensor, name)
    g.check_usable(name)
    return g, peer, global_rank, tag, transport, P2PWork(name, g)


def _send(tensor, dst, group, tag, group_dst, name: str, async_op: bool) -> P2PWork:
    g, peer, _, tag, transport, work = _prepare(tensor, group, tag, "dst", dst, group_dst, name)

    def post() -> None:
        _finish_send(work, transport, _post_send(transport, tensor, peer, tag, name), name)

    g.enqueue(work, post, async_op)
    return work


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Group | NonMember | None = None, tag: int = 0,
    group_src: int | None = None,
) -> Work | None:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``); returns a handle.

    ``src`` is required (no any-source receive). Read ``tensor`` only after ``wait()``. On a rank
    outside ``group``: nothing (``None``, with torch's warning).
    """
    if is_non_member(group):
        return member(group, "irecv")  # warns; None
    return _recv(tensor, src, group, tag, group_src, "irecv", async_op=True)[0]


def recv(
    tensor: torch.Tensor, src: int | None = None, group: Group | NonMember | None = None, tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or group rank ``group_src``); returns ``src``.

    On a rank outside ``group``: nothing; returns -1 (with torch's warning).
    """
    if is_non_member(group):
        member(group, "recv")  # warns
        return -1
    work, source = _recv(tensor, src, group, tag, group_src, "recv", async_op=False)
    work.wait()
    return source


def _recv(tensor, src, group, tag, group_src, name: str, async_op: bool) -> tuple[P2PWork, int]:
    g, peer, source, tag, transport, work = _prepare(tensor, group, tag, "src", src, group_src, name)
    rec = Incoming(transport, tensor, peer, source, tag, name)

    def post() -> None:
        box = g.mailbox
        box.settle(peer_of=rec)  # earlier receives from this peer claim their payloads first
        with transport.operation(name):
            rec.head_request = transport.irecv(rec.head, peer)
        box.add(rec)
        _finish_recv(work, g, rec)

    g.enqueue(work, post, async_op)
    return work, source


class _Batch(Work):
    """The executor's handle of a batch: passes the outcome of the post to every op's handle."""

    def __init__(self, works: Sequence[P2PWork]):
        super().__init__("batch_isend_irecv")
        self._works = works

    def finish(self, error: BaseException | None) -> None:
        super().finish(error)
        for w in self._works:
            w.finish(error)


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every send and receive of the list together; returns one handle per op, in order.

    All ops must use the same group and device. The headers of the whole batch are exchanged in one
    post, then the payloads in another, so two ranks can exchange messages on every backend
    (NCCL included). The group's queue waits for the headers of the batch's receives.
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
    sends: list[tuple[torch.Tensor, int, int]] = []
    recs: list[Incoming] = []
    for op in p2p_op_list:
        validate.tensor(op.tensor, name)
        tag = _check_tag(op.tag, name)
        if op.kind == "isend":
            sends.append((op.tensor, g.peer(name, "dst", op.peer, op.group_peer)[0], tag))
        else:
            peer, source = g.peer(name, "src", op.peer, op.group_peer)
            recs.append(Incoming(_wire(g, op.tensor, name), op.tensor, peer, source, tag, name))
    devices = {op.tensor.device for op in p2p_op_list}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    transport = _wire(g, p2p_op_list[0].tensor, name)
    g.check_usable(name)
    works = [P2PWork(name, g) for _ in p2p_op_list]

    def post() -> None:
        box = g.mailbox
        for rec in recs:
            box.settle(peer_of=rec)
        payloads = [(t.contiguous().view(-1), peer) for t, peer, _ in sends]
        with transport.operation(name):
            heads = transport.post(
                sends=[(header(tag, t), peer) for t, peer, tag in sends], recvs=[(rec.head, rec.peer) for rec in recs]
            )
            for rec, request in zip(recs, heads):
                rec.head_request = request
            incoming = [(rec, rec.check()) for rec in recs]
            posted = [(rec, m) for rec, m in incoming if m is not None]
            out = [(b, p) for b, p in payloads if b.numel()]
            requests = transport.post(sends=out, recvs=[m for _, m in posted])
        for (rec, _), request in zip(posted, requests):
            rec.payload = request
        send_requests = iter(heads[len(recs) :])
        data_requests = iter(requests[len(posted) :])
        rec_iter = iter(recs)
        for op, work in zip(p2p_op_list, works):
            if op.kind == "isend":
                mine = [next(send_requests)] + ([next(data_requests)] if op.tensor.numel() else [])
                _finish_send(work, transport, mine, name)
            else:
                rec = next(rec_iter)
                work._complete = rec.complete

    g.enqueue(_Batch(works), post, async_op=True)
    return list(works)
