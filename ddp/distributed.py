"""``DistributedDataParallel``: bucketed gradient all-reduce that overlaps the backward pass.

What it does, in the order it happens::

    model = ddp.DistributedDataParallel(model)    # 1. broadcast rank 0's parameters and buffers
    out = model(x)                                # 2. (buffers re-broadcast), module's forward
    loss_fn(out, y).backward()                    # 3. hooks fire as gradients appear:
                                                  #    bucket full -> async all-reduce starts
                                                  # 4. end of backward: wait for every bucket,
                                                  #    averaged gradients land in param.grad
    optimizer.step()                              # 5. safe: every rank has the same gradients

The overlap
-----------
Autograd computes the gradients from the last layer back to the first. Each trainable parameter
gets a ``post_accumulate_grad`` hook, called the moment its ``.grad`` is final for this backward
pass. The hook copies the gradient into its slot of the bucket's flat buffer (or finds it already
there, with ``gradient_as_bucket_view=True``) and counts the bucket down; when the count reaches
zero, the bucket's ``all_reduce(..., async_op=True)`` is queued on the group's communication
thread and the hook returns at once. While bucket 0 (the last layers) is on the wire, autograd
computes the gradients of the earlier layers. At the end of the backward pass a callback queued
on the autograd engine (``Variable._execution_engine.queue_callback``) waits for the outstanding
buckets, so when ``loss.backward()`` returns the gradients are averaged. Only the communication
of the last bucket(s) is exposed::

    backward:  [grads bucket 0][grads bucket 1][grads bucket 2]
    comm:                      [all-reduce 0  ][all-reduce 1  ][all-reduce 2]
                                                               ^ exposed: wait at the end

The cost model says how to size buckets: each all-reduce costs ``2(n-1)α + 2(n-1)/n · Sβ``;
fewer, bigger buckets pay ``α`` fewer times, smaller ones start earlier (see ``bucket.py``).

Module and Reducer
------------------
As in torch, the ``nn.Module`` here only wraps: it finds the parameters, checks the layout,
broadcasts the state, runs ``forward``, keeps the ``no_sync`` flag and registers the hooks. Each
hook calls :meth:`Reducer.on_grad_ready <ddp.reducer.Reducer.on_grad_ready>`; the Reducer
(``reducer.py``) owns the buckets, the per-pass state, the in-order launch, the end of backward
and the write-back. :meth:`DistributedDataParallel.register_comm_hook` replaces how a bucket is
reduced (``comm_hooks.py``: compression, an explicit reduce-scatter + all-gather, your own).

Same order on every rank
------------------------
Our collectives are point-to-point messages matched by order, so every rank must start the same
all-reduces in the same order. Gradients can become ready in a slightly different order on
different ranks, so a bucket is launched only when it is complete *and* every bucket before it has
been launched (as torch's reducer does). The bucket layout itself is checked to be identical on
every rank at construction.

Exactness
---------
The all-reduce is a SUM followed by one division by the world size (``ReduceOp.AVG``), performed
identically everywhere: the ring algorithm combines every element once, in one order, so the
averaged gradients are bitwise equal on all ranks and the replicas never drift apart. A comm
hook keeps this as long as it only post-processes collective results (``comm_hooks.py``).

Unused parameters
-----------------
A parameter that takes no part in a forward pass never gets its hook called, so its bucket never
fills. With ``find_unused_parameters=False`` (the default) that is an error: at the end of the
backward pass this rank raises a ``RuntimeError`` naming those parameters, without starting the
incomplete buckets. Ranks that *did* use them are by then waiting for this rank in an all-reduce
and fail with the collectives' ``CollectiveTimeoutError`` after the group's timeout (no silent
hang, no wrong result). With ``find_unused_parameters=True`` the remaining buckets are completed
at the end of the backward pass with zeros in place of the missing gradients (or the locally
accumulated ``.grad``) and reduced; a small all-reduce of a "used" flag per parameter tells every
rank which parameters were used *somewhere*, and a parameter used on no rank keeps ``.grad`` as it
was (``None`` stays ``None``, so the optimizer skips it exactly as it would without DDP). Unlike
torch, which walks the autograd graph after the forward pass to mark unused parameters ready
early, the incomplete buckets here are only launched at the end of backward (less overlap, same
result).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
import zlib
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, trace

from .bucket import BucketInfo, assign_buckets, cap_from_mb, format_bucket_table
from .join import Join
from .reducer import CommHook, Reducer, ReductionStats
from .sync import broadcast_tensors

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: same model on every rank, gradients averaged in overlapped buckets.

    Use it like ``torch.nn.parallel.DistributedDataParallel``: wrap the model after
    ``collectives.init_process_group()`` (or inside ``collectives.launch``), build the optimizer on
    ``model.parameters()``, and train as usual; after ``loss.backward()`` returns, every rank's
    ``param.grad`` holds the average over ranks and ``optimizer.step()`` can follow at once. Any
    optimizer works, since DDP only touches gradients.

    Args:
        module: the model. Parameters may live on any device the group's backend can move
            (CPU with ``p2p``/``torch``, CUDA with ``nccl-cupy``); each bucket lives on its
            parameters' device.
        device_ids, output_device: torch's arguments, accepted for scripts that pass them:
            ``device_ids`` is ``None`` or names the module's one device; ``output_device`` is
            ignored (outputs stay where the module puts them).
        group: the collectives group to average over (default: the default group). The
            parameters are broadcast from its first rank. ``process_group`` is torch's name for it.
        bucket_cap_mb: target bucket size in MiB (torch's default 25). ``0`` puts every parameter
            in its own bucket; ``float("inf")`` makes one bucket per dtype.
        first_bucket_cap_mb: cap of the first bucket (default: ``bucket_cap_mb``). A small first
            bucket starts communicating sooner.
        broadcast_buffers: re-broadcast the module's buffers (e.g. BatchNorm running statistics)
            from the first rank at the start of every forward, like torch's default.
        find_unused_parameters: allow parameters that get no gradient in a backward pass (see the
            module docstring). Costs one extra small all-reduce per step.
        gradient_as_bucket_view: make ``param.grad`` a view into the bucket buffer instead of a
            separate tensor (default True; torch's default is False): saves one copy of the
            gradients in memory and the copy back after the all-reduce (on the bench model 64 MiB
            a step). With ``optimizer.zero_grad(set_to_none=True)`` (torch's default) the next
            backward creates a fresh ``.grad``, which is copied into the bucket once and replaced
            by the view again; ``set_to_none=False`` avoids even that copy. The one thing it
            changes for a user: a ``.grad`` kept across steps is the bucket, overwritten by the
            next reduction (``.clone()`` it to keep it); pass False for separate tensors.
        init_sync: broadcast parameters and buffers at construction (default True).

    Attributes:
        buckets: list of :class:`~ddp.bucket.BucketInfo`, in launch order.
        last_stats: :class:`~ddp.reducer.ReductionStats` of the last synchronised backward pass.
        reducer: the :class:`~ddp.reducer.Reducer` doing the gradient work.
        join_context: the active ``join()`` context (:class:`~ddp.join.Join` sets and clears it), or ``None``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        *,
        group: Group | None = None,
        process_group: Group | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        _check_devices(module, device_ids, output_device)
        if group is not None and process_group is not None:
            raise ValueError("DistributedDataParallel: pass group or process_group (torch's name), not both")
        group = process_group if group is None else group
        self.process_group: Group = collectives.get_group(group, "DistributedDataParallel")
        self.world_size = collectives.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb

        # Trainable parameters, each once (tied parameters are one Parameter object), in
        # registration order; every name a parameter is reachable by, for messages.
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._params: list[nn.Parameter] = []
        self._names: list[str] = []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"DistributedDataParallel: parameter {name} has dtype {p.dtype}; expected one of {_FLOAT_DTYPES}")
            if p.is_sparse:
                raise TypeError(f"DistributedDataParallel: parameter {name} is sparse; only dense parameters are supported")
            others = [a for a in aliases[id(p)] if a != name]
            self._params.append(p)
            self._names.append(name + (f" (= {', '.join(others)})" if others else ""))
        if not self._params:
            log.warning("DistributedDataParallel: the module has no trainable parameters")
        numel = sum(p.numel() for p in self._params)  # before a sharded wrapper empties them

        layout = self._bucket_layout(self._params, bucket_cap_mb, first_bucket_cap_mb)
        self._check_same_layout(self._agreement(self._params, self._names, layout))
        if init_sync:
            broadcast_tensors(list(module.parameters()) + list(module.buffers()), group=self.process_group)
        self.reducer = self._make_reducer(self._params, self._names, layout)
        self.join_context: Join | None = None  # inside join(): the context to notify at each forward
        self._require_sync = True  # False inside no_sync()
        self._forward_sync = True  # _require_sync as it was at the last forward with grad enabled

        # Hooks hold a weak reference: dropping the wrapper disarms them (the module may be
        # wrapped again without the old wrapper still reducing).
        self_ref = weakref.ref(self)
        self._hook_handles = []
        for i, p in enumerate(self._params):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)))
        log.info(
            "%s: %d parameters (%s elements) in %d buckets over %d ranks",
            type(self).__name__,
            len(self._params),
            f"{numel:,}",
            len(layout),
            self.world_size,
        )
        log.debug("bucket layout:\n%s", self.describe_buckets())

    # ------------------------------------------------------------------ public API

    @property
    def buckets(self) -> list[BucketInfo]:
        """The bucket layout, in launch order (bucket 0 first)."""
        return [b.info for b in self.reducer.buckets]

    @property
    def last_stats(self) -> ReductionStats:
        """What the last synchronised backward pass did."""
        return self.reducer.last_stats

    def describe_buckets(self) -> str:
        """The bucket layout as a table: dtype, size and parameter names of each bucket."""
        return format_bucket_table(self.buckets)

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, buckets={len(self.reducer.buckets)}, bucket_cap_mb={self.bucket_cap_mb}, "
            f"find_unused_parameters={self.find_unused_parameters}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        src = None  # buffers come from the group's first rank; inside join() from the one notify names
        if torch.is_grad_enabled():
            self._forward_sync = self._require_sync
            if self.join_context is not None:
                src = self.join_context.notify(self._require_sync)
        with trace.span("forward", "ddp"):
            if self.broadcast_buffers:
                buffers = list(self.module.buffers())
                if buffers:
                    with trace.label("broadcast buffers"):
                        broadcast_tensors(buffers, src=src, group=self.process_group)
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside (or of forwards run inside) skip the
        all-reduce. The next synchronised backward reduces the accumulated ``.grad``::

            for micro in micro_batches[:-1]:
                with model.no_sync():
                    loss_fn(model(micro.x), micro.y).backward()
            loss_fn(model(last.x), last.y).backward()   # reduces the sum of all micro-batches
            optimizer.step()
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the built-in AVG all-reduce.

        As in torch: ``bucket`` is a :class:`~ddp.reducer.GradBucket` (``buffer()``, ``index()``,
        ``parameters()``, ``gradients()``, ``is_last()``, ``set_buffer()``) and the hook returns a
        ``torch.futures.Future`` whose value is the reduced flat tensor; ``state`` is passed through
        (torch's hooks take the process group there: pass ``model.process_group`` or ``None``).
        Register once, before the first backward pass. Ready-made hooks and the rules a hook must
        follow: ``ddp/comm_hooks.py``.
        """
        self.reducer.register_comm_hook(state, hook)

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Train on uneven inputs: ranks that run out of batches shadow the others (``ddp/join.py``)::

            with model.join():
                for x, y in loader:     # a different number of batches on each rank
                    ...
        """
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def remove_hooks(self) -> None:
        """Detach this wrapper from the module's parameters (gradients are no longer reduced)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------------------ construction steps
    # The three methods below are the seams the sharded wrapper (ddp.ZeroDataParallel) overrides:
    # its own layout (flat units), what the ranks must agree on (the stage too) and its Reducer.

    def _bucket_layout(
        self, params: list[nn.Parameter], bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> list[list[int]]:
        """Buckets as lists of indices into ``params``, in launch order (``assign_buckets``)."""
        return assign_buckets(
            [p.numel() * p.element_size() for p in params],
            [(p.dtype, p.device) for p in params],
            cap_from_mb(bucket_cap_mb),
            None if first_bucket_cap_mb is None else cap_from_mb(first_bucket_cap_mb),
        )

    def _agreement(self, params: list[nn.Parameter], names: list[str], layout: list[list[int]]) -> dict[str, int]:
        """What every rank must agree on, as named integers: here a checksum of the layout."""
        text = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)] + layout)
        return {"trainable parameters or the bucket layout": zlib.crc32(text.encode())}

    def _make_reducer(self, params: list[nn.Parameter], names: list[str], layout: list[list[int]]) -> Reducer:
        return Reducer(
            params,
            names,
            layout,
            self.process_group,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def _check_same_layout(self, items: dict[str, int]) -> None:
        """Every rank must agree on ``items`` (:meth:`_agreement`): compare them across ranks.

        A mismatch (different model, different bucket cap) would otherwise pair all-reduces of
        different sizes; all ranks see the same gathered values, so all raise together. It is the
        first collective a wrapper makes.
        """
        device = self._params[0].device if self._params else _group_device(self.module)
        mine = torch.tensor(list(items.values()), dtype=torch.int64, device=device)
        gathered = torch.empty(self.world_size * len(items), dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(gathered, mine, group=self.process_group)
        per_rank = gathered.view(self.world_size, len(items)).t().tolist()
        for (what, _), values in zip(items.items(), per_rank):
            if len(set(values)) > 1:
                raise RuntimeError(
                    f"{type(self).__name__}: the ranks disagree on the {what} (per rank: {values}); build the "
                    "same model with the same arguments on every rank"
                )


def _make_hook(self_ref: "weakref.ref[DistributedDataParallel]", index: int):
    def hook(param: nn.Parameter) -> None:
        self = self_ref()
        if self is not None:
            self.reducer.on_grad_ready(index, sync=self._require_sync and self._forward_sync)

    return hook


def _check_devices(module: nn.Module, device_ids: object, output_device: object) -> None:
    """torch's ``device_ids`` / ``output_device``, for scripts that pass them.

    Our DDP runs the module where its parameters are. ``device_ids`` must then be ``None`` or name
    that one device (``DDP(model, device_ids=[rank])`` on a model moved to ``cuda:rank``; on a CPU
    model ``None``), as torch requires for single-device modules. ``output_device`` is accepted and
    ignored, as torch does for CPU modules: outputs stay where the module puts them.
    """
    if device_ids is None:
        return
    devices = {p.device for p in module.parameters()} or {torch.device("cpu")}
    if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
        raise ValueError(f"DistributedDataParallel: device_ids must be None or a list of one device, got {device_ids!r}")
    d = device_ids[0]
    device = torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else torch.device(d)
    if devices != {device}:
        raise ValueError(
            f"DistributedDataParallel: device_ids={device_ids!r} but the module's parameters are on "
            f"{sorted(map(str, devices))}; device_ids must name the module's one device (None for a CPU module)"
        )


def _group_device(module: nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


__all__ = ["DistributedDataParallel"]
