"""What one :class:`~collectives.testing.strategies.Case` looks like as a call, per collective.

For every collective this module knows three things, all written independently of the code under
test:

* :func:`slots`: the tensors a rank passes (names as in torch's signature, shapes, and whether a
  tensor carries input values or is an output buffer);
* :func:`call`: how to call an implementation with torch's signature — the same call for our
  collectives, for a user's ``impl`` and for ``torch.distributed`` itself;
* :func:`expected`: what every tensor of every rank must hold afterwards, computed on the
  caller's side from all ranks' inputs with plain elementwise torch ops (the hand-computed
  oracle; no collective involved).

Signatures an ``impl`` must have (torch's; ``op`` is a ``torch.distributed.ReduceOp``, ``src`` /
``dst`` are ranks of ``group``, which is the group of all the pool's ranks):

======================== ==================================================================
all_reduce               ``impl(tensor, op=, group=)``
broadcast                ``impl(tensor, src=, group=)``
reduce                   ``impl(tensor, dst=, op=, group=)``
all_gather               ``impl(tensor_list, tensor, group=)``
all_gather_into_tensor   ``impl(output_tensor, input_tensor, group=)``
reduce_scatter           ``impl(output, input_list, op=, group=)``
reduce_scatter_tensor    ``impl(output, input, op=, group=)``
scatter                  ``impl(tensor, scatter_list, src=, group=)`` (``scatter_list`` None off the root)
gather                   ``impl(tensor, gather_list, dst=, group=)`` (``gather_list`` None off the root)
all_to_all               ``impl(output_tensor_list, input_tensor_list, group=)``
all_to_all_single        ``impl(output, input, output_split_sizes=, input_split_sizes=, group=)``
======================== ==================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..ops import ReduceOp
from .strategies import Case

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor a rank passes: ``salt`` picks its input values; ``None`` marks an output buffer."""

    name: str
    shape: tuple[int, ...]
    salt: int | None


def _rows(case: Case, count: int) -> tuple[int, ...]:
    return (count,) + case.shape[1:]


