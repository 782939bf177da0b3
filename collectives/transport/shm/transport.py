"""Shared-memory transport: the ranks of one host exchange bytes through mapped memory.

On one host a socket transport copies every byte user → kernel → user and wakes I/O threads;
here a sender copies straight into memory the receiver has mapped, and the receiver copies out.

Segments
    Every rank creates one segment in ``RINGDDP_SHM_DIR`` (default ``/dev/shm``) as an *unnamed*
    file (``O_TMPFILE``; where that is unsupported, a uniquely named file unlinked right after
    creation), reserves its space with ``os.posix_fallocate`` (an ``ftruncate``d segment would die
    with SIGBUS on first touch when the file system is full) and hands the file descriptor to
    every peer over a unix-domain socket (``SCM_RIGHTS``). So no name ever lingers in /dev/shm,
    whatever happens to the processes, and two jobs on one machine cannot collide. A segment holds

    * a control block: 64-byte lines of growing ``int64`` counters (below);
    * a FIFO per peer for messages *to* this rank: ``slots`` slots of ``slot_bytes`` each;
    * the rank's *region*, two halves that the shared-memory algorithms
      (``collectives/shm_algorithms.py``) fill and every peer reads directly.

    Size per rank: ``region_bytes + (n - 1) · slots · slot_bytes`` plus 4 KiB, by default
    8 MiB + (n - 1) · 2 MiB (10 MiB per rank at 2 ranks, 14 MiB at 4, 56 MiB for a 4-rank job).
    Messages larger than the FIFO stream through it in slot-sized chunks. Set
    ``RINGDDP_SHM_REGION_BYTES``, ``RINGDDP_SHM_SLOT_BYTES``, ``RINGDDP_SHM_SLOTS``, and
    ``RINGDDP_SHM_CMA=0`` to turn single-copy reads off (rank 0's values are used by every
    rank). A file system too small fails on every rank with :class:`ShmUnavailableError`
    naming the size needed and the fixes.

Messages
    Sender ``s`` owns ``head[s]`` and receiver ``r`` owns ``tail[s]``, both in ``r``'s control
    block; both only grow. The sender copies a chunk into slot ``head % slots`` when
    ``head - tail < slots``, records the message's total size and its tag (what the message
    is, :mod:`collectives.wire`) next to it, then publishes ``head + 1``; the receiver checks
    both against what it posted (a mismatch is an error, never a silent misread; see
    :meth:`ShmTransport.operation`), copies the chunk out and publishes ``tail + 1``. Counters are
    written after the data they cover, behind a full fence. Messages between a pair therefore
    arrive in the order posted. Progress happens inside :meth:`Request.wait` (and eagerly when a
    message is posted): a waiting rank moves every pending chunk it can, so a ring step's send
    and receive advance together.

Single-copy reads (cross-memory attach)
    Through a region every byte is copied twice: the owner into its region, the reader out of
    it. Linux's ``process_vm_readv`` lets the reader copy straight out of the owner's private
    tensor: one copy, done by the kernel (see :meth:`ShmTransport.publish`). The owner writes
    (address, bytes, piece number) of the tensor a reader may read into the reader's control
    block, in its pair's head line; a step makes it visible; the reader checks the bytes and
    piece number against what it expects and reads; the owner then waits until its readers
    have ended the piece, since its tensor must stay untouched until then (a collective that
    fails on the owner withdraws them instead, :meth:`ShmTransport.withdraw`). Whether this works
    (same user, no Yama ``ptrace_scope`` above 0, no seccomp filter, one pid namespace) is
    probed at set-up: every rank reads a random word from each peer, and all ranks agree
    through the store. Else, or with ``RINGDDP_SHM_CMA=0`` (rank 0's value counts), it is off
    on every rank, logged once at INFO, and the algorithms copy through the regions. The
    process's security settings are never changed (no ``PR_SET_PTRACER``).

Waiting
    Ranks may outnumber cores (4 ranks on 2 cores), so a waiter spins only briefly
    (``spin_seconds``: 300 µs when every rank has a core, the first 50 µs without yielding it;
    else 50 µs yielding the core each turn), then sets its ``sleeping`` word to the events it
    waits for, fences, checks again and blocks in ``poll`` on its sockets to the peers. Whoever
    publishes a counter fences, reads the peers' ``sleeping`` words and writes one byte to the
    socket of each peer asleep on that event. A sleeping waiter costs its peers a system call
    and itself a wake-up (on a VM about 200 µs), hence the spin. The same sockets report a dead
    peer (EOF: the kernel closes them when a process dies, even by SIGKILL), and ``poll``
    carries the group's deadline, so a stopped peer gives
    a :class:`~collectives.errors.CollectiveTimeoutError` and a dead one a
    :class:`~collectives.errors.CollectiveError`, both naming the operation and the peer.
"""

