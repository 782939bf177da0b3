"""Timeline tracing in the Chrome trace format (chrome://tracing, https://ui.perfetto.dev).

Wrap any code in :func:`tracing` and every collective it runs is recorded as a span with its
name, group, bytes and the thread it ran on; your own phases can be added with :func:`span`::

    with collectives.trace.tracing() as tracer:
        with collectives.trace.span("forward"):
            out = model(x)
        collectives.all_reduce(t)
    tracer.save("rank0.json")                    # or merge several ranks: chrome_trace([...])

Each rank is one "process" row (``pid`` = rank) and each thread a sub-row, so with asynchronous
collectives the communication thread's spans sit under the main thread's compute spans and the
overlap is visible at a glance. Timestamps come from ``time.perf_counter_ns`` (the system-wide
monotonic clock on Linux), so traces of processes on one machine line up without adjustment.

A caller can give the next collectives a more telling name with :func:`label` (DDP names each
bucket's all-reduce this way). When no tracer is active the cost is one global lookup per call.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator, Sequence

Event = dict[str, Any]

_active: "Tracer | None" = None
class _Labels(threading.local):
    text: str | None = None  # a class default: reading it on a fresh thread raises nothing


_labels = _Labels()


class Tracer:
    """Collects the spans of one process. Use through :func:`tracing`."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None:
        """Record a finished span (times from ``time.perf_counter_ns``)."""
        thread = threading.current_thread().name
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start_ns / 1000.0,
            "dur": max(end_ns - start_ns, 0) / 1000.0,
            "pid": self.rank,
            "args": args or {},
        }
        with self._lock:
            event["tid"] = self._tids.setdefault(thread, len(self._tids))
            self.events.append(event)

    def metadata(self) -> list[Event]:
        """Name rows: the process row ``rank N`` and one row per thread."""
        rows: list[Event] = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        rows += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": _row_name(thread)}}
            for thread, tid in self._tids.items()
        ]
        return rows

    def export(self) -> list[Event]:
        """This process's events, metadata first, as plain JSON-able dicts."""
        with self._lock:
            return self.metadata() + list(self.events)

    def save(self, path: str | os.PathLike) -> None:
        """Write this process's trace alone to ``path``."""
        write_chrome_trace(path, [self.export()])


def _row_name(thread: str) -> str:
    if thread == "MainThread":
        return "compute (main thread)"
    if thread.startswith("ringddp-"):
        return f"communication ({thread[len('ringddp-'):]})"
    return thread


_default_rank: int | None = None


def set_default_rank(rank: int | None) -> None:
    """The rank :func:`tracing` labels its row with when given none: set by
    ``collectives.init_process_group`` to the default group's rank, ``None`` again on destroy."""
    global _default_rank
    _default_rank = rank


@contextlib.contextmanager
def tracing(rank: int | None = None) -> Iterator[Tracer]:
    """Record spans until the block exits; yields the :class:`Tracer`.

    ``rank`` labels the process row (default: the default group's rank, else 0). Only one tracer
    is active per process; nesting returns the outer one.
    """
    global _active
    if _active is not None:
        yield _active
        return
    if rank is None:
        rank = 0 if _default_rank is None else _default_rank
    _active = Tracer(rank)
    try:
        yield _active
    finally:
        _active = None


def active() -> Tracer | None:
    """The current tracer, or None when not tracing."""
    return _active


@contextlib.contextmanager
def span(name: str, cat: str = "user", **args: Any) -> Iterator[None]:
    """Record the block as one span (no-op when not tracing)."""
    tracer = _active
    if tracer is None:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        tracer.add(name, cat, start, time.perf_counter_ns(), args)


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Name the collectives *submitted* by this thread inside the block (e.g. ``"bucket 3"``)."""
    previous = _labels.text
    _labels.text = text
    try:
        yield
    finally:
        _labels.text = previous


def current_label() -> str | None:
    """The label set by :func:`label` on this thread, if any."""
    return _labels.text


def chrome_trace(per_rank: Sequence[Sequence[Event]]) -> dict[str, Any]:
    """Merge the exported events of several ranks into one Chrome trace document (inputs untouched)."""
    events = [e for rank_events in per_rank for e in rank_events]
    starts = [e["ts"] for e in events if e.get("ph") == "X"]
    origin = min(starts) if starts else 0.0
    shifted = [{**e, "ts": round(e["ts"] - origin, 3)} if "ts" in e else e for e in events]  # timeline from 0
    return {"traceEvents": shifted, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, per_rank: Sequence[Sequence[Event]]) -> None:
    """Write the merged trace of several ranks to ``path`` (JSON)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(per_rank), f)
