"""Shared-memory transport: the ranks of one host exchange bytes through mapped memory.

The transport and its overview are in ``transport.py``.
"""

from .transport import ShmConfig, ShmTransport, ShmUnavailableError

__all__ = ["ShmConfig", "ShmTransport", "ShmUnavailableError"]