from __future__ import annotations

import array
import collections
import ctypes
import errno
import functools
import logging
import os
import secrets
import select
import socket
import sys
import time
from typing import Callable, ContextManager, Iterable, Mapping

import torch
import torch.distributed as dist

from ... import wire
from ...errors import CollectiveError, CollectiveTimeoutError
from ..base import GroupInfo, Peer, Request, SharedRegions, Transport
from ..torch_p2p import TorchP2PTransport
from .config import ShmConfig, ShmUnavailableError
from .control import (
    ABANDONED, BYTES, CALL, CMA, DONE, LINE, ON_ANY, ON_CALL, ON_DONE, ON_MESSAGE, ON_STEP, PAGE, PAIR, SEQ, SLEEPING, TAG,
    fence,
)
from .rendezvous import Rendezvous, machine
from .segment import Segments

log = logging.getLogger(__name__)

_BUSY_SPIN = 50e-6  # seconds a waiter with a core of its own spins without yielding


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@functools.cache
def _process_vm_readv() -> Callable[..., int]:
    """libc's ``process_vm_readv`` (AttributeError where libc lacks it)."""
    f = ctypes.CDLL(None, use_errno=True).process_vm_readv
    iov = ctypes.POINTER(_IoVec)
    f.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    f.restype = ctypes.c_ssize_t
    return f


