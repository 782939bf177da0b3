"""Segments: unnamed, fully reserved files of shared memory, and every rank's as mapped here.

A rank creates its segment in ``RINGDDP_SHM_DIR`` (default ``/dev/shm``) as an *unnamed* file
(``O_TMPFILE``; where that is unsupported, a uniquely named file unlinked right after creation),
so no name ever lingers there, whatever happens to the processes, and two jobs cannot collide.
``os.posix_fallocate`` reserves its space at once: an ``ftruncate``d file would die with SIGBUS
on first touch when the file system is full; this way a file system too small is an error at
set-up naming the size needed and the fixes. The peers receive the file descriptor (over a unix
socket, :mod:`.rendezvous`) and map it ``MAP_SHARED | MAP_POPULATE`` (no
``multiprocessing.SharedMemory``, whose resource tracker would unlink segments it does not own).

A segment holds, in this order: the control block (:mod:`.control`), one FIFO per peer for
messages *to* its owner (``slots`` slots of ``slot_bytes``, :mod:`.fifo`), and the owner's
*region*, two halves the shared-memory algorithms fill and every peer reads (:mod:`.regions`).
"""

from __future__ import annotations

import errno
import mmap
import os

import torch

from .config import ShmConfig, ShmUnavailableError


def create(directory: str, size: int, uid: str, rank: int) -> int:
    """An unnamed, fully reserved file of ``size`` bytes in ``directory``; returns its fd.

    ``uid`` (the job) and ``rank`` name the file for the moment it exists where ``O_TMPFILE``
    does not. Raises :class:`ShmUnavailableError` when the file system is too small.
    """
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):  # no O_TMPFILE here: a unique name, unlinked at once
        path = os.path.join(directory, f"ringddp-{uid}-{rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        try:
            st = os.statvfs(directory)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB"
        except OSError:
            free = "free space unknown"
        raise ShmUnavailableError(
            f"shm: {directory} is too small: rank {rank} needs {size} bytes "
            f"({size / 2**20:.1f} MiB; {free}). Fix: enlarge it (docker run --shm-size=1g, or "
            f"mount -o remount,size=1G {directory}), point RINGDDP_SHM_DIR at a larger tmpfs, shrink "
            "RINGDDP_SHM_REGION_BYTES / RINGDDP_SHM_SLOT_BYTES, or use backend='p2p'"
        ) from exc
    return fd


def map_file(fd: int, size: int) -> mmap.mmap:
    """Map the segment ``fd`` (a peer's, received over a socket), checking it has ``size`` bytes."""
    if os.fstat(fd).st_size != size:
        raise ConnectionError(f"peer segment has {os.fstat(fd).st_size} bytes, expected {size}")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class Segments:
    """Every rank's segment as mapped in this process (index = rank), and where its parts start.

    Attributes:
        ctrl: each rank's control block as ``int64`` words (:mod:`.control`).
        data: each rank's whole segment as ``uint8``.
        fifo_start: byte offset of the first FIFO slot; region_start: of the region.

    The other parts keep these lists themselves (one lookup at construction, none per access in
    their loops), so :meth:`close` empties them in place.
    """

    def __init__(self, maps: list[mmap.mmap], config: ShmConfig):
        n = len(maps)
        self._maps = maps
        self.ctrl = [memoryview(m).cast("q") for m in maps]
        self.data = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]  # type: ignore[arg-type]
        self.fifo_start = config.control_bytes(n)
        self.region_start = self.fifo_start + (n - 1) * config.slots * config.slot_bytes

    def adopt(self, maps: list[mmap.mmap]) -> None:
        """Keep more mappings (symmetric memory, :meth:`.regions.Regions.allocate`) until :meth:`close`."""
        self._maps.extend(maps)

    def close(self) -> None:
        """Drop every view of the segments (``ctrl`` and ``data`` are emptied in place, for every
        holder) and unmap them; a mapping a caller still views stays until that view goes."""
        self.ctrl.clear()
        self.data.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
        self._maps.clear()
