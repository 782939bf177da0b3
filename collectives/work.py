"""Async handles and the per-group communication queue.

Point-to-point traffic has no order of its own: if rank 0 starts all-reduce A then B while rank 1
starts B then A, their messages pair up wrongly. So every collective of a group, asynchronous or
not, goes through one FIFO queue and runs in program order on every rank.

An ``async_op=True`` call is queued and runs on the group's communication thread; it returns a
:class:`Work` handle at once. A synchronous call runs on the caller's thread when nothing is
queued (no thread hop on the common path), and otherwise queues behind the pending work and waits.

One thread per group at a time. The queue orders one thread's calls; two threads calling
collectives on the same group concurrently would be ordered by whichever thread gets there first,
which differs from rank to rank, so the ranks would pair different collectives (mixing each
other's data). :meth:`Executor.submit` refuses, with a ``RuntimeError`` saying what to do, a call
from a second thread while another thread's calls are still queued or running. Use a group per
thread (``new_group``), or hand the calls to one thread. The refusal is local, and the ranks may
refuse different threads (each lets run whichever came first); what keeps that from pairing one
thread's call with another's is the wire check, whose header names the issuing thread
(:mod:`collectives.wire`, *Threads*): such a pair is a mismatch, and the group breaks on both
ranks.

The communication thread runs at a lower scheduling priority than the process (``nice`` + 5 by
default, ``$RINGDDP_COMM_NICE`` to change, 0 to keep the process's), as ``SCHED_BATCH`` (from
the normal policy only; a real-time or idle one is kept): when it and the caller's compute want
the same core, the compute goes first, and waking it (queueing a call) does not preempt the
caller. Its work still runs whenever the compute blocks or leaves a core idle; what changes is
who waits when both are runnable. Without it, a caller that released the GIL for a moment
(torch's own ``dist.all_reduce`` does, inside ``tensor.is_complex()``, and so does making a
``dist.Work``) while the thread was busy, or had just been woken onto its core, sometimes waited
out one of the thread's torch ops (measured in ``ddp.bench``: returning from an async 4 KiB
all-reduce behind a 16 MiB one took 18-48 µs or 170-190 µs, run to run; niced, 17-28 µs in
every run, steps unchanged; with nothing in flight, niced only, 27-54 µs medians; also
``SCHED_BATCH``, 18-33 µs, steps unchanged: docs/DESIGN.md).

Future callbacks may issue collectives, and wait for them. Where such a collective falls in
the group's order depends on when the callback was attached (``then``):

* **before the work completed** (the usual case: ``work.get_future().then(cb)`` right after the
  async call): the callback runs on the thread that completes the work, usually the
  communication thread, right after the collective; a collective issued there runs at once,
  inline, before the queue moves on (were it queued, the thread would wait on work queued behind
  itself). It follows the collective whose completion ran the callback, whatever the caller's
  thread has queued meanwhile.
* **after the work completed**: torch runs the callback at once, on the attaching thread, and
  its collective takes that thread's next place in the queue, behind anything the thread issued
  on the group since the work.

Both give the same order on every rank when nothing is issued on the group between the work and
attaching its callback (attach it right after the call, as torch's DDP comm hooks and PowerSGD
do); then it does not matter that the work finished before the attachment on some ranks and after
it on others. Issue a collective in between and the ranks may order the chained call differently:
the wire check then raises on both sides if the two calls differ in anything it compares, and
pairs them silently if they are alike. A chained collective carries the issuing thread of the
work whose completion ran it (:func:`current_issuer`), so in either case it counts as the
caller's thread's (see :mod:`collectives.wire`, *Threads*).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
from typing import Callable

import torch

from .errors import CollectiveTimeoutError, timed_out, timeout_seconds

log = logging.getLogger(__name__)

class _Role(threading.local):
    # a class default: getattr with a default on a missing attribute raises and catches an
    # AttributeError inside, ~0.3 µs warm and ~8 µs when the call comes with cold caches
    background = False
    issuer = 0  # on a communication thread: the wire's thread code of the item it runs


_thread_role = _Role()


#: how much lower (``nice`` steps) a communication thread runs than its process, by default.
COMM_NICE = 5


def comm_nice() -> int:
    """``$RINGDDP_COMM_NICE`` (0 to 19), else :data:`COMM_NICE`; anything else raises ``ValueError``."""
    text = os.environ.get("RINGDDP_COMM_NICE")
    if text is None:
        return COMM_NICE
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"RINGDDP_COMM_NICE must be an integer from 0 to 19, got {text!r}")
    return value


def _lower_priority(steps: int) -> None:
    """Raise this thread's nice value by ``steps`` (Linux: per thread; never above 19) and, if it
    runs under the normal policy, make it ``SCHED_BATCH``: when woken, it waits for a free core
    or the scheduler's tick instead of preempting the thread on its core (see the module
    docstring). Other policies are kept: a real-time process's thread would otherwise drop below
    its compute, a ``SCHED_IDLE`` one rise above it."""
    if steps == 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()

    def nice() -> None:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))

    def batch() -> None:
        if os.sched_getscheduler(tid) == os.SCHED_OTHER:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))

    for change in (nice, batch) if hasattr(os, "SCHED_BATCH") else (nice,):
        try:  # each on its own, so a sandbox refusing one (even the policy's read) keeps the other
            change()
        except OSError as exc:  # lowering one's own priority is always allowed; a sandbox may still refuse
            log.debug("communication thread keeps its priority or policy: %s", exc)


def _thread_name(ident: int) -> str:
    """The name of the live thread ``ident`` (for error messages)."""
    return next((t.name for t in threading.enumerate() if t.ident == ident), f"<thread {ident}>")


def on_communication_thread() -> bool:
    """Whether this thread is a group's communication thread (it runs async collectives in the
    background, so its waits should give the core to the caller's compute soon)."""
    return _thread_role.background


