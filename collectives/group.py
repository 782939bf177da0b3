"""Process groups: who takes part in a collective, over which backend, with which deadline.

A :class:`Group` wraps a torch process group (used for rendezvous and as the point-to-point wire)
and adds what our collectives need: the backend (see :mod:`collectives.backends`), one engine per
device, a FIFO communication queue, a timeout, a store private to the group, a host key per rank,
and a "broken" state set by the first communication failure.

**After a failure.** The first :class:`~collectives.errors.CollectiveError` of a group (a dead or
silent peer, a mismatch found by the wire check) breaks it: that call's waiter gets the error
itself, and every call after it (queued before the failure or submitted later, from any thread)
raises at once, before any traffic, ``<op>: group <name> is unusable after an earlier failure:
<the first error>``. Work queued behind the failure therefore never waits out a deadline of its
own, and :meth:`Group.close` on a broken group returns as soon as the call in flight (if any)
has ended: at most one timeout.

Backends are chosen by name (``backend=`` argument, or the ``RINGDDP_BACKEND`` environment
variable; default ``auto``): ``p2p`` (alias ``gloo``), ``nccl-cupy`` (alias ``nccl``), ``torch``,
or any registered with :func:`collectives.register_backend`.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from . import debug, faults, trace, wire
from .backends import AUTO, Backend, get_backend, resolve_backend, select_backend
from .engine import Engine
from .errors import CollectiveError, CollectiveTimeoutError, timed_out, timeout_seconds
from .mailbox import USER_TAG, Mailbox
from .transport.base import wait_for_keys
from .transport.torch_p2p import TorchP2PTransport
from .tuning import Tuning
from .work import Executor, Work, current_issuer, on_communication_thread

log = logging.getLogger(__name__)

#: what ``torch.no_grad()`` calls on entry and exit (thread-local, like the context)
_set_grad_enabled = torch._C._set_grad_enabled

#: torch's default for CPU process groups.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_CPU = torch.device("cpu")


def host_key() -> str:
    """``hostname/boot id/network namespace/device of /dev/shm``: equal exactly for processes that
    can share memory *and* reach each other without a network. The network namespace counts so
    that emulated hosts (namespaces of one machine, :mod:`collectives.testing.hosts`) are hosts."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("-")
    try:
        parts.append(f"net{os.stat('/proc/self/ns/net').st_ino}")
    except OSError:
        parts.append("-")
    try:
        parts.append(str(os.stat("/dev/shm").st_dev))
    except OSError:
        parts.append("-")
    return "/".join(parts)


