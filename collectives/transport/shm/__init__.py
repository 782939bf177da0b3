"""Shared-memory transport: the ranks of one host exchange bytes through mapped memory.

On one host a socket transport copies every byte user → kernel → user and wakes I/O threads;
here a sender copies straight into memory the receiver has mapped, and the receiver copies out.

Every rank creates one *segment*, an unnamed file in ``RINGDDP_SHM_DIR`` (default ``/dev/shm``)
whose fd it hands to every peer over a unix socket, so no name ever lingers there and two jobs
cannot collide. A segment holds a control block of growing ``int64`` counters, a FIFO per peer
for messages *to* its owner, and the owner's *region*, two halves the shared-memory algorithms
(``collectives/shm_algorithms.py``) fill and every peer reads directly. Size per rank:
``region_bytes + (n - 1) · slots · slot_bytes`` plus 4 KiB, by default 8 MiB + (n - 1) · 2 MiB
(10 MiB per rank at 2 ranks, 14 MiB at 4, 56 MiB for a 4-rank job). ``RINGDDP_SHM_REGION_BYTES``,
``RINGDDP_SHM_SLOT_BYTES`` (bytes, or ``8M``, ``512K``), ``RINGDDP_SHM_SLOTS`` change it and
``RINGDDP_SHM_CMA=0`` turns single-copy reads off (rank 0's values are used by every rank);
``RINGDDP_SHM_SPIN_US`` sets the spin before a caller's wait sleeps (a communication thread's is
fixed and short, see ``waiting.py``). A bad value raises a ValueError naming the variable; a file
system too small fails on every rank with :class:`ShmUnavailableError` naming the size needed and
the fixes.

One concept per file, lowest first (each imports only files listed before it):

``control.py``
    the control block: which word holds which counter; the fence that orders them.
``config.py``
    :class:`ShmConfig` (sizes, ``RINGDDP_SHM_*``) and :class:`ShmUnavailableError`.
``segment.py``
    creating a segment (``O_TMPFILE``, ``posix_fallocate``), mapping one, and every rank's
    segment as mapped here (:class:`~.segment.Segments`).
``rendezvous.py``
    agreeing through the store (job id, rank 0's sizes, who succeeded) and passing segment fds
    over abstract unix sockets (``SCM_RIGHTS``).
``waiting.py``
    spin-then-sleep waits, wake-ups through the sockets, dead peers (EOF) and deadlines.
``wirecheck.py``
    whether the ranks run the same call (:mod:`collectives.wire` without a message of its own),
    and abandoning a call on any mismatch.
``fifo.py``
    messages: posted sends and receives moved chunk by chunk through the slots.
``cma.py``
    single-copy reads with ``process_vm_readv``: the set-up probe, and publish, read, wait for the
    readers, withdraw.
``regions.py``
    :class:`~collectives.transport.base.SharedRegions`: pieces, halves, steps, signatures, and
    symmetric memory.
``transport.py``
    :class:`ShmTransport`, the composition of the above: set-up on the first collective, the
    fallback to p2p, and the operation bracket around each collective (wire check, withdrawal).
"""

from .config import ShmConfig, ShmUnavailableError
from .transport import ShmTransport

__all__ = ["ShmConfig", "ShmTransport", "ShmUnavailableError"]
