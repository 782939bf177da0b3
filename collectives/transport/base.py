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
* Optional, the wire check (:mod:`collectives.wire`): inside :meth:`Transport.operation`,
  :func:`collectives.wire.current` is the :class:`~collectives.wire.Header` of the collective
  (None when unchecked). A transport that can should make every message of the collective say
  which collective it belongs to (``wire.tag(header.tag_base(seq), nbytes)``, with ``seq`` its
  count of checked collectives) and never deliver a message whose tag differs from the receive's,
  and compare the headers of the ranks before trusting a payload, raising ``CollectiveError`` on
  a difference. torch point-to-point does it with gloo tags and a header exchange; a transport
  with its own wire (shared memory) can put the tag in each slot's header for free; one that
  cannot (NCCL) ignores the header.

Buffers handed to a transport are contiguous; the caller keeps them alive and untouched until
the request completes.

A backend builds its transport from what it knows of the group (:class:`GroupInfo`: rank, size,
deadline, a private store, the hosts of the ranks, torch's process group), never from the
group object itself: the transport layer sits below the groups that own transports.

One optional capability goes beyond messages: :meth:`Transport.shared_regions` returns a
:class:`SharedRegions` when the ranks share memory (the ``shm`` transport), and ``None``
otherwise. Algorithms that use it (``collectives/shm_algorithms.py``) read the peers' data where
it lies and combine straight from it, instead of receiving a copy first.
"""

from __future__ import annotations

import abc
import time
from typing import Callable, ContextManager, Iterable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import wire
from ..errors import CollectiveError
from ..ops import ReduceOp
from ..tuning import Tuning

Peer = int
Message = tuple[torch.Tensor, Peer]


class GroupInfo(Protocol):
    """What a backend may use of the group it builds a transport (or engine) for.

    :class:`collectives.group.Group` provides it; so can anything else with these members (a test,
    a torch process-group adapter). Everything here is fixed for the group's lifetime.

    Attributes:
        name: a label for messages (``"world"``, ``"group[0, 1]"``).
        backend: the canonical backend name the group asked for (``"auto"``, ``"shm"``, ...).
        timeout: seconds any single wait may block.
        store: a torch ``Store`` private to the group, for the transport's own rendezvous. Its
            connection may be shared with other groups: wait for keys with :func:`wait_for_keys`,
            never with ``store.wait``/``get`` on a key that may not be there yet.
        hosts: one host key per group rank; equal keys can share memory.
        process_group: torch's process group of the members (gloo), usable as a wire.
        tuning: the group's algorithm thresholds, shared (an engine reads them at every call).
        broken: why the group is unusable (its first communication failure, or a peer found dead
            by :class:`collectives.ElasticGroup`'s heartbeats), or None: a set-up wait gives up
            when it is set.
    """

    name: str
    backend: str
    timeout: float
    store: dist.Store
    hosts: Sequence[str]
    process_group: dist.ProcessGroup
    tuning: Tuning
    broken: str | None

    def rank(self) -> int:
        """This process's rank within the group."""

    def size(self) -> int:
        """The number of ranks in the group."""


class Request(abc.ABC):
    """One posted send or receive."""

    __slots__ = ()  # a subclass may keep its requests small (the simulator makes one per message)

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

    def operation(self, name: str) -> ContextManager[None]:
        """Label the traffic inside the block with a collective's name, for error messages."""
        return _Label(self, name)

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

    def shared_regions(self) -> "SharedRegions | None":
        """The ranks' shared regions if this transport has them (see :class:`SharedRegions`)."""
        return None

    def close(self) -> None:
        """Release resources. The transport is unusable afterwards."""


class _Label:
    """:meth:`Transport.operation`'s context: sets ``transport.op``, restores it at the end."""

    __slots__ = ("transport", "name", "previous")

    def __init__(self, transport: Transport, name: str):
        self.transport, self.name = transport, name

    def __enter__(self) -> None:
        self.previous, self.transport.op = self.transport.op, self.name

    def __exit__(self, *_: object) -> None:
        self.transport.op = self.previous


class SharedRegions(abc.ABC):
    """Capability: every rank owns a region of memory that every rank of the group can read.

    A region has two halves of ``piece_bytes`` each. An algorithm processes its buffer in
    *pieces* of at most ``piece_bytes``; piece ``g`` (counted over the transport's lifetime, on
    every rank alike) uses half ``g % 2``, so a rank may fill the next piece while slower peers
    still read the previous one. Every rank runs the same sequence of calls:

    * ``h = begin_piece(signature)`` waits until every peer has finished piece ``g - 2`` (the
      last user of half ``h``); then the rank may write its own half ``h``. ``signature`` (an
      int naming the collective, size and dtype) is published with the piece.
    * ``step(wait_for)`` publishes "I have reached the next step" and waits until each rank in
      ``wait_for`` has reached it too: writes before it are visible to those ranks after it. A
      rank in ``wait_for`` whose piece has another signature raises ``CollectiveError`` (ranks
      that called different collectives or sizes never produce a silent wrong answer).
    * ``view(q, h, dtype, numel)`` is rank ``q``'s half ``h`` as a tensor; read a peer's only
      between a ``step`` that waited for it and ``end_piece``.
    * ``end_piece()`` publishes that this rank no longer reads anybody's half ``h``.

    Single-copy reads (:attr:`cma`, the same on every rank): a piece may also carry tensors
    that stay in the owner's private memory. The owner calls :meth:`publish` between
    ``begin_piece`` and ``step``; after a ``step`` that waited for the owner, a reader copies
    the tensor straight into its output with :meth:`read`; after ``end_piece`` the owner calls
    :meth:`wait_readers`, and only then may it return (the caller may change or free the tensor
    afterwards). Through the regions a byte is copied twice (into the owner's half, out of it);
    this way once, by the kernel. Cost per transfer of ``S`` bytes: ``σ + S`` for the reader
    (one system call plus one copy, instead of two copies of ``S`` split between owner and
    reader), and the owner pays a second synchronisation, waiting for its slowest reader (a
    wake-up of ~200 µs on a VM), so it pays off for large transfers only.

    A transport may also offer symmetric memory (:meth:`allocate`): buffers the user computes in
    that every peer reads in place, so an all-reduce needs no copy into the regions at all.

    Every wait has the transport's deadline and raises
    :class:`~collectives.errors.CollectiveError` naming the operation and the peer.
    """

    rank: int
    world_size: int
    #: bytes of one half (the largest piece).
    piece_bytes: int
    #: the collective running, for error messages (the transport's :attr:`Transport.op`).
    op: str
    #: whether :meth:`publish` / :meth:`read` / :meth:`wait_readers` work (every rank agrees).
    cma: bool = False

    @abc.abstractmethod
    def begin_piece(self, signature: int) -> int:
        """Start the next piece of the collective ``signature``; returns the half (0 or 1) it uses."""

    @abc.abstractmethod
    def view(self, rank: int, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``rank``'s half ``half`` as ``dtype``."""

    @abc.abstractmethod
    def step(self, wait_for: Sequence[int]) -> None:
        """Arrive at the next step; wait until the ranks in ``wait_for`` have arrived too."""

    @abc.abstractmethod
    def end_piece(self) -> None:
        """Finish the current piece: this rank reads no region's half of it any more."""

    def publish(self, tensors: Mapping[int, torch.Tensor]) -> None:
        """Let each rank ``q`` in ``tensors`` read ``tensors[q]`` (contiguous) from this rank's
        memory during the current piece; call between :meth:`begin_piece` and :meth:`step`, and
        end the call with :meth:`wait_readers` over the same ranks. Only when :attr:`cma`."""
        raise NotImplementedError

    def read(self, owner: int, out: torch.Tensor) -> None:
        """Copy the tensor ``owner`` published for this rank into ``out`` (contiguous), in one copy.

        Call after a :meth:`step` that waited for ``owner`` and before :meth:`end_piece`. The
        bytes ``owner`` published must be ``out``'s, else the ranks ran different calls and this
        raises (like ``mismatch``, telling the peers); a peer that died or stopped waiting
        raises :class:`~collectives.errors.CollectiveError` naming it.
        """
        raise NotImplementedError

    def wait_readers(self, readers: Iterable[int]) -> None:
        """After :meth:`end_piece`: wait until every rank in ``readers`` has ended the piece, so
        none reads the tensors this rank published any more. When the collective fails on this
        rank instead (here or earlier: deadline, dead peer, mismatch), the transport withdraws
        the publication as the error leaves :meth:`Transport.operation`: a reader that has not
        finished raises instead of returning bytes the caller may be changing."""
        raise NotImplementedError

    def mismatch(self, peer: int, detail: str) -> CollectiveError:
        """The error to raise when ``peer``'s data shows it runs another call than this rank
        (``detail`` says how). A transport that checks calls itself (``shm``'s wire check) returns
        its own description of both calls and tells the peers to stop waiting."""
        return CollectiveError(f"{self.op}: {detail}", op=self.op, peer=peer)

    def one_shot_kernel(
        self, numel: int, dtype: torch.dtype, op: ReduceOp, signature: int
    ) -> Callable[[torch.Tensor], None] | None:
        """Optional: the one-shot all-reduce of a contiguous buffer of ``numel`` elements of
        ``dtype`` (one piece; :func:`collectives.shm_algorithms.one_shot_fits`) as one native
        call: ``run(buf)`` does what ``begin_piece(signature)``, the copy in, ``step``, the fold
        in rank order and ``end_piece`` do, bitwise alike, and interoperates with peers running
        those (AVG folds as SUM: the caller divides). None where the transport has no kernel
        for this call; then the caller runs the algorithm itself."""
        return None

    def fold_kernel(
        self, dtype: torch.dtype, op: ReduceOp
    ) -> Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], None] | None:
        """Optional: ``run(out, also, operands)`` folds ``operands`` (contiguous, of one size) in
        rank order into ``out`` and copies the result into ``also`` in one pass over memory,
        bitwise as ``combine`` would, AVG as SUM (the caller divides); ``also`` may be one of the
        operands, ``out`` not. None where the transport has no such kernel for ``(dtype, op)``."""
        return None

    def checked_one_shot(
        self, name: str, numel: int, dtype: torch.dtype, op: ReduceOp, signature: int, header: wire.Header
    ) -> Callable[[torch.Tensor], None] | None:
        """Optional: :meth:`one_shot_kernel`'s ``run(buf)`` that also does what the transport's
        :meth:`~Transport.operation` ``name`` does around it with ``header`` as
        :func:`collectives.wire.current` (label, number, publish and compare the call), in one
        call: for a planned call (:mod:`collectives.persistent`, or a plain all-reduce whose
        shape ran before: :func:`collectives.api.all_reduce`), whose header stays the same.
        None where there is no such call; then the caller runs ``one_shot_kernel``'s or the
        algorithm inside the operation."""
        return None

    def allocate(self, nbytes: int) -> list[torch.Tensor] | None:
        """Optional: *symmetric memory*, ``nbytes`` on every rank that every rank can read and write.

        Collective: every rank calls it in the same order with the same ``nbytes``. Returns one
        ``uint8`` tensor per rank (``[q]``: rank ``q``'s memory as mapped here, a storage of
        exactly ``nbytes`` when ``nbytes > 0``), or None on every rank alike when it cannot (the
        default). Collectives on tensors that live there skip the copy into the regions
        (``shm_algorithms.all_reduce_symmetric``).
        """
        return None


def wait_all(requests: Sequence[Request]) -> None:
    """Wait for every request, in order."""
    for request in requests:
        request.wait()


def wait_for_keys(store: dist.Store, keys: list[str], deadline: float) -> bool:
    """Wait until every key in ``keys`` is set in ``store``; False if ``deadline`` (monotonic) passed.

    Polls ``store.check`` (one short request each, backing off from 0.1 ms to 5 ms) rather than
    calling ``store.wait``: a TCPStore client serves one request at a time and ``wait`` holds it
    until the key appears. All groups of a rank talk to the store over one client, and their
    transports set up lazily on their own threads; with ``wait``, one group's set-up waiting for a
    peer busy elsewhere would hold up every other group's on this rank, and overlapping groups
    started in different orders on different ranks would wait on each other until the deadline.
    A connection per group avoids that too, but each new connection to torch's store server costs
    a reverse name lookup of the client there (5 s where the resolver drops the query).
    """
    pause = 0.0001
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.005)
    return True
