"""Waiting for the peers: spin, then sleep on the sockets; wake sleepers; notice dead peers.

A waiter spins on the control block for a bounded time, then writes the events it waits for
into its ``sleeping`` word, fences, checks again and blocks in ``poll`` on its sockets to the
peers (``poll`` releases the GIL). How long it spins depends on who waits: a caller running a
blocking collective on its own thread has nothing else to do, and a peer that left a barrier a
few hundred µs later should find it awake (``spin_seconds``: 1 ms when every rank has a core, the
first 10 µs without yielding it; with more ranks than cores 50 µs, yielding the core each turn,
since the peer may need it); a group's communication thread, which runs async collectives while
the caller computes (DDP's buckets during backward), spins 20 µs yielding each turn (the yield
releases the GIL) and then sleeps, so its waits take neither the core nor the GIL from the
compute. Whoever publishes
a counter fences, reads the peers' ``sleeping`` words and writes one byte to the socket of each
peer asleep on that event (the Dekker pattern: store, fence, load the other side's word, on both
sides). A sleeping waiter costs its peers a system call and itself a wake-up (on a VM about
200 µs), hence the spin; a ready counter costs one read, no fence and no call.

Two ranks that each have a core can still end up on one: the scheduler leaves tasks that keep
yielding where they are, and two spinning ranks on one core take turns instead of running at
once (a 4 KiB all-reduce back to back: ~70 µs a call instead of ~20). So a caller publishes the
CPU it waits on, and when; when the peer it waits for began a wait on the same CPU within
:data:`CPU_FRESH`, the higher of the two ranks moves itself to a CPU of its affinity mask that no
peer reported as recently, by narrowing its mask to that CPU and restoring it at once: the
kernel migrates the thread on the first call and leaves it there, so nothing stays pinned
(pinning measured 8x slower for gloo's threads sharing a rank's core). At most one move per
:data:`MOVE_INTERVAL`, so a scheduler that keeps putting the ranks together costs a move
(~40 µs) per 10 ms at most. Measured at 2 ranks on 2 cores, 4 KiB
all-reduce, ``collectives.bench --timing loop``, five interleaved runs each: 26-32 µs a call
with moves, 26-82 µs without (the ranks shared a core in most runs); after both ranks were put
on one CPU, they were apart 100 calls later in 498 of 500 rounds with moves (in the other two
the kernel put the moved rank back within the round) against 5 of 8 without. Older reports are
ignored because the kernel moves ranks meanwhile: trusting them, a rank whose peer had last
waited on its CPU, tens of ms before (the bench's gloo calls in between), "moved away" onto the
CPU the peer had moved to, and the two shared a core for the rest of the sample (3 of 12
samples of 50 calls after 50 of gloo's, 87 µs a call there; none with the freshness check).
Where the ranks end up stays the scheduler's: with every CPU busy it has nowhere to keep them
apart. The waiter counts its moves (:class:`Moves`); ``python -m collectives.bench --placement``
reports both.

The same sockets report a dead peer (EOF: the kernel closes them when a process dies, even by
SIGKILL), and ``poll`` carries the group's deadline, so a stopped peer gives a
:class:`~collectives.errors.CollectiveTimeoutError` and a dead one a
:class:`~collectives.errors.CollectiveError`, both naming the operation and the peer. A sleeping
waiter also wakes every 100 ms to ask whether the wait was abandoned (the group broke: an
elastic group's heartbeat fenced a stopped peer it could not kill), and then raises at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import socket
import time
from typing import Callable, Iterable, NamedTuple

from ...errors import CollectiveError, CollectiveTimeoutError, timed_out
from ...work import on_communication_thread
from ..base import Peer, Transport
from .control import CPU, SLEEPING, fence
from .segment import Segments

log = logging.getLogger(__name__)

BUSY_SPIN = 10e-6  # seconds a waiter with a core of its own spins without yielding (see spin_times)
BACKGROUND_SPIN = 20e-6  # seconds a communication thread spins (yielding) before it sleeps
MOVE_INTERVAL = 0.01  # seconds between two moves of a rank off its peer's CPU (see the module doc)
CPU_FRESH = 1e-3  # seconds a peer's published CPU is trusted: then it may have slept and woken elsewhere
CPU_BITS = 12  # the CPU word: the µs it was published at, then the CPU + 1 in its low bits
CPU_MASK = (1 << CPU_BITS) - 1


def _cpu_reader() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (~0.1 µs through ctypes), or None where the C library lacks it."""
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None


_current_cpu = _cpu_reader()


