"""Stage 3's schedule: when each unit is gathered and freed, driven by forward and backward hooks.

Between steps a rank holds only its master chunk of every unit (``units.py``). The schedule
gathers a unit just before it computes and frees it right after::

    forward:   [gather 0][unit 0][free 0] [gather 1][unit 1][free 1] ...    (root: gathered throughout)
    prefetch:             [gather 1 ......]        [gather 2 ......]
    backward:  ... [gather 1][grad unit 1][RS 1, free 1] [gather 0][grad unit 0][RS 0, free 0]
    prefetch:                 [gather 0 ........]

* **Forward**: a pre-hook on the unit's module gathers it (waiting for a prefetch if one is in
  flight) and starts the all-gather of the unit that came next in the *previous* forward; a
  post-hook frees the unit and hooks its output tensors.
* **Backward**: the gradient of a unit's output arrives just before autograd runs the unit's
  backward; that tensor hook gathers the unit again and starts the all-gather of the unit that
  ran before it in this forward (next in backward). When the unit's last gradient is in, its
  bucket is reduce-scattered and the unit freed (``ShardBucket.on_start``); units with frozen
  weights, and the root, are freed when the whole backward pass ends (a frozen weight may still
  be needed after the trainable ones' gradients are final).
* **Per step**: at most the root, the unit computing and one prefetched unit are gathered, so
  parameter memory is ``1/n`` of the model plus about two units. (With ``prefetch`` the unit
  that ran last in forward stays gathered: it is the first one backward needs.)

All ranks must issue the same all-gathers in the same order: our collectives pair by order, and
two units of equal size would pair silently. Each rank therefore folds the units it gathers into
a checksum, and the end of every backward pass compares it across ranks (one small all-reduce):
a unit run on some ranks only raises on every rank instead of training on mixed-up weights.

The reduce-scatters sit between those all-gathers, so a unit's must start at the same point on
every rank too: once its last gradient is in, during its backward. A parameter of the unit that
this rank's forward did not use (``find_unused_parameters``; on other ranks it may be used) would
hold it back to the end of the pass, behind the gathers of the units before it. So with
``on_unreached`` the end of every forward walks the autograd graph of its output, and when a
unit's backward starts, its trainable parameters the graph does not reach are handed to
``on_unreached`` (the Reducer counts them as arrived, with zeros): its bucket then completes with
its used gradients, as on the ranks that used them all.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

import collectives
from collectives import Group, ReduceOp
from torch.utils.hooks import RemovableHandle

from .units import FlatParams


class UnitSchedule:
    """Gathers and frees stage 3's units around their forward and backward (module docstring).

    Args:
        modules: the unit modules by unit number, ``None`` last for the root unit.
        flats: the :class:`FlatParams` of each unit number (``None``: a unit without parameters).
        group: the group the units are sharded over.
        prefetch: start the next unit's all-gather while the current one computes.
        on_unreached: ``on_unreached(params)`` when a unit's backward starts, with its trainable
            parameters that the last forward's output does not depend on (``find_unused_parameters``;
            ``None``: the graph is not walked).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module | None],
        flats: Sequence[FlatParams | None],
        group: Group,
        prefetch: bool,
        on_unreached: Callable[[list[nn.Parameter]], None] | None = None,
    ):
        self.modules = list(modules)
        self.flats = list(flats)
        self.group = group
        self.prefetch = prefetch
        self.on_unreached = on_unreached
        self._unreached: dict[int, list[nn.Parameter]] = {}  # per unit, from the last forward's graph
        self.order: list[int] = []  # unit numbers in the order their forward started (one per call)
        self.last_order: list[int] = []  # the previous forward's: what forward prefetches
        self.in_backward = False
        self._gathered = 0  # checksum of the units gathered since the last backward pass

    @property
    def root(self) -> int:
        return len(self.modules) - 1

    def register(self) -> list[RemovableHandle]:
        """Forward pre- and post-hooks on every unit module; the handles."""
        handles = []
        self_ref = weakref.ref(self)
        for u, module in enumerate(self.modules):
            if module is not None:
                handles.append(module.register_forward_pre_hook(_forward_hook(self_ref, u, pre=True)))
                handles.append(module.register_forward_hook(_forward_hook(self_ref, u, pre=False)))
        return handles

    # ------------------------------------------------------------------ gathering

    def gather(self, u: int, async_op: bool = False) -> None:
        flat = self.flats[u]
        if flat is None:
            return
        if not flat.gathered and not flat.gathering:
            self._gathered = zlib.crc32(u.to_bytes(4, "little"), self._gathered)
        flat.gather(async_op)

    def release_all(self) -> None:
        for flat in self.flats:
            if flat is not None:
                flat.release()

    # ------------------------------------------------------------------ forward

    def begin_forward(self) -> None:
        if self.in_backward:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError("ZeroDataParallel: forward called during a backward pass; not supported at stage 3")
            # the last backward pass raised before its end: nothing of it counts
            self.in_backward = False
            self.release_all()
            self._gathered = 0
        self.order = []
        self.gather(self.root)

    def end_forward(self, output: Any) -> None:
        self.last_order = self.order
        if not self._hook_backward(output, self.root, None):
            self.release_all()  # no backward will follow (eval, no_grad): free now
        elif self.on_unreached is not None:
            reached = _reached_leaves([t for t in _tensors(output) if t.requires_grad])
            self._unreached = {
                u: [p for p in flat.params if p.requires_grad and id(p) not in reached]
                for u, flat in enumerate(self.flats) if flat is not None
            }  # fmt: skip

    def on_unit(self, u: int, pre: bool, output: Any = None) -> None:
        """Unit ``u``'s forward starts (``pre``) or ends."""
        if pre:
            call = len(self.order)
            self.order.append(u)
            self.gather(u)
            if self.prefetch and call + 1 < len(self.last_order):
                self.gather(self.last_order[call + 1], async_op=True)
            return
        call = len(self.order) - 1
        flat = self.flats[u]
        # The unit that ran last in the previous forward is the first the backward pass needs:
        # with prefetch it keeps its weights instead of freeing and gathering them again.
        if flat is not None and not (self.prefetch and call == len(self.last_order) - 1 and torch.is_grad_enabled()):
            flat.release()
        self._hook_backward(output, u, call)

    # ------------------------------------------------------------------ backward

    def _hook_backward(self, output: Any, u: int, call: int | None) -> bool:
        """Gather unit ``u`` when the gradient of its output arrives; False if none will."""
        if not torch.is_grad_enabled():
            return False
        tensors = [t for t in _tensors(output) if t.requires_grad]
        self_ref = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            schedule = self_ref()
            if schedule is not None:
                schedule.pre_backward(u, call)

        for t in tensors:
            t.register_hook(hook)
        return bool(tensors)

    def pre_backward(self, u: int, call: int | None) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.post_backward)
        self.gather(u)
        if self.prefetch and call:  # backward runs this forward's order backwards
            self.gather(self.order[call - 1], async_op=True)
        unreached = self._unreached.pop(u, None)  # once per pass, however many outputs call this
        if unreached and self.on_unreached is not None:
            self.on_unreached(unreached)

    def post_backward(self) -> None:
        """End of a backward pass: free every unit; check that all ranks gathered alike."""
        self.in_backward = False
        self.release_all()
        mine, self._gathered = self._gathered, 0
        device = next((f.device for f in self.flats if f is not None), torch.device("cpu"))
        check = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
        collectives.all_reduce(check, ReduceOp.MAX, group=self.group)
        if int(check[0]) != -int(check[1]):
            raise RuntimeError(
                "ZeroDataParallel: the ranks gathered different units in this step (a unit ran on some ranks "
                "only, or in another order): their all-gathers paired up wrongly. At stage 3 every rank must run "
                "the same units in the same order; move rank-dependent branches out of the units or use stage 2"
            )


