"""The public collectives, shaped like ``torch.distributed``'s.

Each function does three things, in this order:

1. checks its arguments and raises ``TypeError`` / ``ValueError`` *before any traffic*, so a bad
   call fails on the rank that made it instead of leaving its peers waiting;
2. takes contiguous flat views of the tensors (copying non-contiguous ones, and writing results
   back into the original view only);
3. submits the work to the group (:meth:`~collectives.group.Group.submit`: its FIFO queue, the
   debug check, tracing) and either waits (default) or returns a :class:`~collectives.work.Work`
   handle (``async_op=True``).

It never knows which backend runs the call: ``group.engine(device)`` returns an
:class:`~collectives.engine.Engine` chosen through :mod:`collectives.backends`.

``src`` / ``dst`` are global ranks, as in torch. Tensors passed with ``async_op=True`` must not be
touched until ``wait()`` returns.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from . import debug, validate, wire
from .engine import Engine
from .group import Group, NonMember, default_group, get_group, member
from .ops import ReduceOp, check_op_dtype
from .tuning import ALL_REDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS
from .work import Work

# ---------------------------------------------------------------------------- argument checks


def _check_list(ts: object, op_name: str, what: str, length: int, like: torch.Tensor) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{op_name}: {what} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != length:
        raise ValueError(f"{op_name}: {what} has {len(ts)} tensors; the group has {length} ranks")
    for i, t in enumerate(ts):
        validate.tensor(t, op_name, f"{what}[{i}]")
        _check_same(t, like, op_name, f"{what}[{i}]")
    return list(ts)


def _check_same(t: torch.Tensor, like: torch.Tensor, op_name: str, what: str, numel: bool = True) -> None:
    if t.dtype != like.dtype:
        raise TypeError(f"{op_name}: {what} has dtype {t.dtype}, expected {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{op_name}: {what} is on {t.device}, expected {like.device}")
    if numel and t.numel() != like.numel():
        raise ValueError(f"{op_name}: {what} has {t.numel()} elements, expected {like.numel()}")


def _check_algorithm(algorithm: str, allowed: tuple[str, ...], op_name: str) -> None:
    if algorithm not in allowed:
        raise ValueError(f"{op_name}: unknown algorithm {algorithm!r}; expected one of {allowed}")


def _check_async(async_op: object, op_name: str) -> None:
    if not isinstance(async_op, bool):
        raise TypeError(f"{op_name}: async_op must be a bool, got {type(async_op).__name__}")


# ---------------------------------------------------------------------------- flat views


class _flat:
    """``with _flat(t) as buf``: a contiguous 1-D view of ``t``; for a non-contiguous ``t`` a copy,
    written back when the block ends without error (unless ``write_back=False``)."""

    __slots__ = ("tensor", "flat", "write_back")

    def __init__(self, t: torch.Tensor, write_back: bool = True):
        self.tensor, self.write_back = t, write_back
        if t.is_contiguous():
            self.flat = t if t.dim() == 1 else t.view(-1)  # a view costs a torch call (~1 µs)
        else:
            self.flat = t.contiguous().view(-1)

    def __enter__(self) -> torch.Tensor:
        return self.flat

    def __exit__(self, kind: object, *_: object) -> None:
        t = self.tensor
        if kind is None and self.write_back and not t.is_contiguous():
            t.copy_(self.flat.view_as(t))


@contextlib.contextmanager
def _flats(ts: Sequence[torch.Tensor], write_back: bool) -> Iterator[list[torch.Tensor]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_flat(t, write_back)) for t in ts]


def _pieces(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``flat`` cut into ``n`` equal consecutive views."""
    m = flat.numel() // n
    return [flat[i * m : (i + 1) * m] for i in range(n)]