def _read_memory(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``remote`` of process ``pid`` to address ``local`` of this one.

    One copy, by the kernel (``process_vm_readv``; ctypes releases the GIL meanwhile). A read may
    stop short (a page boundary the kernel could not pin): continue where it stopped. Raises
    OSError: ESRCH (the process is gone), EPERM (not allowed to read it), EFAULT (an address
    not mapped).
    """
    readv, done = _process_vm_readv(), 0
    while done < nbytes:
        here, there = _IoVec(local + done, nbytes - done), _IoVec(remote + done, nbytes - done)
        got = readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv of pid {pid}: {os.strerror(code)}")
        done += got


def _check_contiguous(t: torch.Tensor, op: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: single-copy reads need contiguous tensors")


class _Message:
    """A posted send or receive: ``data`` (bytes of the tensor) moved chunk by chunk."""

    __slots__ = ("data", "tensor", "nbytes", "offset", "chunks", "peer", "kind", "tag")

    def __init__(self, tensor: torch.Tensor, peer: Peer, kind: str, slot_bytes: int, tag_base: int):
        self.tensor = tensor  # keeps the caller's storage alive
        # as_strided: a contiguous tensor of one element may still carry an odd stride
        flat = tensor.as_strided((tensor.numel(),), (1,)) if tensor.numel() else tensor.new_empty(0)
        self.data = flat.view(torch.uint8)
        self.nbytes = self.data.numel()
        self.offset = 0
        self.chunks = max(1, -(-self.nbytes // slot_bytes))  # an empty message is one empty chunk
        self.peer = peer
        self.kind = kind
        self.tag = wire.tag(tag_base, self.nbytes) if tag_base else 0  # what the message is (wire check)

    def chunk(self, slot_bytes: int) -> tuple[int, int]:
        """``(offset, size)`` of the next chunk of at most ``slot_bytes``."""
        return self.offset, min(slot_bytes, self.nbytes - self.offset)

    def advance(self, size: int) -> bool:
        """Count one chunk of ``size`` bytes as moved; True when the whole message has moved."""
        self.offset += size
        self.chunks -= 1
        return not self.chunks


class ShmRequest(Request):
    __slots__ = ("_transport", "_message")

    def __init__(self, transport: "ShmTransport", message: _Message):
        self._transport = transport
        self._message = message

    def wait(self) -> None:
        if self._message.chunks:
            self._transport.wait_message(self._message)

    def is_completed(self) -> bool:
        if self._message.chunks:
            self._transport.progress()
        return not self._message.chunks


class _Operation:
    """:meth:`ShmTransport.operation`'s context: labels the traffic; when the body raised,
    withdraws what this rank published for single-copy reads (its caller may change those
    tensors now); when it succeeded and the collective is checked, confirms the peers ran the
    same call."""

    __slots__ = ("transport", "label", "checked")

    def __init__(self, transport: "ShmTransport", label: ContextManager[None], checked: bool):
        self.transport, self.label, self.checked = transport, label, checked

    def __enter__(self) -> None:
        self.label.__enter__()

    def __exit__(self, kind: object, *rest: object) -> None:
        try:
            if kind is not None:
                self.transport.withdraw()
            elif self.checked:
                self.transport.confirm()
        finally:
            self.label.__exit__(kind, *rest)


class ShmTransport(Transport, SharedRegions):
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

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        store: "dist.Store",
        config: ShmConfig | None = None,
        fallback: Callable[[], Transport] | None = None,
    ):
        Transport.__init__(self, rank, world_size, timeout)
        self._rendezvous = Rendezvous(self, store)
        self.config = config or ShmConfig.from_env()
        self.config.validate()
        self._fallback = fallback
        # Spinning: with a core per rank, first without yielding (the peer is about to publish;
        # sched_yield hands the core to any other runnable thread for up to its time slice),
        # then yielding (other threads, e.g. gloo's I/O, get the core); with more ranks than
        # cores, yield from the start (the peer we wait for may need our core).
        own_core = world_size <= len(os.sched_getaffinity(0))
        spin = self.config.spin_seconds
        self._spin = spin if spin is not None else (300e-6 if own_core else 50e-6)
        self._busy_spin = min(self._spin, _BUSY_SPIN) if own_core else 0.0
        self._p2p: Transport | None = None
        self._set_up = False
        self._seq = 0  # checked collectives so far (the wire check numbers them)
        self._tag_base = 0  # of the checked collective under way; 0: unchecked
        self._verified = 0  # the last one whose pieces matched every peer's signature
        self._header: wire.Header | None = None  # its header
        self._published_header: wire.Header | None = None  # the one whose fields are in shared memory
        self._segments: Segments | None = None
        self._socks: dict[Peer, socket.socket] = {}
        self._published: list[Peer] = []  # readers of this rank's tensors in the current call (publish)
        self._allocations = 0  # symmetric allocations made (see allocate)

    def operation(self, name: str) -> ContextManager[None]:
        """Label the traffic; a checked collective (:func:`collectives.wire.current`) is numbered,
        tags its messages and pieces with what it is, publishes its header, and compares the
        peers' headers before it returns.

        The check sends no message. Each slot carries its message's tag
        (:func:`collectives.wire.tag`) next to its size and each piece its signature mixed with
        the header's tag base, so data of another call is never read: the rank that finds one
        raises and tells its peers (:meth:`_abandon`). Every rank publishes its header (the
        all-to-all byte counts in each peer's pair lines) when the collective starts; at the end,
        each rank waits until every peer has started the same collective number and compares
        headers, so a rank that finished without reading anything of the peers' (a broadcast
        root, a sender whose messages fit the slots) raises too. Ranks that wait on each other
        without moving data (one runs a region algorithm, the other messages) compare while they
        sleep.
        """
        if self._p2p is not None:  # fell back: the p2p transport runs its own wire check
            return self._p2p.operation(name)
        header = wire.current()
        if header is None or self.world_size == 1:
            self._tag_base = 0
            return _Operation(self, super().operation(name), checked=False)
        self._seq += 1
        self._tag_base = header.tag_base(self._seq)
        self._header = header
        if self._set_up:
            self._publish_call()
        return _Operation(self, super().operation(name), checked=True)

    def _publish_call(self) -> None:
        """Publish the header of the checked collective: byte counts and fields, then its number."""
        me, h = self.rank, self._header
        mine = self._ctrl[me]
        if h is not self._published_header:  # a loop repeating one call only bumps the number
            mine[CALL] = 0  # a seqlock: readers that see the number change meanwhile discard what they read
            fence()
            if h.sends is not None and h.recvs is not None:
                for q in self._sends:
                    pair = PAIR + me * PAIR + BYTES
                    self._ctrl[q][pair : pair + 2] = array.array("q", (h.sends[q], h.recvs[q]))
            mine[CALL + 1 : CALL + LINE] = array.array("q", h.fields(0, 0)[1:LINE])
            self._published_header = h
        fence()
        mine[CALL] = self._seq
        self._wake(ON_CALL)

    def _header_of(self, q: Peer) -> list[int] | None:
        """Peer ``q``'s header message if it runs our checked collective (by number), else None."""
        theirs, seq = self._ctrl[q], self._seq
        if theirs[CALL] != seq:
            return None
        fence()
        fields = theirs[CALL : CALL + LINE].tolist()
        pair = PAIR + q * PAIR + BYTES
        sizes = self._ctrl[self.rank][pair : pair + 2].tolist() if self._header.sends is not None else [-1, -1]
        fence()
        return fields + sizes if theirs[CALL] == seq else None  # else it moved on meanwhile

    def _mine(self, q: Peer) -> list[int]:
        return self._header.fields(self._seq, q)

    def _check_calls(self, peers: Iterable[Peer]) -> None:
        """Raise if a peer in our checked collective (by number) runs a different call."""
        if not self._tag_base:
            return
        for q in peers:
            theirs = self._header_of(q)
            if theirs is not None and wire.compare(self._mine(q), theirs):
                raise self._abandon(self._mismatch(q))

    def confirm(self) -> None:
        """End of a checked collective: wait until every peer has started it, compare headers
        (unless a step already compared every peer's piece signature, which covers the header).
        A collective that moved nothing still sets the segments up for this."""
        seq = self._seq
        if self._verified == seq or not self._ready():
            return
        for q in self._sends:
            theirs = self._ctrl[q]
            if theirs[CALL] < seq:
                self._await(lambda: theirs[CALL] >= seq, self._never, "waiting for", q, ON_CALL)
        self._check_calls(self._sends)

    def mismatch(self, peer: Peer, detail: str) -> CollectiveError:
        """See :meth:`SharedRegions.mismatch`: the wire check's description when ``peer``'s header
        differs from ours, else ``detail``; either way the peers stop waiting."""
        theirs = self._header_of(peer) if self._tag_base else None
        if theirs is not None and wire.compare(self._mine(peer), theirs):
            return self._abandon(self._mismatch(peer))
        return self._abandon(CollectiveError(f"{self.op}: {detail}", op=self.op, peer=peer))

    def _mismatch(self, q: Peer) -> CollectiveError:
        """The error for a peer whose message, piece or header says it runs another call than ours."""
        if not self._tag_base:  # unchecked traffic (no header): sizes or signatures differed
            what = f"rank {q} is running a different collective or size than this rank (rank {self.rank})"
        else:
            theirs, mine = self._header_of(q), self._mine(q)
            what = f"this rank ({self.rank}) called {wire.describe(torch.tensor(mine))}; rank {q} called "
            diffs = wire.compare(mine, theirs) if theirs is not None else []
            if diffs:
                what += f"{wire.describe(torch.tensor(theirs))}; they differ in {', '.join(diffs)}"
            elif theirs is not None:  # equal headers, different pieces (symmetric memory on one rank, offsets)
                what += "the same; yet their pieces say they ran a different collective or size (a tensor in "
                what += "symmetric memory on some ranks only, or at different offsets in it)"
            else:
                what += "another collective"
        return CollectiveError(
            f"{self.op}: rank {q} called a different collective (wire check): {what}. Every rank must "
            "issue the same collectives with matching arguments and sizes, in the same order",
            op=self.op,
            peer=q,
        )

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
        """Agree on sizes, create the segment, check every rank succeeded, exchange and map."""
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
            maps, self._socks = rendezvous.map_all(fd, size, deadline, "")
        except OSError as exc:  # the ranks agreed they can share memory: a peer failed mid-way
            raise CollectiveError(
                f"{self.op}: shared-memory set-up failed while exchanging segments with the peers "
                f"(this is rank {rank} of {self.world_size}): {exc}",
                op=self.op,
            ) from exc
        segments = self._segments = Segments(maps, cfg)
        self._ctrl, self._bytes, self._ctrl_bytes = segments.ctrl, segments.data, segments.fifo_start
        half = cfg.region_bytes // 2
        start = segments.region_start
        self._halves = [[b[start + h * half : start + (h + 1) * half] for h in (0, 1)] for b in self._bytes]
        self.piece_bytes = half
        self._head = [0] * n  # my sends to q: chunks published (mirror of q's head[me])
        self._tail = [0] * n  # my receives from q: chunks consumed
        self._sends: dict[Peer, collections.deque[_Message]] = {q: collections.deque() for q in range(n) if q != rank}
        self._recvs: dict[Peer, collections.deque[_Message]] = {q: collections.deque() for q in range(n) if q != rank}
        self._step = 0
        self._pieces = 0
        self._views: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}
        self._half = self._signature = 0
        self._dead: set[Peer] = set()
        self._poll = select.poll()
        self._fd_peer: dict[int, Peer] = {}
        for q, s in self._socks.items():
            s.setblocking(False)
            self._poll.register(s.fileno(), select.POLLIN)
            self._fd_peer[s.fileno()] = q
        self.cma = self._probe_cma(deadline)
        if self._tag_base:
            self._publish_call()
        log.debug("shm transport %s: rank %d/%d, %d bytes per rank", rendezvous.uid, rank, n, size)

    def _probe_cma(self, deadline: float) -> bool:
        """Whether every rank can read every peer's memory (:func:`_read_memory`), agreed by all.

        Each rank publishes its pid and the address of a random word in the store, reads each
        peer's word and reports; a refusal (EPERM: Yama, seccomp), a missing system call or a
        wrong word (the pid names another process: separate pid namespaces) turns single-copy
        reads off on every rank, logged once. Two rounds through the store, at set-up only.
        """
        rendezvous, rank, n = self._rendezvous, self.rank, self.world_size
        if not self.config.cma:
            log.info("shm: single-copy reads are off (RINGDDP_SHM_CMA=0)")
            return False
        self._probe_word = ctypes.c_int64(secrets.randbits(63))
        word = self._probe_word
        rendezvous.set(f"cma/{rank}", f"{os.getpid()} {ctypes.addressof(word)} {word.value}")
        peers = {q: [int(x) for x in rendezvous.get(f"cma/{q}", q, deadline).split()] for q in range(n) if q != rank}
        failure = ""
        for q, (pid, address, value) in peers.items():
            word = ctypes.c_int64()
            try:
                _read_memory(pid, ctypes.addressof(word), address, 8)
            except (OSError, AttributeError) as exc:
                failure = f"rank {rank} cannot read rank {q}'s memory: {exc}"
                break
            if word.value != value:
                failure = f"rank {q}'s pid {pid} is another process to rank {rank} (separate pid namespaces?)"
                break
        rendezvous.set(f"cma-ok/{rank}", failure or "ok")
        reports = [rendezvous.get(f"cma-ok/{q}", q, deadline) for q in range(n)]
        failures = [text for text in reports if text != "ok"]
        if failures:
            log.info("shm: single-copy reads (process_vm_readv) are unavailable, large transfers copy twice "
                     "through shared memory: %s", failures[0])
            return False
        self._pids = {q: pid for q, (pid, _address, _value) in peers.items()}
        return True

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
        return cls(group.rank(), group.size(), group.timeout, group.store, fallback=fallback)

    @staticmethod
    def usable(group: GroupInfo | None) -> bool:
        """Whether ``auto`` may pick shm for ``group``: every rank on this host (by host key).

        The constructor checks the rest (one kernel and network namespace, space for the
        segments) and falls back to p2p, on every rank alike, if that fails.
        """
        return group is not None and sys.platform.startswith("linux") and len(set(group.hosts)) == 1

    # ---- waiting ---------------------------------------------------------------------------

    def _wake(self, event: int, peers: Iterable[Peer] | None = None) -> None:
        """Tell the peers (default: all) that ``event`` happened, writing a byte to those asleep on it."""
        fence()  # the counter we published must be visible before we read their flags (Dekker)
        for q in self._sends if peers is None else peers:
            if self._ctrl[q][SLEEPING] & event:
                try:
                    self._socks[q].send(b"\0")
                except OSError:  # full (it has wake-ups pending) or gone (its waits find out)
                    pass

    def _await(
        self, ready: Callable[[], bool], peers: Callable[[], Iterable[Peer]], kind: str, peer: Peer, event: int
    ) -> None:
        """Block until ``ready()``; ``peers()`` are the ranks whose progress it needs, ``event``
        the kinds of publication (``_ON_*``) that can make it ready.

        Spins for ``spin_seconds`` then sleeps on the peer sockets; raises naming ``peer`` (or
        the dead peer among ``peers()``) at the deadline or when a needed peer has exited.
        """
        if ready():
            return
        now = time.perf_counter()
        spin_until = now + self._spin
        busy_until = now + self._busy_spin
        while (now := time.perf_counter()) < spin_until:
            if now >= busy_until:
                os.sched_yield()
            if ready():
                return
        deadline = time.monotonic() + self.timeout
        me = self._ctrl[self.rank]
        while True:
            me[SLEEPING] = event
            fence()
            if ready():
                me[SLEEPING] = 0
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                me[SLEEPING] = 0
                raise CollectiveTimeoutError(
                    f"{self.op}: {kind} rank {peer} timed out after {self.timeout:g}s "
                    f"(this is rank {self.rank} of {self.world_size})",
                    op=self.op,
                    peer=peer,
                )
            events = self._poll.poll(min(remaining, 0.1) * 1000)
            me[SLEEPING] = 0
            for fileno, _event in events:
                self._drain(self._fd_peer[fileno])
            if ready():
                return
            self._check_calls(self._sends)
            abandoned = [q for q in range(self.world_size) if q != self.rank and self._ctrl[q][ABANDONED]]
            if abandoned and self._tag_base and self._header_of(abandoned[0]) is not None:
                raise self._mismatch(abandoned[0])
            if abandoned:
                raise CollectiveError(
                    f"{self.op}: rank {abandoned[0]} found that the ranks called different collectives or sizes "
                    f"and abandoned the call (this is rank {self.rank} of {self.world_size})",
                    op=self.op,
                    peer=abandoned[0],
                )
            dead = [q for q in ([peer] + list(peers())) if q in self._dead]
            if dead:
                raise CollectiveError(
                    f"{self.op}: {kind} rank {dead[0]} failed: the peer exited "
                    f"(this is rank {self.rank} of {self.world_size})",
                    op=self.op,
                    peer=dead[0],
                )

    def _abandon(self, error: CollectiveError) -> CollectiveError:
        """Publish that this rank found a mismatch, so peers waiting on it raise at once instead of
        at the deadline; returns ``error`` for the caller to raise."""
        self._ctrl[self.rank][ABANDONED] = 1
        self._wake(ON_ANY)
        return error

    def _drain(self, q: Peer) -> None:
        s = self._socks[q]
        try:
            while True:
                data = s.recv(4096)
                if not data:
                    break
                if len(data) < 4096:
                    return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._dead.add(q)  # EOF or reset: the peer's process is gone
        self._poll.unregister(s.fileno())

    # ---- messages --------------------------------------------------------------------------

    def _slot(self, owner: Peer, sender: Peer, slot: int, nbytes: int) -> torch.Tensor:
        index = sender if sender < owner else sender - 1
        start = self._ctrl_bytes + (index * self.config.slots + slot) * self.config.slot_bytes
        return self._bytes[owner][start : start + nbytes]

    def _push(self, q: Peer) -> bool:
        """Copy pending chunks to ``q`` while it has free slots; True if any moved."""
        queue, ctrl, base = self._sends[q], self._ctrl[q], PAIR + self.rank * PAIR
        slots, slot_bytes = self.config.slots, self.config.slot_bytes
        moved = False
        while queue:
            head = self._head[q]
            if head - ctrl[base + LINE] >= slots:
                break
            m = queue[0]
            offset, size = m.chunk(slot_bytes)
            if size:
                self._slot(q, self.rank, head % slots, size).copy_(m.data[offset : offset + size])
            ctrl[base + 2 * LINE + head % slots] = m.nbytes
            ctrl[base + 3 * LINE + head % slots] = m.tag
            fence()
            ctrl[base] = self._head[q] = head + 1
            if m.advance(size):
                queue.popleft()
            moved = True
        if moved:
            self._wake(ON_MESSAGE, (q,))
        return moved

    def _pull(self, q: Peer) -> bool:
        """Copy arrived chunks from ``q`` into posted receives; True if any moved."""
        queue, ctrl, base = self._recvs[q], self._ctrl[self.rank], PAIR + q * PAIR
        slots, slot_bytes = self.config.slots, self.config.slot_bytes
        moved = False
        while queue:
            tail = self._tail[q]
            if ctrl[base] == tail:
                break
            fence()
            m = queue[0]
            sent = ctrl[base + 2 * LINE + tail % slots]
            if sent != m.nbytes:  # checked calls: the wire check's account of both; else the sizes
                raise self._abandon(self._mismatch(q) if self._tag_base else CollectiveError(
                    f"{self.op}: rank {q} sent a {sent}-byte message where this rank (rank {self.rank}) "
                    f"expected {m.nbytes} bytes: the ranks called different collectives or sizes",
                    op=self.op,
                    peer=q,
                ))
            if ctrl[base + 3 * LINE + tail % slots] != m.tag:
                raise self._abandon(self._mismatch(q))
            offset, size = m.chunk(slot_bytes)
            if size:
                m.data[offset : offset + size].copy_(self._slot(self.rank, q, tail % slots, size))
            fence()
            ctrl[base + LINE] = self._tail[q] = tail + 1
            if m.advance(size):
                queue.popleft()
            moved = True
        if moved:
            self._wake(ON_MESSAGE, (q,))
        return moved

    def progress(self) -> None:
        """Move every chunk that can move now."""
        for q in self._sends:
            if self._sends[q]:
                self._push(q)
            if self._recvs[q]:
                self._pull(q)

    def _pending_peers(self) -> list[Peer]:
        return [q for q in self._sends if self._sends[q] or self._recvs[q]]

    def wait_message(self, m: _Message) -> None:
        def ready() -> bool:
            self.progress()
            return not m.chunks

        self._await(ready, self._pending_peers, "send to" if m.kind == "send" else "recv from", m.peer, ON_MESSAGE)

    def _check_peer(self, peer: Peer) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"{self.op}: peer {peer} is not another rank of 0..{self.world_size - 1}")

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        if not self._ready():
            return self._p2p.isend(tensor, peer)  # type: ignore[union-attr]
        return self._queue(tensor, peer, "send", self._sends, self._push)

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        if not self._ready():
            return self._p2p.irecv(tensor, peer)  # type: ignore[union-attr]
        return self._queue(tensor, peer, "recv", self._recvs, self._pull)

    def _queue(self, tensor: torch.Tensor, peer: Peer, kind: str, queues, move: Callable[[Peer], bool]) -> Request:
        """Queue one message to or from ``peer``; the first of its queue starts moving at once."""
        self._check_peer(peer)
        m = _Message(tensor, peer, kind, self.config.slot_bytes, self._tag_base)
        queues[peer].append(m)
        if len(queues[peer]) == 1:
            move(peer)
        return ShmRequest(self, m)

    # ---- shared regions (see base.SharedRegions) -------------------------------------------

    def shared_regions(self) -> SharedRegions | None:
        return self if self._ready() else None

    def view(self, rank: int, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (rank, half, dtype, numel)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 256:  # a loop repeats a few shapes; anything else starts over
                self._views.clear()
            v = self._views[key] = self._halves[rank][half][: numel * dtype.itemsize].view(dtype)
        return v

    def _never(self) -> tuple[Peer, ...]:
        return ()

    def begin_piece(self, signature: int) -> int:
        g = self._pieces
        if g >= 2:
            for q in self._sends:
                ctrl = self._ctrl[q]
                if ctrl[DONE] < g - 1:
                    self._await(lambda: ctrl[DONE] >= g - 1, self._never, "waiting for", q, ON_DONE)
        signature ^= self._tag_base  # the wire check rides on the piece's signature
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
                self._await(lambda: theirs[SEQ] >= step, self._never, "waiting for", q, ON_STEP)
        fence()  # we read their halves only after seeing their step
        half, signature, checked = TAG + self._half, self._signature, 0
        for q in wait_for:
            if ctrl[q][half] != signature:
                raise self._abandon(self._mismatch(q))
            checked += q != me
        if checked == self.world_size - 1:
            self._verified = self._seq

    def publish(self, tensors: Mapping[Peer, torch.Tensor]) -> None:
        """See :meth:`SharedRegions.publish`: writes (address, bytes, piece + 1) into each reader's
        control block, in this rank's head line there; the next :meth:`step` makes it visible."""
        stamp, me = self._pieces + 1, PAIR + self.rank * PAIR + CMA
        for q, t in tensors.items():
            _check_contiguous(t, self.op)
            self._ctrl[q][me : me + 3] = array.array("q", (t.data_ptr(), t.numel() * t.element_size(), stamp))
        self._published = list(tensors)

    def read(self, owner: Peer, out: torch.Tensor) -> None:
        """See :meth:`SharedRegions.read`."""
        _check_contiguous(out, self.op)
        line, mine = PAIR + owner * PAIR + CMA, self._ctrl[self.rank]
        address, nbytes, stamp = mine[line : line + 3].tolist()
        expected, piece = out.numel() * out.element_size(), self._pieces + 1
        if stamp < 0:
            raise self._gave_up(owner)
        if stamp != piece or nbytes != expected:
            what = "nothing" if stamp != piece else f"{nbytes} bytes"
            raise self.mismatch(
                owner,
                f"rank {owner} published {what} for this rank (rank {self.rank}) to read, which expects "
                f"{expected} bytes: the ranks called different collectives or sizes",
            )
        if nbytes:
            try:
                _read_memory(self._pids[owner], out.data_ptr(), address, nbytes)
            except OSError as exc:
                gone = exc.errno == errno.ESRCH
                raise CollectiveError(
                    f"{self.op}: reading rank {owner}'s tensor failed: "
                    + ("the peer exited" if gone else f"{exc} (RINGDDP_SHM_CMA=0 copies through shared memory instead)")
                    + f" (this is rank {self.rank} of {self.world_size})",
                    op=self.op,
                    peer=owner,
                ) from exc
        fence()
        if mine[line + 2] != stamp:  # the owner gave up waiting for us: its tensor may have changed meanwhile
            raise self._gave_up(owner)

    def _gave_up(self, owner: Peer) -> CollectiveError:
        return CollectiveError(
            f"{self.op}: rank {owner} stopped waiting for this rank (rank {self.rank}) to read its tensor "
            "(it failed or timed out), so the tensor may have changed",
            op=self.op,
            peer=owner,
        )

    def wait_readers(self, readers: Iterable[Peer]) -> None:
        """See :meth:`SharedRegions.wait_readers`. On an error the operation's context withdraws
        the descriptors (:meth:`withdraw`) before the caller may touch the tensors."""
        done = self._pieces
        for q in readers:
            theirs = self._ctrl[q]
            if theirs[DONE] < done:
                self._await(lambda: theirs[DONE] >= done, self._never, "waiting for a read by", q, ON_DONE)
        self._published = []

    def withdraw(self) -> None:
        """Void what this rank published (piece number -1): a collective failed here, and the
        caller may change the tensors. A reader checks its descriptor again after reading, so
        one that has not finished raises instead of returning bytes that may have changed."""
        if self._published and self._ctrl:
            me = PAIR + self.rank * PAIR + CMA + 2
            for q in self._published:
                self._ctrl[q][me] = -1
            fence()
        self._published = []

    def allocate(self, nbytes: int) -> list[torch.Tensor] | None:
        """Symmetric memory: ``nbytes`` on every rank, in a segment of its own that every rank maps.

        Collective (every rank calls it, in the same order, with the same ``nbytes``). Returns
        ``nbytes`` views, one per rank (``[q]`` is rank ``q``'s memory; ``[self.rank]`` is this
        rank's), or None on every rank alike when some rank cannot create its segment (the file
        system is full) or shared memory is not in use; the reason is logged. The segments are
        unnamed files like the transport's own and stay mapped until :meth:`close`.
        """
        if not self._ready():
            return None
        self._allocations += 1
        rank, n, rendezvous = self.rank, self.world_size, self._rendezvous
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        deadline = time.monotonic() + self.timeout
        name = f"alloc/{self._allocations}"
        fd, _reports, failures = rendezvous.report_segment(name, self.config.directory, size, "ok", deadline)
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
        return [torch.frombuffer(m, dtype=torch.uint8)[:nbytes] for m in maps]  # type: ignore[arg-type]

    # ---- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        if self._p2p is not None:
            self._p2p.close()
        self._close_setup()

    def _close_setup(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()
        self._halves = []
        self._views = {}
        if self._segments is not None:
            self._segments.close()