class Group:
    """A set of ranks that run collectives together (like torch's ``ProcessGroup``).

    Attributes:
        ranks: global ranks of the members, sorted; group rank ``i`` is global rank ``ranks[i]``.
        name: a label for messages and traces (``"world"``, ``"group[0, 1]"``).
        backend: canonical backend name (``"auto"``, ``"p2p"``, ...).
        timeout: seconds any single wait inside a collective may block.
        tuning: algorithm thresholds and pipelining (:class:`~collectives.tuning.Tuning`); change
            them identically on every rank, between collectives.
        process_group: the torch process group used as the wire and for rendezvous.
        store: a torch ``Store`` private to this group: keys cannot clash with other groups', and a
            TCP store connection is shared, so its users poll (:func:`~collectives.transport.base.wait_for_keys`).
        hosts: a host key per group rank (:func:`host_key`); equal keys share memory.
        mailbox: user point-to-point's receives and the streams they read from, and the user
            channel CPU messages travel on (:class:`~collectives.mailbox.Mailbox`).
        plans: the public API's planned calls by call shape (:func:`collectives.api.all_reduce`).

    A group is the :class:`~collectives.transport.base.GroupInfo` its backend builds transports from.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        ranks: Sequence[int],
        backend: str,
        timeout: float,
        name: str,
        *,
        store: dist.Store,
        hosts: Sequence[str],
    ):
        self.process_group = process_group
        self.ranks = list(ranks)
        self.backend = backend
        self.timeout = timeout
        self.name = name
        self.tuning = Tuning()
        self.store = store
        self.hosts = list(hosts)
        self._rank = process_group.rank()
        debug.read_environment()  # the checking level: an unknown $RINGDDP_DEBUG raises here
        self.mailbox = Mailbox(self.ranks, lambda: TorchP2PTransport(process_group, self._rank, timeout, tag=USER_TAG))
        self._executor = Executor(name)
        # no communication thread (virtual ranks): async collectives complete before returning
        self._threadless = backend != AUTO and get_backend(backend).threadless
        self._failure: CollectiveError | None = None  # the first communication failure
        self._creator = threading.current_thread()  # its calls carry thread code 0 (collectives.wire)
        # compared first in _issuer: one C call instead of current_thread() (None: made on a communication thread)
        self._creator_id = None if on_communication_thread() else threading.get_ident()
        self._selected: dict[tuple[str, str], Backend] = {}
        self._engines: dict[tuple[str, torch.device], Engine] = {}
        self._by_device: dict[torch.device, Engine] = {}  # engine(device), once built
        self._building = threading.RLock()  # one engine per key even when two threads ask at once
        #: the public API's planned calls by call shape (:func:`collectives.api.all_reduce`): the
        #: checking level and tuning the plan is for, and the :meth:`plan` made after the first
        #: call of that shape, or None where it runs the ordinary path
        self.plans: dict[tuple, tuple[tuple, Callable[..., bool] | None]] = {}

    @classmethod
    def from_store(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta | float | None = None,
        *,
        backend: str | None = None,
        ranks: Sequence[int] | None = None,
        name: str = "world",
    ) -> "Group":
        """A group of ``size`` ranks that meet through ``store``, from what torch hands a backend.

        Every member calls it with the same ``store`` (private to the group: a ``PrefixStore``),
        its own ``rank`` and the same ``size``. It exchanges host keys through the store and
        connects a gloo process group of the members (the wire of ``p2p`` and of user
        point-to-point) over it; that takes one round of the store and a TCP connection per peer.

        Args:
            timeout: deadline of every wait, also of this rendezvous (default 30 minutes).
            backend: which of our backends runs the collectives (default: ``$RINGDDP_BACKEND``,
                else ``auto``).
            ranks: the members' global ranks, by group rank (default ``0 .. size-1``): what
                ``src``/``dst`` arguments name.
            name: a label for messages and traces.
        """
        seconds = timeout_seconds(timeout, DEFAULT_TIMEOUT.total_seconds())
        members = list(range(size) if ranks is None else ranks)
        if len(members) != size or not 0 <= rank < size:
            raise ValueError(f"Group.from_store: rank {rank} and ranks {members} do not fit a group of {size}")
        hosts = _exchange_hosts(store, rank, size, seconds)
        wire = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, datetime.timedelta(seconds=seconds))
        return cls(wire, members, resolve_backend(backend), seconds, name, store=store, hosts=hosts)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, rank={self._rank}, backend={self.backend!r})"

    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    @property
    def broken(self) -> str | None:
        """Why the group is unusable (the first communication failure), or ``None``."""
        return None if self._failure is None else str(self._failure)

    def check_usable(self, op_name: str) -> None:
        """Raise ``CollectiveError`` naming the first failure if the group is broken (module docstring)."""
        first = self._failure
        if first is not None:
            raise CollectiveError(
                f"{op_name}: group {self.name} is unusable after an earlier failure: {first}", op=op_name, peer=first.peer
            )

    def _issuer(self) -> int:
        """The calling thread's code in the wire header (:func:`collectives.wire.thread_code`): 0
        for the group's creator; on a communication thread (a future callback), the code of the
        thread that issued the collective whose completion runs the callback."""
        if threading.get_ident() == self._creator_id:  # the common case (never a communication thread)
            return 0
        if on_communication_thread():
            return current_issuer()
        thread = threading.current_thread()
        return 0 if thread is self._creator else wire.thread_code(thread.name)

    def group_rank(self, global_rank: int, what: str, op_name: str) -> int:
        """Map a global ``src``/``dst`` rank to this group, or raise ``ValueError``."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"{op_name}: {what} must be an int rank, got {type(global_rank).__name__}")
        if global_rank not in self.ranks:
            raise ValueError(f"{op_name}: {what}={global_rank} is not a rank of this group (ranks {self.ranks})")
        return self.ranks.index(global_rank)

    def peer(self, op_name: str, what: str, peer: int | None, group_peer: int | None) -> tuple[int, int]:
        """The (group rank, global rank) of a point-to-point peer given as global ``peer`` or as
        ``group_peer`` (``what``: ``"src"`` or ``"dst"``); raises before any traffic if it is
        missing, both, out of range or this rank itself."""
        if peer is None and group_peer is None:
            raise ValueError(f"{op_name}: {what} is required")
        if peer is not None and group_peer is not None:
            raise ValueError(f"{op_name}: pass either {what} or group_{what}, not both")
        if group_peer is not None:
            if isinstance(group_peer, bool) or not isinstance(group_peer, int):
                raise TypeError(f"{op_name}: group_{what} must be an int rank, got {type(group_peer).__name__}")
            if not 0 <= group_peer < self.size():
                raise ValueError(f"{op_name}: group_{what}={group_peer} is out of range for a group of {self.size()}")
            local = group_peer
        else:
            local = self.group_rank(peer, what, op_name)
        if local == self._rank:
            raise ValueError(f"{op_name}: {what} is this rank ({self.ranks[local]}); a rank cannot message itself")
        return local, self.ranks[local]

    def source(self, op_name: str, src: int | None, group_src: int | None) -> tuple[int | None, int | None]:
        """:meth:`peer` of a receive, which may name no sender: ``(None, None)`` then (any source)."""
        if src is None and group_src is None:
            return None, None
        return self.peer(op_name, "src", src, group_src)

    # ------------------------------------------------------------------------ engines

    def _select(self, name: str, device_type: str, op_name: str) -> Backend:
        key = (name, device_type)
        with self._building:
            if key not in self._selected:
                self._selected[key] = select_backend(name, device_type, self, op_name)
            return self._selected[key]

    def _engine(self, backend: Backend, device: torch.device) -> Engine:
        key = (backend.name, device)
        engine = self._engines.get(key)
        if engine is None:
            with self._building:  # two engines would set up two transports: the ranks could join different ones
                engine = self._engines.get(key)
                if engine is None:
                    engine = self._engines[key] = backend.build(self, device)
                    log.debug("group %s: %s engine on %s", self.name, backend.name, device)
        return engine

    def engine(self, device: torch.device, op_name: str = "engine") -> Engine:
        """The engine that runs collectives on tensors of ``device`` (built on first use).

        Raises ``ValueError`` (before any traffic) if the backend cannot move such tensors.
        """
        engine = self._by_device.get(device)
        if engine is None:
            with self._building:
                engine = self._by_device[device] = self._engine(self._select(self.backend, device.type, op_name), device)
        return engine

    def metadata_engine(self) -> Engine:
        """The CPU engine for small metadata (debug checks), whatever device payloads live on."""
        name = self.backend if self.backend == AUTO else resolve_backend(get_backend(self.backend).metadata())
        return self._engine(self._select(name, "cpu", "metadata"), _CPU)

    def barrier_engine(self, op_name: str = "barrier") -> Engine:
        """Where barriers run: the backend's own engine if it asks for that, else the metadata engine."""
        if self.backend != AUTO:
            backend = get_backend(self.backend)
            if backend.barrier_on_device:
                kind = backend.device_types[0]
                device = _CPU if kind == "cpu" else torch.device(kind, getattr(torch, kind).current_device())
                return self.engine(device, op_name)
        return self.metadata_engine()

    # ------------------------------------------------------------------------ running collectives

    def submit(
        self,
        name: str,
        fn: Callable[[], None],
        async_op: bool,
        signature: debug.Signature,
        result: list[torch.Tensor] | None = None,
        *,
        algorithm: str = "-",
        sizes: tuple[list[int], list[int]] | None = None,
    ) -> Work | None:
        """Run ``fn`` on the group's FIFO queue (now, or on the communication thread if async).

        Refuses to start on a broken group, when submitted and again when its turn comes (see the
        module docstring); a :class:`CollectiveError` inside ``fn`` breaks it.
        At ``RINGDDP_DEBUG=DETAIL`` every rank's ``signature`` is compared first; while tracing, the
        call is recorded. ``result``: the output tensors, the value of the returned
        :class:`Work`'s future. ``algorithm`` and ``sizes`` (all-to-all: bytes to / from each
        rank) complete the wire check's header (:mod:`collectives.wire`). ``fn`` runs under
        ``torch.no_grad()``: like torch's, collectives are not recorded by autograd, so tensors
        that require grad are accepted.
        """
        if self._failure is not None:
            self.check_usable(name)
        label = trace.current_label()  # read on the submitting thread
        level = debug.level()
        issuer = self._issuer()
        header = wire.header(signature, self.tuning, algorithm, sizes, level, issuer)
        agree = signature if level == "DETAIL" else None

        def run() -> None:
            tracer = trace.active()
            if tracer is None:
                self._run(name, fn, header, agree)
                return
            start = time.perf_counter_ns()
            try:
                self._run(name, fn, header, agree)
            finally:
                args = {"op": name, "group": self.name, "bytes": signature.nbytes, "async": async_op}
                tracer.add(label or name, "collective", start, time.perf_counter_ns(), args)

        if log.isEnabledFor(logging.DEBUG):  # --verbose: one line per collective
            log.debug("%s on %s (rank %d)", debug.describe(signature), self.name, self._rank)
        if async_op:
            return self._executor.submit(Work(name, result), run, not self._threadless, issuer)
        self._executor.call(name, run, issuer)  # inline when nothing is queued: no handle, no thread hop
        return None

    def _run(self, name: str, fn: Callable[..., None], header: wire.Header | None,
             agree: debug.Signature | None = None, current: bool = True, args: tuple = (),
             no_grad: bool = True) -> None:
        """A collective's turn in the queue: refuse on a broken group, let pending receives take
        their messages, compare ``agree`` with every rank first (DETAIL), make ``header`` the
        wire check's (unless ``current`` is False: ``fn`` was given it), run ``fn(*args)``
        without autograd (unless ``no_grad`` is False: see :meth:`plan`); a
        :class:`CollectiveError` breaks the group."""
        try:
            if self._failure is not None:  # it may have broken while this call was queued
                self.check_usable(name)
            if self.mailbox.pending:  # receives posted by irecv take their messages before ours
                self.mailbox.settle_shared()
            if agree is not None:
                self._check_agreement(agree, header)  # before the header: its own traffic
            previous = wire.swap(header) if current else None
            grad = no_grad and torch.is_grad_enabled()  # off already inside backward hooks and under no_grad
            try:
                if grad:
                    _set_grad_enabled(False)  # torch.no_grad() without its ~1 µs of Python frames
                faults.reached("collective")
                fn(*args)
            finally:
                if grad:
                    _set_grad_enabled(True)
                if current:
                    wire.swap(previous)
        except CollectiveError as exc:
            self.mark_broken(exc)
            raise

    def plan(self, name: str, fn: Callable[..., None], header: wire.Header, current: bool = True,
             no_grad: bool = True) -> Callable[..., bool]:
        """The per-call path of a planned collective (a persistent one, :mod:`collectives.persistent`,
        or a plain call whose shape ran before, :data:`plans`): a function ``start(*args)`` that
        runs ``fn(*args)`` now, synchronously, as :meth:`submit` would with ``header`` (built
        with issuing thread 0), and returns True; or does nothing and returns False when the call
        needs more than that, so the caller submits it instead: not on the thread that created
        the group, work queued or running on the group, a trace recording, ``--verbose``
        logging. ``current=False``: ``fn`` runs its transport's operation with ``header``
        itself, so it is not made :func:`collectives.wire.current`. ``no_grad=False``: ``fn``
        runs no torch operation autograd could record (a native call; what it runs in torch it
        runs with autograd off itself), so the grad mode is left alone (switching it off and on
        costs ~0.4 µs a call)."""
        run = self._run
        creator, get_ident, active, logs = self._creator_id, threading.get_ident, trace.active, log.isEnabledFor
        claim, release = self._executor.claim, self._executor.release

        def start(*args: object) -> bool:
            if get_ident() != creator or active() is not None or logs(logging.DEBUG) or not claim(name):
                return False
            try:
                run(name, fn, header, None, current, args, no_grad)
            finally:
                release()
            return True

        return start

    def enqueue(self, work: Work, fn: Callable[[], None], async_op: bool) -> Work:
        """Run ``fn`` in the group's queue order, like :meth:`submit` but without the checks made
        for collectives (DETAIL agreement, wire header, trace span): user point-to-point posts
        its messages this way (``collectives/p2p.py``), and an async call made of collectives
        runs them (sparse all-reduce: on the communication thread each runs inline, in this
        call's place, with its own checks). ``work`` completes when ``fn`` has run;
        it fails at once if the group broke before its turn, and a :class:`CollectiveError`
        inside ``fn`` breaks the group."""

        def run() -> None:
            try:
                self.check_usable(work.name)
                fn()
            except CollectiveError as exc:
                self.mark_broken(exc)
                raise

        return self._executor.submit(work, run, async_op and not self._threadless, self._issuer())

    def _check_agreement(self, signature: debug.Signature, header: wire.Header | None) -> None:
        """DETAIL: all-gather the signature, with what the wire ``header`` compares besides, over
        the metadata engine (CPU, also for CUDA payloads)."""
        engine = self.metadata_engine()

        def all_gather(outs: list[torch.Tensor], mine: torch.Tensor) -> None:
            with engine.transport_op(f"{signature.name} (debug check)"):
                engine.all_gather(outs, mine)

        if header is None:  # not a collective of the wire check (symmetric_empty)
            debug.check_agreement(signature, self._rank, self.size(), all_gather)
            return
        sizes = (header.sends, header.recvs) if header.sends is not None and header.recvs is not None else None
        debug.check_agreement(
            signature, self._rank, self.size(), all_gather, header.algorithm, header.tuning, sizes
        )

    def mark_broken(self, error: CollectiveError) -> None:
        """Record the first communication failure; the group refuses further collectives."""
        if self._failure is None:
            self._failure = error
            log.error("group %s is unusable after: %s", self.name, error)

    def close(self) -> None:
        """Release the group: wait for its queue (on a broken group only the call in flight, if
        any, takes time: the rest fail at once), stop its thread, say goodbye to the peers' user
        point-to-point (:meth:`Mailbox.close <collectives.mailbox.Mailbox.close>`), close its
        engines (shared-memory segments, connections).

        A broken group also lets go of its torch process group (``process_group`` becomes
        ``None``): gloo closes its connections when the last reference goes, so a peer still
        waiting on this rank inside the failed collective (it was not next to the failure) fails at
        once instead of at its deadline. Without this the references held by the failure's
        traceback (a reference cycle) would keep the connections open until the garbage
        collector ran."""
        self._executor.close()
        self.mailbox.close()
        with self._building:
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()
            self._by_device.clear()
            self.plans.clear()
        if self._failure is not None:
            self.mailbox.release()
            self.process_group = None


