"""The simulated transport: many virtual ranks in one process, on a virtual clock.

Our algorithms are written against :class:`~collectives.transport.base.Transport` only, so they
run unchanged when the wire is a simulation. Here every virtual rank is a *greenlet* (a
coroutine with its own stack) inside one process, and a :class:`Simulation` schedules them on a
virtual clock:

Scheduler
    A discrete-event loop (the *hub*) keeps the ``(time, seq, rank)`` wake-ups in time order (a
    heap of the distinct times, each with its wake-ups in ``seq`` order). It resumes the rank
    with the earliest wake-up, which runs real Python (the algorithm, torch ops on real
    tensors) in zero virtual time until it waits: on a message not yet sent, on a message still
    on the wire, or in :meth:`Simulation.sleep` (modelled compute). Then the hub resumes the next
    rank. A second heap holds the network's events (the predicted ends of the flows that share
    a link, below; a flow alone needs none); at equal times the network goes first. Ranks therefore act in order of virtual time, ties
    broken by the order they were queued: the run is deterministic, and every message is posted
    in time order, which is what lets the network share its links between the flows in progress.

Messages
    ``isend`` at virtual time ``t`` starts the message's flow on its path (``route`` and the
    links' sharing, below) and queues the message on the pair's channel; ``irecv`` takes the
    pair's next message (messages of a pair match in posting order, as the contract says).
    A send completes at its arrival (eager: it does not wait for the receive to be posted), a
    receive at ``max(arrival, its own posting time)`` (a receive posted before the arrival
    completes the fabric's ``wake_latency`` later: its rank's thread is woken and waits for a
    core; 0 by default). Both times are predicted as soon as the
    flow's rate is known and revised while it is in progress (a rank sleeping until the old
    time is rescheduled: each rank has one valid wake-up in the heap, the others go stale). The payload is copied when both sides are
    known; a send whose receiver has not posted yet keeps a reference to the sender's tensor and
    copies it aside when the sender's wait returns (the contract keeps it untouched until then).

Any-source receives
    :meth:`Simulation.wait_any` blocks a rank until the first of the next messages from a set
    of senders, among those a predicate accepts, has arrived, and names its sender; the caller
    then receives from that sender as usual. "First" is the earliest arrival in virtual time,
    ties going to the lowest rank: the rank sleeps until the earliest arrival known so far and
    is woken again whenever a candidate is posted or its arrival revised, so a message posted
    later that arrives sooner still wins. A sender's next message is a candidate only while
    no receive from that sender is posted (that receive takes it).

Links and sharing
    The fabric (:class:`Fabric`; :class:`collectives.sim.network.Network` is the model shipped)
    says for a pair of ranks the latency ``α``, the seconds per byte ``β`` of the path's
    slowest link, and which links the path crosses, each with its own ``β``. A message of ``S``
    bytes is a *flow* from its posting until its last byte has crossed its path; it arrives
    ``α`` after that. The flows in progress share the links' bandwidth *max-min fairly* (a
    fluid model of TCP's processor sharing): the link whose bandwidth divided by its flows is
    the smallest is the bottleneck of those flows, which each get that share; the others split
    what remains on their own links, recursively (progressive filling). Every time a flow
    starts or ends, the rates of the flows it shares links with (its connected component, not
    the whole network) are recomputed and their ends predicted again. So two sends a rank
    posts at once over one NIC both end at ``2Sβ`` (TCP measured so; a first-come-first-served
    link would end the first at ``Sβ``), no link ever carries more than its bandwidth, and a
    message alone on its path takes exactly ``α + Sβ``, the closed form. The links of a path
    are coupled only through the rates (a fluid: no packets, buffers, head-of-line blocking,
    slow start or congestion control), and ``α`` is pure latency (it holds no link).
    ``contention=False`` gives every message its own path (each as if alone).

    A rank's work at one instant (its posts) is settled once, before the clock moves on: the
    rates of every component touched at that instant are recomputed then, so a rank posting
    ``n`` sends at once costs one recomputation, not ``n``. A flow alone on its links is not
    rated and has no event, nor even a flow object: it is a *note* on its links (its end
    ``t + Sβ``, and what it would need to become a flow), which a flow that joins before that end
    turns into a flow sharing the links, and one that comes later finds stale (a ring: no
    flow, event or recomputation at all).

Deadlock and failure
    When no rank can run and no flow is in progress (both heaps are empty) but some ranks wait, no message they wait for can ever
    come: each waiting rank gets a :class:`~collectives.errors.CollectiveError` naming its
    collective and the peer it waits for. A bug that hangs a real job (a tree that never sends to
    rank ``2^k``) thus raises at once instead of timing out. A rank that raises ends; the ranks
    waiting on it get that error in turn.

Token buckets
    A fabric may give a message a token bucket to draw from (``Fabric.burst``: its sender's NIC
    egress, ``Network.nic_burst``). A message posted while that link carries nothing takes up to
    the bucket's tokens at once (those bytes cross the path instantly, as through a shaper's
    burst); the rest is its flow. The tokens refill at the link's rate while it is idle, up to
    the bucket's depth; a link that carries a flow has none left (its backlog drains them). Only
    with ``contention`` (the bucket is the link's state).

Local work
    :meth:`Simulation.compute` is a rank's CPU work: with a fabric that has CPUs
    (``Fabric.cpu_path``: ``Network.cores``) it is a flow of CPU seconds over the rank's thread
    (one core) and its CPU's cores, shared max-min fairly with the other ranks computing at once,
    as links are; else (or without ``contention``) it lasts its seconds. Two kinds of work use
    it. Reductions, when ``reduce_beta`` (seconds per byte combined) is set: inside a collective on a
    :class:`SimTransport`, every :func:`~collectives.ops.combine` first computes its output's
    bytes (times the byte scale) times ``reduce_beta`` (the hook
    :data:`collectives.ops.combine_cost`). Receives, when the fabric charges them
    (``Fabric.receive_cpu``: ``Network.recv_cpu`` between hosts): a receive that completes
    computes its bytes (as the fabric saw them) times that, when its rank waits for it. Other
    copies (staging, unpacking) stay free; the defaults keep the pure network model of the
    closed forms.

Timing only
    ``byte_scale`` multiplies every message's bytes as the fabric sees them, and ``copy=False``
    skips the payload copies: a study runs the algorithms on tiny tensors that stand for large
    ones (the caller scales the tuning's byte thresholds by the same factor, so the engine makes
    the same choices and cuts the same number of segments).

Requires ``greenlet`` (a dependency of ringddp): a switch between virtual ranks costs about a
microsecond, where an OS thread hand-off costs 15 µs on a busy machine.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import heapq
import itertools
import logging
import math
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence, TypeVar

import torch

from ..errors import CollectiveError
from ..ops import combine_cost
from .base import GroupInfo, Message, Peer, Request, Transport

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the channel of the world group's user point-to-point messages (:meth:`SimTransport.user_channel`);
#: its collectives use 0. The ``k``-th subgroup of a world (``new_group`` on virtual ranks) uses
#: ``2k`` and ``2k + 1``: each group matches its messages apart from the others', as gloo's
#: separate process groups keep them apart.
USER_CHANNEL = 1

#: (simulation, global rank) of the virtual rank running in this context (each greenlet has its own).
_current: contextvars.ContextVar[tuple["Simulation", int] | None] = contextvars.ContextVar("ringddp_sim", default=None)


class Fabric(Protocol):
    """The network a :class:`Simulation` runs on (see :class:`collectives.sim.network.Network`)."""

    @property
    def world_size(self) -> int:
        """The number of ranks."""

    @property
    def link_count(self) -> int:
        """Links are numbered ``0 .. link_count - 1``."""

    def route(self, src: int, dst: int) -> tuple[float, float, tuple[tuple[int, float], ...]]:
        """``(α, β, ((link, β_link), ...))`` of a message from ``src`` to ``dst``; ``β`` is the
        path's (its slowest link's) seconds per byte."""

    # Optional (a fabric without them has no token buckets and no CPUs; see Network):
    # burst(src, dst) -> (link, bytes, β) | None: the token bucket a message draws from;
    # cpu_path(rank) -> ((link, β), ...): the links its CPU work crosses, "bytes" being CPU seconds;
    # background_flows -> {link: flows}: flows of other work always on those links (a CPU's other threads);
    # receive_cpu(src, dst) -> float: CPU seconds per byte the receiver spends on a message;
    # wake_latency: seconds a receive posted before its message arrives completes after the arrival.


class _Task:
    """One virtual rank: its greenlet, result and error."""

    __slots__ = ("rank", "glet", "result", "error", "finished", "waiting_on", "due")

    def __init__(self, rank: int):
        self.rank = rank
        self.glet: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.waiting_on: SimRequest | None = None
        self.due = -1  # the seq of its one valid wake-up in the heap (a revised one leaves a stale entry)


class _Flow:
    """A message on the wire: its bytes ``left`` at time ``since``, its current ``rate`` (bytes
    per second) and predicted ``end``; ``links`` are the ``(link, β)`` it crosses (β > 0)."""

    __slots__ = ("send", "links", "beta", "alpha", "left", "rate", "since", "end", "done", "stamp", "fixed", "event")

    def __init__(
        self, send: "SimRequest", links: tuple[tuple[int, float], ...], beta: float, alpha: float, size: float, now: float
    ):
        self.send, self.links, self.beta, self.alpha = send, links, beta, alpha
        self.left, self.rate, self.since, self.end = size, 0.0, now, math.inf  # inf: not rated yet
        self.done = False
        self.stamp = self.fixed = 0  # marks of the last recomputation that visited / rated it
        self.event = math.nan  # the end its event in the network's heap is for (none: nan)


class _AnyWait:
    """A rank's :meth:`Simulation.wait_any` in progress: its senders, in rank order, and the
    channel's base key (``channel * n * n + dst``: a sender's pair key adds ``src * n``)."""

    __slots__ = ("task", "sources", "accept", "base")

    def __init__(self, task: _Task, sources: Sequence[int], accept: Callable[[torch.Tensor], bool], base: int):
        self.task, self.accept, self.base = task, accept, base
        self.sources = sorted(sources)


_NOTHING = torch.empty(0)


class SimRequest(Request):
    """A posted send or receive; ``done_at`` is its completion time once known (None: a receive
    whose message is not sent yet, or a message whose rate is not settled yet), revised while its
    flow is in progress as others join or leave its links; a send's ``match`` is its receive."""

    __slots__ = ("sim", "recv", "rank", "peer", "tensor", "nbytes", "posted", "done_at", "waiter", "op", "held",
                 "match")

    def __init__(self, sim: "Simulation", recv: bool, rank: int, peer: int, tensor: torch.Tensor, op: str):
        self.sim, self.recv, self.rank, self.peer, self.tensor, self.op = sim, recv, rank, peer, tensor, op
        self.nbytes = tensor.nbytes
        self.posted = sim.now
        self.done_at: float | None = None
        self.waiter: _Task | None = None
        self.held = False  # a send whose receiver has not posted: its payload is still the caller's tensor
        self.match: SimRequest | None = None

    def wait(self) -> None:
        sim = self.sim
        done = self.done_at
        if done is None or done > sim.now:
            sim._wait(self)
        if sim.events is not None:
            sim._trace(self)
        if self.held:  # the receiver has not posted: keep the bytes, the caller may reuse its buffer
            self.held = False
            if sim.copy:
                self.tensor = self.tensor.clone()
        elif type(self.tensor) is CollectiveError:
            raise self.tensor
        elif sim._recv_cost and self.recv:  # the receiver's CPU work on the message (Network.recv_cpu)
            cost = sim._recv_cost.pop(self, 0.0)
            if cost:
                sim.compute(cost)

    def is_completed(self) -> bool:
        return self.done_at is not None and self.done_at <= self.sim.now