# ---------------------------------------------------------------------------- collectives


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | NonMember | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> Work | None:
    """Reduce ``tensor`` across all ranks of the group, in place; every rank gets the result.

    The result is bitwise identical on every rank. ``algorithm``: ``"ring"`` (bandwidth-optimal,
    ``2(n-1)α + 2(n-1)/n·Sβ``), ``"recursive_doubling"`` (latency-optimal, ``log2(n)(α + Sβ)``),
    or ``"auto"`` (by size). A sparse COO ``tensor`` is summed as gloo sums it
    (:func:`_all_reduce_sparse`).

    A synchronous ``auto`` call of a dense contiguous tensor whose key (CPU or not, dtype,
    element count, op) ran before on the group, at the checking level and tuning in force, takes
    that key's planned path (:func:`_plan`): what a persistent start runs, the queue's order,
    the wire check and the errors included.
    """
    name = "all_reduce"
    op = op if type(op) is ReduceOp else ReduceOp.coerce(op)
    plan = False  # whether to plan this call's key after it (_plan)
    if async_op is False and algorithm == "auto" and isinstance(tensor, torch.Tensor):
        g = default_group() if group is None else group if isinstance(group, Group) else None
        # of validate.tensor's checks only what the key below does not fix (see _plan)
        if g is not None and tensor.layout is torch.strided and not tensor.is_nested and tensor.is_contiguous():
            key, state = (tensor.is_cpu, tensor.dtype, tensor.numel(), op), (debug.level(), g.tuning.key())
            planned = g.plans.get(key)
            if planned is None or planned[0] != state:  # not yet, or for another level or tuning
                plan = True
            elif (start := planned[1]) is not None and start(tensor):
                return None
    if isinstance(tensor, torch.Tensor) and tensor.layout is torch.sparse_coo:
        return _all_reduce_sparse(tensor, op, group, async_op, algorithm)
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    check_op_dtype(op, tensor.dtype, name)
    if algorithm != "auto":
        _check_algorithm(algorithm, ALL_REDUCE_ALGORITHMS, name)
    if async_op is not False:
        _check_async(async_op, name)
    if not tensor.is_contiguous():  # a contiguous tensor never shares memory with itself
        validate.aliasing(name, [("tensor", tensor)])
    engine = g.engine(tensor.device, name)

    def run() -> None:
        with _flat(tensor) as buf, engine.transport_op(name):
            engine.all_reduce(buf, op, algorithm)

    signature = debug.signature(name, tensor, op)
    work = g.submit(name, run, async_op, signature, [tensor], algorithm=algorithm)
    if plan:  # the first call of its key: the transport is set up now
        _plan(g, engine, key, state, signature)
    return work


def _plan(g: Group, engine: Engine, key: tuple, state: tuple, signature: debug.Signature) -> None:
    """Plan an ``auto`` all-reduce of ``key`` (a CPU tensor or not, dtype, element count, op) for
    ``state`` (checking level, group tuning), after one such call (what :func:`all_reduce` found
    no plan for) ran on ``engine``: the engine's checked call
    (:meth:`~collectives.engine.AlgorithmEngine.checked_all_reduce`: the native one-shot on
    ``shm``) started by :meth:`Group.plan <collectives.group.Group.plan>`, or None (the ordinary
    path) where the engine offers none, the tensor is not on the CPU, or every rank's signature
    is compared first (DETAIL).

    A planned call checks at every call what its key does not fix: a tensor, strided, not
    nested, contiguous (so no staged copy, no aliasing), a group given or the default one (not a
    non-member), synchronous, ``auto``. The rest depends on the key and state alone, so the call
    that planned them (with every check of the ordinary path, in its order) stands for it: a
    supported dtype, not quantized (a dtype) nor meta (not the CPU), the op for the dtype, the
    CPU's engine; the engine's algorithm choice (count, dtype, tuning) and the wire header
    (count, dtype, op, tuning, level; built here for issuing thread 0, the only thread a plan
    starts on). A call whose key has no plan for the state in force, or whose plan declines it
    (:meth:`Group.plan <collectives.group.Group.plan>`: queued work, another thread, tracing),
    takes the ordinary path with all its checks."""
    on_cpu, dtype, numel, op = key
    level = state[0]
    checked = getattr(engine, "checked_all_reduce", None)  # optional: other engines run the ordinary path
    start = None
    if checked is not None and on_cpu and level != "DETAIL":
        header = wire.header(signature, g.tuning, "auto", None, level, 0)
        if (kernel := checked(numel, dtype, op, header)) is not None:
            start = g.plan("all_reduce", kernel, header, current=False, no_grad=False)
    if len(g.plans) >= 256:  # a loop repeats a few shapes; anything else starts over
        g.plans.clear()
    g.plans[key] = (state, start)