def _exchange_hosts(store: dist.Store, rank: int, size: int, seconds: float) -> list[str]:
    """Every rank's :func:`host_key`, through the store (one set, then a poll and a multi-get)."""
    store.set(f"ringddp/host/{rank}", host_key())
    keys = [f"ringddp/host/{r}" for r in range(size)]
    if not wait_for_keys(store, keys, time.monotonic() + seconds):
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise CollectiveTimeoutError(
            f"init: ranks {missing} did not publish their host: {timed_out(seconds)} (this is rank {rank} of {size})",
            op="init",
            peer=missing[0] if missing else None,
        )
    return [v.decode() for v in store.multi_get(keys)]


_world: Group | None = None
#: a default group bound to the calling context only (a virtual rank of collectives.sim), over _world
_bound_world: contextvars.ContextVar[Group | None] = contextvars.ContextVar("ringddp_default_group", default=None)
_owns_torch_group = False
_subgroups: list[Group] = []
_created = itertools.count()


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
) -> Group:
    """Join the default group (like ``torch.distributed.init_process_group``).

    If torch.distributed is already initialised (say by your own code or a framework) its default
    group is reused as the wire; otherwise a gloo group is created with the given rendezvous
    (``init_method``, ``store``, or ``env://`` with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
    ``WORLD_SIZE`` as under torchrun).

    Args:
        backend: see the module docstring; ``None`` reads ``$RINGDDP_BACKEND``, else ``auto``.
        timeout: deadline of every blocking wait (and of the rendezvous); default 30 minutes.
    """
    global _world, _owns_torch_group
    if _world is not None:
        raise RuntimeError("init_process_group: already initialised; call destroy_process_group first")
    name = resolve_backend(backend)
    seconds = timeout_seconds(timeout, DEFAULT_TIMEOUT.total_seconds())
    if not dist.is_initialized():
        if store is None and init_method in (None, "env://"):
            store, rank, world_size = _restart_store(rank, world_size, seconds)
            init_method = None if store is not None else init_method
        try:
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                timeout=datetime.timedelta(seconds=seconds),
                world_size=world_size,
                rank=rank,
                store=store,
            )
        except (RuntimeError, dist.DistError) as exc:  # name the phase; torch's text says who is missing
            joined = _joined(str(exc))
            raise CollectiveTimeoutError(
                f"init_process_group: rendezvous failed after up to {seconds:g}s as rank {rank} of "
                f"{world_size}{joined}: {str(exc).splitlines()[0][:300]}",
                op="init_process_group",
            ) from exc
        _owns_torch_group = True
    pg, size = dist.group.WORLD, dist.get_world_size()
    store = _get_default_store()
    hosts = _exchange_hosts(store, pg.rank(), size, seconds)
    _world = Group(pg, range(size), name, seconds, "world", store=store, hosts=hosts)
    trace.set_default_rank(_world.rank())
    log.debug("rank %d/%d joined the default group (backend %s)", _world.rank(), size, name)
    return _world


