"""Run a :class:`~collectives.testing.strategies.Case` and check every tensor of every rank.

:func:`run_case` is the rank-side job for a :class:`~collectives.testing.WorkerPool`: every rank
builds its tensors for the case (in the case's memory layout, surrounded by sentinel bytes) and
calls the implementation under test — our collectives, or your ``impl`` with torch's signature
(see :mod:`collectives.testing.calls`) — and then ``torch.distributed``'s own collective, called
directly on a separate torch gloo group, on plain contiguous copies of the same inputs.

:func:`assert_matches_reference` runs that job and checks, on the caller's side, against an
expectation computed there from every rank's inputs with plain elementwise torch ops:

1. nothing outside any tensor's view was written (byte-level, so even a stray ``True`` into bool
   storage shows);
2. results that must be identical on every rank are bitwise identical;
3. every tensor holds exactly the expected bytes: outputs the result, inputs their original values;
4. torch's built-in agrees with the same expectation (a check of the oracle itself).

A failure raises :class:`Counterexample`, whose message shows the case, every rank's inputs, and
expected vs got for the tensors that differ.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

import collectives

from .calls import Tensors, call, expected, slots
from .strategies import ALGORITHMS, UNWRITTEN_BYTE, Case, filled, layout, values, written_outside

#: elements of a tensor shown in a counterexample.
SHOWN = 24

_torch_groups: dict[str, Any] = {}


class Counterexample(AssertionError):
    """An implementation gave a wrong answer on a case; the message shows inputs, expected and got."""


def _torch_group(purpose: str, timeout: float) -> Any:
    """A gloo group of all ranks for ``purpose`` (created on first use, the same order on every rank)."""
    if purpose not in _torch_groups:
        import datetime

        _torch_groups[purpose] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    return _torch_groups[purpose]


def _torch_all_to_all(outs: list[torch.Tensor], ins: list[torch.Tensor], group: Any = None) -> None:
    """torch's all_to_all; gloo's needs equal pieces, so unequal ones go through all_to_all_single."""
    if len({t.shape for t in outs + ins}) == 1:
        dist.all_to_all(outs, ins, group=group)
        return
    recv = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
    send = torch.cat([t.reshape(-1) for t in ins])
    dist.all_to_all_single(recv, send, [t.numel() for t in outs], [t.numel() for t in ins], group=group)
    for o, piece in zip(outs, recv.split([t.numel() for t in outs])):
        o.copy_(piece.view(o.shape))


def _torch_all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None) -> None:
    """torch's all_gather_into_tensor on flat views (gloo's shape checks reject 0-d and empty pieces)."""
    dist.all_gather_into_tensor(output_tensor.reshape(-1), input_tensor.reshape(-1), group=group)


def _torch_reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any = None) -> None:
    """torch's reduce_scatter_tensor on flat views (gloo crashes on a 0-d output)."""
    dist.reduce_scatter_tensor(output.reshape(-1), input.reshape(-1), op=op, group=group)


_TORCH_WRAPPERS = {
    "all_to_all": _torch_all_to_all,
    "all_gather_into_tensor": _torch_all_gather_into_tensor,
    "reduce_scatter_tensor": _torch_reduce_scatter_tensor,
}


def _torch_function(name: str) -> Callable[..., Any]:
    return _TORCH_WRAPPERS.get(name) or getattr(dist, name)


def inputs_of(case: Case, rank: int) -> Tensors:
    """Rank ``rank``'s input tensors for ``case`` (contiguous), by slot name."""
    return {s.name: values(case, rank, s.shape, s.salt) for s in slots(case, rank) if s.salt is not None}


def _execute(case: Case, rank: int, fn: Callable[..., Any], group: Any, **extra: Any) -> tuple[Tensors, dict[str, tuple[list[int], list]]]:
    """Run ``fn`` on this rank's tensors for ``case``; returns copies of them after the call and,
    per tensor written outside its view, the element indices of its allocation and their values."""
    tensors: Tensors = {}
    bases = []
    for s in slots(case, rank):
        start = values(case, rank, s.shape, s.salt) if s.salt is not None else filled(s.shape, case.dtype, UNWRITTEN_BYTE)
        view, base = layout(start, case.layout)
        tensors[s.name] = view
        bases.append((s.name, view, base))
    call(case, rank, fn, tensors, group, **extra)
    outside = {name: (idx[:8], base.reshape(-1)[idx[:8]].tolist())
               for name, view, base in bases if (idx := written_outside(view, base))}
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, outside


def run_case(rank: int, world_size: int, case: Case, impl: Callable[..., Any] | None = None, timeout: float = 20.0) -> dict:
    """Rank-side job: run ``case`` on the implementation under test and on torch's built-in.

    ``impl`` None tests our collectives (on the ranks' default group, with ``case.algorithm``);
    otherwise ``impl`` is called with torch's signature and ``group=`` a torch gloo group of all
    ranks. Returns ``{"got": ..., "outside": ..., "reference": ...}``.
    """
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # deprecation notes
    if impl is None:
        extra = {"algorithm": case.algorithm} if case.collective in ALGORITHMS else {}
        got, outside = _execute(case, rank, getattr(collectives, case.collective), None, **extra)
    else:
        got, outside = _execute(case, rank, impl, _torch_group("impl", timeout))
    # torch's built-in gets plain contiguous tensors holding the same values (it mishandles some
    # non-contiguous views); it runs on its own gloo group, never through our api.
    plain = dataclasses.replace(case, layout="contiguous")
    reference, _ = _execute(plain, rank, _torch_function(case.collective), _torch_group("reference", timeout))
    return {"got": got, "outside": outside, "reference": reference}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (distinguishes -0.0 from 0.0 and bool bytes other than 0/1)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(_raw(a), _raw(b))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _show(t: torch.Tensor | None) -> str:
    if t is None:
        return "(not checked)"
    flat = t.reshape(-1)
    text = str(flat[:SHOWN].tolist())
    more = f" ... ({flat.numel()} elements)" if flat.numel() > SHOWN else ""
    return f"{text}{more}" + (f"  shape {tuple(t.shape)}" if t.dim() != 1 else "")


