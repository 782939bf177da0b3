"""The Reducer: buckets of gradients, reduced in order while the backward pass runs.

:class:`~ddp.DistributedDataParallel` (the module) finds the parameters, broadcasts the state and
registers one hook per parameter; every hook call lands here. The Reducer owns the rest:

* :class:`Bucket`: one flat buffer per bucket and the views of its parameters' gradients in it;
  it copies a gradient into its slot (:meth:`Bucket.fill`) and the reduced values back to
  ``.grad`` (:meth:`Bucket.write_back`);
* a :class:`_Pass` per synchronised backward pass, made by its first hook (or
  :meth:`Reducer.arrive_unused`) and dropped by the end-of-backward callback: which gradients arrived, each bucket's count of missing gradients and
  its reduction in flight (:class:`_Reduction`), which bucket is next to launch, timings. Nothing
  about a pass outlives it, so a pass that raised cannot leak into the next;
* the comm hook: by default a bucket is reduced with ``all_reduce(AVG, async_op=True)``; with
  :meth:`Reducer.register_comm_hook` the hook decides (see ``ddp/comm_hooks.py``).

The Reducer drives its buckets only through ``fill``, ``start``, ``complete`` (``keep=False``
when it drains a pass whose backward raised) and ``write_back``
(plus ``index``, ``param_indices``, ``params`` and ``info``), so another kind of bucket can take
the same path through the backward pass: ``make_bucket`` builds them and ``retire_early`` bounds
how many are in flight (``ddp/zero/buckets.py`` reduce-scatters into per-rank shards that way).

One bucket's life in a pass::

    hooks fill it: missing 3 -> 2 -> 1 -> 0   complete; launched once every earlier bucket is
    launch: all_reduce / the comm hook         queued on the group's communication thread
    end of backward: wait                      the reduced flat tensor lands in the buffer
    write back                                 buffer -> param.grad (nothing to do for views)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp, Work, trace

from .bucket import BucketInfo

log = logging.getLogger(__name__)

#: A comm hook: ``hook(state, bucket) -> Future`` whose value is the reduced flat tensor.
CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]  # quoted: defined below


@dataclasses.dataclass
class ReductionStats:
    """What the last synchronised backward pass did (``DistributedDataParallel.last_stats``).

    Attributes:
        buckets: number of buckets reduced.
        launched_during_backward: buckets whose reduction started before the end of the backward
            pass (the overlapped ones); the others started in the final callback.
        first_launch_s: seconds from the first gradient hook to the first bucket launch.
        backward_s: seconds from the first gradient hook to the final callback (the part of the
            backward pass that communication could overlap).
        wait_s: seconds the final callback waited for outstanding reductions (exposed
            communication).
        unused_params: names of parameters that got no gradient on this rank.
    """

    buckets: int = 0
    launched_during_backward: int = 0
    first_launch_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0
    unused_params: tuple[str, ...] = ()


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        grad.data_ptr() == view.data_ptr()
        and grad.shape == view.shape
        and grad.stride() == view.stride()
        and grad.dtype == view.dtype
    )


class Bucket:
    """One bucket: a flat buffer holding the gradients of some parameters, one slot each.

    Built once, at construction; it holds no per-pass state.

    Attributes:
        index: launch order (bucket 0 first).
        param_indices: the parameters' indices in the Reducer's list, in buffer order.
        params: those parameters.
        buffer: the flat buffer (one dtype, one device), zeroed, from ``make_buffer(numel,
            dtype, device)`` (default ``torch.zeros``). The Reducer puts CPU buckets in
            symmetric memory (:func:`collectives.symmetric_empty`): over ``shm`` the peers read
            them in place, so the all-reduce copies nothing into shared memory first.
        views: ``views[k]`` is ``params[k]``'s slot in ``buffer``, shaped like the parameter.
        info: the readable :class:`~ddp.bucket.BucketInfo`.
    """

    __slots__ = ("index", "param_indices", "params", "buffer", "views", "info")

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        make_buffer: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
    ):
        self.index = index
        self.param_indices = param_indices
        self.params = [params[i] for i in param_indices]
        numel = sum(p.numel() for p in self.params)
        dtype, device = self.params[0].dtype, self.params[0].device
        if make_buffer is None:
            self.buffer = torch.zeros(numel, dtype=dtype, device=device)
        else:
            self.buffer = make_buffer(numel, dtype, device).zero_()
        self.views = _views(self.buffer, self.params)
        self.info = BucketInfo(
            index=index,
            dtype=self.buffer.dtype,
            device=self.buffer.device,
            param_names=tuple(names[i] for i in param_indices),
            shapes=tuple(tuple(p.shape) for p in self.params),
            numel=numel,
            nbytes=numel * self.buffer.element_size(),
        )

    def fill(self, slot: int, as_view: bool) -> None:
        """Put ``params[slot].grad`` into its slot (zeros if it has none).

        With ``as_view`` the slot *becomes* ``.grad``: a fresh gradient is copied in once and
        replaced by the view, which autograd then accumulates into directly.
        """
        p, view = self.params[slot], self.views[slot]
        if p.grad is None:
            view.zero_()
        elif not as_view:
            view.copy_(p.grad)
        elif not _is_view_of(p.grad, view):
            view.copy_(p.grad)
            p.grad = view

    def start(self, reducer: Reducer, is_last: bool) -> Work | torch.futures.Future:
        """Start reducing the (complete) bucket: the built-in AVG all-reduce, or the comm hook."""
        if self.buffer.device.type == "cuda":
            # The gradients were written by kernels queued on this thread's stream; the
            # communication thread must not read the buffer before they ran.
            torch.cuda.current_stream(self.buffer.device).synchronize()
        hook = reducer.comm_hook
        if hook is None:
            with trace.label(f"all_reduce bucket {self.index}"):
                return collectives.all_reduce(self.buffer, ReduceOp.AVG, group=reducer.group, async_op=True)
        with trace.label(f"{_hook_name(hook)} bucket {self.index}"):
            future = hook(reducer.comm_state, GradBucket(self, is_last))
        if not isinstance(future, torch._C.Future):  # the base of torch.futures.Future, and what .then() returns
            raise TypeError(
                f"DistributedDataParallel: comm hook {_hook_name(hook)} returned {type(future).__name__} for bucket "
                f"{self.index}; a hook must return a torch.futures.Future whose value is the reduced flat tensor, "
                "e.g. collectives.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0])"
            )
        return future

    def complete(self, pending: Work | torch.futures.Future, reducer: Reducer, keep: bool = True) -> None:
        """Wait for what :meth:`start` returned; afterwards the buffer holds the reduced gradients
        (``keep=False``: the pass is being discarded, only wait)."""
        buffer = self.buffer
        if isinstance(pending, Work):
            pending.wait()
            return
        value = pending.wait()
        if not keep:
            return
        if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel() or value.dtype != buffer.dtype:
            got = f"a {value.dtype} tensor of {value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(
                f"DistributedDataParallel: the future of comm hook {_hook_name(reducer.comm_hook)} for bucket "
                f"{self.index} holds {got}; expected the reduced flat tensor ({buffer.dtype}, "
                f"{buffer.numel()} elements), like bucket.buffer()"
            )
        if value.data_ptr() != buffer.data_ptr():
            buffer.copy_(value.reshape(-1))

    def write_back(self, as_view: bool, used_anywhere: list[bool] | None) -> None:
        """The reduced buffer -> every parameter's ``.grad``.

        ``used_anywhere`` (find_unused_parameters) is indexed like the Reducer's parameters; a
        parameter used on no rank keeps ``.grad = None``, so the optimizer skips it.
        """
        for i, p, view in zip(self.param_indices, self.params, self.views):
            if p.grad is None:
                if used_anywhere is not None and not used_anywhere[i]:
                    continue
                p.grad = view if as_view else view.clone()
            elif not _is_view_of(p.grad, view):
                p.grad.copy_(view)


def _views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


class GradBucket:
    """What a comm hook sees of one bucket: the surface of torch's ``dist.GradBucket``.

    ``buffer()`` is the bucket's flat buffer itself (not a copy): a hook may reduce it in place
    and return it, as torch's hooks do.
    """

    def __init__(self, bucket: Bucket, is_last: bool):
        self._bucket = bucket
        self._buffer = bucket.buffer
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's position in launch order; bucket 0 is reduced first."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor of all the bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of ``buffer()`` per parameter, shaped like it (same order as ``parameters()``)."""
        return _views(self._buffer, self._bucket.params)

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in buffer order."""
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (the last one launched)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Make ``buffer()`` (and ``gradients()``) return ``buffer`` for the rest of this hook call.

        As in torch, this changes what the hook reads, not where the result comes from: the
        reduced gradients are always the value of the future the hook returns.
        """
        old = self._buffer
        if not isinstance(buffer, torch.Tensor) or buffer.shape != old.shape or buffer.dtype != old.dtype:
            raise ValueError(
                f"GradBucket.set_buffer: expected a tensor of shape {tuple(old.shape)} and dtype {old.dtype}, got "
                f"{buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer).__name__} "
                f"{tuple(buffer.shape) if isinstance(buffer, torch.Tensor) else ''}"
            )
        self._buffer = buffer