def spin_times(spin_seconds: float | None, world_size: int) -> tuple[float, float]:
    """How long a waiter spins before it sleeps, and for how much of that it keeps its core.

    With a core per rank: ``spin_seconds`` (default 1 ms), the first :data:`BUSY_SPIN`
    without yielding (the peer is about to publish; ``sched_yield`` hands the core to any
    other runnable thread for up to its time slice), then yielding (other threads, e.g. gloo's
    I/O, get the core). Short, because having a core per rank does not mean each rank is on
    its own: the scheduler sometimes leaves two spinning ranks on one core for a whole run
    (tasks that keep yielding stay "cache hot" and are not migrated; the waiter then moves one
    of them, see the module docstring), and there a waiter that does not yield holds off the
    very peer it waits for. Measured at 2 ranks, 4 KiB all-reduce
    back to back, both ranks pinned to one core after set-up: 105 µs a call with 50 µs of busy
    spin, 61 µs with 10 µs; on separate cores 17.6-18.8 µs and 17.0-18.5 µs (4 runs each). In
    samples of 50 calls after 50 of gloo's (as ``collectives.bench`` interleaves them), the
    ranks shared a core in 9-16 of 40 samples, each checked with ``sched_getcpu``: 110 µs a call
    there with 50 µs of busy spin, 72-74 µs with 10 µs. (Tried: sleeping at once when the peer
    last waited on this core, so that its wake-up would move one rank; the ranks stayed
    together, no gain.) With more ranks than cores: 50 µs by default, yielding from the start
    (the peer we wait for may need our core). These are the caller's; a communication thread
    spins :data:`BACKGROUND_SPIN`, yielding.
    """
    own_core = world_size <= len(os.sched_getaffinity(0))
    spin = spin_seconds if spin_seconds is not None else (1e-3 if own_core else 50e-6)
    return spin, min(spin, BUSY_SPIN) if own_core else 0.0


class Moves(NamedTuple):
    """What :meth:`Waiter._keep_apart` did so far: ``count`` moves off a peer's CPU, and the
    age in seconds of the oldest peer's word one of them acted on (at most :data:`CPU_FRESH`).
    Where the ranks end up is the scheduler's; these are ours (``collectives.bench --placement``
    reports both)."""

    count: int
    oldest_word: float


def nobody() -> tuple[Peer, ...]:
    """For :meth:`Waiter.wait`: the wait needs no rank's progress but its ``peer``'s."""
    return ()


