"""Sizes and switches of the shared-memory transport, from ``RINGDDP_SHM_*`` variables.

Rank 0's sizes and its single-copy switch are used by every rank (they agree through the store,
:meth:`~.rendezvous.Rendezvous.agree`); the directory and the spin time are each rank's own.
"""

from __future__ import annotations

import dataclasses
import os

from ...sizes import env_size, env_value
from .control import MAX_SLOTS, PAGE, PAIR


class ShmUnavailableError(RuntimeError):
    """Shared memory cannot be set up (file system too small, peers on another host, ...)."""


def _microseconds(text: str) -> float:
    return float(text) / 1e6


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    """Sizes of a segment; rank 0's are used by every rank.

    Attributes:
        directory: where segments live (a tmpfs: /dev/shm).
        slot_bytes: size of one FIFO slot: the chunk a long message is streamed in.
        slots: FIFO depth per pair (at most 8).
        region_bytes: a rank's region for the shared-memory algorithms (two halves).
        spin_seconds: how long a waiter polls memory before it blocks (``RINGDDP_SHM_SPIN_US``);
            ``None``: 1 ms when every rank has a core, else 50 µs (:func:`.waiting.spin_times`).
        cma: allow single-copy reads of the peers' tensors with ``process_vm_readv`` where the
            set-up probe finds them possible (``RINGDDP_SHM_CMA=0`` turns them off).
    """

    directory: str = "/dev/shm"
    slot_bytes: int = 512 << 10
    slots: int = 4
    region_bytes: int = 8 << 20
    spin_seconds: float | None = None
    cma: bool = True

    @classmethod
    def from_env(cls) -> "ShmConfig":
        return cls(
            directory=os.environ.get("RINGDDP_SHM_DIR", cls.directory),
            slot_bytes=env_size("RINGDDP_SHM_SLOT_BYTES", cls.slot_bytes),
            slots=env_value("RINGDDP_SHM_SLOTS", int, f"an integer from 1 to {MAX_SLOTS}", cls.slots),
            region_bytes=env_size("RINGDDP_SHM_REGION_BYTES", cls.region_bytes),
            spin_seconds=env_value("RINGDDP_SHM_SPIN_US", _microseconds, "microseconds, such as 50", cls.spin_seconds),
            cma=os.environ.get("RINGDDP_SHM_CMA", "1") != "0",
        )

    def validate(self) -> None:
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"shm: slots must be 1..{MAX_SLOTS}, got {self.slots}")
        if self.slot_bytes < 64 or self.slot_bytes % 64 or self.region_bytes < 128 or self.region_bytes % 128:
            raise ValueError(
                f"shm: slot_bytes ({self.slot_bytes}) must be a multiple of 64, region_bytes "
                f"({self.region_bytes}) a multiple of 128"
            )

    def control_bytes(self, world_size: int) -> int:
        """Bytes of a segment's control block (:mod:`.control`), whole pages."""
        return -(-(PAIR + world_size * PAIR) * 8 // PAGE) * PAGE

    def segment_bytes(self, world_size: int) -> int:
        """Bytes of one rank's segment."""
        return self.control_bytes(world_size) + (world_size - 1) * self.slots * self.slot_bytes + self.region_bytes
