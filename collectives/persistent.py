"""Persistent collectives: check and plan a call once, start it many times.

MPI-4's ``MPI_Allreduce_init`` / ``MPI_Start``: a loop that all-reduces the same buffer again
and again (a gradient bucket, a small statistics tensor, a latency benchmark) pays for the
argument checks, the call's signature and wire header, the engine and algorithm choice and the
region views once, at :func:`all_reduce_init`, instead of at every call::

    plan = collectives.all_reduce_init(t)   # every rank, like a collective; nothing moves yet
    for step in range(steps):
        t.copy_(...)                        # write the buffer in place
        plan.start()                        # collectives.all_reduce(t), the same bits

What a start still does on the fast path (a synchronous start on the thread that created the
group, nothing queued, no trace, no ``--verbose``): the group's broken check, pending receives,
the wire check (the collective is numbered and its header published, so a rank that starts a
plan while its peer calls something else raises as with :func:`collectives.all_reduce`),
autograd off, and the algorithm. On ``shm`` with a buffer up to the one-shot limit that is the
one-shot with both halves' views of every region and its signature computed once
(:func:`collectives.shm_algorithms.plan_all_reduce`); where the native kernel runs it, the
transport's checked operation is part of that one call (the kernel publishes the call's number
for the wire check: :meth:`collectives.transport.base.SharedRegions.checked_one_shot`), so a
start is a few Python frames around one C call; elsewhere the engine chooses as in every call.
Anything else (``async_op=True``, another thread, queued work, tracing, DETAIL checks)
runs the ordinary :func:`collectives.all_reduce`, so a plan is never less checked or ordered
than the call it stands for, and ranks may mix plans and ordinary calls freely: the wire
header and the bits are the same.

A plain synchronous :func:`collectives.all_reduce` of a CPU tensor whose dtype, element count
and op ran before now takes the same planned call (:func:`collectives.api.all_reduce`), after
the argument checks its key does not fix; a plan saves those and a cache lookup per call.

The buffer is bound at init, as in MPI: write into it in place, do not resize or re-point it
(``resize_``, ``set_``). Each start compares its address and element count with the plan's,
and a changed tensor, checking level or group tuning is planned again at that start.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import debug, validate, wire
from .api import all_reduce
from .group import Group, NonMember, member
from .ops import ReduceOp, check_op_dtype
from .tuning import ALL_REDUCE_ALGORITHMS
from .work import Work

_NAME = "all_reduce"


class PersistentAllReduce:
    """An all-reduce of one tensor, checked once, started many times (:func:`all_reduce_init`).

    Attributes:
        tensor: the buffer each :meth:`start` reduces in place.
        op, group, algorithm: as given to :func:`all_reduce_init`.
    """

    __slots__ = ("tensor", "op", "group", "algorithm", "_signature", "_key", "_go")

    def __init__(self, tensor: torch.Tensor, op: ReduceOp, group: Group, algorithm: str):
        self.tensor, self.op, self.group, self.algorithm = tensor, op, group, algorithm
        self._signature = debug.signature(_NAME, tensor, op)
        self._key: tuple | None = None  # what the plan was made for (_state)
        self._go: Callable[[], bool] | None = None  # the fast path (checks _state() first), once planned

    def _state(self) -> tuple:
        t = self.tensor
        return debug.level(), self.group.tuning.key(), t.data_ptr(), t.numel()

    @property
    def planned(self) -> bool:
        """Whether a synchronous :meth:`start` now may take the planned path (it still takes the
        ordinary one when the module docstring's conditions say so)."""
        return self._go is not None and self._state() == self._key

    def start(self, async_op: bool = False) -> Work | None:
        """All-reduce :attr:`tensor` in place now (every rank starts its plan, in the same order
        as its other collectives); with ``async_op=True`` return a :class:`~collectives.work.Work`
        handle as :func:`collectives.all_reduce` does."""
        go = self._go
        if go is not None and async_op is False and go():
            return None
        work = all_reduce(self.tensor, self.op, self.group, async_op, algorithm=self.algorithm)
        if self._state() != self._key:  # the first start (it set the transport up), or something changed
            self._plan()
        return work

    def _plan(self) -> None:
        """Build the fast path for the state now in force (none where it would not apply)."""
        g, t, algorithm = self.group, self.tensor, self.algorithm
        self._key = key = self._state()
        self._go = None
        if key[0] == "DETAIL" or not t.is_contiguous():  # every rank's signature all-gathered; a staged copy
            return
        engine = g.engine(t.device, _NAME)
        flat = t if t.dim() == 1 else t.view(-1)
        header = wire.header(self._signature, g.tuning, algorithm, None, key[0], 0)
        planner = getattr(engine, "plan_all_reduce", None)  # optional: engines without one choose per call
        if planner is not None:
            run, current = planner(flat, self.op, algorithm, header)
        else:
            transport_op, current = engine.transport_op, True

            def run() -> None:
                with transport_op(_NAME):
                    engine.all_reduce(flat, self.op, algorithm)

        # the transport's checked call (current False) is the engine's checked_all_reduce: it records nothing
        group_start, level = g.plan(_NAME, run, header, current, no_grad=current), debug.level
        planned_level, planned_tuning, ptr, numel = key

        def go() -> bool:  # _state() == key, then the group's start, without their frames
            return (level() == planned_level and g.tuning.key() == planned_tuning and t.data_ptr() == ptr
                    and t.numel() == numel and group_start())

        self._go = go


def all_reduce_init(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | NonMember | None = None,
    *,
    algorithm: str = "auto",
) -> PersistentAllReduce | None:
    """A persistent :func:`collectives.all_reduce` of ``tensor`` (module docstring): the same
    checks now, raising ``TypeError`` / ``ValueError`` before any traffic; ``None`` on a rank
    outside ``group`` (with torch's warning), as the call itself returns. Moves nothing: the
    first :meth:`PersistentAllReduce.start` does the first all-reduce, and plans the rest."""
    op = op if type(op) is ReduceOp else ReduceOp.coerce(op)
    validate.tensor(tensor, _NAME)
    if (g := member(group, _NAME)) is None:
        return None
    check_op_dtype(op, tensor.dtype, _NAME)
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"{_NAME}: unknown algorithm {algorithm!r}; expected one of {ALL_REDUCE_ALGORITHMS}")
    validate.aliasing(_NAME, [("tensor", tensor)])
    g.engine(tensor.device, _NAME)  # the backend takes this device: raises now
    return PersistentAllReduce(tensor, op, g, algorithm)
