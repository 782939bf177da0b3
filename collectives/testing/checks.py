"""Run a :class:`~collectives.testing.strategies.Case` on our collectives and on torch's built-in.

:func:`compare_with_reference` is a rank-side job for a :class:`~collectives.testing.WorkerPool`:
every rank builds its inputs for the case, runs the collective twice — once through our
algorithms (the ranks' default group) and once through torch's own collectives (a group with the
``torch`` backend, created on first use) — and returns both outputs, plus whether anything
outside the tensors' views was written. :func:`assert_matches_reference` runs that job and checks
the answers on the caller's side: equal to torch's, and for all-reduce bitwise identical on every
rank. Users can pass ``impl`` to test their own all-reduce the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import api
from ..group import Group, new_group
from .strategies import Case, make_input, untouched_outside

_reference: Group | None = None


def _reference_group() -> Group:
    global _reference
    if _reference is None:
        _reference = new_group(backend="torch")
    return _reference


def _run(case: Case, rank: int, ws: int, group: Group | None, impl: Callable[..., Any] | None) -> list[torch.Tensor]:
    """Run ``case`` on ``group``; return the tensors this rank ends up holding.

    Also checks that no element outside any input/output view was written.
    """
    name, shape = case.collective, case.shape
    kw: dict[str, Any] = {"group": group}
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def tensor(r: int, shape: tuple[int, ...] = shape, salt: int = 0) -> torch.Tensor:
        view, base = make_input(case, r, shape, salt)
        placed.append((view, base))
        return view

    inp = tensor(rank)
    if name == "all_reduce":
        if impl is not None:
            impl(inp, op=case.op, group=group)
        else:
            api.all_reduce(inp, op=case.op, algorithm=case.algorithm, **kw)
        outputs = [inp]
    elif name == "broadcast":
        api.broadcast(inp, src=case.root, algorithm=case.algorithm, **kw)
        outputs = [inp]
    elif name == "reduce":
        api.reduce(inp, dst=case.root, op=case.op, algorithm=case.algorithm, **kw)
        outputs = [inp]  # other ranks' tensors must come back unchanged
    elif name == "all_gather":
        outputs = [tensor(-1 - i) for i in range(ws)]
        api.all_gather(outputs, inp, **kw)
    elif name == "all_gather_into_tensor":
        outputs = [tensor(-1, (ws,) + shape)]
        api.all_gather_into_tensor(outputs[0], inp, **kw)
    elif name == "reduce_scatter":
        ins = [tensor(rank, salt=i + 1) for i in range(ws)]
        api.reduce_scatter(inp, ins, op=case.op, **kw)
        outputs = [inp] + ins
    elif name == "reduce_scatter_tensor":
        big = tensor(rank, (ws,) + shape, salt=1)
        api.reduce_scatter_tensor(inp, big, op=case.op, **kw)
        outputs = [inp, big]
    elif name == "scatter":
        pieces = [tensor(rank, salt=i + 1) for i in range(ws)] if rank == case.root else None
        api.scatter(inp, pieces, src=case.root, **kw)
        outputs = [inp] + (pieces or [])
    elif name == "gather":
        outs = [tensor(-1 - i) for i in range(ws)] if rank == case.root else None
        api.gather(inp, outs, dst=case.root, **kw)
        outputs = [inp] + (outs or [])
    elif name == "all_to_all":
        ins = [tensor(rank, salt=i + 1) for i in range(ws)]
        outputs = [tensor(-1 - i) for i in range(ws)]
        api.all_to_all(outputs, ins, **kw)
        outputs += ins
    elif name == "all_to_all_single":
        outputs = [tensor(-1)]
        api.all_to_all_single(outputs[0], inp, **kw)
        outputs.append(inp)
    else:
        raise ValueError(f"unknown collective {name!r}")
    for view, base in placed:
        if not untouched_outside(view, base):
            raise AssertionError(f"{case}: rank {rank} wrote outside a tensor's view")
    return [t.clone() for t in outputs]


def compare_with_reference(
    rank: int, world_size: int, case: Case, impl: Callable[..., Any] | None = None
) -> dict[str, list[torch.Tensor]]:
    """Rank-side job: ``{"ours": [...], "reference": [...]}`` for ``case``.

    ``impl`` (optional, all-reduce cases only) replaces our ``all_reduce``: it is called as
    ``impl(tensor, op=..., group=...)`` and must reduce in place.
    """
    ours = _run(case, rank, world_size, None, impl)
    # torch's built-in gets plain contiguous tensors holding the same values (it mishandles some
    # non-contiguous views), so the reference does not depend on our own flattening code.
    reference = _run(dataclasses.replace(case, layout="contiguous"), rank, world_size, _reference_group(), None)
    return {"ours": ours, "reference": reference}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (distinguishes -0.0 from 0.0, unlike ``torch.equal``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)

    return torch.equal(raw(a), raw(b))


def assert_matches_reference(pool: Any, case: Case, impl: Callable[..., Any] | None = None) -> None:
    """Run ``case`` on every rank of ``pool``; raise ``AssertionError`` describing any difference."""
    results = pool.run(compare_with_reference, case, impl)
    for rank, result in enumerate(results):
        ours, ref = result["ours"], result["reference"]
        assert len(ours) == len(ref), f"{case}: rank {rank} returned {len(ours)} tensors, reference {len(ref)}"
        for i, (a, b) in enumerate(zip(ours, ref)):
            if not torch.equal(a, b):
                raise AssertionError(
                    f"{case}: rank {rank}, output {i} differs from torch's built-in\n"
                    f"ours:      {a.reshape(-1)[:16].tolist()}\nreference: {b.reshape(-1)[:16].tolist()}"
                )
    if case.collective == "all_reduce":
        first = results[0]["ours"][0]
        for rank, result in enumerate(results[1:], start=1):
            assert bitwise_equal(result["ours"][0], first), f"{case}: rank {rank}'s result is not bitwise identical to rank 0's"