def _difference(name: str, got: torch.Tensor, want: torch.Tensor, is_input: bool) -> str | None:
    """Why ``got`` is not ``want`` (None if bitwise equal)."""
    if bitwise_equal(got, want):
        return None
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: expected shape {tuple(want.shape)} {want.dtype}, got {tuple(got.shape)} {got.dtype}"
    if is_input:
        return f"{name}: an input tensor was modified"
    raw = _raw(got)
    if got.numel() and bool((raw == UNWRITTEN_BYTE).all()):
        return f"{name}: never written (still holds the bytes it had before the call)"
    esize = got.element_size()
    bad = (raw.view(-1, esize) != _raw(want).view(-1, esize)).any(dim=1).nonzero().reshape(-1)
    return f"{name}: {bad.numel()} of {got.numel()} elements differ (first at flat index {int(bad[0])})"


def _in_place_results(case: Case, rank: int) -> set[str]:
    name = case.collective
    if name == "all_reduce" or (name == "broadcast" and rank != case.root) or (name == "reduce" and rank == case.root):
        return {"tensor"}
    return set()


def _problems(case: Case, got: list[Tensors], want: list[dict[str, torch.Tensor | None]],
              outside: list[dict[str, tuple[list[int], list]]] | None) -> list[tuple[int, str, str]]:
    """(rank, slot, description) for every check that fails."""
    found: list[tuple[int, str, str]] = []
    for r, written in enumerate(outside or []):
        for name, (idx, now) in written.items():
            found.append((r, name, f"{name}: wrote outside the tensor's view (elements {idx} of its allocation now hold {now})"))
    if case.collective == "all_reduce":
        first = got[0]["tensor"]
        for r in range(1, len(got)):
            if not bitwise_equal(got[r]["tensor"], first):
                found.append((r, "tensor", "tensor: result differs from rank 0's; all_reduce must give every rank the same bits"))
    for r, (tensors, wanted) in enumerate(zip(got, want)):
        # inputs that must come back unchanged (in-place results are outputs)
        inputs = {s.name for s in slots(case, r) if s.salt is not None} - _in_place_results(case, r)
        for name, w in wanted.items():
            if w is None:
                continue
            why = _difference(name, tensors[name], w, is_input=name in inputs)
            if why:
                found.append((r, name, why))
    return found


def describe_failure(case: Case, problems: list[tuple[int, str, str]], got: list[Tensors] | None,
                     want: list[dict[str, torch.Tensor | None]] | None, title: str = "Counterexample") -> str:
    """The counterexample text: the case, every rank's inputs, and expected vs got where they differ."""
    lines = [f"{title}: {case.describe()}"]
    lines += [f"  rank {r}: {why}" if name else f"  {why}" for r, name, why in problems]
    lines.append("inputs:")
    for r in range(case.world_size):
        for name, t in inputs_of(case, r).items():
            lines.append(f"  rank {r} {name} = {_show(t)}")
    if got is not None and want is not None:
        shown = []
        for r, name, _ in problems:
            w = want[r].get(name)
            if (r, name) in shown or len(shown) >= 4 or name not in got[r] or (w is not None and bitwise_equal(got[r][name], w)):
                continue
            shown.append((r, name))
            lines.append(f"rank {r} {name}:")
            lines.append(f"  expected = {_show(w)}")
            lines.append(f"  got      = {_show(got[r][name])}")
    return "\n".join(lines)


def _pool_for(pool: Any, case: Case) -> tuple[Any, Case]:
    if not hasattr(pool, "run"):  # a pools(n) getter, like the pytest fixture
        if not case.world_size:
            raise ValueError("a case without world_size needs a WorkerPool, not a pool getter")
        pool = pool(case.world_size)
    if not case.world_size:
        case = dataclasses.replace(case, world_size=pool.world_size)
    if case.world_size != pool.world_size:
        raise ValueError(f"case for {case.world_size} ranks given a pool of {pool.world_size}")
    return pool, case


def assert_matches_reference(pool: Any, case: Case, impl: Callable[..., Any] | None = None) -> None:
    """Run ``case`` on every rank of ``pool``; raise :class:`Counterexample` on any wrong answer.

    ``pool``: a :class:`WorkerPool` or a ``pools(world_size)`` getter. ``impl``: your collective
    (torch's signature, see :mod:`collectives.testing.calls`); default: ours.
    """
    pool, case = _pool_for(pool, case)
    try:
        results = pool.run(run_case, case, impl, pool.timeout)
    except Exception as exc:
        if impl is not None:  # a failed user implementation may leave messages in flight: start afresh
            pool.close()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise Counterexample(describe_failure(case, [(0, "", f"a rank raised {type(exc).__name__}: {first}")], None, None)) from exc
    inputs = [inputs_of(case, r) for r in range(case.world_size)]
    got = [res["got"] for res in results]
    want = expected(case, inputs, unchanged_off_root=impl is None)
    problems = _problems(case, got, want, [res["outside"] for res in results])
    if problems:
        raise Counterexample(describe_failure(case, problems, got, want))
    reference = [res["reference"] for res in results]
    want_torch = expected(case, inputs, unchanged_off_root=False)
    oracle = _problems(case, reference, want_torch, None)
    if oracle:
        raise AssertionError(describe_failure(case, oracle, reference, want_torch,
                                              "torch's built-in disagrees with the kit's expectation (a kit bug?)"))
