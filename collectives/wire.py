"""The wire check: every collective says what it is, so mismatched calls fail cleanly on every rank.

Point-to-point algorithms trust that all ranks issue the same collective with matching
arguments. When they do not, gloo pairs the messages anyway: bytes of the same size land in the
wrong place (float32 read as int32, SUM combined with MAX — a silent wrong answer), and a message
of another size makes gloo *abort the receiving process* (``Received data size doesn't match``).

Two mechanisms, in the p2p (gloo) transport:

1. **Tags that say what a payload message is** (every level, free). Every payload message of a
   collective is tagged with a hash of (sequence number, header, message bytes), where the
   header (:class:`Header`) is what the rank was asked to do: collective, dtype, element count,
   reduce op, root, algorithm, a hash of the group's :class:`~collectives.tuning.Tuning`, the
   thread that issued the call (:func:`thread_code`), and for all-to-all the bytes for each peer. A receive only ever matches a send of the same
   collective, arguments and size: a mismatched send is never paired, so it never aborts the
   receiver and never lands in its buffer. It costs one integer per message, nothing on the wire.
   Alone (``RINGDDP_DEBUG=OFF``) a mismatch then leaves the ranks waiting for messages that never
   come: a :class:`~collectives.errors.CollectiveTimeoutError` at the group's deadline.
2. **A header exchange** (``CHECK``, the default, and ``DETAIL``). At the start of each
   collective a rank posts its header (:data:`FIELDS` int64s) to both ring neighbours and a
   receive for theirs, on a slot of their own with a fixed size (they always pair up without
   error). The first wait of the collective (or its end, if it moved nothing) waits for the
   neighbours' headers and compares; on a difference it raises
   :class:`~collectives.errors.CollectiveError` describing both calls. Payload receives are
   posted at once (the tags make that safe), so the header's trip overlaps the payload's instead
   of preceding it; what it costs is one more small message each way per collective. If every
   rank agrees with its ring neighbours, all ranks agree, so every mismatch is found: the
   neighbours of a deviating rank and that rank raise at once, ranks further away when their
   payload waits fail (the raising ranks' processes stop, or the deadline).

**Threads.** Ranks pair a group's collectives by their order, so two threads issuing collectives
on one group at once would pair thread A's call on one rank with thread B's on another (a
silent wrong sum when both calls look alike). The header therefore names the issuing thread:
``0`` for the thread that created the group, else a hash of the thread's name (threads created
by C++, such as autograd's, share one code); a collective issued from a future callback carries
the code of the thread that issued the collective whose completion ran it. Two threads of one
rank differ in name, so a mispairing is a mismatch like any other. The price: a thread other
than the group's creator that issues collectives must have the same name on every rank (threads
named per rank, ``f"worker-{rank}"``, are refused; Python's default names match when the ranks
start their threads in the same order).

A transport that owns its wire (the shared-memory transport) carries the same
:func:`tag` in its slot header and compares it on arrival, for free. NCCL has neither
tags nor a side channel in its send/receive, so the NCCL transport ignores headers (use
``RINGDDP_DEBUG=DETAIL``, whose all-gathered signature runs over gloo).

The public API builds the :class:`Header` of each call (:func:`header`) and makes it current for
the transport with :func:`swap` around the collective's body; a transport reads it in
:meth:`~collectives.transport.base.Transport.operation` with :func:`current`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import zlib
from typing import Sequence

import numpy
import torch

from . import debug
from .ops import SUPPORTED_DTYPES, ReduceOp
from .tuning import ALL_REDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS, Tuning

#: int64 fields of a header message.
FIELDS = 10
#: gloo slot (tag) of header messages; collective payload tags are 2 .. HEADER_TAG - 1, unchecked
#: traffic 0, user point-to-point 1 (``collectives/mailbox.py``).
HEADER_TAG = (1 << 31) - 1
_NAMES = ("sequence", "collective", "dtype", "numel", "op", "root", "algorithm", "tuning", "send bytes", "receive bytes")


@functools.lru_cache(maxsize=1024)
def _code(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


#: The calls that carry a header: collectives, where every rank of the group takes part.
#: Point-to-point calls (send / recv) involve two ranks only and go unchecked.
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "gather", "all_to_all", "all_to_all_single", "barrier",
)  # fmt: skip
_KNOWN = {
    _code(s): s
    for s in (
        *COLLECTIVES, "-", *(str(d) for d in SUPPORTED_DTYPES), *(o.name for o in ReduceOp),
        *ALL_REDUCE_ALGORITHMS, *BROADCAST_ALGORITHMS, *REDUCE_ALGORITHMS,
    )
}


@dataclasses.dataclass(frozen=True)
class Header:
    """What one rank is about to do: compared with the ring neighbours before payload is trusted.

    ``numel`` is -1 where ranks may legitimately differ (all-to-all, see
    :func:`collectives.debug.signature`); there ``sends`` / ``recvs`` give the bytes for each peer.
    """

    collective: str
    dtype: str
    numel: int
    op: str
    root: int
    algorithm: str
    tuning: int
    sends: tuple[int, ...] | None = None
    recvs: tuple[int, ...] | None = None
    exchange: bool = True  #: exchange headers (CHECK, DETAIL); at OFF only the tags are used

    thread: int = 0  #: the issuing thread (:func:`thread_code`); shares a word with ``tuning``

    @functools.cached_property
    def _fields(self) -> tuple[int, ...]:
        context = self.tuning | self.thread << 32  # tuning hash low, thread code high (31 bits)
        return (_code(self.collective), _code(self.dtype), self.numel, _code(self.op), self.root, _code(self.algorithm), context)

    def fields(self, seq: int, peer: int) -> list[int]:
        """The :data:`FIELDS` numbers of the header message for ``peer``."""
        pair = (self.sends[peer], self.recvs[peer]) if self.sends is not None and self.recvs is not None else (-1, -1)
        return [seq, *self._fields, *pair]

    def encode(self, seq: int, peer: int) -> torch.Tensor:
        """The header message for ``peer``."""
        return torch.from_numpy(numpy.array(self.fields(seq, peer), dtype=numpy.int64))

    @functools.cached_property
    def _hash(self) -> int:
        return _code(str(self._fields))

    def tag_base(self, seq: int) -> int:
        """A hash of this header as collective number ``seq``; see :func:`tag`."""
        return self._hash ^ (seq * 0x9E3779B1 & 0xFFFFFFFF)


def tag(base: int, nbytes: int) -> int:
    """Tag of a payload message of ``nbytes`` in the collective whose :meth:`Header.tag_base` is ``base``."""
    return (base + nbytes * 2654435761) % (HEADER_TAG - 2) + 2


_LOW = 0xFFFFFFFF
_THREADS: dict[int, str] = {}  # code -> thread name, for the names this process has coded
_FOREIGN = "<a thread started outside Python>"
_DUMMY = re.compile(r"Dummy-\d+")  # what threading names a thread it did not start


def thread_code(name: str) -> int:
    """The header's code for collectives issued by the thread called ``name``: a 31-bit hash of
    the name; one code for every thread started outside Python (``Dummy-N``: autograd's device
    threads, whose numbers depend on how many threads a process made before). Never 0, the
    creator's code (see the module docstring)."""
    if _DUMMY.fullmatch(name):
        name = _FOREIGN
    code = (_code(name) & 0x7FFFFFFF) or 1
    _THREADS[code] = name
    return code


