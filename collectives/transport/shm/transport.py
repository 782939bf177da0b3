"""ShmTransport: the shared-memory transport, composed of the parts of this package.

At the first collective the transport agrees with its peers (:mod:`.rendezvous`), creates and
maps the segments (:mod:`.segment`), and builds on them the waits (:mod:`.waiting`), the message
FIFOs (:mod:`.fifo`), the single-copy reads (:mod:`.cma`) and the shared regions
(:mod:`.regions`). The wire check (:mod:`.wirecheck`) lives from construction on, since
collectives are numbered before anything is shared. What remains here is the order of all that,
the fallback to p2p, and :meth:`ShmTransport.operation`, which brackets each collective.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from ... import wire
from ...errors import CollectiveError
from ..base import GroupInfo, Peer, Request, SharedRegions, Transport
from ..torch_p2p import TorchP2PTransport
from .cma import SingleCopy, probe_single_copy
from .config import ShmConfig, ShmUnavailableError
from .fifo import Fifos
from .regions import Regions
from .rendezvous import Rendezvous, machine
from .segment import Segments
from .waiting import Moves, Waiter, spin_times
from .wirecheck import WireCheck

log = logging.getLogger(__name__)


class _Operation:
    """:meth:`ShmTransport.operation`'s context: labels the traffic (``transport.op``, as
    :meth:`Transport.operation` does); when the body raised, withdraws what this rank published
    for single-copy reads (its caller may change those tensors now); when it succeeded and the
    collective is checked, confirms the peers ran the same call."""

    __slots__ = ("transport", "name", "previous", "checked")

    def __init__(self, transport: "ShmTransport", name: str, checked: bool):
        self.transport, self.name, self.checked = transport, name, checked

    def __enter__(self) -> None:
        transport = self.transport
        self.previous, transport.op = transport.op, self.name

    def __exit__(self, kind: object, *rest: object) -> None:
        try:
            if kind is not None:
                self.transport.withdraw()
            elif self.checked:
                self.transport.confirm()
        finally:
            self.transport.op = self.previous


class ShmTransport(Transport):
    """Point-to-point messages and shared regions among the ranks of one host.

    Args:
        rank, world_size: this process's rank in the group and the group's size.
        timeout: seconds any wait may block (also bounds the set-up).
        store: a torch Store private to the group (rendezvous: a random job id, rank 0's sizes,
            each rank's success); fds travel over unix-domain sockets, never through the store.
        config: sizes; default :meth:`ShmConfig.from_env`.
        fallback: builds the transport to use instead when shared memory is unavailable;
            without one, that raises :class:`ShmUnavailableError`.

    Nothing is shared until the first message or shared-region call (the first collective), so
    set-up failures name that collective. Then, on every rank alike: if any rank cannot create its
    segment (the message names the rank, the size needed and the fixes) or the ranks are not on
    one kernel and network namespace, ``fallback`` is used or :class:`ShmUnavailableError` raised;
    a peer that does not join within ``timeout`` gives
    :class:`~collectives.errors.CollectiveTimeoutError` naming it.
    """

    device_type = "cpu"
    #: whether single-copy reads work (set at set-up, the same on every rank; see :mod:`.cma`).
    cma = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        store: "dist.Store",
        config: ShmConfig | None = None,
        fallback: Callable[[], Transport] | None = None,
        abandoned: Callable[[], str | None] = lambda: None,
    ):
        Transport.__init__(self, rank, world_size, timeout)
        self._rendezvous = Rendezvous(self, store, abandoned)
        self._abandoned = abandoned
        self.config = config or ShmConfig.from_env()
        self.config.validate()
        self._fallback = fallback
        self._spin = spin_times(self.config.spin_seconds, world_size)
        self._p2p: Transport | None = None
        self._set_up = False
        self._check = WireCheck(self)
        # built by the first collective (_setup)
        self._segments: Segments | None = None
        self._waiter: Waiter | None = None
        self._fifos: Fifos | None = None
        self._single_copy: SingleCopy | None = None
        self._regions: Regions | None = None

    def operation(self, name: str) -> ContextManager[None]:
        """Label the traffic; a checked collective (:func:`collectives.wire.current`) is numbered,
        tags its messages and pieces with what it is, publishes its header, and compares the
        peers' headers before it returns, all without a message of its own (:mod:`.wirecheck`).
        When the body raises, what this rank published for single-copy reads is withdrawn.
        """
        if self._p2p is not None:  # fell back: the p2p transport runs its own wire check
            return self._p2p.operation(name)
        header = wire.current()
        checked = header is not None and self.world_size > 1
        self._check.begin(header if checked else None)
        return _Operation(self, name, checked)

    def confirm(self) -> None:
        """End of a checked collective: wait until every peer has started it, compare headers
        (unless a step already compared every peer's piece signature, which covers the header).
        A collective that moved nothing still sets the segments up for this."""
        check = self._check
        if check.verified != check.seq and self._ready():
            check.confirm()

    def withdraw(self) -> None:
        """A collective failed on this rank: void what it published for single-copy reads
        (:meth:`.cma.SingleCopy.withdraw`)."""
        if self._single_copy is not None:
            self._single_copy.withdraw()

    def _ready(self) -> bool:
        """Set up on first use (inside a collective, so errors name it); False once on the fallback."""
        if self._set_up:
            return True
        if self._p2p is not None:
            self._p2p.op = self.op
            return False
        try:
            self._setup()
        except ShmUnavailableError as exc:
            if self._fallback is None:
                raise
            log.warning("%s; falling back to the p2p backend", exc)
            self._p2p = self._fallback()
            return self._ready()
        self._set_up = True
        return True

    def _setup(self) -> None:
        """Agree on sizes, create the segment, check every rank succeeded, exchange and map; then
        build the waits, FIFOs, single-copy reads and regions on the segments."""
        rendezvous, rank, n = self._rendezvous, self.rank, self.world_size
        deadline = time.monotonic() + self.timeout
        self.config = cfg = rendezvous.agree(self.config, deadline)
        size = cfg.segment_bytes(n)
        fd, reports, failures = rendezvous.report_segment("ok", cfg.directory, size, f"ok {machine()}", deadline)
        if not failures and len(set(reports)) > 1:  # checked, not assumed: one kernel, one network
            failures = [(rank, f"shm: the ranks are not all on one host in one network namespace: {reports}; "
                               "use backend='p2p'")]
        if failures:
            if fd >= 0:
                os.close(fd)
            q, text = failures[0]
            raise ShmUnavailableError(text if q == rank else f"shm: rank {q} could not set up: {text}")
        try:
            maps, socks = rendezvous.map_all(fd, size, deadline, "")
        except OSError as exc:  # the ranks agreed they can share memory: a peer failed mid-way
            raise CollectiveError(
                f"{self.op}: shared-memory set-up failed while exchanging segments with the peers "
                f"(this is rank {rank} of {n}): {exc}",
                op=self.op,
            ) from exc
        check = self._check
        segments = self._segments = Segments(maps, cfg)
        waiter = self._waiter = Waiter(self, segments, socks, self._spin, check.check_peers, self._abandoned)
        self._fifos = Fifos(self, segments, cfg, waiter, check)
        pids = probe_single_copy(rendezvous, cfg.cma, deadline)
        self.cma = pids is not None
        self._single_copy = SingleCopy(self, segments, waiter, check, pids or {})
        self._regions = Regions(self, segments, cfg, waiter, check, self._single_copy, self.cma, rendezvous)
        check.attach(segments, waiter)
        log.debug("shm transport %s: rank %d/%d, %d bytes per rank", rendezvous.uid, rank, n, size)

    @classmethod
    def for_group(cls, group: GroupInfo, device: torch.device) -> Transport:
        """The ``shm`` backend's factory: the transport of ``group``.

        The segments are set up by the first collective (so a missing peer gives that
        collective's timeout error). If the backend was picked by ``auto`` and shared memory
        cannot be set up (on every rank alike: the failure is agreed through the store), the
        transport logs why and forwards everything to a ``p2p`` transport; a group that asked
        for ``shm`` by name gets :class:`ShmUnavailableError`.
        """
        fallback = None if group.backend == "shm" else (lambda: TorchP2PTransport.for_group(group, device))
        return cls(group.rank(), group.size(), group.timeout, group.store, fallback=fallback, abandoned=lambda: group.broken)

    @staticmethod
    def usable(group: GroupInfo | None) -> bool:
        """Whether ``auto`` may pick shm for ``group``: every rank on this host (by host key).

        The constructor checks the rest (one kernel and network namespace, space for the
        segments) and falls back to p2p, on every rank alike, if that fails.
        """
        return group is not None and sys.platform.startswith("linux") and len(set(group.hosts)) == 1

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        if not self._ready():
            return self._p2p.isend(tensor, peer)  # type: ignore[union-attr]
        return self._fifos.queue(tensor, peer, "send")  # type: ignore[union-attr]

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        if not self._ready():
            return self._p2p.irecv(tensor, peer)  # type: ignore[union-attr]
        return self._fifos.queue(tensor, peer, "recv")  # type: ignore[union-attr]

    @property
    def fell_back(self) -> bool:
        """Whether set-up found no shared memory and the traffic runs over the p2p fallback."""
        return self._p2p is not None

    @property
    def moves(self) -> Moves:
        """How often this rank's blocking waits moved it off a peer's CPU (:class:`.waiting.Moves`)."""
        return self._waiter.moves if self._waiter is not None else Moves(0, 0.0)

    def shared_regions(self) -> SharedRegions | None:
        return self._regions if self._ready() else None

    def close(self) -> None:
        if self._p2p is not None:
            self._p2p.close()
        if self._waiter is not None:
            self._waiter.close()
        if self._regions is not None:
            self._regions.close()  # its views go before the segments are unmapped
        if self._segments is not None:
            self._segments.close()
