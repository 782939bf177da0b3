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
averaged gradients are bitwise equal on all ranks and the replicas never drift apart.

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
import dataclasses
import logging
import time
import weakref
import zlib
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp, Work, trace

from .bucket import BucketInfo, assign_buckets, cap_from_mb, format_bucket_table
from .join import Join
from .naive import broadcast_tensors

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass
class ReductionStats:
    """What the last synchronised backward pass did (``DistributedDataParallel.last_stats``).

    Attributes:
        buckets: number of buckets reduced.
        launched_during_backward: buckets whose all-reduce started before the end of the backward
            pass (the overlapped ones); the others started in the final callback.
        first_launch_s: seconds from the first gradient hook to the first bucket launch.
        backward_s: seconds from the first gradient hook to the final callback (the part of the
            backward pass that communication could overlap).
        wait_s: seconds the final callback waited for outstanding all-reduces (exposed
            communication).
        unused_params: names of parameters that got no gradient on this rank.
    """

    buckets: int = 0
    launched_during_backward: int = 0
    first_launch_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0
    unused_params: tuple[str, ...] = ()


class _Bucket:
    """Runtime state of one bucket: its flat buffer and the views of its parameters' gradients."""

    __slots__ = ("index", "param_indices", "buffer", "views", "info")

    def __init__(self, index: int, param_indices: list[int], params: list[nn.Parameter], names: list[str]):
        self.index = index
        self.param_indices = param_indices
        first = params[param_indices[0]]
        numel = sum(params[i].numel() for i in param_indices)
        self.buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for i in param_indices:
            p = params[i]
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.info = BucketInfo(
            index=index,
            dtype=first.dtype,
            device=first.device,
            param_names=tuple(names[i] for i in param_indices),
            shapes=tuple(tuple(params[i].shape) for i in param_indices),
            numel=numel,
            nbytes=numel * self.buffer.element_size(),
        )


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        grad.data_ptr() == view.data_ptr()
        and grad.shape == view.shape
        and grad.stride() == view.stride()
        and grad.dtype == view.dtype
    )


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
        group: the collectives group to average over (default: the default group). The
            parameters are broadcast from its first rank.
        bucket_cap_mb: target bucket size in MiB (torch's default 25). ``0`` puts every parameter
            in its own bucket; ``float("inf")`` makes one bucket per dtype.
        first_bucket_cap_mb: cap of the first bucket (default: ``bucket_cap_mb``). A small first
            bucket starts communicating sooner.
        broadcast_buffers: re-broadcast the module's buffers (e.g. BatchNorm running statistics)
            from the first rank at the start of every forward, like torch's default.
        find_unused_parameters: allow parameters that get no gradient in a backward pass (see the
            module docstring). Costs one extra small all-reduce per step.
        gradient_as_bucket_view: make ``param.grad`` a view into the bucket buffer instead of a
            separate tensor: saves one copy of the gradients in memory and the copy back after the
            all-reduce. With ``optimizer.zero_grad(set_to_none=True)`` (torch's default) the next
            backward creates a fresh ``.grad``, which is copied into the bucket once and replaced
            by the view again; ``set_to_none=False`` avoids even that copy.
        init_sync: broadcast parameters and buffers at construction (default True).

    Attributes:
        buckets: list of :class:`~ddp.bucket.BucketInfo`, in launch order.
        last_stats: :class:`ReductionStats` of the last synchronised backward pass.
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
        gradient_as_bucket_view: bool = False,
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
        self.process_group: Group = collectives.get_default_group() if group is None else group
        self.world_size = self.process_group.size()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self.last_stats = ReductionStats()

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

        layout = assign_buckets(
            [p.numel() * p.element_size() for p in self._params],
            [(p.dtype, p.device) for p in self._params],
            cap_from_mb(bucket_cap_mb),
            None if first_bucket_cap_mb is None else cap_from_mb(first_bucket_cap_mb),
        )
        self._buckets = [_Bucket(b, idx, self._params, self._names) for b, idx in enumerate(layout)]
        self._bucket_of: list[int] = [0] * len(self._params)
        self._view_of: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for i, view in zip(bucket.param_indices, bucket.views):
                self._bucket_of[i] = bucket.index
                self._view_of[i] = view

        self._check_same_layout()
        if init_sync:
            broadcast_tensors(list(module.parameters()) + list(module.buffers()), group=self.process_group)
        if gradient_as_bucket_view:
            with torch.no_grad():
                for p, view in zip(self._params, self._view_of):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

        # Per-backward state.
        self._join: Join | None = None  # inside join(): the context to notify at each forward
        self._require_sync = True  # False inside no_sync()
        self._forward_sync = True  # _require_sync as it was at the last forward with grad enabled
        self._active = False  # a synchronised backward pass is under way
        self._graph_task = -1
        self._ready = [False] * len(self._params)
        self._pending = [len(b.param_indices) for b in self._buckets]
        self._next_bucket = 0
        self._works: list[Work | None] = [None] * len(self._buckets)
        self._used = [False] * len(self._params)  # got a gradient since the last synchronised step
        self._t_start = 0.0
        self._t_first_launch = 0.0

        # Hooks hold a weak reference: dropping the wrapper disarms them (the module may be
        # wrapped again without the old wrapper still reducing).
        self_ref = weakref.ref(self)
        self._hook_handles = []
        for i, p in enumerate(self._params):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(self_ref, i)))
        log.info(
            "DistributedDataParallel: %d parameters (%s elements) in %d buckets over %d ranks",
            len(self._params),
            f"{sum(p.numel() for p in self._params):,}",
            len(self._buckets),
            self.world_size,
        )
        log.debug("bucket layout:\n%s", self.describe_buckets())

    # ------------------------------------------------------------------ public API

    @property
    def buckets(self) -> list[BucketInfo]:
        """The bucket layout, in launch order (bucket 0 first)."""
        return [b.info for b in self._buckets]

    def describe_buckets(self) -> str:
        """The bucket layout as a table: dtype, size and parameter names of each bucket."""
        return format_bucket_table(self.buckets)

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, buckets={len(self._buckets)}, bucket_cap_mb={self.bucket_cap_mb}, "
            f"find_unused_parameters={self.find_unused_parameters}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        src = None  # buffers come from the group's first rank; inside join() from the one notify names
        if torch.is_grad_enabled():
            self._forward_sync = self._require_sync
            if self._join is not None:
                src = self._join.notify(self._require_sync)
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

    # ------------------------------------------------------------------ construction checks

    def _check_same_layout(self) -> None:
        """Every rank must hold the same parameters in the same buckets: compare a checksum.

        A mismatch (different model, different bucket cap) would otherwise pair all-reduces of
        different sizes; all ranks see the same gathered checksums, so all raise together.
        """
        text = repr(
            [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
            + [b.param_indices for b in self._buckets]
        )
        device = self._params[0].device if self._params else _group_device(self.module)
        mine = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=device)
        gathered = torch.empty(self.world_size, dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(gathered, mine, group=self.process_group)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(
                "DistributedDataParallel: the ranks disagree on the trainable parameters or the bucket "
                f"layout (checksums per rank: {gathered.tolist()}); build the same model with the same "
                "arguments on every rank"
            )

    # ------------------------------------------------------------------ backward machinery

    @torch.no_grad()
    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is final for this backward pass."""
        self._used[index] = True
        if not (self._require_sync and self._forward_sync):
            return  # no_sync: the gradient stays (accumulates) in param.grad
        task = torch._C._current_graph_task_id()
        if not self._active:
            self._start_pass(task)
        elif task != self._graph_task:
            log.warning("the previous backward pass ended without its gradient reduction (did it raise?); resetting")
            self._abandon_pass()
            self._start_pass(task)
        if self._ready[index]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self._names[index]} received its gradient twice in one "
                "backward pass (reentrant checkpointing or a second backward inside the first?); not supported"
            )
        grad = param.grad
        if grad is None:  # cannot happen for a post-accumulate hook, but be explicit
            raise RuntimeError(f"DistributedDataParallel: hook of {self._names[index]} fired without a gradient")
        if grad.is_sparse:
            raise RuntimeError(f"DistributedDataParallel: parameter {self._names[index]} has a sparse gradient; not supported")
        view = self._view_of[index]
        if self.gradient_as_bucket_view:
            if not _is_view_of(grad, view):
                view.copy_(grad)
                param.grad = view
        else:
            view.copy_(grad)
        self._mark_ready(index)

    def _start_pass(self, task: int) -> None:
        self._active = True
        self._graph_task = task
        self._ready = [False] * len(self._params)
        self._pending = [len(b.param_indices) for b in self._buckets]
        self._next_bucket = 0
        self._works = [None] * len(self._buckets)
        self._t_start = time.perf_counter()
        self._t_first_launch = 0.0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)

    def _abandon_pass(self) -> None:
        for work in self._works:
            if work is not None:
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - best effort, the pass is discarded
                    log.warning("discarded all-reduce failed: %s", exc)
        self._active = False

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        b = self._bucket_of[index]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every complete bucket, strictly in bucket order (the same order on every rank)."""
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            bucket = self._buckets[self._next_bucket]
            if bucket.buffer.device.type == "cuda":
                # The gradients were written by kernels queued on this thread's stream; the
                # communication thread must not read the buffer before they ran.
                torch.cuda.current_stream(bucket.buffer.device).synchronize()
            with trace.label(f"all_reduce bucket {bucket.index}"):
                self._works[bucket.index] = collectives.all_reduce(
                    bucket.buffer, ReduceOp.AVG, group=self.process_group, async_op=True
                )
            if not self._t_first_launch:
                self._t_first_launch = time.perf_counter()
            self._next_bucket += 1

    def _finish_pass(self) -> None:
        """Autograd's end-of-backward callback: complete, wait, and write back the gradients."""
        t_end = time.perf_counter()
        launched_early = self._next_bucket
        try:
            unused = [i for i, ready in enumerate(self._ready) if not ready]
            used_anywhere: list[bool] | None = None
            if unused and not self.find_unused_parameters:
                names = [self._names[i] for i in unused]
                shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
                raise RuntimeError(
                    f"DistributedDataParallel: {len(names)} parameter(s) received no gradient in this backward "
                    f"pass: {shown}. They took no part in computing the loss, so their buckets can never be "
                    "reduced. Pass find_unused_parameters=True if parameters may go unused, set "
                    "requires_grad=False on parameters that never train, or make every parameter contribute "
                    "to the loss. (Other ranks, if they used these parameters, are now waiting in an "
                    "all-reduce and will fail with the collectives' timeout.)"
                )
            if unused:
                with torch.no_grad():
                    for i in unused:
                        self._fill_unready(i)
                for i in unused:
                    self._ready[i] = True
                    self._pending[self._bucket_of[i]] -= 1
                self._launch_ready_buckets()
            t_wait = time.perf_counter()
            if self.find_unused_parameters:
                used_anywhere = self._all_reduce_used()  # queued behind the buckets
            for work in self._works:
                assert work is not None
                work.wait()
            t_done = time.perf_counter()
            wait_s = t_done - t_wait
            tracer = trace.active()
            if tracer is not None:
                ns = lambda s: int(s * 1e9)  # noqa: E731 - perf_counter and perf_counter_ns share a clock
                tracer.add("backward (gradient hooks)", "ddp", ns(self._t_start), ns(t_end), {"buckets_launched": launched_early})
                tracer.add("wait for buckets", "ddp", ns(t_wait), ns(t_done), {"buckets": len(self._buckets)})
            with torch.no_grad():
                self._write_back(used_anywhere)
            self.last_stats = ReductionStats(
                buckets=len(self._buckets),
                launched_during_backward=launched_early,
                first_launch_s=(self._t_first_launch - self._t_start) if self._t_first_launch else 0.0,
                backward_s=t_end - self._t_start,
                wait_s=wait_s,
                unused_params=tuple(self._names[i] for i in unused),
            )
        finally:
            self._active = False
            self._used = [False] * len(self._params)

    def _fill_unready(self, i: int) -> None:
        """Put the gradient of a parameter that got none in this pass into its bucket slot."""
        p, view = self._params[i], self._view_of[i]
        if p.grad is None:
            view.zero_()
        elif self.gradient_as_bucket_view:
            if not _is_view_of(p.grad, view):
                view.copy_(p.grad)
                p.grad = view
        else:
            view.copy_(p.grad)  # accumulated under no_sync, or left over

    def _all_reduce_used(self) -> list[bool]:
        """Which parameters got a gradient on at least one rank (one small all-reduce)."""
        device = self._buckets[0].buffer.device if self._buckets else torch.device("cpu")
        flags = torch.tensor(self._used, dtype=torch.int32, device=device)
        collectives.all_reduce(flags, ReduceOp.MAX, group=self.process_group)
        return [bool(f) for f in flags.tolist()]

    def _write_back(self, used_anywhere: list[bool] | None) -> None:
        """Averaged bucket contents -> ``param.grad``."""
        for bucket in self._buckets:
            for i, view in zip(bucket.param_indices, bucket.views):
                p = self._params[i]
                if p.grad is None:
                    if used_anywhere is not None and not used_anywhere[i]:
                        continue  # used on no rank: leave None, the optimizer skips it
                    p.grad = view if self.gradient_as_bucket_view else view.clone()
                elif not _is_view_of(p.grad, view):
                    p.grad.copy_(view)


def _make_hook(self_ref: "weakref.ref[DistributedDataParallel]", index: int):
    def hook(param: nn.Parameter) -> None:
        self = self_ref()
        if self is not None:
            self._on_grad_ready(index, param)

    return hook


def _check_devices(module: nn.Module, device_ids: object, output_device: object) -> None:
    """torch's ``device_ids`` / ``output_device``: accepted when they name the module's one device.

    Our DDP runs the module where its parameters are; these arguments only say so (as for a
    single-device module in torch). ``DDP(model, device_ids=[rank])`` on a model moved to
    ``cuda:rank`` works; on a CPU model, as in torch, they must be ``None``.
    """
    if device_ids is None and output_device is None:
        return
    devices = {p.device for p in module.parameters()} or {torch.device("cpu")}
    if device_ids is not None and (not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1):
        raise ValueError(f"DistributedDataParallel: device_ids must be None or a list of one device, got {device_ids!r}")
    for what, d in (("device_ids[0]", device_ids[0] if device_ids else None), ("output_device", output_device)):
        if d is None:
            continue
        device = torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else torch.device(d)
        if devices != {device}:
            raise ValueError(
                f"DistributedDataParallel: {what}={d!r} but the module's parameters are on "
                f"{sorted(map(str, devices))}; device_ids/output_device must name the module's one device "
                "(None for a CPU module)"
            )


def _group_device(module: nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


__all__ = ["DistributedDataParallel", "ReductionStats"]
