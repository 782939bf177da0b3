"""Fault points: let a test kill a process at a chosen phase of its work, once per job.

Tests of restarts need kills that land *inside* a phase (a collective, the backward pass, the
optimizer step, a checkpoint write), which a kill from outside at a random moment hits only by
chance. Code marks a phase with :func:`reached`; the environment arms one point::

    RINGDDP_KILL_AT="<phase>:<n>:<rank>:<flag file>"

makes the process whose ``RANK`` is ``<rank>`` SIGKILL itself the ``n``-th time it reaches
``<phase>`` (counted per process from 1), after creating ``<flag file>``; a process that finds
the flag file already there never fires, so a job restarted with the same environment (torchrun
keeps it) is killed once. Several points, separated by commas (at most one per phase and rank),
kill a job several times: each fires once, in whichever start of the job reaches it. The
variable is read at the first :func:`reached` of the process (not at import: a rank forked from
a preloaded server gets its environment after the import). Unset, :func:`reached` costs one
global lookup.

Phases marked: ``"collective"`` (:meth:`collectives.group.Group.run`, with the call's header on
the wire and before its data moves: the peers are inside the same collective), and whatever the
layers above mark (``ddp.train``: ``"backward"``, ``"step"``; ``ddp.checkpoint``: ``"checkpoint"``;
``ddp.elastic``: ``"heal"``, reached by a replacement in the middle of healing, and ``"step"``,
between a step's gradient exchange and its update; there a member's rank is its slot). A
process without ``RANK`` in its environment counts as rank 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "RINGDDP_KILL_AT"


class _Point:
    def __init__(self, text: str) -> None:
        try:
            phase, n, rank, flag = text.split(":", 3)
            self.phase, self.n, self.rank, self.flag = phase, int(n), int(rank), flag
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: expected '<phase>:<n>:<rank>:<flag file>'") from None
        self.count = 0
        self.lock = threading.Lock()


def _arm() -> dict[str, _Point]:
    """This process's armed points by phase (read once, at the first use)."""
    global _points
    rank, points, seen = int(os.environ.get("RANK", "0")), {}, set()
    for point in map(_Point, filter(None, os.environ.get(ENV, "").split(","))):
        if point.rank != rank:
            continue
        if point.phase in seen:
            raise ValueError(f"{ENV}: two points for phase {point.phase!r} and rank {rank}")
        seen.add(point.phase)
        if not os.path.exists(point.flag):
            points[point.phase] = point
    _points = points
    return points


_points: dict[str, _Point] | None = None  # None: the environment not read yet


def _armed() -> dict[str, _Point]:
    return _arm() if _points is None else _points


def reached(phase: str) -> None:
    """Mark that this process is now in ``phase``; SIGKILL it here if the armed point says so."""
    point = (_arm() if _points is None else _points).get(phase)  # _armed() without its frame
    if point is None:
        return
    with point.lock:
        point.count += 1
        if point.count != point.n:
            return
        try:
            fd = os.open(point.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{phase} {point.n}\n".encode())
        os.fsync(fd)
        os.close(fd)
        log.warning("fault point: killing this process in %s (%d-th time)", phase, point.n)
        os.kill(os.getpid(), signal.SIGKILL)


def mark_backward(module: torch.nn.Module) -> None:
    """Reach ``"backward"`` whenever the gradient of ``module``'s output has been computed: the
    backward pass is then past every later layer, whose gradients exist and whose buckets'
    collectives may be running. Registers nothing unless the point is armed for ``"backward"``."""
    if "backward" not in _armed():
        return

    def forward_hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:  # not under no_grad (evaluation)
            output.register_hook(lambda _grad: reached("backward"))

    module.register_forward_hook(forward_hook)