def current_issuer() -> int:
    """On a communication thread: the ``issuer`` given with the item it runs (and completes, so
    also inside the completion's future callbacks); 0 elsewhere."""
    return _thread_role.issuer


class Work:
    """Handle of a collective started with ``async_op=True`` (like torch's ``Work``).

    Args:
        name: the collective's name, for messages.
        result: the tensors the collective writes (``get_future().value()``), like torch's
            ``Work.result()``; ``None`` for collectives that produce nothing.
    """

    def __init__(self, name: str, result: list[torch.Tensor] | None = None):
        self.name = name
        self._result = [] if result is None else list(result)
        self._done = False
        self._ready = threading.Lock()  # held until the work is done: waiting is acquiring it
        self._ready.acquire()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._future: torch.futures.Future | None = None
        self._signal: torch.futures.Future | None = None  # completed (with None) when the work is

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the collective finished; re-raise its error if it failed.

        ``timeout`` (seconds or timedelta) bounds this wait only; the collective's own
        communication deadline (the group's timeout) applies regardless.
        """
        if not self._done:
            seconds = timeout_seconds(timeout)
            if not self._ready.acquire(timeout=-1 if seconds is None else seconds):  # releases the GIL
                raise CollectiveTimeoutError(f"{self.name}: Work.wait: {timed_out(seconds)}", op=self.name)
            self._ready.release()  # for the next waiter
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The tensors this collective writes (valid once it completed)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed when the collective finishes, as torch's.

        Its value is :meth:`result` (so ``fut.value()[0]`` is the reduced tensor of an
        all-reduce). A failure fails the future itself, as torch's C++ side sees it: C++
        consumers (torch's DDP reducer, ``torch.futures.collect_all``, a ``Work`` made from the
        future) see an error, never a value; in Python ``fut.wait()``/``fut.value()`` raise a
        ``RuntimeError`` whose message is the collective's error (its type and text), as for an
        error raised in any ``then`` callback. (``Future.set_exception`` would not do: it stores
        the exception as the future's *value*, which C++ reads as success.) :meth:`wait` raises
        the error itself. Callbacks added with ``then`` run on the thread that completes the
        work, usually the group's communication thread; they may issue collectives and wait for
        them (see the module docstring). Every call returns the same future.
        """
        with self._lock:
            if self._future is not None:
                return self._future
            signal = self._signal = torch.futures.Future()
            future = self._future = signal.then(self._outcome)
            done = self._done
        if done:  # finished before anyone asked: complete here (else finish does)
            signal.set_result(None)
        return future

    def _outcome(self, _: torch.futures.Future) -> list[torch.Tensor]:
        """The future's value, or (raised inside ``then``) its error as C++ sees errors."""
        if self._error is not None:
            raise self._error
        return self._result

    def finish(self, error: BaseException | None) -> None:
        """Complete the handle: ``error`` is the collective's failure, or ``None``. Called once, by
        the group's queue when the collective has run (not by users)."""
        with self._lock:
            self._error = error
            self._done = True
            signal = self._signal
        self._ready.release()
        if signal is not None:  # outside the lock: callbacks may call get_future() again
            signal.set_result(None)


class Executor:
    """Runs a group's collectives one at a time, in submission order."""

    def __init__(self, name: str):
        self._name = name
        self._queue: collections.deque[tuple[Work, Callable[[], None], int]] = collections.deque()
        self._mutex = threading.Lock()  # guards the fields below
        self._busy = False
        # The communication thread sleeps by acquiring _bell, held while it is awake; whoever
        # queues work for a sleeping thread releases it once (_ring). A lock rather than a
        # threading.Condition: single C calls instead of the condition's Python frames (a queued
        # call back to back 1.16 -> 0.89 µs; waking a sleeping thread stays ~3 µs, its system call).
        self._bell = threading.Lock()
        self._bell.acquire()
        self._sleeping = False
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None  # its ident: compared on every call, cheaper than current_thread()
        self._closed = False
        self._owner: int | None = None  # ident of the thread whose calls are queued or running
        self._nice = comm_nice()  # read here, on the caller's thread: a bad value raises to the caller

    def submit(self, work: Work, fn: Callable[[], None], async_op: bool, issuer: int = 0) -> Work:
        """Run ``fn`` in queue order; ``work`` completes when it has run (``async_op``: on the
        communication thread, and this returns at once). Called from the communication thread
        itself (a future callback), ``fn`` runs at once: see the module docstring. ``issuer``:
        what :func:`current_issuer` answers on the communication thread while it runs ``fn`` and
        completes ``work``."""
        if threading.get_ident() == self._thread_id:
            try:
                self._inline(fn, work, nested=True)
            except BaseException:
                if not async_op:
                    raise  # an async call's error is the handle's, as when it is queued
            return work
        if not async_op and self.claim(work.name):
            self._inline(fn, work)
            return work
        self._enqueue(work, fn, issuer)
        if not async_op:
            work.wait()
        return work

    def call(self, name: str, fn: Callable[[], None], issuer: int = 0) -> None:
        """Run ``fn`` synchronously in queue order: on this thread when nothing is queued (no
        handle, no thread hop), else behind the pending work."""
        if threading.get_ident() == self._thread_id:  # a future callback: now (module docstring)
            self._inline(fn, None, nested=True)
        elif self.claim(name):
            self._inline(fn, None)
        else:
            work = Work(name)
            self._enqueue(work, fn, issuer)
            work.wait()

    def claim(self, name: str) -> bool:
        """Claim the queue for a call run inline on this thread (not the communication thread)
        if nothing is queued or running, and return True (then :meth:`release` it when the
        call ends); False when the call must queue."""
        with self._mutex:
            if self._closed:
                raise RuntimeError(f"{name}: the group was destroyed")
            if self._busy or self._queue:
                self._check_thread(name)
                return False
            self._owner = threading.get_ident()  # idle: any thread may claim it (_check_thread)
            self._busy = True
            return True

    def _inline(self, fn: Callable[[], None], work: Work | None, nested: bool = False) -> None:
        """Run ``fn`` on this thread; ``nested``: inside the communication thread's current item,
        which keeps the queue claimed."""
        try:
            fn()
        except BaseException as exc:
            if work is not None:
                work.finish(exc)
            raise
        else:
            if work is not None:
                work.finish(None)
        finally:
            if not nested:
                self.release()

    def release(self) -> None:
        """End an inline call (:meth:`claim`): the queue's next item may run."""
        with self._mutex:
            self._busy = False
            if self._queue:
                self._ring()

    def _enqueue(self, work: Work, fn: Callable[[], None], issuer: int) -> None:
        with self._mutex:
            if self._closed:
                raise RuntimeError(f"{work.name}: the group was destroyed")
            self._check_thread(work.name)
            self._queue.append((work, fn, issuer))
            self._ensure_thread()
            self._ring()

    def _ring(self) -> None:
        """Wake the communication thread if it sleeps (a system call: only then). Hold _mutex."""
        if self._sleeping:
            self._sleeping = False
            self._bell.release()

    def _check_thread(self, op_name: str) -> None:
        """Refuse a call from a second thread while another thread's calls are pending (see the module doc)."""
        me = threading.get_ident()
        if me == self._thread_id:  # a Future callback chaining a collective: ordered by the queue itself
            return
        if (self._busy or self._queue) and self._owner is not None and self._owner != me:
            raise RuntimeError(
                f"{op_name}: thread {_thread_name(me)!r} called a collective on group {self._name} while thread "
                f"{_thread_name(self._owner)!r} still has collectives queued or running on it. Ranks would pair the "
                "two threads' calls in different orders and mix their data. Issue a group's collectives "
                "from one thread (or wait for them first), or give each thread its own group (new_group)"
            )
        self._owner = me

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"ringddp-{self._name}", daemon=True)
            self._thread.start()
            self._thread_id = self._thread.ident  # set before the thread can take work: we hold the lock

    def _loop(self) -> None:
        _thread_role.background = True
        _lower_priority(self._nice)
        while True:
            with self._mutex:
                sleep = not self._closed and (self._busy or not self._queue)
                if sleep:
                    self._sleeping = True  # then wait for _ring, outside the lock
                elif not self._queue:
                    return  # closed, and nothing left
                else:
                    work, fn, _thread_role.issuer = self._queue.popleft()
                    self._busy = True
            if sleep:
                self._bell.acquire()  # returns at once if _ring came first
                continue
            try:
                fn()
                work.finish(None)
            except BaseException as exc:  # delivered to whoever waits on the handle
                log.debug("%s failed on the communication thread: %s", work.name, exc)
                work.finish(exc)
            finally:
                with self._mutex:
                    self._busy = False

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._mutex:
            self._closed = True
            self._ring()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