def _from_thread(code: int) -> str:
    if code == 0:
        return "from the thread that created the group"
    return f"from thread {_THREADS.get(code, f'<unknown, code {code:#x}>')!r}"


def compare(mine: torch.Tensor | Sequence[int], theirs: torch.Tensor | Sequence[int]) -> list[str]:
    """Names of the fields in which two header messages (as sent to each other) disagree."""
    mine = mine.tolist() if isinstance(mine, torch.Tensor) else list(mine)
    theirs = theirs.tolist() if isinstance(theirs, torch.Tensor) else list(theirs)
    if mine[:8] == theirs[:8] and mine[8] == theirs[9] and mine[9] == theirs[8]:
        return []
    diffs = [_NAMES[i] for i in range(7) if mine[i] != theirs[i]]
    if mine[7] & _LOW != theirs[7] & _LOW:
        diffs.append("tuning")
    if mine[7] >> 32 != theirs[7] >> 32:
        diffs.append("thread")
    # all-to-all: what I send them must be what they expect from me, and vice versa
    if mine[8] != theirs[9] or mine[9] != theirs[8]:
        diffs.append("bytes exchanged")
    return diffs


def describe(message: torch.Tensor, thread: bool = False) -> str:
    """A header message in words: ``all_reduce(dtype=torch.float32, numel=8, op=SUM) as collective
    #3``; the issuing thread too when ``thread`` is set or it is not the group's creator."""
    seq, coll, dtype, numel, op, root, alg, context, send, recv = message.tolist()
    name = lambda code: _KNOWN.get(code, f"<{code:#x}>")  # noqa: E731
    parts = [f"dtype={name(dtype)}"] if name(dtype) != "-" else []
    parts += [f"numel={numel}"] if numel >= 0 and name(dtype) != "-" else [f"sends {send} bytes, expects {recv} bytes"] if send >= 0 else []
    parts += [f"op={name(op)}"] if name(op) != "-" else []
    parts += [f"root={root}"] if root >= 0 else []
    parts += [f"algorithm={name(alg)}"] if name(alg) not in ("-", "auto") else []
    by = f" {_from_thread(context >> 32)}" if thread or context >> 32 else ""
    return f"{name(coll)}({', '.join(parts)}){by} as collective #{seq}"