def piece_shape(case: Case, src: int, dst: int) -> tuple[int, ...]:
    """Shape of what ``src`` sends ``dst`` in an all-to-all."""
    if case.splits is not None:
        return _rows(case, case.splits[src][dst])
    if case.collective == "all_to_all_single":
        return _rows(case, case.shape[0] // case.world_size)
    return case.shape


def stacked(case: Case) -> tuple[int, ...]:
    """Shape of the ``n``-times-larger tensor of all_gather_into_tensor / reduce_scatter_tensor:
    the ranks' pieces concatenated along dim 0 (stacked for 0-d pieces), as torch expects."""
    n, shape = case.world_size, case.shape
    return (n * shape[0],) + shape[1:] if shape else (n,)


def piece(case: Case, big: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of a :func:`stacked` tensor."""
    return big.reshape(case.world_size, -1)[rank].reshape(case.shape)


def split_sizes(case: Case, rank: int) -> tuple[list[int] | None, list[int] | None]:
    """(output_split_sizes, input_split_sizes) of ``rank`` for all_to_all_single (None: equal)."""
    if case.splits is None:
        return None, None
    n = case.world_size
    return [case.splits[j][rank] for j in range(n)], list(case.splits[rank])


def slots(case: Case, rank: int) -> list[Slot]:
    """The tensors ``rank`` passes, in the order :func:`call` uses them."""
    name, shape, n, root = case.collective, case.shape, case.world_size, case.root
    if name in ("all_reduce", "broadcast", "reduce"):
        return [Slot("tensor", shape, 0)]
    if name == "all_gather":
        return [Slot("tensor", shape, 0)] + [Slot(f"tensor_list[{i}]", shape, None) for i in range(n)]
    if name == "all_gather_into_tensor":
        return [Slot("input_tensor", shape, 0), Slot("output_tensor", stacked(case), None)]
    if name == "reduce_scatter":
        return [Slot("output", shape, None)] + [Slot(f"input_list[{i}]", shape, i + 1) for i in range(n)]
    if name == "reduce_scatter_tensor":
        return [Slot("output", shape, None), Slot("input", stacked(case), 1)]
    if name == "scatter":
        pieces = [Slot(f"scatter_list[{i}]", shape, i + 1) for i in range(n)] if rank == root else []
        return [Slot("tensor", shape, None)] + pieces
    if name == "gather":
        outs = [Slot(f"gather_list[{i}]", shape, None) for i in range(n)] if rank == root else []
        return [Slot("tensor", shape, 0)] + outs
    if name == "all_to_all":
        return [Slot(f"output_tensor_list[{j}]", piece_shape(case, j, rank), None) for j in range(n)] + [
            Slot(f"input_tensor_list[{j}]", piece_shape(case, rank, j), j + 1) for j in range(n)
        ]
    if name == "all_to_all_single":
        out_rows = sum(piece_shape(case, j, rank)[0] for j in range(n))
        in_rows = sum(piece_shape(case, rank, j)[0] for j in range(n))
        return [Slot("output", _rows(case, out_rows), None), Slot("input", _rows(case, in_rows), 1)]
    raise ValueError(f"unknown collective {name!r}")


def call(case: Case, rank: int, fn: Callable[..., Any], t: Tensors, group: Any, **extra: Any) -> None:
    """Call ``fn`` with torch's signature for ``case.collective`` on this rank's tensors ``t``."""
    name, op, root = case.collective, case.op.to_torch(), case.root

    def listed(prefix: str) -> list[torch.Tensor]:
        return [v for k, v in t.items() if k.startswith(prefix + "[")]

    if name == "all_reduce":
        fn(t["tensor"], op=op, group=group, **extra)
    elif name == "broadcast":
        fn(t["tensor"], src=root, group=group, **extra)
    elif name == "reduce":
        fn(t["tensor"], dst=root, op=op, group=group, **extra)
    elif name == "all_gather":
        fn(listed("tensor_list"), t["tensor"], group=group)
    elif name == "all_gather_into_tensor":
        fn(t["output_tensor"], t["input_tensor"], group=group)
    elif name == "reduce_scatter":
        fn(t["output"], listed("input_list"), op=op, group=group)
    elif name == "reduce_scatter_tensor":
        fn(t["output"], t["input"], op=op, group=group)
    elif name == "scatter":
        fn(t["tensor"], listed("scatter_list") if rank == root else None, src=root, group=group)
    elif name == "gather":
        fn(t["tensor"], listed("gather_list") if rank == root else None, dst=root, group=group)
    elif name == "all_to_all":
        fn(listed("output_tensor_list"), listed("input_tensor_list"), group=group)
    elif name == "all_to_all_single":
        out_splits, in_splits = split_sizes(case, rank)
        fn(t["output"], t["input"], output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    else:
        raise ValueError(f"unknown collective {name!r}")


def reduce_all(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``op`` over ``tensors`` in rank order, in their dtype (exact for :func:`values`' inputs)."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if acc.dtype == torch.bool:
            acc = acc | t if op in (ReduceOp.SUM, ReduceOp.MAX) else acc & t
        elif op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + t
        elif op is ReduceOp.PRODUCT:
            acc = acc * t
        elif op is ReduceOp.MIN:
            acc = torch.minimum(acc, t)
        else:
            acc = torch.maximum(acc, t)
    return acc / len(tensors) if op is ReduceOp.AVG else acc


def expected(case: Case, inputs: list[Tensors], unchanged_off_root: bool = True) -> list[dict[str, torch.Tensor | None]]:
    """What every tensor of every rank must hold after the call (``None``: not checked).

    ``inputs[r]`` are rank ``r``'s tensors before the call (contiguous). Input tensors must come
    back unchanged. ``unchanged_off_root=False`` leaves reduce's non-root tensors unchecked:
    torch only defines the root's result (gloo uses the others as scratch).
    """
    name, n, root, op = case.collective, case.world_size, case.root, case.op
    out: list[dict[str, torch.Tensor | None]] = []
    for r in range(n):
        want: dict[str, torch.Tensor | None] = {s.name: inputs[r][s.name] for s in slots(case, r) if s.salt is not None}
        if name == "all_reduce":
            want["tensor"] = reduce_all(op, [inputs[j]["tensor"] for j in range(n)])
        elif name == "broadcast":
            want["tensor"] = inputs[root]["tensor"]
        elif name == "reduce":
            if r == root:
                want["tensor"] = reduce_all(op, [inputs[j]["tensor"] for j in range(n)])
            elif not unchanged_off_root:
                want["tensor"] = None
        elif name == "all_gather":
            want.update({f"tensor_list[{j}]": inputs[j]["tensor"] for j in range(n)})
        elif name == "all_gather_into_tensor":
            want["output_tensor"] = torch.stack([inputs[j]["input_tensor"] for j in range(n)]).reshape(stacked(case))
        elif name == "reduce_scatter":
            want["output"] = reduce_all(op, [inputs[j][f"input_list[{r}]"] for j in range(n)])
        elif name == "reduce_scatter_tensor":
            want["output"] = reduce_all(op, [piece(case, inputs[j]["input"], r) for j in range(n)])
        elif name == "scatter":
            want["tensor"] = inputs[root][f"scatter_list[{r}]"]
        elif name == "gather":
            if r == root:
                want.update({f"gather_list[{j}]": inputs[j]["tensor"] for j in range(n)})
        elif name == "all_to_all":
            want.update({f"output_tensor_list[{j}]": inputs[j][f"input_tensor_list[{r}]"] for j in range(n)})
        elif name == "all_to_all_single":
            pieces = []
            for j in range(n):  # rows rank j sends to r start after what it sends to ranks < r
                start = sum(piece_shape(case, j, k)[0] for k in range(r))
                pieces.append(inputs[j]["input"][start : start + piece_shape(case, j, r)[0]])
            want["output"] = torch.cat(pieces) if pieces else None
        out.append(want)
    return out
