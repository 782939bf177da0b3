"""Single-copy reads (cross-memory attach): a reader copies straight out of the owner's tensor.

Through a region every byte is copied twice: the owner into its region, the reader out of it.
Linux's ``process_vm_readv`` lets the reader copy straight out of the owner's private tensor:
one copy, done by the kernel. The owner writes (address, bytes, piece number + 1) of the tensor
a reader may read into the reader's control block, in its pair's head line (:mod:`.control`);
a step makes it visible; the reader checks the bytes and piece number against what it expects
and reads; the owner then waits until its readers have ended the piece, since its tensor must
stay untouched until then. A collective that fails on the owner withdraws the descriptors
instead (piece number -1): a reader checks its descriptor again after reading, so one that was
merely slow raises naming the owner instead of returning bytes that may have changed.

Whether this works (same user, no Yama ``ptrace_scope`` above 0, no seccomp filter, one pid
namespace) is probed at set-up (:func:`probe_single_copy`): every rank reads a random word from each peer,
and all ranks agree through the store. Else, or with ``RINGDDP_SHM_CMA=0`` (rank 0's value
counts), it is off on every rank, logged once at INFO, and the algorithms copy through the
regions. The process's security settings are never changed (no ``PR_SET_PTRACER``).
"""

from __future__ import annotations

import array
import ctypes
import errno
import functools
import logging
import os
import secrets
from typing import Callable, Iterable, Mapping

import torch

from ...errors import CollectiveError
from ..base import Peer, Transport
from .control import CMA, DONE, ON_DONE, PAIR, fence
from .rendezvous import Rendezvous
from .segment import Segments
from .waiting import Waiter, nobody
from .wirecheck import WireCheck

log = logging.getLogger(__name__)


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


def read_memory(pid: int, local: int, remote: int, nbytes: int) -> None:
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


def probe_single_copy(rendezvous: Rendezvous, enabled: bool, deadline: float) -> dict[Peer, int] | None:
    """The peers' pids if every rank can read every peer's memory (:func:`read_memory`), agreed
    by all; None if not, or if not ``enabled`` (``RINGDDP_SHM_CMA=0``).

    Each rank publishes its pid and the address of a random word in the store, reads each
    peer's word and reports; a refusal (EPERM: Yama, seccomp), a missing system call or a
    wrong word (the pid names another process: separate pid namespaces) turns single-copy
    reads off on every rank, logged once. Two rounds through the store, at set-up only.
    """
    rank, n = rendezvous.rank, rendezvous.world_size
    if not enabled:
        log.info("shm: single-copy reads are off (RINGDDP_SHM_CMA=0)")
        return None
    mine = ctypes.c_int64(secrets.randbits(63))  # alive until every peer has reported its read
    rendezvous.set(f"cma/{rank}", f"{os.getpid()} {ctypes.addressof(mine)} {mine.value}")
    peers = {q: [int(x) for x in rendezvous.get(f"cma/{q}", q, deadline).split()] for q in range(n) if q != rank}
    failure = ""
    for q, (pid, address, value) in peers.items():
        word = ctypes.c_int64()
        try:
            read_memory(pid, ctypes.addressof(word), address, 8)
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
        return None
    return {q: pid for q, (pid, _address, _value) in peers.items()}


class SingleCopy:
    """The descriptors of single-copy reads in the control blocks: publish, read, wait, withdraw.

    The region protocol (:class:`.regions.Regions`) calls these with its piece number; see
    :meth:`~collectives.transport.base.SharedRegions.publish` for the order of the calls.

    Args:
        transport: gives the rank, the group's size and the collective under way (its ``op``).
        segments: the control blocks the descriptors live in.
        waiter: to wait for the readers.
        check: the errors for a reader whose call differs from the owner's.
        pids: each peer's process (:func:`probe_single_copy`); empty when single-copy reads are off.
    """

    def __init__(
        self, transport: Transport, segments: Segments, waiter: Waiter, check: WireCheck, pids: dict[Peer, int]
    ):
        self._transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self._ctrl = segments.ctrl
        self._wait = waiter.wait
        self._check = check
        self._pids = pids
        self._published: list[Peer] = []  # readers of this rank's tensors in the current call

    def _check_contiguous(self, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            raise ValueError(f"{self._transport.op}: single-copy reads need contiguous tensors")

    def publish(self, tensors: Mapping[Peer, torch.Tensor], piece: int) -> None:
        """Let each rank ``q`` in ``tensors`` read ``tensors[q]`` during piece ``piece``: writes
        (address, bytes, piece + 1) into ``q``'s control block, in this rank's head line there;
        the next step makes it visible."""
        stamp, me = piece + 1, PAIR + self.rank * PAIR + CMA
        for q, t in tensors.items():
            self._check_contiguous(t)
            self._ctrl[q][me : me + 3] = array.array("q", (t.data_ptr(), t.numel() * t.element_size(), stamp))
        self._published = list(tensors)

    def read(self, owner: Peer, out: torch.Tensor, piece: int) -> None:
        """Copy the tensor ``owner`` published for this rank during piece ``piece`` into ``out``."""
        self._check_contiguous(out)
        line, mine = PAIR + owner * PAIR + CMA, self._ctrl[self.rank]
        address, nbytes, stamp = mine[line : line + 3].tolist()
        expected, wanted = out.numel() * out.element_size(), piece + 1
        if stamp < 0:
            raise self._gave_up(owner)
        if stamp != wanted or nbytes != expected:
            what = "nothing" if stamp != wanted else f"{nbytes} bytes"
            raise self._check.mismatch(
                owner,
                f"rank {owner} published {what} for this rank (rank {self.rank}) to read, which expects "
                f"{expected} bytes: the ranks called different collectives or sizes",
            )
        if nbytes:
            try:
                read_memory(self._pids[owner], out.data_ptr(), address, nbytes)
            except OSError as exc:
                gone = exc.errno == errno.ESRCH
                op = self._transport.op
                raise CollectiveError(
                    f"{op}: reading rank {owner}'s tensor failed: "
                    + ("the peer exited" if gone else f"{exc} (RINGDDP_SHM_CMA=0 copies through shared memory instead)")
                    + f" (this is rank {self.rank} of {self.world_size})",
                    op=op,
                    peer=owner,
                ) from exc
        fence()
        if mine[line + 2] != stamp:  # the owner gave up waiting for us: its tensor may have changed meanwhile
            raise self._gave_up(owner)

    def _gave_up(self, owner: Peer) -> CollectiveError:
        op = self._transport.op
        return CollectiveError(
            f"{op}: rank {owner} stopped waiting for this rank (rank {self.rank}) to read its tensor "
            "(it failed or timed out), so the tensor may have changed",
            op=op,
            peer=owner,
        )

    def wait_readers(self, readers: Iterable[Peer], done: int) -> None:
        """Wait until every rank in ``readers`` has finished ``done`` pieces, so none reads what
        this rank published any more."""
        for q in readers:
            theirs = self._ctrl[q]
            if theirs[DONE] < done:
                self._wait(lambda: theirs[DONE] >= done, nobody, "waiting for a read by", q, ON_DONE)
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