def _forward_hook(self_ref: "weakref.ref[UnitSchedule]", u: int, pre: bool):
    if pre:

        def pre_hook(module: nn.Module, args: Any) -> None:
            schedule = self_ref()
            if schedule is not None:
                schedule.on_unit(u, True)

        return pre_hook

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        schedule = self_ref()
        if schedule is not None:
            schedule.on_unit(u, False, output)

    return post_hook


def _reached_leaves(tensors: list[torch.Tensor]) -> set[int]:
    """``id`` of every leaf tensor (parameter) that the autograd graph of ``tensors`` leads to."""
    reached = {id(t) for t in tensors if t.grad_fn is None}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's gradient sink
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return reached


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def assign_units(
    module: nn.Module, spec: Iterable[nn.Module] | set[type] | None
) -> tuple[list[nn.Module | None], list[list[tuple[str, nn.Parameter]]]]:
    """Stage 3's units: (unit modules, then ``None`` for the root; each unit's (name, parameter)).

    ``spec``: ``None`` (every submodule that holds parameters itself), a set of module types, or
    module instances. A parameter belongs to the innermost unit that contains it; one reachable
    from two units that do not contain each other (a tied weight) belongs to the root unit, which
    is gathered for the whole forward and backward pass.
    """
    named = dict(module.named_modules())
    if spec is None:
        chosen = [m for n, m in named.items() if n and any(True for _ in m.parameters(recurse=False))]
    elif isinstance(spec, (set, frozenset)) and all(isinstance(t, type) for t in spec):
        chosen = [m for n, m in named.items() if n and isinstance(m, tuple(spec))]
    else:
        chosen = list(spec)
        ids = {id(m) for m in named.values()}
        bad = [type(m).__name__ for m in chosen if not isinstance(m, nn.Module) or id(m) not in ids or m is module]
        if bad:
            raise ValueError(f"ZeroDataParallel: units must be submodules of the wrapped module (not the module itself); got {bad}")
    position = {id(m): i for i, m in enumerate(named.values())}
    prefix = {id(m): n for n, m in named.items()}
    units = sorted({id(m): m for m in chosen}.values(), key=lambda m: position[id(m)])
    paths = [prefix[id(m)] + "." for m in units]
    root = len(units)
    owner: dict[int, int] = {}
    first_name: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        inner = [u for u, path in enumerate(paths) if name.startswith(path)]
        u = max(inner, key=lambda i: len(paths[i])) if inner else root
        first_name.setdefault(id(p), name)
        owner[id(p)] = u if owner.get(id(p), u) == u else root
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(root + 1)]
    for name, p in module.named_parameters():
        members[owner[id(p)]].append((first_name[id(p)], p))
    return [*units, None], members


__all__ = ["UnitSchedule", "assign_units"]