class Waiter:
    """Waits on the control blocks, wakes the peers that sleep, and finds the dead ones.

    Args:
        transport: gives the rank, the group's size and deadline, and the collective under way
            (its ``op``, which errors name).
        segments: the mapped control blocks.
        socks: one connected unix socket per peer (from :meth:`.rendezvous.Rendezvous.map_all`);
            the waiter owns them from now on.
        spin: :func:`spin_times`.
        check_peers: called after each wake-up that did not end a wait; raises when a peer runs
            another call or abandoned it (:meth:`.wirecheck.WireCheck.check_peers`).
        abandoned: why to stop waiting before the deadline, or None; asked as often as
            ``check_peers`` (e.g. the group broke: a heartbeat fenced a peer that could not be
            killed, which would otherwise hold the wait until the deadline).
    """

    def __init__(
        self,
        transport: Transport,
        segments: Segments,
        socks: dict[Peer, socket.socket],
        spin: tuple[float, float],
        check_peers: Callable[[], None],
        abandoned: Callable[[], str | None] = lambda: None,
    ):
        self._transport = transport
        self._abandoned = abandoned
        self.rank, self.world_size, self.timeout = transport.rank, transport.world_size, transport.timeout
        self._ctrl = segments.ctrl
        self._socks = socks
        self._peers = [q for q in range(self.world_size) if q != self.rank]
        self._spin, self._busy_spin = spin
        self._busy_spin_ns = int(self._busy_spin * 1e9)
        # a caller with a core of its own (a busy spin: no more ranks than CPUs) keeps off its
        # peers' CPUs (module docstring)
        self._spread = (
            bool(self._busy_spin) and _current_cpu is not None and max(os.sched_getaffinity(0)) < CPU_MASK
        )
        self._next_move = 0.0
        self.moves = Moves(0, 0.0)
        self._check_peers = check_peers
        self._dead: set[Peer] = set()
        self._poll = select.poll()
        self._fd_peer: dict[int, Peer] = {}
        for q, s in socks.items():
            s.setblocking(False)
            self._poll.register(s.fileno(), select.POLLIN)
            self._fd_peer[s.fileno()] = q

    def busy_spin_ns(self) -> int:
        """Nanoseconds a wait on this thread may spin without yielding before :meth:`wait` takes
        over (:func:`spin_times`; none on a communication thread): for a native wait
        (:mod:`.native`) that returns here when it is not over by then."""
        return 0 if on_communication_thread() else self._busy_spin_ns

    def socket_fds(self) -> list[int]:
        """Per rank, the socket :meth:`wake` writes to (-1 for this rank), for a native wake."""
        return [self._socks[q].fileno() if q in self._socks else -1 for q in range(self.world_size)]

    def wake(self, event: int, peers: Iterable[Peer] | None = None) -> None:
        """Tell the peers (default: all) that ``event`` happened, writing a byte to those asleep on it."""
        fence()  # the counter we published must be visible before we read their flags (Dekker)
        for q in self._peers if peers is None else peers:
            if self._ctrl[q][SLEEPING] & event:
                try:
                    self._socks[q].send(b"\0")
                except OSError:  # full (it has wake-ups pending) or gone (its waits find out)
                    pass

    def wait(
        self, ready: Callable[[], bool], peers: Callable[[], Iterable[Peer]], kind: str, peer: Peer, event: int
    ) -> None:
        """Block until ``ready()``; ``peers()`` are the ranks whose progress it needs besides
        ``peer`` (:func:`nobody`), ``event`` the kinds of publication (``ON_*``) that can make it
        ready.

        Spins for ``spin_seconds`` then sleeps on the peer sockets; raises naming ``peer`` (or
        the dead peer among ``peers()``) at the deadline or when a needed peer has exited.
        ``kind`` says what the wait is for in the message (``"recv from"``, ``"waiting for"``).
        """
        if ready():
            return
        now = time.perf_counter()
        if on_communication_thread():
            spin_until, busy_until = now + BACKGROUND_SPIN, now
        else:
            spin_until, busy_until = now + self._spin, now + self._busy_spin
            if self._spread:
                self._keep_apart(peer)
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
                op = self._transport.op
                raise CollectiveTimeoutError(
                    f"{op}: {kind} rank {peer}: {timed_out(self.timeout)} "
                    f"(this is rank {self.rank} of {self.world_size})",
                    op=op,
                    peer=peer,
                )
            events = self._poll.poll(min(remaining, 0.1) * 1000)
            me[SLEEPING] = 0
            for fileno, _event in events:
                self._drain(self._fd_peer[fileno])
            if ready():
                return
            self._check_peers()
            if (why := self._abandoned()) is not None:
                op = self._transport.op
                raise CollectiveError(
                    f"{op}: {kind} rank {peer} abandoned: {why} (this is rank {self.rank} of {self.world_size})",
                    op=op,
                    peer=peer,
                )
            dead = [q for q in ([peer] + list(peers())) if q in self._dead]
            if dead:
                op = self._transport.op
                raise CollectiveError(
                    f"{op}: {kind} rank {dead[0]} failed: the peer exited "
                    f"(this is rank {self.rank} of {self.world_size})",
                    op=op,
                    peer=dead[0],
                )

    def _keep_apart(self, peer: Peer) -> None:
        """Publish this thread's CPU; if ``peer`` (a lower rank) began a wait on it within
        :data:`CPU_FRESH`, move to a CPU of the affinity mask that no peer reported as recently,
        keeping the mask as it was."""
        assert _current_cpu is not None
        cpu, now = _current_cpu(), time.monotonic()
        stamp = int(now * 1e6) << CPU_BITS  # µs of the system-wide monotonic clock
        words = self._ctrl
        words[self.rank][CPU] = stamp | (cpu + 1)
        if peer > self.rank or now < self._next_move:
            return
        theirs, fresh = words[peer][CPU], stamp - (int(CPU_FRESH * 1e6) << CPU_BITS)
        if theirs & CPU_MASK != cpu + 1 or theirs < fresh:  # elsewhere, or here long ago (now unknown)
            return
        recent = {w & CPU_MASK for q in self._peers if (w := words[q][CPU]) >= fresh}
        mask = os.sched_getaffinity(0)
        free = sorted(mask - {c - 1 for c in recent} - {cpu})
        if not free:
            return
        self._next_move = now + MOVE_INTERVAL
        try:
            os.sched_setaffinity(0, {free[0]})  # the kernel moves this thread now ...
        except OSError as exc:  # the CPU left our cpuset meanwhile, or a policy forbids it
            log.debug("rank %d stops moving off its peers' CPUs: %s", self.rank, exc)
            self._spread = False
            return
        os.sched_setaffinity(0, mask)  # ... and does not move it back: nothing stays pinned
        words[self.rank][CPU] = stamp | (free[0] + 1)
        age = ((stamp >> CPU_BITS) - (theirs >> CPU_BITS)) * 1e-6
        self.moves = Moves(self.moves.count + 1, max(self.moves.oldest_word, age))

    def _drain(self, q: Peer) -> None:
        """Read the wake-up bytes ``q`` sent; on EOF or a reset, count ``q`` dead."""
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

    def close(self) -> None:
        """Close the sockets to the peers."""
        for s in self._socks.values():
            s.close()
        self._socks.clear()