def _restart_store(rank: int, world_size: int, seconds: float) -> tuple[dist.Store | None, int, int]:
    """Under torchrun with its agent's store (the default), that store with this rendezvous round's
    own key prefix, and the rank and world size from the environment; elsewhere
    ``(None, rank, world_size)``.

    The agents keep one store for the whole job and hand every restart of the workers the same
    ``MASTER_PORT``: without a prefix a restarted worker reads the keys of the attempt before it,
    such as a dead peer's gloo address, and its rendezvous fails. The prefix cannot come from
    ``TORCHELASTIC_RESTART_COUNT``: with several nodes the agent whose worker failed counts a
    restart and the others, restarted for the membership change, do not. :func:`_agree_round`
    gives every worker of one round the same fresh number instead.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None, rank, world_size
    rank = int(env["RANK"]) if rank < 0 else rank
    world_size = int(env["WORLD_SIZE"]) if world_size < 0 else world_size
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=seconds))
    round_ = _agree_round(agent, rank, world_size, seconds)
    if round_ > 1:  # a restart; the agents' counts may differ, the round does not
        log.info("rank %d of %d: start %d of this torchrun job's workers (this agent counts %s restarts)",
                 rank, world_size, round_, env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return dist.PrefixStore(f"ringddp/round-{round_}/", agent), rank, world_size


def _agree_round(store: dist.Store, rank: int, size: int, seconds: float) -> int:
    """A number that every rank of this start of the workers shares and no earlier start used.

    Rank 0 draws it from a counter in the store (``add``). The others must not take an earlier
    round's answer for it: the store still holds every key of the workers before them. So each
    rank ``r`` says hello with a nonce of its own (``hello/r``); rank 0 answers every hello it
    sees, stale or new, under that nonce (``welcome/<nonce>``), which only the rank that drew the
    nonce waits for; it stops once every rank confirmed this round's number (``ready/r``), which
    no earlier round can have written. All workers of the previous round are gone before the next
    starts (the agents stop them before they rendezvous again), so nobody answers with an old
    number. Cost: rank 0 polls ``2(N-1)`` keys until the last rank arrived; others one set, one
    wait, one set.
    """
    deadline = time.monotonic() + seconds
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"ringddp/hello/{rank}", nonce)
        welcome = f"ringddp/welcome/{nonce}"
        if not wait_for_keys(store, [welcome], deadline):
            raise CollectiveTimeoutError(
                f"init: rank 0 did not answer rank {rank}'s hello (torchrun round agreement): "
                f"{timed_out(seconds)}", op="init", peer=0)
        round_ = int(store.get(welcome))
        store.set(f"ringddp/ready/{rank}", str(round_))
        return round_
    round_ = store.add("ringddp/rounds", 1)
    answered: dict[int, bytes] = {}
    waiting = set(range(1, size))
    pause = 0.0001
    while waiting:
        for r in sorted(waiting):
            if store.check([f"ringddp/hello/{r}"]):
                hello = store.get(f"ringddp/hello/{r}")
                if answered.get(r) != hello:
                    store.set(f"ringddp/welcome/{hello.decode()}", str(round_))
                    answered[r] = hello
            if store.check([f"ringddp/ready/{r}"]) and int(store.get(f"ringddp/ready/{r}")) == round_:
                waiting.discard(r)
        if waiting:
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"init: ranks {sorted(waiting)} did not join round {round_} of the torchrun job "
                    f"(this is rank 0 of {size}): {timed_out(seconds)}", op="init", peer=min(waiting))
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
    return round_


def _joined(text: str) -> str:
    """' (1 of 2 ranks joined)' from torch's 'N/M clients joined' message, if present."""
    import re

    m = re.search(r"(\d+)/(\d+) clients joined", text)
    return f" ({m.group(1)} of {m.group(2)} ranks joined)" if m else ""


