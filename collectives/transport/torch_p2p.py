"""Transport over torch.distributed point-to-point calls (``isend`` / ``irecv``), gloo on CPU.

This is the default transport. torch's process group is used only as a wire: we never call its
collectives here. gloo runs every posted send/receive on its own I/O threads, so a Python
algorithm can reduce one segment while the next ones are on the wire.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeoutError
from .base import Peer, Request, Transport

if TYPE_CHECKING:
    from ..group import Group


class TorchP2PRequest(Request):
    __slots__ = ("_work", "_transport", "_kind", "_peer", "_done")

    def __init__(self, work: dist.Work, transport: "TorchP2PTransport", kind: str, peer: Peer):
        self._work = work
        self._transport = transport
        self._kind = kind
        self._peer = peer
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            self._work.wait(self._transport.wait_timeout)
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
        self._tag = tag
        self.wait_timeout = datetime.timedelta(seconds=timeout)

    @classmethod
    def for_group(cls, group: "Group", device: torch.device) -> "TorchP2PTransport":
        """The transport of a collectives group (the ``p2p`` backend's factory)."""
        return cls(group.process_group, group.rank(), group.timeout)

    def error(self, exc: RuntimeError, kind: str, peer: Peer) -> CollectiveError:
        """Turn a gloo failure into an error naming the collective, the peer and this rank."""
        text = str(exc)
        timed_out = "Timed out" in text or "timeout" in text.lower()
        cls = CollectiveTimeoutError if timed_out else CollectiveError
        what = f"timed out after {self.timeout:g}s" if timed_out else "failed"
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
        return cls(
            f"{self.op}: {kind} {'to' if kind == 'send' else 'from'} rank {peer} {what} "
            f"(this is rank {self.rank} of {self.world_size}): {first_line}",
            op=self.op,
            peer=peer,
        )

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        # The process group's own methods take group ranks and skip torch's Python-side checks.
        try:
            work = self._pg.send([tensor], peer, self._tag)
        except RuntimeError as exc:  # gloo refuses to post once the pair to the peer is closed
            raise self.error(exc, "send", peer) from exc
        return TorchP2PRequest(work, self, "send", peer)

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        try:
            work = self._pg.recv([tensor], peer, self._tag)
        except RuntimeError as exc:
            raise self.error(exc, "recv", peer) from exc
        return TorchP2PRequest(work, self, "recv", peer)
