"""Reusable scratch buffers.

Fresh large tensors cost page faults on first touch, which on a loopback transport can be a
large share of a collective's time. A :class:`Workspace` keeps one buffer per
(purpose, device, dtype) and grows it when a larger one is needed; it never shrinks.
"""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers owned by one group; used only from that group's communication thread."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of at least ``numel`` elements (contents undefined)."""
        key = (purpose, torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._buffers.clear()
