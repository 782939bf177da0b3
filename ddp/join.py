"""Uneven inputs: ``with model.join(): ...``, torch's ``Join`` semantics for our DDP.

When ranks hold different numbers of batches, the rank that runs out first would stop calling
the all-reduces the others still make, and they would wait for it until the timeout. Inside
``model.join()``, a rank that has left its loop *shadows* the others instead::

    with model.join():
        for x, y in loader:                 # loaders of different lengths
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

How (the same protocol as torch's ``Join`` with DDP's join hook):

1. Each forward pass of a rank still training (grad enabled) first all-reduces (MAX) the code
   ``group rank + 1``, plus ``n`` under ``no_sync`` (:meth:`Join.notify`); a rank that has left
   its loop contributes 0. The result says whether anybody is still training (0: everybody is
   done), whether they will reduce gradients this step (result ``<= n``), and which is the
   highest rank still training: as in torch, the forward's buffer broadcast comes from that rank
   while ``join()`` is active.
2. While the result is positive, the joined rank repeats what the others do in one step: the
   buffer broadcast of the forward (if ``broadcast_buffers``), then, unless they are under
   ``no_sync``, a backward pass whose gradients are all zero, which launches the same bucket
   all-reduces (and comm hooks) through DDP's own hooks. So the gradients are averaged over the
   *initial* world size, zeros included (``divide_by_initial_world_size=True``, torch's default).
3. When every rank has joined, the parameters and buffers of the last rank to join (one that
   shadowed nothing; the highest such rank, as in torch) are broadcast to all: the ranks that
   joined earlier stopped stepping, and this makes the replicas agree again.

Cost: one extra all-reduce of one integer per training step (``≈ log2(n) α``), as in torch.

Not supported (``ValueError``): ``divide_by_initial_world_size=False`` and
``throw_on_early_termination=True``. Only DDP's own collectives are shadowed: a training loop that
makes other collectives (say, an all-reduce of the loss for logging) hangs a joined rank's peers
until the timeout, exactly as in torch. With ``find_unused_parameters=True`` a joined rank reports
every parameter as used, so a parameter unused on all training ranks gets a zero gradient instead
of keeping ``None``.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Protocol

import torch

import collectives
from collectives import Group, ReduceOp, trace

from .sync import broadcast_tensors

log = logging.getLogger(__name__)


class Joinable(Protocol):
    """What :class:`Join` needs of the model it shadows (our ``DistributedDataParallel`` has it).

    Attributes:
        module: the wrapped module (its parameters and buffers are what a joined rank shadows).
        process_group: the group the model reduces over (``None``: the default group).
        broadcast_buffers: whether each forward broadcasts the buffers.
        join_context: the active :class:`Join`, set by its ``__enter__`` and cleared by its
            ``__exit__``; the model's forward calls :meth:`Join.notify` while it is set.
    """

    module: torch.nn.Module
    process_group: Group | None
    broadcast_buffers: bool
    join_context: "Join | None"


class Join:
    """The context manager returned by :meth:`DistributedDataParallel.join` (see the module docstring).

    Args:
        model: the DDP model.
        divide_by_initial_world_size: must be True (gradients averaged over all ranks, zeros of
            joined ranks included).
        enable: False turns the context into a no-op (the loop must then be even).
        throw_on_early_termination: must be False.
    """

    def __init__(
        self,
        model: Joinable,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ):
        if divide_by_initial_world_size is not True:
            raise ValueError("join: divide_by_initial_world_size=False is not supported; gradients are averaged over all ranks")
        if throw_on_early_termination is not False:
            raise ValueError("join: throw_on_early_termination=True is not supported")
        if not isinstance(enable, bool):
            raise TypeError(f"join: enable must be a bool, got {type(enable).__name__}")
        self.model = model
        self.enable = enable

    def __enter__(self) -> "Join":
        if self.enable:
            if self.model.join_context is not None:
                raise RuntimeError("join: this model is already inside a join() context")
            self.model.join_context = self
        return self

    def notify(self, sync: bool) -> int:
        """Called by the model's forward on a training rank (see step 1); returns the buffers' source."""
        g = collectives.get_group(self.model.process_group)
        return g.ranks[(self._exchange(g.rank() + 1 + (0 if sync else g.size())) - 1) % g.size()]

    def _exchange(self, code: int) -> int:
        flag = torch.tensor([code], dtype=torch.int64, device=self._device())
        with trace.label("join: ranks still training"):
            collectives.all_reduce(flag, ReduceOp.MAX, group=self.model.process_group)
        return int(flag.item())

    def _device(self) -> torch.device:
        params = list(self.model.module.parameters())
        return params[0].device if params else torch.device("cpu")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if not self.enable:
            return False
        self.model.join_context = None
        if exc_type is not None:  # the loop failed: do not shadow, let the error surface
            return False
        g = collectives.get_group(self.model.process_group)
        shadowed = 0
        while code := self._exchange(0):
            self._shadow_step(src=g.ranks[(code - 1) % g.size()], reduce_gradients=code <= g.size())
            shadowed += 1
        if shadowed:
            log.info("join: shadowed %d steps of ranks with more data", shadowed)
        self._sync_final_model(last_joiner=shadowed == 0)
        return False

    def _shadow_step(self, src: int, reduce_gradients: bool) -> None:
        """One step of a training rank, with zero gradients (see step 2)."""
        model = self.model
        buffers = list(model.module.buffers())
        if model.broadcast_buffers and buffers:
            with trace.label("broadcast buffers"):
                broadcast_tensors(buffers, src=src, group=model.process_group)
        if not reduce_gradients:
            return
        params = [p for p in model.module.parameters() if p.requires_grad]
        if not params:  # no buckets, nothing to reduce
            return
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        with trace.label("join: zero gradients"):
            sum((p * 0).sum() for p in params).backward()  # DDP's hooks reduce the zeros
        for p, grad in zip(params, saved):
            p.grad = grad

    def _sync_final_model(self, last_joiner: bool) -> None:
        """Broadcast parameters (and buffers, if ``broadcast_buffers``) from a last joiner (step 3).

        The last joiners are the ranks that shadowed no step; as in torch, the highest one wins.
        """
        g = collectives.get_group(self.model.process_group)
        src = self._exchange(g.rank() + 1 if last_joiner else 0) - 1
        module = self.model.module
        state = list(module.parameters()) + (list(module.buffers()) if self.model.broadcast_buffers else [])
        broadcast_tensors(state, src=g.ranks[src], group=g)