#: dtypes of sparse all-reduce: gloo's (torch adds sparse tensors of these, not float16 or bool).
SPARSE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.int8)


def _all_reduce_sparse(
    tensor: torch.Tensor, op: ReduceOp, group: Group | NonMember | None, async_op: bool, algorithm: str
) -> Work | None:
    """Sum a sparse COO ``tensor`` over the group, as gloo does: every rank coalesces its tensor,
    the ranks all-gather their sizes, indices and values (padded to the largest count), and every
    rank coalesces the union, in rank order; ``tensor`` then holds the result (coalesced; the
    same bits on every rank). Four all-gathers, the last two of ``n·max(nnz)`` entries; ranks
    whose tensors differ in shape, dimensions or dtype raise ``ValueError`` on every rank."""
    name = "all_reduce"
    if op != ReduceOp.SUM:
        raise ValueError(f"{name}: sparse tensors are reduced with ReduceOp.SUM only (as with gloo), not {op.name}")
    if tensor.dtype not in SPARSE_DTYPES:
        raise TypeError(
            f"{name}: sparse tensors of dtype {tensor.dtype} cannot be summed (torch has no sparse addition "
            f"for it); supported: {[str(d) for d in SPARSE_DTYPES]}"
        )
    _check_algorithm(algorithm, ("auto",), f"{name} (sparse)")
    _check_async(async_op, name)
    if (g := member(group, name)) is None:
        return None
    g.engine(tensor.device, name)  # the backend takes this device: raises before any traffic

    def run() -> None:
        local = tensor.coalesce()
        nnz = local.values().shape[0]
        n, dev = g.size(), tensor.device
        mine = [local.sparse_dim(), local.dense_dim(), SPARSE_DTYPES.index(tensor.dtype), local.dim()]
        metas = torch.zeros(n * 5, dtype=torch.int64, device=dev)
        all_gather_into_tensor(metas, torch.tensor(mine + [nnz], device=dev), g)
        rows = metas.view(n, 5).tolist()
        _same_sparse(name, g.rank(), [f"sparse_dim={s} dense_dim={d} dtype={SPARSE_DTYPES[c]} dims={k}" for s, d, c, k, _ in rows])
        shapes = torch.zeros(n * local.dim(), dtype=torch.int64, device=dev)
        all_gather_into_tensor(shapes, torch.tensor(local.shape, dtype=torch.int64, device=dev), g)
        _same_sparse(name, g.rank(), [f"shape {tuple(s)}" for s in shapes.view(n, -1).tolist()])
        counts = [r[4] for r in rows]
        width = max(counts)
        indices = torch.zeros(n, local.sparse_dim(), width, dtype=torch.int64, device=dev)
        values = torch.zeros((n, width) + tuple(local.shape[local.sparse_dim() :]), dtype=tensor.dtype, device=dev)
        if width:
            mine_i, mine_v = indices[g.rank()].clone(), values[g.rank()].clone()
            mine_i[:, :nnz], mine_v[:nnz] = local.indices(), local.values()
            all_gather_into_tensor(indices, mine_i, g)
            all_gather_into_tensor(values, mine_v, g)
        union = torch.sparse_coo_tensor(
            torch.cat([indices[r, :, : counts[r]] for r in range(n)], dim=1),
            torch.cat([values[r, : counts[r]] for r in range(n)]),
            local.shape,
        )
        tensor.copy_(union.coalesce())

    if async_op:  # the gathers run on the communication thread, inline, in this call's place
        return g.enqueue(Work(name, [tensor]), run, True)
    run()
    return None


