"""Shared regions: the :class:`~collectives.transport.base.SharedRegions` of the shm transport.

Every rank's segment ends in its *region*, two halves that the shared-memory algorithms
(``collectives/shm_algorithms.py``) fill and every peer reads where it lies. Pieces alternate
halves; a rank reuses a half only after every peer has published (``DONE``) that it finished the
piece before, so there is no trailing barrier. A step publishes a growing counter (``SEQ``) and
waits for the listed ranks' counters; each piece carries a signature naming the call, mixed
with the wire check's tag base (:mod:`.wirecheck`), which the step compares, so ranks that
made different calls raise instead of combining unrelated bytes. Region views are cached per
(rank, half, dtype, numel).

Two more ways to read a peer's memory: single-copy reads of its private tensors
(:mod:`.cma`), and symmetric memory (:meth:`Regions.allocate`), a segment of its own per
allocation that the user computes in, which every peer maps.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ... import wire
from ...errors import CollectiveError
from ...ops import ReduceOp
from ..base import Peer, SharedRegions, Transport
from . import native
from .cma import SingleCopy
from .config import ShmConfig
from .control import DONE, ON_DONE, ON_STEP, PAGE, SEQ, TAG, fence
from .rendezvous import Rendezvous
from .segment import Segments
from .waiting import Waiter, nobody
from .wirecheck import WireCheck

log = logging.getLogger(__name__)


class Regions(SharedRegions):
    """The ranks' regions, pieces and steps over the shared segments.

    Args:
        transport: gives the rank, the group's size and deadline, and the collective under way
            (its ``op``, :attr:`op` here).
        segments, config: where the regions are and their size.
        waiter: to wake the peers and wait for them.
        check: the wire check: its tag base goes into each signature; mismatches.
        single_copy: the descriptors of single-copy reads; ``cma``: whether they work.
        rendezvous: to set up symmetric memory (:meth:`allocate`).
    """

    def __init__(
        self,
        transport: Transport,
        segments: Segments,
        config: ShmConfig,
        waiter: Waiter,
        check: WireCheck,
        single_copy: SingleCopy,
        cma: bool,
        rendezvous: Rendezvous,
    ):
        self._transport = transport
        self.rank, self.world_size, self.timeout = transport.rank, transport.world_size, transport.timeout
        self._peers = [q for q in range(self.world_size) if q != self.rank]
        self.cma = cma
        self._segments = segments
        self._ctrl = segments.ctrl
        self._waiter = waiter
        self._wake, self._wait = waiter.wake, waiter.wait
        self._check = check
        self._single_copy = single_copy
        self._rendezvous = rendezvous
        self._directory = config.directory
        half = config.region_bytes // 2
        start = segments.region_start
        self._halves = [[b[start + h * half : start + (h + 1) * half] for h in (0, 1)] for b in segments.data]
        self.piece_bytes = half
        self._views: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}
        self._step = 0
        self._pieces = 0  # pieces finished: the piece under way is number _pieces
        self._half = self._signature = 0
        self._allocations = 0  # symmetric allocations made (see allocate)
        self._kernels: dict[tuple, Callable[[torch.Tensor], None] | None] = {}  # one_shot_kernel's

    @property
    def op(self) -> str:  # type: ignore[override]
        """The collective under way (the transport's ``op``), for error messages."""
        return self._transport.op

    def view(self, rank: int, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (rank, half, dtype, numel)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 256:  # a loop repeats a few shapes; anything else starts over
                self._views.clear()
            v = self._views[key] = self._halves[rank][half][: numel * dtype.itemsize].view(dtype)
        return v

    def begin_piece(self, signature: int) -> int:
        g = self._pieces
        if g >= 2:
            for q in self._peers:
                ctrl = self._ctrl[q]
                if ctrl[DONE] < g - 1:
                    self._wait(lambda: ctrl[DONE] >= g - 1, nobody, "waiting for", q, ON_DONE)
        signature ^= self._check.tag_base  # the wire check rides on the piece's signature
        self._half, self._signature = g % 2, signature
        self._ctrl[self.rank][TAG + g % 2] = signature
        return g % 2

    def end_piece(self) -> None:
        self._pieces += 1
        fence()  # our reads of the peers' halves are done before we say so
        self._ctrl[self.rank][DONE] = self._pieces
        self._wake(ON_DONE)

    def step(self, wait_for: Iterable[Peer]) -> None:
        self._step = step = self._step + 1
        ctrl, me = self._ctrl, self.rank
        fence()  # our writes to our half are visible before the step that announces them
        ctrl[me][SEQ] = step
        self._wake(ON_STEP)
        for q in wait_for:
            if q != me and ctrl[q][SEQ] < step:
                theirs = ctrl[q]
                self._wait(lambda: theirs[SEQ] >= step, nobody, "waiting for", q, ON_STEP)
        fence()  # we read their halves only after seeing their step
        half, signature, checked = TAG + self._half, self._signature, 0
        for q in wait_for:
            if ctrl[q][half] != signature:
                raise self._check.abandon(self._check.error(q))
            checked += q != me
        if checked == self.world_size - 1:
            check = self._check
            check.verified = check.seq

    def one_shot_kernel(
        self, numel: int, dtype: torch.dtype, op: ReduceOp, signature: int
    ) -> Callable[[torch.Tensor], None] | None:
        """See :meth:`SharedRegions.one_shot_kernel`: :mod:`.native`'s, where it is loaded and
        offers ``(dtype, op)``. Cached per call shape, like the views."""
        key = (numel, dtype, op, signature)
        run = self._kernels.get(key, False)
        if run is False:
            if len(self._kernels) >= 64:
                self._kernels.clear()
            run = self._kernels[key] = self._native_one_shot(numel, dtype, op, signature)
        return run

    def _native_one_shot(
        self, numel: int, dtype: torch.dtype, op: ReduceOp, signature: int
    ) -> Callable[[torch.Tensor], None] | None:
        n, kernel = self.world_size, native.kernel()
        halves = tuple([self._halves[q][h].data_ptr() for q in range(n)] for h in (0, 1))
        ctrl_at = [d.data_ptr() for d in self._segments.data[:n]]  # a segment starts with its control block
        plan = native.plan(self.rank, n, dtype, op, numel, ctrl_at, halves, self._waiter.socket_fds())
        if kernel is None or plan is None:
            return None
        at = ctypes.addressof(plan)
        ctrl, check, wait, busy_spin_ns = self._ctrl, self._check, self._wait, self._waiter.busy_spin_ns

        def run(buf: torch.Tensor, call: int = 0) -> None:
            if not self._halves:
                raise CollectiveError(f"{self.op}: the shm transport is closed", op=self.op)
            g, step = self._pieces, self._step + 1
            self._step, self._half = step, g % 2
            self._signature = mine = signature ^ check.tag_base
            phase, spin = 0, busy_spin_ns()
            while reply := kernel(at, buf.data_ptr(), g, step, mine, phase, spin, call):
                phase, q = reply >> 32, reply & 0xFFFFFFFF
                theirs = ctrl[q]
                if phase == native.WAIT_DONE:  # begin_piece's wait
                    wait(lambda: theirs[DONE] >= g - 1, nobody, "waiting for", q, ON_DONE)
                elif phase == native.WAIT_STEP:  # step's
                    wait(lambda: theirs[SEQ] >= step, nobody, "waiting for", q, ON_STEP)
                else:  # native.MISMATCH
                    raise check.abandon(check.error(q))
            self._pieces = g + 1
            check.verified = check.seq

        run.plan = plan  # type: ignore[attr-defined]  # what the kernel reads (and the arrays it holds) lives as long
        return run

    def fold_kernel(
        self, dtype: torch.dtype, op: ReduceOp
    ) -> Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], None] | None:
        """See :meth:`SharedRegions.fold_kernel`: :func:`.native.fold_copy`."""
        return native.fold_copy(dtype, op) if self.world_size <= native.MAX_RANKS else None

    def checked_one_shot(
        self, name: str, numel: int, dtype: torch.dtype, op: ReduceOp, signature: int, header: wire.Header
    ) -> Callable[[torch.Tensor], None] | None:
        """See :meth:`SharedRegions.checked_one_shot`: :meth:`one_shot_kernel`'s call as the
        whole of :meth:`.transport.ShmTransport.operation`: the label, the wire check's number
        (:meth:`.wirecheck.WireCheck.begin_native`: the kernel publishes it and wakes the peers
        with its other wake-ups), the comparison of every peer's signature (the step's, which
        makes ``confirm`` unnecessary) and, on an error, withdrawing what was published for
        single-copy reads."""
        run = self.one_shot_kernel(numel, dtype, op, signature)
        if run is None:
            return None
        transport, begin, withdraw = self._transport, self._check.begin_native, self._single_copy.withdraw

        def checked(buf: torch.Tensor) -> None:
            previous, transport.op = transport.op, name
            try:
                run(buf, begin(header))
            except BaseException:
                withdraw()
                raise
            finally:
                transport.op = previous

        return checked

    def mismatch(self, peer: Peer, detail: str) -> CollectiveError:
        """See :meth:`SharedRegions.mismatch`: :meth:`.wirecheck.WireCheck.mismatch`."""
        return self._check.mismatch(peer, detail)

    def publish(self, tensors: Mapping[Peer, torch.Tensor]) -> None:
        """See :meth:`SharedRegions.publish` and :meth:`.cma.SingleCopy.publish`."""
        self._single_copy.publish(tensors, self._pieces)

    def read(self, owner: Peer, out: torch.Tensor) -> None:
        """See :meth:`SharedRegions.read` and :meth:`.cma.SingleCopy.read`."""
        self._single_copy.read(owner, out, self._pieces)

    def wait_readers(self, readers: Iterable[Peer]) -> None:
        """See :meth:`SharedRegions.wait_readers`. On an error the operation's context withdraws
        the descriptors (:meth:`.cma.SingleCopy.withdraw`) before the caller may touch the tensors."""
        self._single_copy.wait_readers(readers, self._pieces)

    def allocate(self, nbytes: int) -> list[torch.Tensor] | None:
        """Symmetric memory: ``nbytes`` on every rank, in a segment of its own that every rank maps.

        Collective (every rank calls it, in the same order, with the same ``nbytes``). Returns
        ``nbytes`` views, one per rank (``[q]`` is rank ``q``'s memory; ``[self.rank]`` is this
        rank's), or None on every rank alike when some rank cannot create its segment (the file
        system is full); the reason is logged. The segments are unnamed files like the
        transport's own and stay mapped until the transport closes.
        """
        self._allocations += 1
        rank, n, rendezvous = self.rank, self.world_size, self._rendezvous
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        deadline = time.monotonic() + self.timeout
        name = f"alloc/{self._allocations}"
        fd, _reports, failures = rendezvous.report_segment(name, self._directory, size, "ok", deadline)
        if failures:
            if fd >= 0:
                os.close(fd)
            q, text = failures[0]
            log.warning("%s: no symmetric memory of %d bytes (rank %d: %s); using private memory", self.op, nbytes, q, text)
            return None
        try:
            maps, socks = rendezvous.map_all(fd, size, deadline, f"-alloc{self._allocations}")
        except OSError as exc:
            raise CollectiveError(
                f"{self.op}: exchanging symmetric memory with the peers failed (this is rank {rank} of {n}): {exc}",
                op=self.op,
            ) from exc
        for s in socks.values():
            s.close()
        self._segments.adopt(maps)
        # through a memoryview, which holds an export of the mapping: closing the transport then
        # leaves a mapping that a tensor still uses (torch.frombuffer of the mmap itself holds
        # none, and the tensor would point at unmapped memory); each is a storage of exactly
        # nbytes (adoption swaps a tensor's storage with it)
        return [torch.frombuffer(memoryview(m)[: max(1, nbytes)], dtype=torch.uint8)[:nbytes] for m in maps]

    def close(self) -> None:
        """Drop the views of the regions (before the segments are unmapped)."""
        self._halves = []
        self._views = {}
        self._kernels = {}
