"""A unit's parameters as one flat buffer: this rank's master chunk, and the full values when needed.

:class:`FlatParams` owns the storage of one unit (``flat.py`` says how it is laid out):

* the **master chunk**: this rank's ``chunk`` elements, in the parameters' own dtype (float32 for
  a float32 model). The sharded optimizer updates it, and it is what a checkpoint saves;
* the **full buffer**: all ``n · chunk`` elements in the compute dtype (``param_dtype`` of mixed
  precision, else the parameters' dtype). Every parameter's ``.data`` is a view into it, so the
  module computes with it unchanged.

Stages 1 and 2 keep the full buffer *resident*: after the optimizer step each rank writes its
updated chunk into it and one in-place ``all_gather_into_tensor`` completes it everywhere
(:meth:`publish`). Without mixed precision the master chunk *is* a view of the full buffer (no
second copy).

``summon_full_params`` shows the parameters in the *master* dtype (:meth:`summon`): resident
without mixed precision they already are; otherwise the masters are all-gathered into a buffer of
their own, so the rounded compute copy is never written over a master. Leaving the block
(:meth:`unsummon`) keeps this rank's chunk of what the parameters hold (or the masters as they
were), then resident units publish again, so every rank computes with the owners' values.

Stage 3 keeps only the master chunk. :meth:`gather` allocates the full buffer, all-gathers it
(``(n-1)/n · S`` bytes received per rank, ``S`` the unit's bytes) and points the parameters at
it; :meth:`release` frees it and points them at empty tensors. The buffer is one tensor whose
*storage* is resized to zero bytes and back, never replaced: autograd saves views of the weights
during forward (``weight.t()`` for a linear layer), and those views keep pointing at the same
storage, so they see the values again when the unit is gathered for its backward pass, while the
memory in between is really freed. (Replacing the buffer would leave the saved views holding the
old one alive: no memory saved.) Parameter ``.data`` swaps keep each parameter's own version
counter, so autograd does not mistake a gather for an in-place change of a saved weight.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, Work, trace

from .flat import FlatLayout


class FlatParams:
    """The storage of one unit's parameters (see the module docstring).

    Args:
        index: the unit's number, for trace labels and messages.
        params: the parameters, in flat order (trainable and frozen alike); one dtype.
        names: their names.
        group: the group the unit is sharded over.
        compute_dtype: dtype of the full buffer (``None``: the parameters' dtype).
        resident: keep the full buffer between steps (stages 1, 2) or only while gathered (3).
        memory: ``memory(delta_bytes)`` is told when a gathered full buffer is allocated or freed.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group: Group,
        *,
        compute_dtype: torch.dtype | None,
        resident: bool,
        memory: Callable[[int], None] | None = None,
    ):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise TypeError(
                f"unit {index} mixes parameter dtypes {sorted(map(str, dtypes))} ({', '.join(names)}); "
                "a flat unit holds one dtype: cast the model, or put them in different units"
            )
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.shapes = [p.shape for p in params]
        self.group = group
        self.rank = collectives.get_rank(group)
        self.layout = FlatLayout([p.numel() for p in params], collectives.get_world_size(group))
        self.master_dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.device = params[0].device
        self.resident = resident
        #: whether any parameter trains: only those units change at an optimizer step
        self.trainable = any(p.requires_grad for p in params)
        self._memory = memory or (lambda delta: None)
        lo, hi = self.layout.chunk_range(self.rank)
        with torch.no_grad():
            values = torch.zeros(self.layout.padded, dtype=self.master_dtype, device=self.device)
            for view, p in zip(self.layout.views(values, self.shapes), self.params):
                view.copy_(p.detach())
            self.full = values if self.compute_dtype == self.master_dtype else values.to(self.compute_dtype)
            aliased = resident and self.compute_dtype == self.master_dtype
            #: this rank's chunk of the master values; a view of ``full`` when ``aliased``
            self.master = self.full[lo:hi] if aliased else values[lo:hi].clone()
        self.aliased = aliased
        self.gathered = True
        self._pending: Work | None = None
        self._summoned: torch.Tensor | None = None  # the full masters while summoned (not aliased)
        self._kept: torch.Tensor | None = None  # the master chunk to restore (aliased, no writeback)
        self._point_params()
        if not resident:
            self._memory(self.full_bytes)  # counted as gathered until the release below
            self.release()

    # ------------------------------------------------------------------ sizes

    @property
    def full_bytes(self) -> int:
        return self.layout.padded * self.full.element_size()

    def chunk(self) -> torch.Tensor:
        """This rank's chunk of the full buffer."""
        lo, hi = self.layout.chunk_range(self.rank)
        return self.full[lo:hi]

    # ------------------------------------------------------------------ stage 3: gather / release

    def gather(self, async_op: bool = False) -> None:
        """Make the full values available (stage 3). With ``async_op`` the all-gather is only started
        (a prefetch): :meth:`wait` or a later :meth:`gather` completes it."""
        if self.gathered:
            return
        if self._pending is None:
            self.full.untyped_storage().resize_(self.full_bytes)
            self._memory(self.full_bytes)
            source = self.master if self.compute_dtype == self.master_dtype else self.master.to(self.compute_dtype)
            self._sync_device()
            with trace.label(f"all_gather unit {self.index}"):
                self._pending = collectives.all_gather_into_tensor(self.full, source, group=self.group, async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete a started gather and point the parameters at the full buffer."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self.gathered = True
            self._point_params()

    @property
    def gathering(self) -> bool:
        return self._pending is not None

    def release(self) -> None:
        """Free the full buffer (stage 3); the parameters become empty tensors until the next gather."""
        self.wait()
        if self.resident or not self.gathered:
            return
        self._empty_params()
        storage = self.full.untyped_storage()
        if not storage.resizable():
            # Its memory was handed out (``.numpy()`` of a parameter, between steps): leave that
            # storage to whoever holds it and continue with a fresh one. No backward pass can be
            # pending on the old one: forward and backward never expose it.
            self.full = torch.empty(self.layout.padded, dtype=self.compute_dtype, device=self.device)
            storage = self.full.untyped_storage()
        storage.resize_(0)
        self._memory(-self.full_bytes)
        self.gathered = False

    def _sync_device(self) -> None:
        """CUDA: the master chunk was written by kernels queued on this thread's stream; the
        communication thread must not read it before they ran (as DDP's buckets)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _point_params(self, flat: torch.Tensor | None = None) -> None:
        for p, view in zip(self.params, self.layout.views(self.full if flat is None else flat, self.shapes)):
            p.data = view

    def _empty_params(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    # ------------------------------------------------------------------ after the optimizer step

    def publish(self) -> Work | None:
        """Stages 1, 2: write the master chunk into the full buffer (cast to the compute dtype) and
        start the in-place all-gather that brings every rank's chunk to every rank. Returns the
        pending work (``None`` at stage 3: the next gather reads the masters)."""
        if not self.resident:
            return None
        chunk = self.chunk()
        if not self.aliased:
            chunk.copy_(self.master)
        self._sync_device()
        with trace.label(f"all_gather unit {self.index}"):
            return collectives.all_gather_into_tensor(self.full, chunk, group=self.group, async_op=True)

    # ------------------------------------------------------------------ summon_full_params

    def summon(self, writeback: bool) -> Work | None:
        """Point the parameters at the full values in the master dtype; returns the pending gather.

        Aliased (stages 1, 2 without mixed precision) they are there already; without
        ``writeback`` the master chunk is kept aside to be restored. Otherwise the masters are
        all-gathered into a buffer of their own: the compute copy is never written over them.
        """
        if self.aliased:
            self._kept = None if writeback else self.master.clone()
            return None
        self.release()  # stage 3: a unit still gathered in the compute dtype gives way
        values = torch.empty(self.layout.padded, dtype=self.master_dtype, device=self.device)
        self._memory(values.numel() * values.element_size())
        self._summoned = values
        self._point_params(values)
        self._sync_device()
        with trace.label(f"all_gather unit {self.index}"):
            return collectives.all_gather_into_tensor(values, self.master, group=self.group, async_op=True)

    def unsummon(self, writeback: bool) -> Work | None:
        """Leave :meth:`summon`: with ``writeback`` this rank's chunk of what the parameters hold
        becomes its master chunk (exactly, in the master dtype), else the masters stay as they were.

        A resident unit whose parameters may have changed then publishes again (returned: the
        pending all-gather), so every rank computes with the owners' values cast to the compute
        dtype, whatever a rank wrote outside its own chunk.
        """
        with torch.no_grad():
            if self.aliased:
                if self._kept is not None:
                    self.master.copy_(self._kept)
                self._kept = None
                return self.publish()
            values, self._summoned = self._summoned, None
            assert values is not None, "unsummon without summon"
            if writeback:
                lo, hi = self.layout.chunk_range(self.rank)
                self.master.copy_(values[lo:hi])
            self._memory(-values.numel() * values.element_size())
            if not self.resident:
                self._empty_params()  # the next gather casts the masters
                return None
            self._point_params()
            return self.publish() if writeback else None  # without writeback the compute copy is as it was


def wait_all(works: Iterable[Work | None]) -> None:
    """Consume ``works`` (each a started work or ``None``) to the end, then wait for each: all
    start before the first wait."""
    for work in [w for w in works if w is not None]:
        work.wait()


__all__ = ["FlatParams", "wait_all"]
