"""Byte counts as people type them (``4K``, ``1MiB``, ``256``) and as tables print them."""

from __future__ import annotations

_UNITS = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1.5M"`` -> 1572864, ``"64"`` -> 64 (a trailing ``B``/``iB`` is ignored)."""
    units = dict(_UNITS)
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human_size(nbytes: int) -> str:
    """The largest binary unit that fits: 4096 -> ``"4K"``, 1536 -> ``"1.5K"``, 100 -> ``"100B"``."""
    for unit, scale in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"
