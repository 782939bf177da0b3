"""A transport over a subset of another transport's ranks (no new connections).

Hierarchical collectives run ordinary algorithms (ring, recursive doubling) among one rank per
host (a rail), and among the ranks of one host where those cannot share memory (else they use a
shared-memory transport of their own). :class:`SubsetTransport` presents ``members`` of a
parent transport as ranks ``0 .. len(members) - 1`` and forwards every message to the parent, so
those algorithms run unchanged on the subset. The parent's ordering contract carries over: the
phases of one collective run one after another, and messages between a pair stay in order.
Errors are the parent's, naming the peer by its rank in the parent group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import Message, Peer, Request, Transport


class SubsetTransport(Transport):
    """Ranks ``members`` of ``parent`` (which must include the parent's own rank), renumbered from 0."""

    def __init__(self, parent: Transport, members: Sequence[int]):
        super().__init__(list(members).index(parent.rank), len(members), parent.timeout)
        self.parent = parent
        self.members = list(members)

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.parent.isend(tensor, self.members[peer])

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.parent.irecv(tensor, self.members[peer])

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[Request]:
        return self.parent.post(
            sends=[(t, self.members[p]) for t, p in sends], recvs=[(t, self.members[p]) for t, p in recvs]
        )