def _hook_name(hook: CommHook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


class _Reduction:
    """One bucket during one backward pass: gradients still missing, then its reduction in flight."""

    __slots__ = ("bucket", "missing", "pending")

    def __init__(self, bucket: Bucket):
        self.bucket = bucket
        self.missing = len(bucket.param_indices)
        self.pending: Work | torch.futures.Future | None = None  # set by launch, cleared by wait

    def launch(self, reducer: Reducer, is_last: bool) -> None:
        self.pending = self.bucket.start(reducer, is_last)

    def wait(self, reducer: Reducer, keep: bool = True) -> None:
        """Wait for the reduction (once; later calls do nothing); ``keep=False`` discards its result."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.bucket.complete(pending, reducer, keep)


class _Pass:
    """The state of one synchronised backward pass: made at its first hook, dropped at its end."""

    __slots__ = ("task", "arrived", "unreached", "reductions", "next_launch", "t_start", "t_first_launch")

    def __init__(self, buckets: Sequence[Bucket], n_params: int, task: int):
        self.task = task  # autograd graph task id: tells a new backward from this one
        self.arrived = [False] * n_params
        self.unreached: list[int] = []  # arrived through arrive_unused, without a gradient
        self.reductions = [_Reduction(b) for b in buckets]
        self.next_launch = 0  # index of the first bucket not launched yet
        self.t_start = time.perf_counter()
        self.t_first_launch = 0.0


class Reducer:
    """Buckets the gradients of ``params`` and reduces them over ``group`` during backward.

    Args:
        params: the trainable parameters, each once.
        names: a name per parameter, for messages and the bucket table.
        layout: buckets as lists of parameter indices, in launch order (``assign_buckets``).
        group: the group to reduce over.
        find_unused_parameters, gradient_as_bucket_view: as documented on
            :class:`~ddp.DistributedDataParallel`.
        make_bucket: ``make_bucket(index, param_indices)`` builds bucket ``index``; default a
            :class:`Bucket` (a persistent flat buffer, all-reduced). Any object with the same
            methods works (see the module docstring).
        retire_early: when a bucket receives its first gradient of a pass, first wait for every
            reduction already launched. Buckets whose buffers live only while they are reduced
            then hold at most one filling and one reducing buffer at a time, at the price of
            overlapping each reduction with the gradients of the next bucket only.

    Attributes:
        buckets: the :class:`Bucket` objects, in launch order.
        last_stats: :class:`ReductionStats` of the last synchronised backward pass.
        comm_hook, comm_state: the registered comm hook and its state (``None``: built-in AVG).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        layout: Sequence[list[int]],
        group: Group,
        *,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        make_bucket: Callable[[int, list[int]], Bucket] | None = None,
        retire_early: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.retire_early = retire_early
        if make_bucket is None:
            make_bucket = lambda b, idx: Bucket(b, idx, self.params, self.names, self._bucket_buffer)  # noqa: E731
        self.buckets = [make_bucket(b, list(idx)) for b, idx in enumerate(layout)]
        self._slot_of: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._slot_of[i] = (bucket, slot)
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.last_stats = ReductionStats()
        self._pass: _Pass | None = None
        self._passes = 0  # synchronised backward passes started
        # Which parameters got a gradient since the last synchronised pass ended. This spans the
        # no_sync() passes before it, so it is per step, not per pass.
        self._used = [False] * len(self.params)
        if gradient_as_bucket_view:
            with torch.no_grad():
                for bucket in self.buckets:
                    for slot, p in enumerate(bucket.params):
                        if p.grad is not None:
                            bucket.fill(slot, as_view=True)

    def _bucket_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """CPU buckets live in symmetric memory: over ``shm`` the peers read them in place."""
        if device.type == "cpu":
            return collectives.symmetric_empty(numel, dtype=dtype, group=self.group)
        return torch.empty(numel, dtype=dtype, device=device)

    # ------------------------------------------------------------------ comm hook

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` from now on (see ``ddp/comm_hooks.py``)."""
        name = "register_comm_hook"
        if self.comm_hook is not None:
            raise RuntimeError(f"{name}: a comm hook ({_hook_name(self.comm_hook)}) is already registered; it can be registered only once")
        if self._passes:
            raise RuntimeError(f"{name}: register the comm hook before the first backward pass ({self._passes} ran already)")
        if not callable(hook):
            raise TypeError(f"{name}: hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError:
            raise TypeError(f"{name}: hook {_hook_name(hook)} must take two arguments (state, bucket)") from None
        except ValueError:
            pass  # no signature to inspect (some builtins): trust the caller
        self.comm_hook, self.comm_state = hook, state

    # ------------------------------------------------------------------ the backward pass

    @torch.no_grad()
    def on_grad_ready(self, index: int, sync: bool) -> None:
        """Called by parameter ``index``'s hook once its ``.grad`` is final for this backward pass.

        ``sync=False`` (inside ``no_sync()``): the gradient stays, and accumulates, in ``.grad``.
        """
        self._used[index] = True
        if not sync:
            return
        if self._current_pass().arrived[index]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self.names[index]} received its gradient twice in one "
                "backward pass (reentrant checkpointing, a second backward inside the first, or, with "
                "find_unused_parameters at ZeRO stage 3, a gradient the last forward's outputs did not lead to?); "
                "not supported"
            )
        grad = self.params[index].grad
        if grad is None:  # cannot happen for a post-accumulate hook, but be explicit
            raise RuntimeError(f"DistributedDataParallel: hook of {self.names[index]} fired without a gradient")
        if grad.is_sparse:
            raise RuntimeError(f"DistributedDataParallel: parameter {self.names[index]} has a sparse gradient; not supported")
        self._arrive(index)

    @torch.no_grad()
    def arrive_unused(self, indices: Sequence[int], sync: bool) -> None:
        """Count parameters ``indices`` as arrived now: this backward pass will not reach them.

        For a caller that knows it before the end of the pass (ZeRO stage 3 walks the forward's
        autograd graph): their slots get zeros (or what ``no_sync`` accumulated in ``.grad``) at
        once, so their buckets launch when the used parameters' gradients are in, at the same point
        of the pass as on the ranks that used them, instead of at its end. They stay unused for
        ``find_unused_parameters``' "used anywhere" flags. Parameters already arrived are skipped.
        """
        if not sync:
            return
        p = self._current_pass()
        for i in indices:
            if not p.arrived[i]:
                p.unreached.append(i)
                self._arrive(i)

    def _current_pass(self) -> _Pass:
        """The pass of the running backward; the first hook of a backward pass makes it."""
        task = torch._C._current_graph_task_id()
        if self._pass is not None and self._pass.task != task:
            log.warning("the previous backward pass ended without its gradient reduction (did it raise?); resetting")
            self._abandon()
        if self._pass is None:
            self._pass = _Pass(self.buckets, len(self.params), task)
            self._passes += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return self._pass

    def _arrive(self, index: int) -> None:
        """Put parameter ``index``'s gradient into its bucket; launch whatever became launchable."""
        bucket, slot = self._slot_of[index]
        p = self._pass
        assert p is not None
        if self.retire_early and p.reductions[bucket.index].missing == len(bucket.param_indices):
            for r in p.reductions[: p.next_launch]:  # this bucket's first gradient: retire the launched ones
                r.wait(self)
        bucket.fill(slot, self.gradient_as_bucket_view)
        p.arrived[index] = True
        p.reductions[bucket.index].missing -= 1
        # Strictly in bucket order, the same on every rank: our collectives pair by order.
        while p.next_launch < len(p.reductions) and p.reductions[p.next_launch].missing == 0:
            p.reductions[p.next_launch].launch(self, is_last=p.next_launch == len(p.reductions) - 1)
            if not p.t_first_launch:
                p.t_first_launch = time.perf_counter()
            p.next_launch += 1

    def _abandon(self) -> None:
        """Drop a pass that never reached its end (its backward raised): drain what it launched."""
        assert self._pass is not None
        for r in self._pass.reductions:
            if r.pending is not None:
                try:
                    r.wait(self, keep=False)
                except Exception as exc:  # noqa: BLE001 - best effort, the pass is discarded
                    log.warning("discarded reduction of bucket %d failed: %s", r.bucket.index, exc)
        self._pass = None

    def _finish(self) -> None:
        """Autograd's end-of-backward callback: complete, wait, and write back the gradients."""
        p = self._pass
        assert p is not None
        t_end = time.perf_counter()
        launched_early = p.next_launch
        try:
            unused = [i for i, arrived in enumerate(p.arrived) if not arrived]
            if unused and not self.find_unused_parameters:
                raise RuntimeError(self._unused_message(unused))
            with torch.no_grad():
                for i in unused:  # zeros, or the gradient accumulated under no_sync
                    self._arrive(i)
            t_wait = time.perf_counter()
            used_anywhere = self._all_reduce_used() if self.find_unused_parameters else None  # queued behind the buckets
            for r in p.reductions:
                r.wait(self)
            t_done = time.perf_counter()
            tracer = trace.active()
            if tracer is not None:
                ns = lambda s: int(s * 1e9)  # noqa: E731 - perf_counter and perf_counter_ns share a clock
                tracer.add("backward (gradient hooks)", "ddp", ns(p.t_start), ns(t_end), {"buckets_launched": launched_early})
                tracer.add("wait for buckets", "ddp", ns(t_wait), ns(t_done), {"buckets": len(self.buckets)})
            with torch.no_grad():
                for bucket in self.buckets:
                    bucket.write_back(self.gradient_as_bucket_view, used_anywhere)
            self.last_stats = ReductionStats(
                buckets=len(self.buckets),
                launched_during_backward=launched_early,
                first_launch_s=(p.t_first_launch - p.t_start) if p.t_first_launch else 0.0,
                backward_s=t_end - p.t_start,
                wait_s=t_done - t_wait,
                unused_params=tuple(self.names[i] for i in sorted(unused + p.unreached)),
            )
        finally:
            self._pass = None
            self._used = [False] * len(self.params)

    def _unused_message(self, unused: list[int]) -> str:
        names = [self.names[i] for i in unused]
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        return (
            f"DistributedDataParallel: {len(names)} parameter(s) received no gradient in this backward "
            f"pass: {shown}. They took no part in computing the loss, so their buckets can never be "
            "reduced. Pass find_unused_parameters=True if parameters may go unused, set "
            "requires_grad=False on parameters that never train, or make every parameter contribute "
            "to the loss. (Other ranks, if they used these parameters, are now waiting in an "
            "all-reduce and will fail with the collectives' timeout.)"
        )

    def _all_reduce_used(self) -> list[bool]:
        """Which parameters got a gradient on at least one rank (one small all-reduce)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor(self._used, dtype=torch.int32, device=device)
        collectives.all_reduce(flags, ReduceOp.MAX, group=self.group)
        return [bool(f) for f in flags.tolist()]