class Simulation:
    """Virtual ranks on a virtual clock over a :class:`Fabric` (module docstring).

    Args:
        fabric: the network (routes and link bandwidths).
        contention: share the links between the messages in progress (else every message goes as if alone).
        byte_scale: the fabric charges ``nbytes * byte_scale`` per message (timing-only studies).
        copy: move payloads (``False``: timing only, the receivers' buffers are left as they are).
        delays: ``{rank: seconds}``: a straggler enters every collective that much late.
        slowdown: ``{rank: factor}``: that rank's :meth:`sleep` (modelled compute) lasts longer.
        trace: record every message and collective as Chrome trace events (:meth:`chrome_trace`).
        reduce_beta: seconds per byte a reduction combines (module docstring, "Local work").
    """

    def __init__(
        self,
        fabric: Fabric,
        *,
        contention: bool = True,
        byte_scale: float = 1.0,
        copy: bool = True,
        delays: dict[int, float] | None = None,
        slowdown: dict[int, float] | None = None,
        trace: bool = False,
        reduce_beta: float = 0.0,
    ):
        if not reduce_beta >= 0:
            raise ValueError(f"Simulation: reduce_beta must be >= 0 seconds per byte, got {reduce_beta!r}")
        self.reduce_beta = float(reduce_beta)
        self.fabric = fabric
        self.world_size = fabric.world_size
        self.contention = contention
        self.byte_scale = float(byte_scale)
        self.copy = copy
        self.delays = dict(delays or {})
        self.slowdown = dict(slowdown or {})
        self.now = 0.0
        self.messages = 0
        self.events: list[dict[str, Any]] | None = [] if trace else None
        # wake-ups: a heap of the distinct times, and per time its (seq, rank) in seq order (the
        # order of a heap of (time, seq, rank), without comparing tuples: a ring's 1,024 ranks
        # wake at one time)
        self._times: list[float] = []
        self._at: dict[float, collections.deque[tuple[int, _Task]]] = {}
        self._flows: list[tuple[float, int, _Flow]] = []  # predicted ends (stale ones are skipped)
        self._on: dict[int, dict[_Flow, None]] = {}  # per busy link: its flows, in starting order
        # per link: the note of the flow alone there, (end, send, links, β, α, bytes), or None
        # (stale once its end has passed: :meth:`_start`)
        self._lone: list[tuple[float, SimRequest, tuple[tuple[int, float], ...], float, float, float] | None] = (
            [None] * fabric.link_count
        )
        self._dirty: list[_Flow] = []  # flows whose rates must be recomputed before the clock moves
        self._stamps = itertools.count(1)
        self._seq = itertools.count()
        self._pairs = self.world_size * self.world_size
        # per channel and pair, channel*n*n + src*n + dst: unmatched sends, oldest first (short
        # lists: a pair's queue is made and dropped with nearly every message)
        self._sends: dict[int, list[SimRequest]] = {}
        self._recvs: dict[int, list[SimRequest]] = {}
        self._anys: dict[int, _AnyWait] = {}  # per rank: its any-source wait in progress (wait_any)
        self._routes: dict[int, tuple[float, float, tuple[tuple[int, float], ...], Any]] = {}  # per pair src*n+dst
        # (links with β = 0 never limit a flow: left out; all of them without contention)
        self._running: _Task | None = None
        self._hub: Any = None
        # optional parts of the fabric (module docstring: token buckets, local work)
        self._burst_of = getattr(fabric, "burst", None) if contention else None
        self._cpu_of = getattr(fabric, "cpu_path", None) if contention else None
        self._receive_cpu_of = getattr(fabric, "receive_cpu", None)
        self.wake = float(getattr(fabric, "wake_latency", 0.0))  # a posted receive completes this long after its arrival
        self._buckets: dict[int, tuple[float, float]] = {}  # per bucket link: (tokens, since when idle)
        self._phantoms: dict[int, float] = dict(getattr(fabric, "background_flows", {})) if contention else {}
        self._cpu_paths: dict[int, tuple[tuple[tuple[int, float], ...], float]] = {}  # per rank: (links, path β)
        self._recv_cost: dict[SimRequest, float] = {}  # CPU seconds a send / its receive will cost the receiver

    # ------------------------------------------------------------------ running ranks

    def run(self, body: Callable[[int], T], ranks: Sequence[int] | None = None) -> list[T]:
        """Run ``body(rank)`` on every virtual rank (default all) until all return; their results by rank.

        The clock goes on from where the last run left it. If ranks raise, the first error (in
        virtual time) is raised here with a note naming every failed rank.
        """
        import greenlet  # a dependency; imported here so that the package imports without it

        ranks = list(range(self.world_size) if ranks is None else ranks)
        self._hub = greenlet.getcurrent()
        tasks = [_Task(r) for r in ranks]
        failed: list[_Task] = []

        def start(task: _Task) -> None:
            _current.set((self, task.rank))
            try:
                task.result = body(task.rank)
            except Exception as exc:  # noqa: BLE001 - every failure is reported by run()
                task.error = exc
                failed.append(task)
            finally:  # anything else (KeyboardInterrupt, a test's timeout) goes on to the hub: _abort
                task.finished = True

        for task in tasks:
            task.glet = greenlet.greenlet(start, parent=self._hub)
            self._wake(task, self.now)
        times, at, flows, pop = self._times, self._at, self._flows, heapq.heappop
        try:
            while True:
                while True:
                    if self._dirty:
                        self._settle()
                    if flows and (not times or flows[0][0] <= times[0]):
                        when, _, flow = pop(flows)
                        if not flow.done and flow.end == when:  # else a prediction since revised
                            self.now = when
                            self._finish(flow)
                    elif times:
                        when = times[0]
                        bucket = at[when]
                        seq, task = bucket.popleft()
                        if not bucket:
                            pop(times)
                            del at[when]
                        if task.due != seq:  # a wake-up since revised
                            continue
                        self.now = when
                        self._running = task
                        task.glet.switch(task)  # starts the rank, or resumes it where it blocked
                        self._running = None
                    else:
                        break
                stuck = [t for t in tasks if not t.finished]
                if not stuck:
                    break
                self._break_deadlock(stuck, failed)
        except BaseException as exc:
            self._abort(exc, tasks)
            raise
        finally:
            self._running = None
            self._times.clear()
            self._at.clear()
            self._flows.clear()
            self._on.clear()
            self._lone = [None] * len(self._lone)
            self._dirty.clear()
            self._buckets.clear()
            self._recv_cost.clear()
            self._sends.clear()
            self._recvs.clear()
            self._anys.clear()
        if failed:
            first = failed[0].error
            assert first is not None
            summary = "; ".join(f"rank {t.rank}: {type(t.error).__name__}: {t.error}" for t in failed[:8])
            more = f" (and {len(failed) - 8} more)" if len(failed) > 8 else ""
            if hasattr(first, "add_note"):
                first.add_note(f"[sim] {len(failed)} of {len(tasks)} virtual ranks failed: {summary}{more}")
            raise first
        return [t.result for t in tasks]

    def _abort(self, exc: BaseException, tasks: list[_Task]) -> None:
        """A rank was interrupted by something that is not its own failure (``KeyboardInterrupt``,
        a test runner's timeout signal, ``SystemExit``; it lands in whichever rank runs): stop
        the whole simulation and let ``exc`` propagate as itself, instead of reporting it as that
        rank's error while the others run on. The ranks still suspended unwind now (their
        ``finally`` blocks run), not whenever their greenlets are collected."""
        import greenlet

        running = self._running
        if running is not None and hasattr(exc, "add_note"):
            exc.add_note(
                f"[sim] interrupted while virtual rank {running.rank} ran (virtual t={self.now:.6g}s); "
                "the simulation stopped there"
            )
        for task in tasks:
            if task.glet is not None and task.glet and not task.finished:
                self._running = task
                with contextlib.suppress(BaseException):
                    task.glet.throw(greenlet.GreenletExit)

    def _break_deadlock(self, stuck: list[_Task], failed: list[_Task]) -> None:
        """No rank can run but ``stuck`` wait: throw each an error naming what it waits for."""
        done = [t.rank for t in failed]
        for task in stuck:
            req = task.waiting_on
            op = req.op if req is not None else "collective"
            anyone = req is not None and req.peer < 0  # wait_any
            what = "a message from any rank" if anyone else f"a message from peer {req.peer}" if (
                req is not None and req.recv) else "its peer"
            cause = f" (ranks {done[:8]} failed first)" if done else " (a deadlock: no rank can make progress)"
            err = CollectiveError(
                f"{op}: virtual rank {task.rank} waits at t={self.now:.6g}s for {what}, which no rank "
                f"will send{cause}",
                op=op,
                peer=req.peer if req is not None and not anyone else None,
            )
            self._running = task
            task.glet.throw(err)
        self._running = None

    def _wake(self, task: _Task, when: float) -> None:
        """(Re)schedule ``task`` at ``when``: its earlier wake-up, if any, goes stale."""
        task.due = seq = next(self._seq)
        bucket = self._at.get(when)
        if bucket is None:
            bucket = self._at[when] = collections.deque()
            heapq.heappush(self._times, when)
        bucket.append((seq, task))

    def current_rank(self) -> int:
        """The virtual rank running now."""
        if self._running is None:
            raise RuntimeError("no virtual rank is running")
        return self._running.rank

    def sleep(self, seconds: float) -> None:
        """Advance the calling rank's clock by ``seconds`` of modelled compute (times its slowdown)."""
        task = self._running
        if task is None:
            raise RuntimeError("Simulation.sleep: call it from a virtual rank")
        seconds *= self.slowdown.get(task.rank, 1.0)
        if seconds > 0:
            self._until(task, self.now + seconds)

    def sleep_until(self, when: float) -> None:
        """Advance the calling rank's clock to ``when`` (no-op if it is already past)."""
        task = self._running
        if task is None:
            raise RuntimeError("Simulation.sleep_until: call it from a virtual rank")
        if when > self.now:
            self._until(task, when)

    def compute(self, seconds: float) -> None:
        """Run ``seconds`` of CPU work (times the rank's slowdown) on the calling rank: on its
        thread and its CPU's cores when the fabric has CPUs, shared max-min fairly with the other
        ranks' work at the same time; else it lasts ``seconds`` (module docstring, "Local work")."""
        task = self._running
        if task is None:
            raise RuntimeError("Simulation.compute: call it from a virtual rank")
        seconds *= self.slowdown.get(task.rank, 1.0)
        if seconds <= 0:
            return
        start = self.now
        found = self._cpu_paths.get(task.rank)
        if found is None:
            path = self._cpu_of(task.rank) if self._cpu_of is not None else ()
            # alone, at the slowest of its links' rates; a link with other work is shared with it
            beta = max((b * (1.0 + self._phantoms.get(link, 0.0)) for link, b in path), default=0.0)
            found = self._cpu_paths[task.rank] = (path, beta)
        path, beta = found
        if path:
            work = SimRequest(self, False, task.rank, task.rank, _NOTHING, "compute")
            self._start(work, path, beta, 0.0, seconds)
            self._wait(work)
        else:
            self._until(task, self.now + seconds)
        if self.events is not None:
            self._event(task.rank, "cpu", start, self.now, {"cpu_s": seconds})

    # ------------------------------------------------------------------ messages

    def isend(
        self, tensor: torch.Tensor, src: int, dst: int, op: str, byte_scale: float | None = None, channel: int = 0
    ) -> SimRequest:
        """Post a send from ``src`` to ``dst`` now; it completes when its bytes arrive. The fabric
        charges its bytes times ``byte_scale`` (default: the simulation's). Messages match per
        pair and ``channel`` (0: the collectives'; :data:`USER_CHANNEL`: user point-to-point)."""
        req = SimRequest(self, False, src, dst, tensor, op)
        self.messages += 1
        key = src * self.world_size + dst
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._route(src, dst)
        alpha, beta, links, extra = route
        size = req.nbytes * (self.byte_scale if byte_scale is None else byte_scale)
        if extra is not None:  # a token bucket, a receive's CPU work (module docstring)
            bucket, cpu = extra
            if cpu:
                self._recv_cost[req] = size * cpu
            if bucket is not None and size:
                size = self._draw(bucket, size)
        if size and links:
            self._start(req, links, beta, alpha, size)
        else:  # nothing to share: the closed form
            req.done_at = self.now + alpha + size * beta
        if channel:
            key += channel * self._pairs
        waiting = self._recvs.get(key)
        if waiting is not None:
            recv = waiting.pop(0)
            if not waiting:
                del self._recvs[key]
            self._deliver(req, recv)
        else:
            req.held = True
            queue = self._sends.get(key)
            if queue is None:
                self._sends[key] = [req]
            else:
                queue.append(req)
            if self._anys and dst in self._anys:  # a new candidate for dst's any-source wait
                self._wake(self._anys[dst].task, self.now)
        return req

    def _route(self, src: int, dst: int) -> tuple[float, float, tuple[tuple[int, float], ...], Any]:
        """``(α, β, shared links, extra)`` of a pair: the links a flow shares are none without
        contention or a path's β (links of β = 0 never limit a flow); ``extra`` is None, or
        ``(token bucket or None, receive CPU per byte)`` where the fabric has either."""
        alpha, beta, links = self.fabric.route(src, dst)
        shared = tuple((link, b) for link, b in links if b > 0) if beta and self.contention else ()
        bucket = self._burst_of(src, dst) if self._burst_of is not None and shared else None
        cpu = self._receive_cpu_of(src, dst) if self._receive_cpu_of is not None else 0.0
        return alpha, beta, shared, (bucket, cpu) if bucket is not None or cpu else None

    def _draw(self, bucket: tuple[int, float, float], size: float) -> float:
        """The bytes of a message of ``size`` left after it draws on ``bucket`` (``(link, depth,
        β)``: module docstring, "Token buckets"): all of them while the link carries a flow."""
        link, depth, beta = bucket
        now = self.now
        note = self._lone[link]
        if note is not None and note[0] > now:
            return size
        sharing = self._on.get(link)
        if sharing:
            self._drop_ended(sharing)
            if sharing:
                return size
        tokens, since = self._buckets.get(link, (depth, -math.inf))
        if since == math.inf:  # drained by a flow that has ended since: idle from its end
            since = note[0] if note is not None else now
        tokens = min(depth, tokens + (now - since) / beta) if beta > 0 else depth
        if size <= tokens:
            self._buckets[link] = (tokens - size, now)
            return 0.0
        self._buckets[link] = (0.0, math.inf)  # busy: idle again from its flows' end
        return size - tokens

    def irecv(self, tensor: torch.Tensor, dst: int, src: int, op: str, channel: int = 0) -> SimRequest:
        """Post a receive on ``dst`` of the next message from ``src`` on ``channel``."""
        req = SimRequest(self, True, dst, src, tensor, op)
        key = src * self.world_size + dst + channel * self._pairs
        queued = self._sends.get(key)
        if queued is not None:
            send = queued.pop(0)
            if not queued:
                del self._sends[key]
            self._deliver(send, req)
        else:
            queue = self._recvs.get(key)
            if queue is None:
                self._recvs[key] = [req]
            else:
                queue.append(req)
        return req

    def _deliver(self, send: SimRequest, recv: SimRequest) -> None:
        """Match ``send`` with ``recv``: copy the payload; the receive completes at the send's
        arrival, once that is known (and again if it is revised: :meth:`_publish`)."""
        send.held = False
        if self._recv_cost:
            cost = self._recv_cost.pop(send, 0.0)
            if cost:
                self._recv_cost[recv] = cost
        if send.nbytes != recv.nbytes:
            err = CollectiveError(
                f"{recv.op}: virtual rank {recv.rank} posted a receive of {recv.nbytes} bytes from rank "
                f"{send.rank}, which sent {send.nbytes} bytes (the ranks run different calls or sizes)",
                op=recv.op,
                peer=send.rank,
            )
            recv.tensor = err  # type: ignore[assignment] - raised by the receiver's wait
            self._arrive(recv, self.now)
            return
        if self.copy and send.nbytes:
            recv.tensor.copy_(send.tensor)
        send.match = recv
        arrival = send.done_at
        if arrival is not None:  # as _arrive does (one call less per message)
            recv.done_at = done = arrival + self.wake if arrival > recv.posted else recv.posted
            if recv.waiter is not None:
                self._wake(recv.waiter, done)

    def _arrive(self, recv: SimRequest, arrival: float) -> None:
        """Complete ``recv`` at its arrival (plus the wake-up latency) if it was posted before, else
        at its posting; wake its rank then if it waits."""
        recv.done_at = done = arrival + self.wake if arrival > recv.posted else recv.posted
        if recv.waiter is not None:
            self._wake(recv.waiter, done)

    # ------------------------------------------------------------------ flows (module docstring)

    def _start(self, send: SimRequest, links: tuple[tuple[int, float], ...], beta: float, alpha: float, size: float) -> None:
        """Put ``send``'s flow of ``size`` bytes on ``links``. Alone there, it runs at its path's
        full rate and ends ``size·β`` from now, the closed form: it is only *noted* on its links
        (``_lone``: its end and what :meth:`_share` needs), with no :class:`_Flow`, no rate and
        no event; a flow that comes while it is still on the wire makes it a :class:`_Flow`, one
        that comes later finds the note stale. Else its component's rates are recomputed before
        the clock moves on (:meth:`_settle`)."""
        now = self.now
        on, lone = self._on, self._lone
        for link, _ in links:
            note = lone[link]
            if note is not None and note[0] > now:  # a lone flow still on the wire: now it shares
                self._share(note)
        shared = False
        if on:  # some flows have shared links (never, in a ring)
            for link, _ in links:
                sharing = on.get(link)
                if sharing:
                    self._drop_ended(sharing)
                    shared = shared or bool(sharing)
        if not shared:
            end = now + size * beta
            send.done_at = end + alpha
            note = (end, send, links, beta, alpha, size)
            for link, _ in links:
                lone[link] = note
            return
        flow = _Flow(send, links, beta, alpha, size, now)
        for link, _ in links:
            sharing = on.get(link)
            if sharing is None:
                sharing = on[link] = {}
            sharing[flow] = None
        self._dirty.append(flow)

    def _share(self, note: tuple[float, SimRequest, tuple[tuple[int, float], ...], float, float, float]) -> None:
        """A lone flow (its note, :meth:`_start`) meets another: make it the :class:`_Flow` it
        stood for (posted at its send's posting, at its path's full rate) on each of its links."""
        end, send, links, beta, alpha, size = note
        flow = _Flow(send, links, beta, alpha, size, send.posted)
        flow.rate, flow.end = 1.0 / beta, end
        on, lone = self._on, self._lone
        for link, _ in links:
            lone[link] = None
            sharing = on.get(link)
            if sharing is None:
                sharing = on[link] = {}
            sharing[flow] = None

    def _drop_ended(self, sharing: dict[_Flow, None]) -> None:
        """Take the flows on a link that have ended by now off their links (lone ones have no
        event; one whose event is still queued for now gets :meth:`_finish` here)."""
        now = self.now
        if len(sharing) == 1:  # the common case (a ring): no list to build
            flow = next(iter(sharing))
            if flow.end <= now:
                self._finish(flow)
            return
        for flow in [f for f in sharing if f.end <= now]:
            self._finish(flow)

    def _finish(self, flow: _Flow) -> None:
        """``flow`` has ended (now): free its links and have the flows left on them re-rated.
        Its arrival was published already (:meth:`_publish`)."""
        flow.done = True
        on, dirty, buckets = self._on, self._dirty, self._buckets
        for link, _ in flow.links:
            sharing = on[link]
            del sharing[flow]
            if sharing:
                dirty.append(next(iter(sharing)))
            elif buckets and link in buckets:  # a drained token bucket refills from the flow's end
                buckets[link] = (0.0, flow.end)

    def _publish(self, flow: _Flow) -> None:
        """``flow``'s end is (newly) ``flow.end``: its send arrives ``α`` later, and so its receive
        if matched; a rank sleeping until the old times is rescheduled."""
        send = flow.send
        send.done_at = arrival = flow.end + flow.alpha
        if send.waiter is not None:
            self._wake(send.waiter, arrival)
        if send.match is not None:
            self._arrive(send.match, arrival)
        elif self._anys and send.peer in self._anys:  # a candidate of an any-source wait: it chooses again
            self._wake(self._anys[send.peer].task, self.now)

    def _settle(self) -> None:
        """Recompute the max-min fair rates of the components of the dirty flows, as of now."""
        while self._dirty:  # dropping ended flows may dirty more
            dirty, self._dirty = self._dirty, []
            self._settle_seeds(dirty)

    def _settle_seeds(self, dirty: list[_Flow]) -> None:
        on = self._on
        floor = next(self._stamps)  # a flow stamped at or above it was visited by this call
        for seed in dirty:
            if seed.done or seed.stamp >= floor:
                continue
            if seed.end <= self.now:  # ended at the same time as the flow that dirtied it
                self._finish(seed)
                continue
            stamp = next(self._stamps)
            seed.stamp = stamp
            members, links = [seed], {}
            for flow in members:  # grows while it runs: the connected component of seed
                for link, b in flow.links:
                    if link not in links:
                        links[link] = b
                        self._drop_ended(on[link])
                        for other in on[link]:
                            if other.stamp != stamp:
                                other.stamp = stamp
                                members.append(other)
            self._rate(members, links, stamp)

    def _rate(self, members: list[_Flow], links: dict[int, float], stamp: int) -> None:
        """Progressive filling on one component: the link with the smallest fair share
        (remaining bandwidth / flows not yet rated) fixes its flows' rates at that share; repeat.
        Then each flow's end is predicted again from the bytes it has left."""
        now = self.now
        on = self._on
        for flow in members:
            flow.left -= flow.rate * (now - flow.since)
            flow.since = now
        room = {link: 1.0 / b for link, b in links.items()}
        count = {link: len(on[link]) for link in links}
        if self._phantoms:  # flows of other work that never end (a CPU's other threads)
            for link in links:
                count[link] += self._phantoms.get(link, 0.0)
        shares = [(room[link] / count[link], link) for link in links if count[link]]
        heapq.heapify(shares)
        while shares:
            share, link = heapq.heappop(shares)
            left = count[link]
            if not left:
                continue
            current = room[link] / left
            if current > share:  # flows fixed since elsewhere, at less: its share grew
                heapq.heappush(shares, (current, link))
                continue
            share = current if current > 0 else 1.0 / links[link] * 1e-12  # rounding: never stop a flow
            for flow in on[link]:
                if flow.fixed != stamp:
                    flow.fixed = stamp
                    flow.rate = share
                    for other, _ in flow.links:
                        room[other] -= share
                        count[other] -= 1
        push, seq, shared = heapq.heappush, self._seq, len(members) > 1
        for flow in members:
            left = flow.left if flow.left > 0 else 0.0
            # at its path's full rate (alone again): the closed form's product, not a quotient
            end = now + (left * flow.beta if flow.rate * flow.beta >= 1.0 else left / flow.rate)
            if end != flow.end:
                flow.end = end
                self._publish(flow)
            if shared and flow.event != end:  # its end will change the others' rates
                flow.event = end
                push(self._flows, (end, next(seq), flow))

    def _wait(self, req: SimRequest) -> None:
        """Block the running rank until ``req`` completes (its time may not be known yet, and may
        be revised while it sleeps: :meth:`_publish` reschedules it)."""
        task = self._running
        if task is None:
            raise RuntimeError(f"{req.op}: a simulated request can only be waited for by a virtual rank")
        if self._dirty:
            self._settle()
        done = req.done_at
        if done is not None:
            if done <= self.now:
                return
            times, flows = self._times, self._flows
            if (not times or times[0] > done) and (not flows or flows[0][0] > done):
                self.now = done  # nothing happens before: no flow can join ours
                return
            task.due = seq = next(self._seq)  # as _wake does (one call less per message)
            bucket = self._at.get(done)
            if bucket is None:
                bucket = self._at[done] = collections.deque()
                heapq.heappush(times, done)
            bucket.append((seq, task))
        req.waiter = task  # a receive whose message is not sent yet: its sender wakes us
        task.waiting_on = req
        try:
            self._hub.switch()
        finally:
            req.waiter = None
            task.waiting_on = None

    def wait_any(
        self, dst: int, sources: Sequence[int], accept: Callable[[torch.Tensor], bool], op: str, channel: int = 0
    ) -> int:
        """Block the running rank ``dst`` until the first of the next messages from ``sources`` on
        ``channel`` that ``accept`` takes (given the message's tensor, e.g. a user message's
        header) has arrived; return its sender. The message stays queued: the caller's receive
        from that sender takes it.

        "First": the earliest arrival in virtual time, ties to the lowest rank (module
        docstring). A sender's next message is a candidate only while no receive from that
        sender is posted. Raises ``CollectiveError`` (naming ``op``) if no candidate can come.
        """
        task = self._running
        if task is None or task.rank != dst:
            raise RuntimeError(f"{op}: wait_any must be called by the receiving virtual rank")
        wait = self._anys[dst] = _AnyWait(task, sources, accept, channel * self._pairs + dst)
        marker = SimRequest(self, True, dst, -1, _NOTHING, op)  # what a deadlock report names
        try:
            while True:
                if self._dirty:
                    self._settle()
                best = self._first_arrival(wait)
                if best is not None and best[0] <= self.now:
                    return best[1]
                if best is None:
                    task.due = -1  # no wake-up: a new candidate or a revised arrival wakes it
                else:
                    self._wake(task, best[0])
                task.waiting_on = marker
                self._hub.switch()
        finally:
            del self._anys[dst]
            task.waiting_on = None
            task.due = -1  # a wake-up left by a hook while it chose is void

    def _first_arrival(self, wait: "_AnyWait") -> tuple[float, int] | None:
        """``(arrival, sender)`` of the earliest known candidate of ``wait``, or None."""
        n, best = self.world_size, None
        sends, recvs = self._sends, self._recvs
        for src in wait.sources:
            key = wait.base + src * n
            queue = sends.get(key)
            if not queue or key in recvs:
                continue
            send = queue[0]
            if send.done_at is not None and (best is None or send.done_at < best[0]) and wait.accept(send.tensor):
                best = (send.done_at, src)
        return best

    def _until(self, task: _Task, when: float) -> None:
        """Resume ``task`` at ``when``: at once if no other rank, and no flow, has anything to do
        before (or at) then."""
        if self._dirty:
            self._settle()
        times, flows = self._times, self._flows
        if (not times or times[0] > when) and (not flows or flows[0][0] > when):
            self.now = when
            return
        self._wake(task, when)
        self._hub.switch()

    # ------------------------------------------------------------------ trace

    def _trace(self, req: SimRequest) -> None:
        """Record a completed message on its rank's row (once its time is final: when waited for)."""
        assert req.done_at is not None
        if req.recv:
            self._event(req.rank, f"recv from {req.peer}", req.posted, req.done_at, {"bytes": req.nbytes})
        else:
            self._event(req.rank, f"send to {req.peer}", req.posted, req.done_at, {"bytes": req.nbytes, "op": req.op})

    def _event(self, rank: int, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        assert self.events is not None
        self.events.append(
            {"name": name, "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
             "cat": "message", "args": args}
        )

    @contextlib.contextmanager
    def span(self, rank: int, name: str) -> Iterator[None]:
        """Record ``name`` on ``rank``'s row for the duration of the block (virtual time)."""
        start = self.now
        try:
            yield
        finally:
            if self.events is not None:
                self.events.append(
                    {"name": name, "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e6,
                     "dur": (self.now - start) * 1e6, "cat": "collective"}
                )

    def chrome_trace(self) -> dict[str, Any]:
        """The recorded events as a Chrome trace (every virtual rank a row), times in virtual µs."""
        if self.events is None:
            raise RuntimeError("chrome_trace: the simulation was made without trace=True")
        names = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
            for r in sorted({e["tid"] for e in self.events})
        ]
        return {"traceEvents": names + self.events, "displayTimeUnit": "ns"}


