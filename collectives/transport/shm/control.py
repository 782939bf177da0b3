"""The control block: where each counter of a segment lives, and the fence that orders them.

Every rank's segment starts with a control block of 64-byte lines of ``int64`` words (one
``memoryview`` cast to ``"q"`` per rank, :class:`~.segment.Segments`). Every word has one
writer and the counters among them only grow, so no one takes a lock: a reader compares a
counter with the value it waits for. The words of rank ``r``'s block, by index:

* ``SEQ``: ``r``'s step in the region algorithms (:class:`~.regions.Regions`);
  ``TAG``, ``TAG + 1``: the signature of the piece in each half of ``r``'s region.
* ``DONE``: pieces ``r`` has finished (it no longer reads anybody's half of them).
* ``SLEEPING``: the events (``ON_*``) ``r`` is asleep on, 0 when awake; ``ABANDONED``: set
  once when ``r`` found a mismatch, so its peers stop waiting; ``CPU``: the CPU on which ``r``'s
  caller last began a wait, plus one, in the low bits, and when (0: none yet; advisory, see
  :mod:`.waiting`).
* ``CALL`` .. ``CALL + 7``: the checked collective ``r`` runs: its number, then its
  :class:`~collectives.wire.Header` fields (a seqlock: the number is 0 while they change).
* From ``PAIR + s * PAIR``, four lines per sender ``s`` (the FIFO from ``s`` to ``r``): the
  head line (``s``'s head, which ``s`` writes; at ``+ BYTES`` ``s``'s all-to-all bytes to
  ``r`` and from ``r``; at ``+ CMA`` what ``s`` publishes for ``r`` to read: address, bytes,
  piece number + 1), the tail line (``r``'s tail, which ``r`` writes), then the total size and
  the tag (:func:`collectives.wire.tag`) of the message in each slot, a line each.

Ordering: data is written before the counter that announces it and read after the counter
was seen, with a :func:`fence` between. Python offers no memory barrier but a lock's
acquire/release: on x86 its locked instruction is a full barrier; on ARM the acquire/release
pair orders the accesses (untested here).
"""

from __future__ import annotations

import threading

LINE = 8  # int64 words per 64-byte cache line
SEQ, DONE, SLEEPING = 0, LINE, 2 * LINE  # region-algorithm step, pieces done, what a sleeper waits for
# SLEEPING holds a mask of the events that would end the owner's sleep (0: awake); a rank that
# publishes one of them writes a wake-up byte only to the peers sleeping on it
ON_MESSAGE, ON_STEP, ON_DONE, ON_CALL, ON_ANY = 1, 2, 4, 8, 15
ABANDONED = SLEEPING + 1  # set once by a rank that found a mismatch: its peers stop waiting
CPU = SLEEPING + 2  # where and when the owner's caller last began a wait (.waiting; read without a fence)
TAG = SEQ + 1  # two words after the step: the signature of the piece in each half
CALL = 3 * LINE  # the checked collective under way: its number, then its wire.Header fields
PAIR = 4 * LINE  # per sender: head line, tail line, slot-size line, slot-tag line
BYTES = 1  # in the sender's head line: its all-to-all bytes to the owner, and from the owner
CMA = 3  # then the tensor it publishes to the owner (publish): address, bytes, piece number + 1
MAX_SLOTS = LINE  # a slot-size or slot-tag line holds one word per slot
PAGE = 4096

_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: a lock's atomic acquire/release (Python has no other)."""
    _FENCE.acquire()
    _FENCE.release()
