"""``ZeroRedundancyOptimizer``: each rank keeps and updates the optimizer state of its own shard.

Built like torch's ``torch.distributed.optim.ZeroRedundancyOptimizer``::

    optimizer = ddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

It wraps a *local* optimizer of the given class (``optimizer.optim``) that only ever sees this
rank's pieces of the parameters (``flat.py``): one tensor per piece, a view of the master chunk,
grouped like the parameters they come from. ``step()`` gives each piece its averaged gradient,
steps the local optimizer (so Adam's two moments exist for ``1/n`` of the elements: the ZeRO-1
saving) and then makes every rank's parameters whole again. How depends on the parameters:

* of a :class:`~ddp.ZeroDataParallel` at stage 1 or 2: the averaged gradient chunks come from its
  reduce-scatter, and one in-place all-gather per bucket brings the updated chunks to every rank
  (the second half of DDP's all-reduce: a step costs DDP's bytes);
* of one at stage 3: the chunks are the only copy; the next forward gathers them;
* of one at stage 0: nothing is sharded: the local optimizer is a plain one over the parameters;
* of any other model (our DDP, torch's DDP, ``all_reduce_gradients``): torch's usage. The
  parameters are flattened into buckets (their ``.data`` becomes a view of a flat buffer), the
  gradients are read from ``.grad`` (already averaged by the DDP), and the updated chunks are
  all-gathered: DDP's all-reduce plus one all-gather, ``1.5 x`` DDP's bytes, as torch's (which
  broadcasts each parameter from its owner instead).

Which optimizers: those whose update is element-wise, so that stepping pieces equals stepping the
whole tensor: SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, Adagrad, Adadelta, ASGD and
their subclasses, or a class declared with :func:`register_elementwise_optimizer`. The others
(LBFGS needs the whole gradient at once, Adafactor factors a matrix's second moment by rows and
columns, Muon orthogonalises whole matrices, SparseAdam needs sparse gradients) raise a
``TypeError`` on every rank before any communication.

State dicts: :meth:`~ZeroRedundancyOptimizer.consolidate_state_dict` (collective) gathers the
state of every piece onto one rank, whose :meth:`~ZeroRedundancyOptimizer.state_dict` then has the
format of a plain optimizer of the same class on the same parameters (so it loads into one, and
:meth:`~ZeroRedundancyOptimizer.load_state_dict` loads a plain optimizer's, at any world size).
Sharded checkpoints without the gather: ``ddp/zero/checkpoint.py``.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

import collectives
from collectives import Group

from ..bucket import assign_buckets, cap_from_mb
from .model import OwnedPiece, ZeroDataParallel, owner_of
from .units import FlatParams, wait_all

log = logging.getLogger(__name__)

_ELEMENTWISE: set[type] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
}


def register_elementwise_optimizer(optimizer_class: type) -> type:
    """Declare that ``optimizer_class`` updates every element from that element's own gradient and
    state (and per-tensor scalars like a step count) only, so it may be sharded. Usable as a
    class decorator."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"register_elementwise_optimizer: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    _ELEMENTWISE.add(optimizer_class)
    return optimizer_class