def destroy_process_group() -> None:
    """Leave the default group and every subgroup; destroys torch's group if we created it."""
    global _world, _owns_torch_group
    for g in _subgroups:
        g.close()
    _subgroups.clear()
    if _world is not None:
        _world.close()
        _world = None
        trace.set_default_rank(None)
    if _owns_torch_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_torch_group = False


def bind_default_group(group: Group | None) -> contextvars.Token:
    """Make ``group`` the default group of the calling context only, over the process-wide one.

    The simulated backend (:mod:`collectives.sim`) runs many virtual ranks in one process, each in
    a context of its own: each binds its own world group, so that ``get_default_group()`` and
    every collective called without ``group=`` act on the calling virtual rank's group. Returns
    the token that :func:`unbind_default_group` takes to undo it.
    """
    return _bound_world.set(group)


def unbind_default_group(token: contextvars.Token) -> None:
    """Undo :func:`bind_default_group`."""
    _bound_world.reset(token)


def default_group() -> Group | None:
    """The default group of the calling context, or None before :func:`init_process_group`
    (:func:`get_default_group` raises instead)."""
    bound = _bound_world.get()
    return _world if bound is None else bound


def is_initialized() -> bool:
    return default_group() is not None


def group_count() -> int:
    """How many groups this rank is in: the default group (if any) plus its subgroups (a
    virtual rank's, :mod:`collectives.sim`, are kept by its world's process group)."""
    world = default_group()
    virtual = getattr(world.process_group, "subgroups", None) if world is not None else None
    return (world is not None) + len(_subgroups if virtual is None else virtual)


