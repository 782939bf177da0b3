"""Gradient buckets that are reduce-scattered: each rank keeps the average of its own chunk only.

A :class:`ShardBucket` takes the same path through the backward pass as DDP's all-reduce
:class:`~ddp.reducer.Bucket` (the :class:`~ddp.reducer.Reducer` fills it from the gradient hooks,
launches it in bucket order, waits at the end), but its flat buffer has the layout of a flat unit
(``flat.py``: padded to ``n · chunk``) and it is reduced with one
``reduce_scatter_tensor(AVG, async_op=True)``: rank ``r`` receives the average of elements
``[r · chunk, (r + 1) · chunk)`` and nothing else. That is the first half of a ring all-reduce
(``(n-1)/n · S`` bytes sent per rank instead of ``2(n-1)/n · S``); the second half moves the
*updated parameters* after the optimizer step instead of gradients (``units.py``), so a step
communicates as much as DDP's. ZeRO-3 adds one more all-gather per unit (the backward pass needs
the weights again): ``1.5 x`` DDP.

The averaged chunk lands in :attr:`ShardBucket.grad` (the parameters' own dtype, float32 for a
float32 model; kept until ``zero_grad``, and accumulated into by a later synchronised backward,
as ``.grad`` is). The gradient is copied into the buffer as soon as its hook fires and ``.grad``
is dropped, so autograd's full-size gradients live one at a time.

Memory, per rank, for a unit of ``S`` bytes:

* ZeRO-1 (``keep_buffer=True``): the buffer stays allocated between steps, like DDP's bucket
  (gradient memory ``S`` + ``S/n`` for the chunk). Only the optimizer state is sharded.
* ZeRO-2 and 3: the buffer is allocated at the bucket's first gradient and freed when its
  reduce-scatter is done. With the Reducer's ``retire_early`` a bucket's reduction is waited for
  before the next bucket allocates its buffer, so at most one bucket buffer exists at a time:
  ``S_total/n`` of chunks + one bucket (+ the gradient autograd just computed).

Equality with DDP: the reduce-scatter and DDP's all-reduce both sum every element once, then
divide by ``n``. When they add the ranks' values in the same order the averages are bitwise
equal: always at 2 ranks (``a + b = b + a`` exactly), and on ``shm`` at any size (both add in rank
order). The ring on ``p2p`` starts each chunk's sum at a different rank, and small all-reduces use
recursive doubling, so above 2 ranks the two differ by float rounding there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp, Work, trace

from ..bucket import BucketInfo
from ..reducer import Reducer
from .flat import FlatLayout


class ShardBucket:
    """One reduce-scattered bucket (see the module docstring); driven by the Reducer.

    Args:
        index: launch order.
        param_indices: the bucket's trainable parameters, as indices into ``all_params``.
        all_params, names: the Reducer's parameters and their names.
        layout: the unit's flat layout; ``slots[k]`` is parameter ``param_indices[k]``'s position
            in it (a stage-3 unit also holds frozen parameters, whose slots stay zero).
        group: the group to reduce over.
        reduce_dtype: dtype of the buffer and the reduce-scatter.
        grad_dtype: dtype of the averaged chunk (the master parameters' dtype).
        keep_buffer: ZeRO-1: keep the buffer allocated between passes.
        on_start: called once the bucket's reduce-scatter is queued (ZeRO-3 frees the unit's
            full parameters there: their gradients are all in).
        memory: ``memory(delta_bytes)`` is told about every buffer allocated or freed.
    """

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        all_params: Sequence[nn.Parameter],
        names: Sequence[str],
        layout: FlatLayout,
        slots: Sequence[int],
        group: Group,
        *,
        reduce_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        keep_buffer: bool,
        on_start: Callable[[], None] | None = None,
        memory: Callable[[int], None] | None = None,
    ):
        self.index = index
        self.param_indices = param_indices
        self.params = [all_params[i] for i in param_indices]
        self.layout = layout
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.grad_dtype = grad_dtype
        self.keep_buffer = keep_buffer
        self.on_start = on_start
        self._memory = memory or (lambda delta: None)
        self._ranges = [(layout.offsets[k], layout.offsets[k] + layout.numels[k]) for k in slots]
        self._gaps = layout.gaps(slots)
        self.buffer: torch.Tensor | None = None
        #: this rank's averaged chunk (``layout.chunk`` elements), ``None`` after ``zero_grad``
        self.grad: torch.Tensor | None = None
        #: per parameter: whether it has a gradient since the last ``zero_grad(set_to_none=True)``
        self.has_grad = [False] * len(self.params)
        self._out: torch.Tensor | None = None  # the reduce-scatter's output while it runs
        self._work: Work | None = None
        device = self.params[0].device
        self.info = BucketInfo(
            index=index,
            dtype=reduce_dtype,
            device=device,
            param_names=tuple(names[i] for i in param_indices),
            shapes=tuple(tuple(p.shape) for p in self.params),
            numel=layout.padded,
            nbytes=layout.padded * torch.empty(0, dtype=reduce_dtype).element_size(),
        )
        if keep_buffer:
            self._allocate()

    def _allocate(self) -> torch.Tensor:
        device = self.params[0].device
        buffer = torch.empty(self.layout.padded, dtype=self.reduce_dtype, device=device)
        for a, b in self._gaps:  # padding and frozen slots: zero once, never written
            buffer[a:b].zero_()
        self.buffer = buffer
        if not self.keep_buffer:  # a resident buffer is held memory, not transient
            self._memory(self.info.nbytes)
        return buffer

    # ------------------------------------------------------------------ the Reducer's interface

    def fill(self, slot: int, as_view: bool) -> None:
        """Copy ``params[slot].grad`` into its slot (zeros if none) and drop ``.grad``."""
        if self._work is not None:  # launched by a pass whose backward raised: finish it, keep nothing
            self._drop_pending()
        buffer = self.buffer if self.buffer is not None else self._allocate()
        p = self.params[slot]
        a, b = self._ranges[slot]
        if p.grad is None:
            buffer[a:b].zero_()
            return
        nbytes = p.grad.numel() * p.grad.element_size()
        self._memory(nbytes)  # autograd's gradient is alive until it is copied
        buffer[a:b].copy_(p.grad.reshape(-1))
        p.grad = None
        self._memory(-nbytes)

    def start(self, reducer: Reducer, is_last: bool) -> Work:
        """Queue the reduce-scatter of the (complete) buffer into this rank's chunk."""
        assert self.buffer is not None
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self._out = self.buffer.new_empty(self.layout.chunk)
        with trace.label(f"reduce_scatter bucket {self.index}"):
            self._work = collectives.reduce_scatter_tensor(self._out, self.buffer, ReduceOp.AVG, group=self.group, async_op=True)
        if self.on_start is not None:
            self.on_start()
        return self._work

    def complete(self, pending: Work, reducer: Reducer, keep: bool = True) -> None:
        """Wait for the reduce-scatter, fold the result into :attr:`grad` (the first one of a step
        becomes it), free the buffer. ``keep=False`` (a discarded pass): only wait and free."""
        out = self._drop_pending()
        if not keep:
            return
        if self.grad is None:
            self.grad = out.to(self.grad_dtype)  # no copy when the dtypes agree
        else:
            self.grad.add_(out)

    def _drop_pending(self) -> torch.Tensor:
        """Wait for the reduction in flight; free a transient buffer; return its output."""
        work, out = self._work, self._out
        assert work is not None and out is not None
        self._work = self._out = None
        try:
            work.wait()
        finally:
            if not self.keep_buffer:
                self.buffer = None
                self._memory(-self.info.nbytes)
        return out

    def write_back(self, as_view: bool, used_anywhere: list[bool] | None) -> None:
        """Record which parameters have a gradient now (a parameter used on no rank has none)."""
        for k, i in enumerate(self.param_indices):
            if used_anywhere is None or used_anywhere[i]:
                self.has_grad[k] = True

    # ------------------------------------------------------------------ between steps

    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none or self.grad is None:
            self.grad = None
            self.has_grad = [False] * len(self.params)
        else:
            self.grad.zero_()


__all__ = ["ShardBucket"]
