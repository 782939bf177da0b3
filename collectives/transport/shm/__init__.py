"""Shared-memory transport: the ranks of one host exchange bytes through mapped memory.

The transport and its overview are in ``transport.py``.
"""

from .config import ShmConfig, ShmUnavailableError
from .transport import ShmTransport

__all__ = ["ShmConfig", "ShmTransport", "ShmUnavailableError"]