def _same_sparse(name: str, rank: int, described: list[str]) -> None:
    """Raise ``ValueError`` if the ranks' sparse tensors, ``described`` by rank, differ (on every
    rank alike: they all compare the same gathered metadata)."""
    if len(set(described)) > 1:
        others = "; ".join(f"rank {q}: {d}" for q, d in enumerate(described) if d != described[rank])
        raise ValueError(
            f"{name}: the ranks' sparse tensors differ: this rank ({rank}) has {described[rank]}; {others}. "
            "Every rank must pass a tensor of the same shape, dimensions and dtype"
        )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Group | NonMember | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> Work | None:
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every rank of the group."""
    name = "broadcast"
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    root = g.group_rank(src, "src", name)
    _check_algorithm(algorithm, BROADCAST_ALGORITHMS, name)
    _check_async(async_op, name)
    validate.aliasing(name, [("tensor", tensor)])  # written on every rank but the root: same check on all
    engine = g.engine(tensor.device, name)

    def run() -> None:
        with _flat(tensor, write_back=g.rank() != root) as buf, engine.transport_op(name):
            engine.broadcast(buf, root, algorithm)

    return g.submit(name, run, async_op, debug.signature(name, tensor, root=root), [tensor], algorithm=algorithm)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | NonMember | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> Work | None:
    """Reduce ``tensor`` across the group onto global rank ``dst`` (in place there).

    The tensors of the other ranks are left unchanged (torch's CPU reduce overwrites them).
    """
    name = "reduce"
    op = ReduceOp.coerce(op)
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    check_op_dtype(op, tensor.dtype, name)
    root = g.group_rank(dst, "dst", name)
    _check_algorithm(algorithm, REDUCE_ALGORITHMS, name)
    _check_async(async_op, name)
    validate.aliasing(name, [("tensor", tensor)])
    engine = g.engine(tensor.device, name)

    def run() -> None:
        with _flat(tensor, write_back=g.rank() == root) as buf, engine.transport_op(name):
            engine.reduce(buf, root, op, algorithm)

    return g.submit(name, run, async_op, debug.signature(name, tensor, op, root=root), [tensor], algorithm=algorithm)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | NonMember | None = None, async_op: bool = False
) -> Work | None:
    """Gather ``tensor`` from every rank into ``tensor_list[i]`` (from group rank ``i``)."""
    name = "all_gather"
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    outs = _check_list(tensor_list, name, "tensor_list", g.size(), tensor)
    _check_async(async_op, name)
    in_place = validate.is_chunk(outs[g.rank()], tensor, 0)
    stage = validate.aliasing(name, [(f"tensor_list[{i}]", t) for i, t in enumerate(outs)], [] if in_place else [("tensor", tensor)])
    engine = g.engine(tensor.device, name)

    def run() -> None:
        (src,) = validate.staged([tensor], stage) if stage else (tensor,)
        with _flats(outs, write_back=True) as flat_outs, _flat(src, write_back=False) as inp:
            with engine.transport_op(name):
                engine.all_gather(flat_outs, inp)

    return g.submit(name, run, async_op, debug.signature(name, tensor), outs)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | NonMember | None = None, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (``n`` times as many elements)."""
    name = "all_gather_into_tensor"
    validate.tensor(input_tensor, name, "input_tensor")
    validate.tensor(output_tensor, name, "output_tensor")
    if (g := member(group, name)) is None:
        return None
    _check_same(output_tensor, input_tensor, name, "output_tensor", numel=False)
    if output_tensor.numel() != g.size() * input_tensor.numel():
        raise ValueError(
            f"{name}: output_tensor has {output_tensor.numel()} elements; expected world size "
            f"{g.size()} x input {input_tensor.numel()} = {g.size() * input_tensor.numel()}"
        )
    _check_async(async_op, name)
    in_place = validate.is_chunk(output_tensor, input_tensor, g.rank())
    stage = validate.aliasing(name, [("output_tensor", output_tensor)], [] if in_place else [("input_tensor", input_tensor)])
    engine = g.engine(input_tensor.device, name)

    def run() -> None:
        (src,) = validate.staged([input_tensor], stage) if stage else (input_tensor,)
        with _flat(output_tensor) as out, _flat(src, write_back=False) as inp, engine.transport_op(name):
            engine.all_gather(_pieces(out, g.size()), inp)

    return g.submit(name, run, async_op, debug.signature(name, input_tensor), [output_tensor])


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input_list[i]`` across ranks and leave the result on group rank ``i`` in ``output``."""
    name = "reduce_scatter"
    op = ReduceOp.coerce(op)
    validate.tensor(output, name, "output")
    if (g := member(group, name)) is None:
        return None
    check_op_dtype(op, output.dtype, name)
    ins = _check_list(input_list, name, "input_list", g.size(), output)
    _check_async(async_op, name)
    stage = validate.aliasing(name, [("output", output)], [(f"input_list[{i}]", t) for i, t in enumerate(ins)])
    engine = g.engine(output.device, name)

    def run() -> None:
        srcs = validate.staged(ins, stage)
        with _flat(output) as out, _flats(srcs, write_back=False) as flat_ins, engine.transport_op(name):
            engine.reduce_scatter(out, flat_ins, op)

    return g.submit(name, run, async_op, debug.signature(name, output, op), [output])


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` (``n`` equal chunks) across ranks; group rank ``i`` gets chunk ``i`` in ``output``."""
    name = "reduce_scatter_tensor"
    op = ReduceOp.coerce(op)
    validate.tensor(output, name, "output")
    validate.tensor(input, name, "input")
    if (g := member(group, name)) is None:
        return None
    _check_same(input, output, name, "input", numel=False)
    check_op_dtype(op, output.dtype, name)
    if input.numel() != g.size() * output.numel():
        raise ValueError(
            f"{name}: input has {input.numel()} elements; expected world size {g.size()} x output "
            f"{output.numel()} = {g.size() * output.numel()}"
        )
    _check_async(async_op, name)
    in_place = validate.is_chunk(input, output, g.rank())
    stage = validate.aliasing(name, [("output", output)], [] if in_place else [("input", input)])
    engine = g.engine(output.device, name)

    def run() -> None:
        (src,) = validate.staged([input], stage) if stage else (input,)
        with _flat(output) as out, _flat(src, write_back=False) as inp, engine.transport_op(name):
            engine.reduce_scatter(out, _pieces(inp, g.size()), op)

    return g.submit(name, run, async_op, debug.signature(name, output, op), [output])


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """Global rank ``src`` sends ``scatter_list[i]`` to group rank ``i``, which receives it in ``tensor``."""
    name = "scatter"
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    root = g.group_rank(src, "src", name)
    if g.rank() == root:
        if scatter_list is None:
            raise ValueError(f"{name}: the source rank {src} must pass scatter_list")
        pieces = _check_list(scatter_list, name, "scatter_list", g.size(), tensor)
    else:
        if scatter_list:
            raise ValueError(f"{name}: only the source rank {src} passes scatter_list")
        pieces = None
    _check_async(async_op, name)
    stage = validate.aliasing(name, [("tensor", tensor)], [(f"scatter_list[{i}]", t) for i, t in enumerate(pieces or ())])
    engine = g.engine(tensor.device, name)

    def run() -> None:
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(_flat(tensor))
            srcs = validate.staged(pieces, stage) if pieces is not None else None
            flat_pieces = stack.enter_context(_flats(srcs, write_back=False)) if srcs is not None else None
            stack.enter_context(engine.transport_op(name))
            engine.scatter(out, flat_pieces, root)

    return g.submit(name, run, async_op, debug.signature(name, tensor, root=root), [tensor])


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank sends ``tensor`` to global rank ``dst``, which stores group rank ``i``'s in ``gather_list[i]``."""
    name = "gather"
    validate.tensor(tensor, name)
    if (g := member(group, name)) is None:
        return None
    root = g.group_rank(dst, "dst", name)
    if g.rank() == root:
        if gather_list is None:
            raise ValueError(f"{name}: the destination rank {dst} must pass gather_list")
        outs = _check_list(gather_list, name, "gather_list", g.size(), tensor)
    else:
        if gather_list:
            raise ValueError(f"{name}: only the destination rank {dst} passes gather_list")
        outs = None
    _check_async(async_op, name)
    stage = validate.aliasing(name, [(f"gather_list[{i}]", t) for i, t in enumerate(outs or ())], [("tensor", tensor)])
    engine = g.engine(tensor.device, name)

    def run() -> None:
        with contextlib.ExitStack() as stack:
            (src,) = validate.staged([tensor], stage)
            inp = stack.enter_context(_flat(src, write_back=False))
            flat_outs = stack.enter_context(_flats(outs, write_back=True)) if outs is not None else None
            stack.enter_context(engine.transport_op(name))
            engine.gather(inp, flat_outs, root)

    return g.submit(name, run, async_op, debug.signature(name, tensor, root=root), outs or [])


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """Rank ``r`` sends ``input_tensor_list[j]`` to rank ``j`` and receives into ``output_tensor_list[j]``.

    Tensors may differ in size between peers; ``output_tensor_list[j]`` must match the size rank
    ``j`` sends.
    """
    name = "all_to_all"
    if not isinstance(input_tensor_list, (list, tuple)) or not input_tensor_list:
        raise TypeError(f"{name}: input_tensor_list must be a non-empty list of tensors")
    like = validate.tensor(input_tensor_list[0], name, "input_tensor_list[0]")
    if (g := member(group, name)) is None:
        return None
    for what, ts in (("input_tensor_list", input_tensor_list), ("output_tensor_list", output_tensor_list)):
        if not isinstance(ts, (list, tuple)) or len(ts) != g.size():
            raise ValueError(f"{name}: {what} must be a list of {g.size()} tensors (one per rank)")
        for i, t in enumerate(ts):
            validate.tensor(t, name, f"{what}[{i}]")
            _check_same(t, like, name, f"{what}[{i}]", numel=False)
    if output_tensor_list[g.rank()].numel() != input_tensor_list[g.rank()].numel():
        raise ValueError(f"{name}: output_tensor_list[{g.rank()}] must match input_tensor_list[{g.rank()}] in size")
    _check_async(async_op, name)
    engine = g.engine(like.device, name)
    outs, ins = list(output_tensor_list), list(input_tensor_list)
    stage = validate.aliasing(
        name, [(f"output_tensor_list[{i}]", t) for i, t in enumerate(outs)], [(f"input_tensor_list[{i}]", t) for i, t in enumerate(ins)]
    )

    def run() -> None:
        with _flats(outs, write_back=True) as flat_outs, _flats(validate.staged(ins, stage), write_back=False) as flat_ins:
            with engine.transport_op(name):
                engine.all_to_all(flat_outs, flat_ins)

    sizes = ([t.numel() * t.element_size() for t in ins], [t.numel() * t.element_size() for t in outs])
    return g.submit(name, run, async_op, debug.signature(name, like, uneven=True), outs, sizes=sizes)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group | NonMember | None = None,
    async_op: bool = False,
) -> Work | None:
    """All-to-all on single tensors split along dim 0 (equal splits unless sizes are given)."""
    name = "all_to_all_single"
    validate.tensor(input, name, "input")
    validate.tensor(output, name, "output")
    if (g := member(group, name)) is None:
        return None
    _check_same(output, input, name, "output", numel=False)
    if output.dim() == 0 or input.dim() == 0:
        raise ValueError(f"{name}: input and output need at least one dimension to split")
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(f"{name}: input and output differ beyond dim 0: {tuple(input.shape)} vs {tuple(output.shape)}")
    in_splits = _splits(input, input_split_sizes, g.size(), name, "input")
    out_splits = _splits(output, output_split_sizes, g.size(), name, "output")
    me = g.rank()
    if out_splits[me] != in_splits[me]:
        raise ValueError(
            f"{name}: this rank ({me}) keeps {in_splits[me]} rows of its input but expects {out_splits[me]} "
            f"rows from itself; output_split_sizes[{me}] must equal input_split_sizes[{me}]"
        )
    _check_async(async_op, name)
    row = input[0].numel() if input.shape[0] else int(torch.Size(input.shape[1:]).numel())
    stage = validate.aliasing(name, [("output", output)], [("input", input)])
    engine = g.engine(input.device, name)

    def run() -> None:
        (src,) = validate.staged([input], stage)  # all_to_all_single(t, t) is exact: t is copied first
        with _flat(output) as out, _flat(src, write_back=False) as inp:
            outs = list(out.split([s * row for s in out_splits]))
            ins = list(inp.split([s * row for s in in_splits]))
            with engine.transport_op(name):
                engine.all_to_all(outs, ins)

    row_bytes = row * input.element_size()
    sizes = ([s * row_bytes for s in in_splits], [s * row_bytes for s in out_splits])
    return g.submit(name, run, async_op, debug.signature(name, input, uneven=True), [output], sizes=sizes)


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, n: int, op_name: str, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if t.shape[0] % n:
            raise ValueError(f"{op_name}: {what} dim 0 ({t.shape[0]}) is not divisible by world size {n}; pass split sizes")
        return [t.shape[0] // n] * n
    sizes = list(sizes)
    if len(sizes) != n or any((not isinstance(s, int)) or s < 0 for s in sizes):
        raise ValueError(f"{op_name}: {what}_split_sizes must be {n} non-negative ints, got {sizes}")
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"{op_name}: {what}_split_sizes sum to {sum(sizes)} but {what} dim 0 is {t.shape[0]}")
    return sizes


