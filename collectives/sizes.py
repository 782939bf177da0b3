"""Byte counts as people type them (``4K``, ``1MiB``, ``256``) and as tables print them, and
environment variables read as such values."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")

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


def env_value(name: str, parse: Callable[[str], T], expected: str, default: T) -> T:
    """``$name`` read by ``parse`` (``default`` when unset or empty); a bad value raises a
    ValueError naming the variable and ``expected`` (what it takes)."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return parse(text)
    except (ValueError, KeyError, IndexError):  # parse_size's unit lookup and indexing too
        raise ValueError(f"{name}={text!r}: expected {expected}") from None


def env_size(name: str, default: int) -> int:
    """``$name`` as a byte count (``8388608``, ``8M``, ``512K``); ``default`` when unset or empty."""
    return env_value(name, parse_size, "a byte count such as 8388608, 8M or 512K", default)