def get_default_group() -> Group:
    world = default_group()
    if world is None:
        raise RuntimeError("collectives are not initialised: call collectives.init_process_group() first")
    return world


#: torch's ``GroupMember.NON_GROUP_MEMBER``: what ``new_group`` gives a rank outside the group.
NON_GROUP_MEMBER: int = dist.GroupMember.NON_GROUP_MEMBER


class NonMember:
    """What :func:`new_group` returns on a rank that is not a member (torch returns
    ``GroupMember.NON_GROUP_MEMBER``, and this compares equal to it).

    Given one, collectives and ``isend``/``irecv``/``recv`` do nothing and warn as torch does
    (:func:`member`); ``get_rank``/``get_world_size`` answer -1; ``get_process_group_ranks``,
    ``get_group_rank`` and ``get_global_rank`` answer about the group (torch answers about the
    last group created, which is the same group when there is one); calls that need a member
    (``send``, ``send_object_list``, ``get_backend``, DDP, ...) raise ``ValueError``.

    Attributes:
        ranks: the global ranks of the group's members.
    """

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NonMember) or (type(other) is int and other == NON_GROUP_MEMBER)

    def __hash__(self) -> int:
        return hash(NON_GROUP_MEMBER)

    def __repr__(self) -> str:
        return f"NonMember(ranks={self.ranks})"


