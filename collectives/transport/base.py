"""The transport interface: the only thing collective algorithms know about the network.

A transport moves the bytes of a tensor between two ranks of one group. Algorithms are written
once against this interface (see ``collectives/ring.py``); each backend (torch point-to-point over
gloo, CuPy NCCL, ...) is one file implementing it.

The contract is deliberately small:

* ``isend(tensor, peer)`` / ``irecv(tensor, peer)`` post one message and return a
  :class:`Request`; ``send`` / ``recv`` are the blocking forms.
* ``post(sends, recvs)`` posts several sends and receives *together*. NCCL needs this (a send and
  a receive issued separately and blocking would deadlock in a ring), and it lets any transport
  batch the calls of one algorithm step.
* Messages between the same pair of ranks are matched in the order they were posted. Algorithms
  rely on that order and never on tags (NCCL has none).
* Ranks are ranks *within the group* (0 .. world_size-1); the transport maps them to whatever the
  wire uses.
* Every :meth:`Request.wait` has a deadline (``timeout`` seconds). Past it, or when the peer
  disappears, the wait raises :class:`~collectives.errors.CollectiveError` naming the collective
  (``transport.op``) and the peer rank.

Buffers handed to a transport are contiguous; the caller keeps them alive and untouched until
the request completes.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

Peer = int
Message = tuple[torch.Tensor, Peer]


class Request(abc.ABC):
    """One posted send or receive."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the buffer may be reused (send) or read (receive).

        For host transports the data is visible to the host when this returns. For stream-ordered
        transports (NCCL) it is visible to all work queued afterwards on the transport's stream.
        Raises :class:`~collectives.errors.CollectiveError` on timeout or peer failure.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True when :meth:`wait` would return without blocking."""


class Transport(abc.ABC):
    """Point-to-point messaging among the ``world_size`` ranks of one group."""

    def __init__(self, rank: int, world_size: int, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.op = "collective"

    @contextmanager
    def operation(self, name: str) -> Iterator[None]:
        """Label the traffic inside the block with a collective's name, for error messages."""
        previous, self.op = self.op, name
        try:
            yield
        finally:
            self.op = previous

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        """Post a send of the whole of ``tensor`` to ``peer``."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        """Post a receive into the whole of ``tensor`` from ``peer``."""

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[Request]:
        """Post sends and receives together; returns their requests, receives first.

        Receives are posted before sends so that a message never waits for its buffer. Backends
        whose wire needs grouping (NCCL) override this.
        """
        requests = [self.irecv(t, p) for t, p in recvs]
        requests += [self.isend(t, p) for t, p in sends]
        return requests

    def send(self, tensor: torch.Tensor, peer: Peer) -> None:
        self.isend(tensor, peer).wait()

    def recv(self, tensor: torch.Tensor, peer: Peer) -> None:
        self.irecv(tensor, peer).wait()

    def close(self) -> None:
        """Release resources. The transport is unusable afterwards."""


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request, in order."""
    for request in requests:
        request.wait()