def barrier(group: Group | NonMember | None = None, async_op: bool = False, device_ids: Sequence[int] | None = None) -> Work | None:
    """Block until every rank of the group has entered the barrier (``device_ids`` is ignored)."""
    name = "barrier"
    _check_async(async_op, name)
    if (g := member(group, name)) is None:
        return None
    engine = g.barrier_engine(name)

    def run() -> None:
        with engine.transport_op(name):
            engine.barrier()

    return g.submit(name, run, async_op, debug.signature(name, None), [])


def symmetric_empty(numel: int, *, dtype: torch.dtype = torch.float32, group: Group | None = None) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements in *symmetric memory*: memory every rank can read.

    Collective: every rank of the group calls it, in the same order, with the same ``numel`` and
    ``dtype`` (like torch's ``_symmetric_memory.empty`` + ``rendezvous`` for CUDA). On the
    ``shm`` backend each rank gets a segment of its own that every peer maps, and an
    ``all_reduce`` of the tensor (or of a contiguous slice of it, the same slice on every rank)
    needs no copy into shared memory: peers read the data where it was computed
    (``shm_algorithms.all_reduce_symmetric``: 2 copies of the buffer instead of 3 at two ranks).
    Everywhere else (other backends, one rank, or shared memory too small: the reason is logged)
    it is an ordinary ``torch.empty`` and everything works the same. Contents are uninitialised.
    The memory stays mapped until the group is destroyed.
    """
    name = "symmetric_empty"
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"{name}: numel must be an int, got {type(numel).__name__}")
    if numel < 0:
        raise ValueError(f"{name}: numel must be >= 0, got {numel}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    g = get_group(group, name)
    engine = g.engine(torch.device("cpu"), name)
    make = getattr(engine, "symmetric_empty", None)  # optional engine method
    made: list[torch.Tensor | None] = [None]

    def run() -> None:
        if make is not None:
            with engine.transport_op(name):
                made[0] = make(numel, dtype)

    g.submit(name, run, False, debug.signature(name, torch.empty(numel, dtype=dtype, device="meta")))
    return made[0] if made[0] is not None else torch.empty(numel, dtype=dtype)