def disagreement(rank: int, mine: torch.Tensor | Sequence[int], peer: int, theirs: torch.Tensor | Sequence[int]) -> str:
    """Both calls of a mismatch in words, for the transports' errors: ``this rank (0) called ...;
    rank 1 called ...; they differ in ...`` and, when the threads differ, what to do about it."""
    mine, theirs = torch.as_tensor(mine), torch.as_tensor(theirs)
    diffs = compare(mine, theirs)
    thread = "thread" in diffs
    text = (f"this rank ({rank}) called {describe(mine, thread)}; rank {peer} called {describe(theirs, thread)}; "
            f"they differ in {', '.join(diffs)}")
    if thread:
        text += (" (the ranks paired calls of different threads: issue a group's collectives from one thread, "
                 "or give each thread its own group; a thread other than the group's creator must have the same "
                 "name on every rank)")
    return text


def header(
    signature: debug.Signature,
    tuning: Tuning,
    algorithm: str = "-",
    sizes: tuple[Sequence[int], Sequence[int]] | None = None,
    level: str | None = None,
    thread: int = 0,
) -> Header | None:
    """The header of a call (None for calls that are not :data:`COLLECTIVES`).

    At level ``OFF`` (``level``, default: the level in force, :func:`collectives.debug.level`) the header only makes the tags
    (``exchange=False``).

    ``sizes``: for all-to-all, (bytes sent to, bytes expected from) each group rank.
    ``thread``: the issuing thread's :func:`thread_code` (0: the group's creator).
    """
    if signature.name not in COLLECTIVES:
        return None
    sends, recvs = (tuple(sizes[0]), tuple(sizes[1])) if sizes is not None else (None, None)
    exchange = (debug.level() if level is None else level) != "OFF"
    return _header(signature.name, signature.dtype, signature.numel, signature.op, signature.root, algorithm,
                   tuning.key(), sends, recvs, exchange, thread)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _header(name: str, dtype: str, numel: int, op: str, root: int, algorithm: str, tuning: tuple,
            sends: tuple[int, ...] | None, recvs: tuple[int, ...] | None, exchange: bool, thread: int) -> Header:  # fmt: skip
    """Headers are immutable: a training loop's repeated calls reuse one."""
    return Header(name, dtype, numel, op, root, algorithm, _code(str(tuning)), sends, recvs, exchange, thread)


class _Current(threading.local):
    header: "Header | None" = None  # a class default: no AttributeError raised on a fresh thread


_current = _Current()


def swap(h: Header | None) -> Header | None:
    """Make ``h`` the header of the collective this thread runs next; returns the previous one
    (restore it when the collective ends)."""
    previous = _current.header
    _current.header = h
    return previous


def current() -> Header | None:
    """The header of the collective this thread is running, if it is checked."""
    return _current.header