def is_non_member(group: object) -> bool:
    """Whether ``group`` says this rank is outside it (a :class:`NonMember` or torch's marker)."""
    return isinstance(group, NonMember) or (type(group) is int and group == NON_GROUP_MEMBER)


def get_group(group: Group | NonMember | None = None, op_name: str | None = None) -> Group:
    """``group``, or the default group when ``None``.

    Raises ``ValueError`` for a non-member handle (:class:`NonMember`: what needs a member cannot
    run on this rank) and ``TypeError`` for anything else that is not a :class:`Group`;
    ``op_name`` starts the message.
    """
    if is_non_member(group):
        of = f" of ranks {group.ranks}" if isinstance(group, NonMember) else ""
        raise ValueError(
            f"{op_name or 'get_group'}: Invalid process group specified: this rank ({get_default_group().rank()}) "
            f"is not a member of the group{of} (new_group returned a non-member handle here)"
        )
    g = get_default_group() if group is None else group
    if not isinstance(g, Group):
        raise TypeError(f"group must be a collectives Group (from new_group), got {type(g).__name__}")
    return g


def member(group: Group | NonMember | None, op_name: str) -> Group | None:
    """The group a call runs on, or ``None`` when this rank is not a member: then, as torch does,
    the call warns ``Running <op> on global rank <r> which does not belong to the given group.``
    and does nothing (the caller returns at once)."""
    if group is None:
        return get_default_group()
    if isinstance(group, Group):  # the common case first: one check
        return group
    if is_non_member(group):
        world = default_group()
        rank = -1 if world is None else world.rank()
        warnings.warn(f"Running {op_name} on global rank {rank} which does not belong to the given group.", stacklevel=3)
        return None
    return get_group(group)


