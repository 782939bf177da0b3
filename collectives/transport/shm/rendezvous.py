"""Rendezvous: how the ranks agree through the store and hand each other their segments.

The group's store carries only small values: a random job id and rank 0's sizes, each rank's
success at creating its segment (with its kernel boot id and network namespace, so ranks that
cannot share memory find out alike), the single-copy probe. File descriptors never go through
it: each pair of ranks connects an abstract unix socket (named after the job id, so two jobs
cannot meet; no file, nothing to clean up) and passes them with ``SCM_RIGHTS``. The transport
keeps those sockets afterwards for wake-ups and dead-peer detection (:mod:`.waiting`).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import socket
import struct
import time
from typing import Callable

import torch.distributed as dist

from ...errors import CollectiveError, CollectiveTimeoutError, timed_out
from ..base import Peer, Transport, wait_for_keys
from . import segment
from .config import ShmConfig, ShmUnavailableError


def machine() -> str:
    """This kernel's boot id and network namespace: ranks with equal values can pass fds over
    abstract unix sockets (and so share segments)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot} {os.stat('/proc/self/ns/net').st_ino}"


class Rendezvous:
    """The set-up exchanges of one transport: values through ``store``, fds over sockets.

    ``transport`` gives the rank, the group's size and deadline, and the collective under way
    (its ``op``, which errors name). Built with the transport: the n-th transport a rank builds on
    a store meets the n-th of every other rank (all keys live under ``shm/<n>/``).
    """

    def __init__(self, transport: Transport, store: dist.Store, abandoned: Callable[[], str | None] = lambda: None):
        self._transport = transport
        self._abandoned = abandoned  # why to stop waiting for the peers before the deadline, or None
        self.rank, self.world_size, self.timeout = transport.rank, transport.world_size, transport.timeout
        self._store = store
        self._key = f"shm/{store.add(f'shm/built/{self.rank}', 1)}"
        self.uid = ""  # the job id, from rank 0 (agree)

    def set(self, name: str, value: str) -> None:
        """Publish this rank's ``value`` under ``name``."""
        self._store.set(f"{self._key}/{name}", value)

    def get(self, name: str, peer: Peer, deadline: float) -> str:
        """The value ``peer`` published under ``name``, waiting at most until ``deadline``."""
        key = f"{self._key}/{name}"
        while not wait_for_keys(self._store, [key], min(deadline, time.monotonic() + 0.1)):
            if (why := self._abandoned()) is not None:  # e.g. a heartbeat found the peer dead
                op = self._transport.op
                raise CollectiveError(
                    f"{op}: shared-memory set-up abandoned while waiting for rank {peer}: {why} "
                    f"(this is rank {self.rank} of {self.world_size})",
                    op=op,
                    peer=peer,
                )
            if time.monotonic() < deadline:
                continue
            op = self._transport.op
            raise CollectiveTimeoutError(
                f"{op}: shared-memory set-up: {timed_out(self.timeout)}: rank {peer} did not "
                f"join (this is rank {self.rank} of {self.world_size})",
                op=op,
                peer=peer,
            )
        return self._store.get(key).decode()

    def agree(self, local: ShmConfig, deadline: float) -> ShmConfig:
        """``local`` with rank 0's sizes and single-copy switch; also fixes the job id."""
        if self.rank == 0:
            uid = secrets.token_hex(8)
            self.set("setup", f"{uid},{local.slot_bytes},{local.slots},{local.region_bytes},{int(local.cma)}")
        self.uid, slot, slots, region, cma = self.get("setup", 0, deadline).split(",")
        return dataclasses.replace(
            local, slot_bytes=int(slot), slots=int(slots), region_bytes=int(region), cma=cma == "1"
        )

    def report_segment(
        self, name: str, directory: str, size: int, ok: str, deadline: float
    ) -> tuple[int, list[str], list[tuple[Peer, str]]]:
        """Create this rank's segment of ``size`` bytes in ``directory`` and publish ``ok`` or
        ``fail <why>`` under ``name``; returns the fd (-1 if it failed), every rank's report and
        the failures (rank, why)."""
        fd, failure = -1, ""
        try:
            fd = segment.create(directory, size, self.uid, self.rank)
        except (OSError, ShmUnavailableError) as exc:
            failure = str(exc)
        self.set(f"{name}/{self.rank}", f"fail {failure}" if failure else ok)
        reports = [self.get(f"{name}/{q}", q, deadline) for q in range(self.world_size)]
        return fd, reports, [(q, text[5:]) for q, text in enumerate(reports) if text.startswith("fail ")]

    def map_all(self, fd: int, size: int, deadline: float, channel: str) -> tuple[list[mmap.mmap], dict[Peer, socket.socket]]:
        """Exchange ``fd`` with every peer and map every rank's segment (index = rank); returns the
        mappings and the sockets. Every fd is closed, ``fd`` included; on OSError so is what it opened.

        ``channel`` tells the exchanges of one job apart (the transport's own segments: ``""``).
        """
        fds: dict[Peer, int] = {self.rank: fd}
        maps: list[mmap.mmap] = []
        socks: dict[Peer, socket.socket] = {}
        try:
            fds, socks = self._exchange_fds(fd, deadline, channel)
            for q in range(self.world_size):
                maps.append(segment.map_file(fds[q], size))
        except OSError:
            for m in maps:
                m.close()
            for s in socks.values():
                s.close()
            raise
        finally:
            for f in {fd, *fds.values()}:
                os.close(f)
        return maps, socks

    def _address(self, q: int, channel: str) -> bytes:
        return f"\0ringddp-shm-{self.uid}-{q}{channel}".encode()

    def _exchange_fds(self, fd: int, deadline: float, channel: str) -> tuple[dict[Peer, int], dict[Peer, socket.socket]]:
        """Exchange segment fds with every peer over abstract unix sockets; return the fds and sockets.

        Rank ``r`` connects to every lower rank and accepts every higher one; a connection only
        waits for a lower rank, so the set-up cannot deadlock.
        """
        n, r = self.world_size, self.rank
        fds = {r: fd}
        socks: dict[Peer, socket.socket] = {}
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._address(r, channel))
            listener.listen(n)
            for q in range(r):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                socks[q] = s
                while True:
                    s.settimeout(max(0.001, deadline - time.monotonic()))
                    try:
                        s.connect(self._address(q, channel))
                        break
                    except (ConnectionRefusedError, FileNotFoundError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.002)
                socket.send_fds(s, [struct.pack("<i", r)], [fd])
                fds[q] = self._receive_fd(s, q)
            for _ in range(r + 1, n):
                listener.settimeout(max(0.001, deadline - time.monotonic()))
                s, _addr = listener.accept()
                s.settimeout(max(0.001, deadline - time.monotonic()))
                data, got, _flags, _addr = socket.recv_fds(s, 4, 1)
                if len(data) != 4 or len(got) != 1:
                    raise ConnectionError("malformed hello from a peer")
                q = struct.unpack("<i", data)[0]
                socks[q] = s
                fds[q] = got[0]
                socket.send_fds(s, [struct.pack("<i", r)], [fd])
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            listener.close()
        return fds, socks

    @staticmethod
    def _receive_fd(s: socket.socket, q: int) -> int:
        data, got, _flags, _addr = socket.recv_fds(s, 4, 1)
        if len(got) != 1 or struct.unpack("<i", data)[0] != q:
            raise ConnectionError(f"malformed reply from rank {q}")
        return got[0]