class SimTransport(Transport):
    """The :class:`Transport` of one virtual rank of a group of a :class:`Simulation`.

    ``ranks[i]`` is the simulation rank of group rank ``i`` (default: the same numbering);
    ``byte_scale`` overrides the simulation's for this transport's sends (timing-only runs whose
    buffers stand for different sizes at once, as DDP's buckets do); ``channel``: whose messages
    these are (even: a group's collectives, the world's 0; odd: that group's user point-to-point;
    messages match per pair and channel, as gloo's tags and process groups keep them apart).
    """

    def __init__(
        self, sim: Simulation, rank: int, ranks: Sequence[int] | None = None, timeout: float = 1800.0,
        byte_scale: float | None = None, channel: int = 0,
    ):
        members = list(range(sim.world_size) if ranks is None else ranks)
        super().__init__(rank, len(members), timeout)
        self.sim = sim
        self.members = members
        self.me = members[rank]
        self.byte_scale = byte_scale
        self.channel = channel
        self._user: SimTransport | None = None

    def user_channel(self) -> "SimTransport":
        """The same ranks on the next channel (the world's: :data:`USER_CHANNEL`): the wire of user
        point-to-point (``collectives.p2p``), whose messages never meet the collectives' and share
        the links with them."""
        if self._user is None:
            self._user = SimTransport(self.sim, self.rank, self.members, self.timeout, self.byte_scale, self.channel + 1)
        return self._user

    @classmethod
    def for_group(cls, group: GroupInfo) -> "SimTransport":
        """The transport of the calling virtual rank in ``group`` (built inside a simulation only).

        Its channel is its process group's ``channel`` attribute (``collectives.sim`` gives each
        group of a world its own: :data:`USER_CHANNEL`), 0 if it has none."""
        sim, me = current()
        ranks = getattr(group, "ranks", None)
        return cls(sim, group.rank(), ranks, group.timeout, channel=getattr(group.process_group, "channel", 0))

    def operation(self, name: str) -> ContextManager[None]:
        sim = self.sim
        delay = 0.0 if self.channel % 2 else sim.delays.get(self.me, 0.0)
        if delay:  # a straggler: late into every collective (not into user point-to-point)
            sim.sleep_until(sim.now + delay)
        if sim.events is None and not sim.reduce_beta:
            return super().operation(name)
        labels = contextlib.ExitStack()
        labels.enter_context(super().operation(name))
        if sim.events is not None:
            labels.enter_context(sim.span(self.me, name))
        if sim.reduce_beta:
            labels.enter_context(self._charging_reductions())
        return labels

    @contextlib.contextmanager
    def _charging_reductions(self) -> Iterator[None]:
        """Inside the block, every reduction of this rank computes its bytes times ``reduce_beta``."""
        sim = self.sim
        per_byte = sim.reduce_beta * (sim.byte_scale if self.byte_scale is None else self.byte_scale)
        token = combine_cost.set(lambda nbytes: sim.compute(nbytes * per_byte))
        try:
            yield
        finally:
            combine_cost.reset(token)

    def first_arrival(self, accept: Callable[[torch.Tensor], bool]) -> int:
        """The group rank of the sender whose next message on this channel, among those ``accept``
        takes, arrives first (:meth:`Simulation.wait_any`: earliest arrival, ties to the lowest
        rank); blocks the calling rank until it has arrived."""
        members = self.members
        src = self.sim.wait_any(self.me, [m for m in members if m != self.me], accept, self.op, self.channel)
        return members.index(src)

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.sim.isend(tensor, self.me, self.members[peer], self.op, self.byte_scale, self.channel)

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.sim.irecv(tensor, self.me, self.members[peer], self.op, self.channel)

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[Request]:
        sim, me, members, op, scale, channel = self.sim, self.me, self.members, self.op, self.byte_scale, self.channel
        requests: list[Request] = []
        for t, p in recvs:
            requests.append(sim.irecv(t, me, members[p], op, channel))
        for t, p in sends:
            requests.append(sim.isend(t, me, members[p], op, scale, channel))
        return requests


def current() -> tuple[Simulation, int]:
    """(simulation, rank) of the calling virtual rank; ``ValueError`` outside a simulation."""
    found = _current.get()
    if found is None:
        raise ValueError(
            "the sim backend runs only on virtual ranks: start them with collectives.launch(fn, n, backend='sim') "
            "or collectives.sim.Simulation.run"
        )
    return found


def in_simulation() -> bool:
    """Whether the caller is a virtual rank of a :class:`Simulation`."""
    return _current.get() is not None
