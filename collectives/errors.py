"""Exceptions raised by the collectives package.

Argument problems are reported with the built-in ``ValueError`` / ``TypeError`` before any
message is sent. Communication problems (a peer that stops answering, a dead peer, a closed
connection) raise :class:`CollectiveError`; a wait that runs past its deadline raises
:class:`CollectiveTimeoutError`. Both name the collective and the peer rank involved. Deadlines
are given as seconds or ``timedelta`` everywhere (:func:`timeout_seconds`).

A deadline error says so in torch's words: ``<op>: <what waited for whom>: Timed out after 2s
(...)`` (:func:`timed_out`). Code written against torch's backends matches those words (torch's
own test suite expects ``" (Timed out|closed|timeout) "``, case and spaces included), so it keeps
working on ours.

``CollectiveError`` derives from torch's ``DistBackendError`` (itself a ``DistError``, a
``RuntimeError``), so ``except torch.distributed.DistError`` (or ``dist.DistError`` after the
import swap) catches our communication failures exactly as it catches torch's.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


class CollectiveError(dist.DistBackendError):
    """A collective could not complete: a peer failed, or the group is unusable.

    Attributes:
        op: name of the collective that failed (``"all_reduce"``, ...).
        peer: rank (within the group) of the peer the failing wait was talking to, or None.
    """

    def __init__(self, message: str, op: str | None = None, peer: int | None = None):
        super().__init__(message)
        self.op = op
        self.peer = peer


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A blocking wait inside a collective ran past its deadline (its message contains
    :func:`timed_out`'s words)."""


def timed_out(seconds: float) -> str:
    """``"Timed out after 2s"``: the words every deadline error puts after ``"<op>: ...: "``, as
    gloo words its own ("Timed out waiting 2000ms ..."), so ``" Timed out "`` is in the message."""
    return f"Timed out after {seconds:g}s"


def timeout_seconds(timeout: datetime.timedelta | float | None, default: float | None = None) -> float | None:
    """A timeout given as seconds or a ``timedelta``, in seconds; ``None`` gives ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)