def _check_class(optimizer_class: object) -> None:
    name = "ZeroRedundancyOptimizer"
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"{name}: optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if not issubclass(optimizer_class, tuple(_ELEMENTWISE)):
        known = ", ".join(sorted(c.__name__ for c in _ELEMENTWISE))
        raise TypeError(
            f"{name}: {optimizer_class.__name__} cannot be sharded: each rank steps only its own pieces of the "
            "parameters, which equals stepping the whole tensors only for element-wise updates "
            f"({known}). If {optimizer_class.__name__} is element-wise, declare it with "
            "ddp.zero.register_elementwise_optimizer"
        )


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shard the optimizer state over the ranks (see the module docstring).

    Args:
        params: the parameters (or param groups), as for any optimizer: all of one
            :class:`~ddp.ZeroDataParallel`, or of any other model whose gradients are averaged.
        optimizer_class: the local optimizer's class (element-wise, see above).
        process_group: the group to shard over (``group`` is our name for it); taken from the
            model for a ``ZeroDataParallel``, default the default group otherwise.
        bucket_cap_mb: how parameters of other models are grouped into flat buckets (one
            all-gather each after the step).
        **defaults: the local optimizer's arguments (``lr``, ``momentum``, ``betas``, ...).

    Attributes:
        optim: the local optimizer (stepping this rank's pieces).
        model: the ``ZeroDataParallel`` whose parameters these are, or ``None``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type,
        process_group: Group | None = None,
        *,
        group: Group | None = None,
        bucket_cap_mb: float = 25.0,
        **defaults: Any,
    ) -> None:
        name = "ZeroRedundancyOptimizer"
        _check_class(optimizer_class)
        if group is not None and process_group is not None:
            raise ValueError(f"{name}: pass group or process_group (torch's name), not both")
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        flat = [p for g in self.param_groups for p in g["params"]]
        owners = {id(owner_of(p)): owner_of(p) for p in flat}
        if len(owners) > 1:
            raise ValueError(f"{name}: the parameters belong to {len(owners)} different models; use one optimizer per model")
        model = next(iter(owners.values())) if owners else None
        self.model: ZeroDataParallel | None = model
        if model is not None:
            if (group or process_group) not in (None, model.process_group):
                raise ValueError(f"{name}: the parameters are sharded over the model's group; do not pass another one")
            self.group: Group = model.process_group
        else:
            self.group = collectives.get_group(group if group is not None else process_group)
        self._units: list[FlatParams] = []
        index = {id(p): i for i, p in enumerate(flat)}
        names = _names(model, flat)
        self._check_agreement(optimizer_class, flat, names)
        if model is not None and model.stage == 0:
            pieces = None  # replicated: the local optimizer steps the parameters themselves
        elif model is not None:
            pieces = model.owned_pieces()
        else:
            pieces = self._flatten(flat, names, bucket_cap_mb)
        #: (parameter index, piece, the tensor the local optimizer steps), in step order
        self.pieces: list[tuple[int, OwnedPiece | None, torch.Tensor]] = []
        by_param: dict[int, list[OwnedPiece]] = {}
        for piece in pieces or []:
            if id(piece.param) in index:
                by_param.setdefault(id(piece.param), []).append(piece)
        inner_groups = []
        for g in self.param_groups:
            tensors = []
            for p in g["params"]:
                if pieces is None:
                    tensors.append(p)
                    self.pieces.append((index[id(p)], None, p))
                    continue
                for piece in by_param.get(id(p), []):
                    t = nn.Parameter(piece.master)
                    tensors.append(t)
                    self.pieces.append((index[id(p)], piece, t))
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": tensors})
        self.optim: torch.optim.Optimizer = optimizer_class(inner_groups, **defaults)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):  # the class's defaults too
            outer.update({k: v for k, v in inner.items() if k != "params"})
        self._consolidated: dict[str, Any] | None = None
        self._names = names

    # ------------------------------------------------------------------ construction

    def _check_agreement(self, optimizer_class: type, flat: list[torch.Tensor], names: list[str]) -> None:
        """All ranks must shard the same parameters the same way (one all-gather of a checksum)."""
        shapes = [tuple(self._shape(p)) for p in flat]
        text = repr((optimizer_class.__name__, [len(g["params"]) for g in self.param_groups], names, shapes))
        device = flat[0].device if flat else torch.device("cpu")
        mine = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=device)
        n = collectives.get_world_size(self.group)
        every = torch.empty(n, dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(every, mine, group=self.group)
        if len(set(every.tolist())) > 1:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer: the ranks disagree on the optimizer class or its parameters (checksums per "
                f"rank: {every.tolist()}); build the same optimizer on every rank"
            )

    def _flatten(self, flat: list[torch.Tensor], names: list[str], bucket_cap_mb: float) -> list[OwnedPiece]:
        """Parameters of another model: flat buckets of our own, gradients read from ``.grad``."""
        layout = assign_buckets([p.numel() * p.element_size() for p in flat], [(p.dtype, p.device) for p in flat], cap_from_mb(bucket_cap_mb))
        out = []
        for b, idx in enumerate(layout):
            unit = FlatParams(b, [flat[i] for i in idx], [names[i] for i in idx], self.group, compute_dtype=None, resident=True)
            self._units.append(unit)
            for piece in unit.layout.pieces(unit.rank):
                p = unit.params[piece.param]
                a, z = piece.offset, piece.offset + piece.numel
                out.append(OwnedPiece(p, unit.names[piece.param], piece.start, piece.stop, unit.master[a:z], _grad_view(p, piece.start, piece.stop)))
        return out

    def _shape(self, p: torch.Tensor) -> torch.Size:
        return p.shape if self.model is None else self.model.full_shape(p)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise RuntimeError(
                "ZeroRedundancyOptimizer: parameters cannot be added after construction (the shards are laid out "
                "once, the same on every rank); build the model and optimizer again with every parameter"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ the step

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's pieces, then make every rank's parameters whole (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.model is not None:
            self.model.prepare_step()
        self._sync_hyperparameters()
        for _, piece, t in self.pieces:
            if piece is not None:
                t.grad = piece.grad()
        self.optim.step()
        if self.model is not None:
            self.model.publish()
        else:
            wait_all(unit.publish() for unit in self._units if unit.trainable)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: of the model (``.grad`` and the averaged chunks) and of the pieces."""
        if self.model is not None:
            self.model.zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)

    # ------------------------------------------------------------------ state dicts

    def shards(self) -> list[tuple[str, int, int, torch.Tensor]]:
        """(parameter name, start, stop, tensor the local optimizer steps) for every piece this rank
        owns; at stage 0 every parameter, whole, on every rank."""
        out = []
        for i, piece, t in self.pieces:
            if piece is None:
                out.append((self._names[i], 0, t.numel(), t))
            else:
                out.append((piece.name, piece.start, piece.stop, t))
        return out

    @property
    def replicated(self) -> bool:
        """True when every rank holds every parameter's state (a stage-0 model)."""
        return bool(self.pieces) and self.pieces[0][1] is None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every piece's state onto global rank ``to`` (collective), for :meth:`state_dict`."""
        local: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
        for (i, _, t), (_, start, stop, _) in zip(self.pieces, self.shards()):
            state = self.optim.state.get(t)
            if state:
                local.setdefault(i, []).append((start, stop, {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}))
        me = self.group.ranks[collectives.get_rank(self.group)]  # global, as ``to`` (any group, not only the default's)
        gathered: list[Any] | None = [None] * collectives.get_world_size(self.group) if me == to else None
        collectives.gather_object(local, gathered, dst=to, group=self.group)
        if gathered is None:
            self._consolidated = None
            return
        flat = [p for g in self.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for per_rank in gathered:
            for i, entries in per_rank.items():
                shape = self._shape(flat[i])
                for start, stop, values in entries:
                    target = state.setdefault(i, {})
                    for k, v in values.items():
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            full = target.get(k)
                            if full is None:
                                full = target[k] = v.new_zeros(shape)
                            full.view(-1)[start:stop] = v.reshape(-1)
                        else:
                            target.setdefault(k, v)
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        self._consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state (plain-optimizer format), on the rank :meth:`consolidate_state_dict`
        gathered it to."""
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer: call consolidate_state_dict(to=rank) on every rank first, then state_dict() "
                "on that rank (each rank holds only its shard; ddp.zero.save_checkpoint saves shards without gathering)"
            )
        return self._consolidated

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (:meth:`state_dict`'s, or a plain optimizer's on the same
        parameters): every rank passes it and keeps the slices of its own pieces."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "ZeroRedundancyOptimizer.load_state_dict: the state dict's param groups have "
                f"{[len(g['params']) for g in groups]} parameters, this optimizer's {[len(g['params']) for g in self.param_groups]}"
            )
        ids = [i for g in groups for i in g["params"]]
        for outer, saved in zip(self.param_groups, groups):
            outer.update({k: v for k, v in saved.items() if k != "params"})
        self._sync_hyperparameters()
        self.optim.state.clear()
        for (i, _, t), (_, start, stop, _) in zip(self.pieces, self.shards()):
            saved = state_dict["state"].get(ids[i])
            if saved is not None:
                self.optim.state[t] = _slice_state(saved, start, stop, t)

def _slice_state(saved: dict[str, Any], start: int, stop: int, like: torch.Tensor) -> dict[str, Any]:
    """Elements ``[start, stop)`` of a parameter's saved state (per-element tensors), scalars as they are."""
    out = {}
    for k, v in saved.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = v.reshape(-1)[start:stop].to(dtype=like.dtype, device=like.device).clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _grad_view(p: torch.Tensor, start: int, stop: int) -> Callable[[], torch.Tensor | None]:
    def grad() -> torch.Tensor | None:
        return None if p.grad is None else p.grad.reshape(-1)[start:stop]

    return grad


def _names(model: ZeroDataParallel | None, flat: list[torch.Tensor]) -> list[str]:
    """Qualified names of the parameters (of a ZeroDataParallel), else their positions."""
    if model is None:
        return [str(i) for i in range(len(flat))]
    known = {id(p): n for n, p in model.module.named_parameters()}
    missing = [i for i, p in enumerate(flat) if id(p) not in known]
    if missing:
        raise ValueError(f"ZeroRedundancyOptimizer: parameters {missing} are not in the model")
    return [known[id(p)] for p in flat]


__all__ = ["ZeroRedundancyOptimizer", "register_elementwise_optimizer"]