def get_rank(group: Group | NonMember | None = None) -> int:
    """This process's rank in ``group`` (default: the default group); -1 if it is not a member."""
    return -1 if is_non_member(group) else get_group(group).rank()


def get_world_size(group: Group | NonMember | None = None) -> int:
    """The number of ranks in ``group`` (default: the default group); -1 if this rank is not a member."""
    return -1 if is_non_member(group) else get_group(group).size()


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
) -> Group | NonMember:
    """Create a group of a subset of ranks (every rank of the default group must call this).

    On ranks that are not members it returns a :class:`NonMember` (equal to torch's
    ``GroupMember.NON_GROUP_MEMBER``): collectives given it do nothing there, as in torch.

    A world whose process group makes its own subgroups (a ``new_subgroup(world, members,
    backend, seconds)`` method: the virtual ranks of :mod:`collectives.sim`, which have no torch
    process group) hands the call to it.
    """
    world = get_default_group()
    members = sorted(set(range(world.size()) if ranks is None else ranks))
    bad = [r for r in members if not 0 <= r < world.size()]
    if bad or not members:
        raise ValueError(f"new_group: ranks {list(ranks or [])} must be a non-empty subset of 0..{world.size() - 1}")
    name = resolve_backend(backend) if backend else world.backend
    seconds = timeout_seconds(timeout, world.timeout)
    virtual = getattr(world.process_group, "new_subgroup", None)
    if virtual is not None:
        return virtual(world, members, name, seconds)
    pg = dist.new_group(members, timeout=datetime.timedelta(seconds=seconds), backend="gloo")
    prefix = f"ringddp/group{next(_created)}/"  # every world rank calls new_group: same count everywhere
    if world.rank() not in members:
        return NonMember(members)
    store = dist.PrefixStore(prefix, world.store)
    hosts = [world.hosts[r] for r in members]
    g = Group(pg, members, name, seconds, f"group{members}", store=store, hosts=hosts)
    _subgroups.append(g)
    return g


def __getattr__(name: str) -> Group | None:
    """``collectives.group.WORLD``: the default group when read (``None`` before init), like torch's."""
    if name == "WORLD":
        return default_group()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
