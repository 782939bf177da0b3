"""``ZeroDataParallel``: DDP that shards optimizer state (1), gradients (2) and parameters (3).

One wrapper, one argument::

    model = ddp.ZeroDataParallel(net, stage=2)                       # 0, 1, 2 or 3
    optimizer = ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

The ladder (``n`` ranks, ``Ψ`` parameter bytes; bytes sent per rank and step on a ring):

=====  ===============================  ==========================================  ===========
stage  each rank keeps                  collectives per step                        bytes sent
=====  ===============================  ==========================================  ===========
0      everything (plain DDP)           all-reduce of the gradients                 2(n-1)/n Ψ
1      1/n of the optimizer state       reduce-scatter of the gradients (during     2(n-1)/n Ψ
                                        backward), all-gather of the parameters
                                        (after the step)
2      1/n of optimizer state and       as stage 1; the gradient buckets exist      2(n-1)/n Ψ
       gradients                        only while they are reduced
3      1/n of everything                all-gather of each unit before its forward  3(n-1)/n Ψ
                                        and again before its backward,
                                        reduce-scatter of its gradients after it
=====  ===============================  ==========================================  ===========

Stage 0 is :class:`~ddp.DistributedDataParallel` (this class adds nothing but the checks). The
others reuse its machinery: the same hooks, the same :class:`~ddp.reducer.Reducer` launching
buckets in order while the backward pass runs, with reduce-scattering buckets
(``buckets.py``) in place of all-reduced ones. Where shards live:

* **Stages 1, 2** flatten each bucket's parameters into one buffer (``units.py``): the module
  computes with the full values as before; rank ``r`` owns chunk ``r`` of every bucket. Backward
  reduce-scatters every bucket into its owner's chunk (overlapped, bucket by bucket); the
  optimizer (``optimizer.py``) updates this rank's chunks only, keeping state for them only, then
  one in-place all-gather per bucket brings the updated chunks to everyone. Stage 1 keeps the
  gradient buckets allocated between steps, as DDP does; stage 2 allocates a bucket when its
  first gradient arrives and frees it after its reduce-scatter.
* **Stage 3** shards the parameters too, per *unit*: by default every submodule that holds
  parameters itself (``units=`` picks others: module types or instances, e.g. transformer
  blocks); parameters of no unit, or shared by two, form the root unit. Between steps a rank
  holds only its master chunk of each unit. A unit is all-gathered when its forward starts and
  freed when it ends; gathered again when the gradient of its output arrives (just before its
  backward) and freed when its last gradient is in and its reduce-scatter is queued. While one
  unit computes, the next one's all-gather runs on the communication thread (``prefetch``): in
  forward the next unit in the previous forward's order, in backward the one before it in this
  forward's order. At most two units (and the root) are gathered at a time.

Mixed precision (stages 1-3, ``MixedPrecision``): the module computes with ``param_dtype``
copies (bfloat16 or float16), gradients are reduced in ``reduce_dtype`` (default
``param_dtype``), and the optimizer updates master chunks in the parameters' own dtype (float32):
the low-precision copies are cast from the masters after every step.

Exactness: the averaged gradient of every element is the same number DDP computes when the
reduce-scatter adds the ranks in the same order as the all-reduce (see ``buckets.py``), and the
optimizer applies the same element-wise update to it, so on the same data the parameters equal
our DDP's (bitwise at 2 ranks, and on ``shm`` at any size) and a single process's within float
rounding.

Limits: ``join()`` and comm hooks are stage-0 only; dense floating-point parameters; at stage 3
every rank must run the same units in the same order (the gather order is checked at the end of
every backward pass: a rank-dependent branch raises on every rank; a parameter that a unit uses on
some ranks only needs ``find_unused_parameters=True``, see ``schedule.py``), parameters are empty
tensors outside forward and backward (use :meth:`ZeroDataParallel.summon_full_params`), and a
unit's parameters must only be used inside its own ``forward``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
import zlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp

from ..bucket import assign_buckets, cap_from_mb
from ..distributed import DistributedDataParallel
from ..join import Join
from ..reducer import CommHook, Reducer
from .buckets import ShardBucket
from .memory import PeakTracker
from .schedule import UnitSchedule, assign_units
from .units import FlatParams, wait_all

log = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in low precision, keep float32 masters (stages 1-3).

    Attributes:
        param_dtype: dtype the module computes in (the full parameter copies); ``None`` keeps the
            parameters' dtype.
        reduce_dtype: dtype gradients are reduce-scattered in (default ``param_dtype``); float32
            halves nothing but rounds less.
        cast_forward_inputs: cast floating-point tensors among the forward's arguments to
            ``param_dtype`` (as torch's FSDP2 does).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """Elements ``[start, stop)`` (flattened) of ``param`` that this rank owns and updates.

    ``master`` is the 1-D view of the master chunk holding them; ``grad()`` their averaged
    gradient (a view of the averaged chunk), or ``None`` when the parameter has no gradient.
    """

    param: nn.Parameter
    name: str
    start: int
    stop: int
    master: torch.Tensor
    grad: Callable[[], torch.Tensor | None]


@dataclasses.dataclass(frozen=True)
class _Settings:
    stage: int
    units: Any
    mixed_precision: MixedPrecision
    prefetch: bool


# Which ZeroDataParallel holds a parameter: id -> (parameter, wrapper), both weakly.
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner_of(param: torch.Tensor) -> ZeroDataParallel | None:
    """The :class:`ZeroDataParallel` that wraps ``param``, if any (how the optimizer finds shards)."""
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


class ZeroDataParallel(DistributedDataParallel):
    """Data parallelism with ZeRO stage ``stage``: 0 = DDP, 1/2/3 shard more (module docstring).

    Build the optimizer with :class:`~ddp.ZeroRedundancyOptimizer` on ``model.parameters()``
    (at stage 0 any optimizer works as with DDP).

    Args:
        module: the model (dense floating-point parameters, on one device).
        stage: 0, 1, 2 or 3; the same on every rank (checked).
        group, process_group, bucket_cap_mb, first_bucket_cap_mb, broadcast_buffers,
            find_unused_parameters, init_sync: as for :class:`~ddp.DistributedDataParallel`
            (bucket caps are counted in ``reduce_dtype`` bytes; stage 3 reduces per unit instead).
        gradient_as_bucket_view: stage 0 only.
        units: stage 3: which submodules are gathered and freed as one unit: ``None`` (every
            submodule holding parameters itself), a set of module types, or module instances.
        mixed_precision: a :class:`MixedPrecision` (stages 1-3).
        prefetch: stage 3: start the next unit's all-gather while the current one computes.

    Attributes:
        stage: the ZeRO stage.
        units: the :class:`~ddp.zero.units.FlatParams` (stages 1-3): one per bucket (1, 2) or
            per unit (3, the root unit last).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int = 2,
        *,
        group: Group | None = None,
        process_group: Group | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        units: Iterable[nn.Module] | set[type] | None = None,
        mixed_precision: MixedPrecision | None = None,
        prefetch: bool = True,
        init_sync: bool = True,
    ) -> None:
        name = "ZeroDataParallel"
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise TypeError(f"{name}: stage must be an int in {STAGES}, got {type(stage).__name__}")
        if stage not in STAGES:
            raise ValueError(f"{name}: stage must be one of {STAGES}, got {stage}")
        mp = MixedPrecision() if mixed_precision is None else mixed_precision
        if not isinstance(mp, MixedPrecision):
            raise TypeError(f"{name}: mixed_precision must be a ddp.MixedPrecision, got {type(mp).__name__}")
        for what in ("param_dtype", "reduce_dtype"):
            dtype = getattr(mp, what)
            if dtype is not None and dtype not in _LOW_PRECISION:
                raise TypeError(f"{name}: mixed_precision.{what} must be one of {_LOW_PRECISION}, got {dtype}")
        if stage == 0 and mixed_precision is not None:
            raise ValueError(f"{name}: mixed_precision needs stage 1-3 (stage 0 is DDP: use a comm hook to compress)")
        if stage != 0 and gradient_as_bucket_view:
            raise ValueError(f"{name}: gradient_as_bucket_view is for stage 0; stages 1-3 keep no full .grad")
        if stage != 3 and units is not None:
            raise ValueError(f"{name}: units= is for stage 3 (stages 1 and 2 shard by bucket)")
        if not isinstance(prefetch, bool):
            raise TypeError(f"{name}: prefetch must be a bool, got {type(prefetch).__name__}")
        # Read by the construction steps that DistributedDataParallel.__init__ calls below, so it
        # is set before nn.Module.__init__ runs (a plain attribute, which Module allows).
        self._zero = _Settings(stage, units, mp, prefetch)
        super().__init__(
            module,
            group=group,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            init_sync=init_sync,
        )
        self.stage = stage
        self._in_summon = False  # inside summon_full_params
        self._param_ids = tuple(id(p) for p in module.parameters())
        self_ref = weakref.ref(self)
        for key in [k for k, (p, m) in _owners.items() if p() is None or m() is None]:
            del _owners[key]
        for p in module.parameters():
            _owners[id(p)] = (weakref.ref(p), self_ref)
        if self.schedule is not None:
            self._hook_handles += self.schedule.register()
        self.memory_tracker.reset_peak()  # building the units is no part of a step

    # ------------------------------------------------------------------ construction steps

    @property
    def _mp(self) -> MixedPrecision:
        return self._zero.mixed_precision

    def _reduce_dtype(self, p: torch.Tensor) -> torch.dtype:
        mp = self._mp
        return mp.reduce_dtype or mp.param_dtype or p.dtype

    def _bucket_layout(
        self, params: list[nn.Parameter], bucket_cap_mb: float, first_bucket_cap_mb: float | None
    ) -> list[list[int]]:
        stage = self._zero.stage
        if stage == 0:
            return super()._bucket_layout(params, bucket_cap_mb, first_bucket_cap_mb)
        if stage in (1, 2):
            sizes = [p.numel() * torch.empty(0, dtype=self._reduce_dtype(p)).element_size() for p in params]
            keys = [(self._mp.param_dtype or p.dtype, p.dtype, p.device) for p in params]
            first = None if first_bucket_cap_mb is None else cap_from_mb(first_bucket_cap_mb)
            return assign_buckets(sizes, keys, cap_from_mb(bucket_cap_mb), first)
        # stage 3: one bucket per unit holding trainable parameters, latest unit first, root last
        self._unit_modules, self._unit_members = assign_units(self.module, self._zero.units)
        index = {id(p): i for i, p in enumerate(params)}
        layout, self._bucket_units = [], []
        root = len(self._unit_modules) - 1
        for u in [*reversed(range(root)), root]:
            trainable = [index[id(p)] for _, p in self._unit_members[u] if id(p) in index]
            if trainable:
                layout.append(sorted(trainable, reverse=True))
                self._bucket_units.append(u)
        return layout

    def _agreement(self, params: list[nn.Parameter], names: list[str], layout: list[list[int]]) -> dict[str, int]:
        mp = self._mp
        text = repr((names, [tuple(p.shape) for p in params], layout, str(mp.param_dtype), str(mp.reduce_dtype)))
        if self._zero.stage == 3:
            text += repr([[n for n, _ in members] for members in self._unit_members])
        return {"ZeRO stage": self._zero.stage, **super()._agreement(params, names, layout), "ZeRO layout": zlib.crc32(text.encode())}

    def _make_reducer(self, params: list[nn.Parameter], names: list[str], layout: list[list[int]]) -> Reducer:
        stage = self._zero.stage
        self.units: list[FlatParams] = []
        self.memory_tracker = PeakTracker()
        #: stage 3: when units are gathered and freed (``schedule.py``)
        self.schedule: UnitSchedule | None = None
        if stage == 0:
            return super()._make_reducer(params, names, layout)
        compute = self._mp.param_dtype
        if stage in (1, 2):
            plain = {id(p): n for n, p in self.module.named_parameters()}  # names[] also lists a tied weight's aliases
            for b, idx in enumerate(layout):
                self.units.append(
                    FlatParams(b, [params[i] for i in idx], [plain[id(params[i])] for i in idx], self.process_group,
                               compute_dtype=compute, resident=True)
                )  # fmt: skip
            #: the unit each bucket reduces into
            self._bucket_flat = list(self.units)
            # Frozen weights: units without a bucket, so that they too compute in param_dtype and
            # keep a master chunk (nothing to all-gather: they never change).
            frozen: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
            for name, p in self.module.named_parameters():
                if not p.requires_grad and p.is_floating_point():
                    frozen.setdefault(p.dtype, []).append((name, p))
            for members in frozen.values():
                self.units.append(
                    FlatParams(len(self.units), [p for _, p in members], [n for n, _ in members], self.process_group,
                               compute_dtype=compute, resident=True)
                )  # fmt: skip
        else:
            flats: list[FlatParams | None] = []
            for u, members in enumerate(self._unit_members):
                flats.append(
                    FlatParams(u, [p for _, p in members], [n for n, _ in members], self.process_group,
                               compute_dtype=compute, resident=False,
                               memory=lambda delta: self.memory_tracker.add("params", delta))
                    if members else None
                )  # fmt: skip
            self.units = [f for f in flats if f is not None]
            self._bucket_flat = [flats[u] for u in self._bucket_units]  # type: ignore[misc]
            self._param_index = {id(p): i for i, p in enumerate(params)}
            on_unreached = _weakly(self._arrive_unreached) if self.find_unused_parameters else None
            self.schedule = UnitSchedule(self._unit_modules, flats, self.process_group, self._zero.prefetch, on_unreached)

        def make_bucket(b: int, idx: list[int]) -> ShardBucket:
            unit = self._bucket_flat[b]
            position = {id(p): k for k, p in enumerate(unit.params)}
            # stage 3: once a unit's last gradient is in, free its weights, unless a frozen one
            # may still be needed by the backward pass, or it is the root: both wait for the end
            early = stage == 3 and all(p.requires_grad for p in unit.params) and self._unit_modules[unit.index] is not None
            return ShardBucket(
                b, idx, params, names, unit.layout, [position[id(params[i])] for i in idx], self.process_group,
                reduce_dtype=self._reduce_dtype(params[idx[0]]), grad_dtype=unit.master_dtype, keep_buffer=stage == 1,
                on_start=unit.release if early else None, memory=lambda delta: self.memory_tracker.add("grads", delta),
            )  # fmt: skip

        return Reducer(
            params, names, layout, self.process_group, find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=False, make_bucket=make_bucket, retire_early=stage >= 2,
        )  # fmt: skip

    def _arrive_unreached(self, unreached: list[nn.Parameter]) -> None:
        """Stage 3, ``find_unused_parameters``: the schedule's ``on_unreached``. The Reducer counts
        the parameters a unit's backward will not reach as arrived (zeros) as that backward starts,
        so the unit's reduce-scatter starts at the same point on every rank (``schedule.py``)."""
        indices = [self._param_index[id(p)] for p in unreached]
        self.reducer.arrive_unused(indices, sync=self._require_sync and self._forward_sync)

    # ------------------------------------------------------------------ forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_summon:
            raise RuntimeError(
                "ZeroDataParallel: forward inside summon_full_params is not supported (the parameters hold the "
                "full values in the masters' dtype there, not what the module computes with); run it after the block"
            )
        self._check_parameters()
        mp = self._mp
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        if self.schedule is None:
            return super().forward(*args, **kwargs)
        self.schedule.begin_forward()
        try:
            out = super().forward(*args, **kwargs)
        except BaseException:
            self.schedule.release_all()
            raise
        self.schedule.end_forward(out)
        return out

    def _check_parameters(self) -> None:
        if tuple(id(p) for p in self.module.parameters()) != self._param_ids:
            known = set(self._param_ids)
            new = [n for n, p in self.module.named_parameters() if id(p) not in known]
            raise RuntimeError(
                f"{type(self).__name__}: the module's parameters changed after wrapping "
                f"({'new: ' + ', '.join(new) if new else 'some were removed or replaced'}); their gradients "
                "would not be reduced nor their shards updated. Add parameters before wrapping, then build the "
                "wrapper and the optimizer again"
            )

    # ------------------------------------------------------------------ what the optimizer uses

    def owned_pieces(self) -> list[OwnedPiece]:
        """This rank's pieces of every trainable parameter (stages 1-3), in unit order."""
        out = []
        for bucket, unit in zip(self.reducer.buckets, self._bucket_flat):
            assert isinstance(bucket, ShardBucket)
            slot_of = {id(p): k for k, p in enumerate(bucket.params)}
            for piece in unit.layout.pieces(unit.rank):
                p = unit.params[piece.param]
                k = slot_of.get(id(p))
                if k is None:  # frozen
                    continue
                a, b = piece.offset, piece.offset + piece.numel
                out.append(OwnedPiece(p, unit.names[piece.param], piece.start, piece.stop, unit.master[a:b], _grad_of(bucket, k, a, b)))
        return out

    def prepare_step(self) -> None:
        """Before the optimizer changes the master chunks: free the gathered units (stage 3)."""
        if self.schedule is not None:
            self.schedule.release_all()

    def publish(self, frozen: bool = False) -> None:
        """After the optimizer step (stages 1, 2): all-gather every trainable unit's updated chunk, in
        place. ``frozen``: every unit, the frozen ones too (after their masters were loaded)."""
        wait_all(unit.publish() for unit in self.units if frozen or unit.trainable)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients: ``.grad`` of the module, and the averaged chunks."""
        super().zero_grad(set_to_none)
        if self.stage:
            for bucket in self.reducer.buckets:
                bucket.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm``; return the norm.

        torch's ``clip_grad_norm_`` over all ranks' shards: each rank adds ``|g|^p`` over the
        elements it owns, one all-reduce (SUM; MAX for ``inf``) makes the total, identical on every
        rank, and each rank scales its own chunk by ``min(1, max_norm / (norm + 1e-6))``. Call it
        after ``backward()`` and before ``optimizer.step()``. At stage 0 every rank has every
        gradient and no communication is needed.
        """
        norm_type = float(norm_type)
        if self.stage == 0:
            grads = [p.grad for p in self.reducer.params if p.grad is not None]
        else:
            grads = [g for g in (piece.grad() for piece in self.owned_pieces()) if g is not None]
        device = self.reducer.params[0].device if self.reducer.params else torch.device("cpu")
        inf = norm_type == float("inf")
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:  # in float64: the sum of many squares loses less
            norm = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64)
            local = torch.maximum(local, norm) if inf else local + norm**norm_type
        if self.stage:
            collectives.all_reduce(local, ReduceOp.MAX if inf else ReduceOp.SUM, group=self.process_group)
        total = local[0] if inf else local[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ full parameters

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Inside the block every parameter holds its full value in the masters' dtype: the numbers
        the optimizer updates (float32 under mixed precision, as torch's FSDP shows them), never the
        rounded compute copy.

        With ``writeback`` what the block writes into the parameters is kept, exactly: each rank
        copies its own chunk into its master chunk (write the same values on every rank; where
        they differ, each element keeps its owner's), and the compute copies are cast from the
        masters again on every rank. Without it the masters stay as they were. Collective: every
        rank enters it. No forward or backward pass inside the block, and no nesting.
        """
        if self._in_summon:
            raise RuntimeError("ZeroDataParallel: summon_full_params is already active (no nesting)")
        if self.schedule is not None and self.schedule.in_backward:
            raise RuntimeError("ZeroDataParallel: summon_full_params inside a backward pass is not supported")
        wait_all(unit.summon(writeback) for unit in self.units)
        self._in_summon = True
        try:
            yield
        finally:
            self._in_summon = False
            wait_all(unit.unsummon(writeback) for unit in self.units)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with full parameter values (the masters' dtype).

        Collective. With ``rank0_only`` the other ranks get ``{}``. Keys are the wrapped module's
        own (no ``module.`` prefix): it loads into the unwrapped model.
        """
        full = {}
        for unit in self.units:
            values = unit.master.new_empty(unit.layout.padded)
            collectives.all_gather_into_tensor(values, unit.master, group=self.process_group)
            for p, view in zip(unit.params, unit.layout.views(values, unit.shapes)):
                full[id(p)] = view
        if rank0_only and collectives.get_rank(self.process_group) != 0:
            return {}
        out = {}
        with torch.no_grad():
            for name, p in self.module.named_parameters(remove_duplicate=False):
                out[name] = full[id(p)].clone() if id(p) in full else p.detach().clone()
            for name, b in self.module.named_buffers():
                out[name] = b.detach().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (what :meth:`full_state_dict` returns); every rank passes it."""
        expected = set(dict(self.module.named_parameters(remove_duplicate=False))) | set(dict(self.module.named_buffers()))
        missing, unexpected = expected - set(state_dict), set(state_dict) - expected
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")
        self.prepare_step()  # nothing may stay gathered from the old values
        in_unit = {id(p) for unit in self.units for p in unit.params}
        for name, p in self.module.named_parameters():
            value = state_dict[name]
            if tuple(value.shape) != tuple(self.full_shape(p)):
                raise ValueError(f"load_full_state_dict: {name} has shape {tuple(value.shape)}, expected {tuple(self.full_shape(p))}")
            if id(p) not in in_unit:
                p.copy_(value)
        for name, b in self.module.named_buffers():
            b.copy_(state_dict[name])
        names = dict((id(p), n) for n, p in self.module.named_parameters())
        for unit in self.units:
            flat = torch.zeros(unit.layout.padded, dtype=unit.master_dtype, device=unit.device)
            for p, view in zip(unit.params, unit.layout.views(flat, unit.shapes)):
                view.copy_(state_dict[names[id(p)]])
            lo, hi = unit.layout.chunk_range(unit.rank)
            unit.master.copy_(flat[lo:hi])
            if unit.resident:
                unit.full.copy_(flat)

    def full_shape(self, p: nn.Parameter) -> torch.Size:
        """A parameter's shape (at stage 3 its ``.data`` is an empty tensor between steps)."""
        for unit in self.units:
            for q, shape in zip(unit.params, unit.shapes):
                if q is p:
                    return shape
        return p.shape

    # ------------------------------------------------------------------ memory

    def memory_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None], dict[str, int]]:
        """(parameter tensors, gradient tensors, peak transient bytes) beyond the module's own
        ``.data`` and ``.grad``, for :func:`ddp.zero.memory_report`."""
        if self.stage == 0:
            return [], [b.buffer for b in self.reducer.buckets], {"params": 0, "grads": 0}
        params = [unit.master for unit in self.units]
        grads: list[torch.Tensor | None] = []
        for bucket in self.reducer.buckets:
            grads += [bucket.grad, bucket.buffer]
        return params, grads, dict(self.memory_tracker.peak)

    # ------------------------------------------------------------------ stage-0-only DDP features

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.stage:
            raise RuntimeError(
                f"ZeroDataParallel: comm hooks are for stage 0; stage {self.stage} reduce-scatters its buckets "
                "(compress with mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))"
            )
        super().register_comm_hook(state, hook)

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        if self.stage:
            raise RuntimeError(f"ZeroDataParallel: join() is for stage 0 (uneven inputs are not supported at stage {self.stage})")
        return super().join(divide_by_initial_world_size, enable, throw_on_early_termination)

    def extra_repr(self) -> str:
        return f"stage={self.stage}, units={len(self.units)}, " + super().extra_repr()


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` (bound) called through a weak reference: whoever keeps the callable does not keep
    its object alive (dropping the wrapper disarms it, as its hooks)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _grad_of(bucket: ShardBucket, slot: int, a: int, b: int) -> Callable[[], torch.Tensor | None]:
    def grad() -> torch.Tensor | None:
        if bucket.grad is None or not bucket.has_grad[slot]:
            return None
        return bucket.grad[a:b]

    return grad


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(item, dtype) for item in obj)
    if isinstance(obj, list):
        return [_cast_floats(item, dtype) for item in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


__all__ = ["MixedPrecision", "OwnedPiece", "ZeroDataParallel", "owner_of"]
