"""torch.distributed backend ``"ringddp"``: torch's own stack on our collectives.

Change one string of a torch program and its collectives run on ours::

    dist.init_process_group(backend="ringddp")            # instead of "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)   # torch's DDP, FSDP2, DTensor: unchanged

torch lets a third party register a backend (``Backend.register_backend(name, creator, ...)``);
its creator gets what torch set up for the group — a store private to it, this rank, the size,
the timeout, the members' global ranks — and returns the process group. torch 2.13 offers no
Python seam below ``ProcessGroup`` (no trampoline for its C++ ``Backend``), so
:class:`RingddpProcessGroup` is a ``ProcessGroup`` subclass: it holds a
:class:`~collectives.group.Group` built from that store (:meth:`Group.from_store`) and forwards
every method torch's stack calls to the public collectives API. The transport is chosen as
``auto`` chooses it (shared memory on one host, the hierarchical algorithms across hosts);
``$RINGDDP_BACKEND`` or ``pg_options=Options(backend="p2p")`` picks another of our backends.

Opt-in, on shared memory: ``Options(adopt_bytes=...)`` or ``$RINGDDP_ADOPT_BYTES`` (e.g. ``1G``)
lets a buffer that is all-reduced again and again (torch DDP's buckets, the same tensors every
step) be *adopted*: its storage moves, once and in place, into memory every rank maps, so later
all-reduces read it where it lies instead of copying it in and out (:mod:`collectives.adoption`:
one pass over the buffer fewer per call). Every tensor and view of that storage follows, but a
NumPy array, DLPack capsule or raw pointer taken from it before it moved does not: that is why
it is not the default.

Two threads of torch call in. torch's Python functions (``dist.all_reduce``, ...) call the
methods by their Python names (``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single``, ...); torch's C++ (DDP's reducer, functional collectives) calls the C++
names through torch's trampoline (``allreduce``, ``allgather_into_tensor_coalesced``,
``alltoall_base``, ...): both sets are here. A call that torch marks blocking
(``opts.asyncOp`` false) runs like our own blocking calls, on the caller's thread when nothing is
queued; an async one is queued on the group's communication thread and returns at once.

What torch gets back is a :class:`RingddpWork`, a ``dist.Work`` subclass: its ``wait`` re-raises a
failed collective (``_create_work_from_future(fut).wait()`` would return True), and its future
fails the way C++ sees failures (:meth:`collectives.work.Work.get_future`), so a failing bucket
all-reduce inside torch's DDP raises in ``backward`` on every rank instead of handing the reducer
an exception object as gradients. Future callbacks may issue and wait on collectives (torch's
PowerSGD hook does): they run on the communication thread, and a collective issued there runs at
once (see :mod:`collectives.work`).

Any-source receives (``recv_anysource``, CPU tensors) and sparse all-reduce (COO, SUM) run on
ours as gloo runs them. Refused, with a clear error: ``PREMUL_SUM`` and the bitwise reduce ops,
other reduce ops on sparse tensors, and torch's ``monitored_barrier`` (torch allows it on gloo
only; ``collectives``' own ``monitored_barrier`` runs on any backend). The backend is registered
for ``cpu``, but a Python process group replaces torch's ``ProcessGroup`` object, so it cannot be
one entry of a per-device string such as ``"cpu:ringddp,cuda:nccl"``, and CUDA tensors handed to
it go to the group's engine for CUDA: under ``auto`` our ``nccl-cupy`` (CuPy, one GPU per rank);
without CuPy that engine raises the install hint, and a CPU-only transport chosen explicitly a
``ValueError``, before any traffic.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from . import api, p2p
from .group import Group
from .ops import ReduceOp
from .sizes import env_size
from .work import Work

log = logging.getLogger(__name__)

#: the name torch knows the backend by.
NAME = "ringddp"


@dataclasses.dataclass
class Options:
    """``pg_options`` of ``init_process_group`` / ``new_group`` with ``backend="ringddp"``.

    Attributes:
        backend: which of our backends runs the collectives (``"auto"``, ``"shm"``, ``"p2p"``,
            or any registered); ``None`` reads ``$RINGDDP_BACKEND``, else ``auto``.
        adopt_bytes: how many bytes of repeatedly all-reduced buffers a rank may move into
            symmetric memory (:mod:`collectives.adoption`); ``None`` reads
            ``$RINGDDP_ADOPT_BYTES`` (``1G``, ``512M``, ...), else 0: off.
    """

    backend: str | None = None
    adopt_bytes: int | None = None


def _adopt_bytes(options: Options | None) -> int:
    """The adoption budget: ``options.adopt_bytes``, else ``$RINGDDP_ADOPT_BYTES``, else 0 (off)."""
    given = options.adopt_bytes if options is not None else None
    if given is None:
        given = env_size("RINGDDP_ADOPT_BYTES", 0)
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"backend '{NAME}': adopt_bytes must be an int, got {type(given).__name__}")
    if given < 0:
        raise ValueError(f"backend '{NAME}': adopt_bytes must be >= 0, got {given}")
    return given


class RingddpWork(dist.Work):
    """The handle torch gets: our :class:`~collectives.work.Work` (or several, for the coalesced
    calls) as a ``dist.Work``, or an already finished call's outputs."""

    def __init__(self, works: Sequence[Work], result: list[torch.Tensor]):
        super().__init__()
        self._works = list(works)
        self._result = result
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; re-raise a failed collective's error. ``timeout`` (torch passes a
        negative or zero one for "none") bounds this wait only."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        for work in self._works:
            work.wait(seconds if seconds is not None and seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def _source_rank(self) -> int:
        """The sender's group rank, for a receive (what ``dist.recv`` returns, made global, when it
        was given no ``src``); -1 before ``wait`` for an any-source one."""
        sources = [w for w in self._works if isinstance(w, p2p.P2PWork)]
        if len(sources) != 1:
            raise RuntimeError("_source_rank: only the handle of a receive has a source rank")
        return sources[0].source_rank()

    source_rank = _source_rank

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> BaseException | None:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def result(self) -> list[torch.Tensor]:
        return self._result

    def _done(self, parts: torch.futures.Future) -> list[torch.Tensor]:
        """A ``then`` callback: the result, or the parts' error (``value()`` raises it, which
        fails this future as C++ sees failures)."""
        parts.value()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """Completed with :meth:`result` when every part is done; failed (as C++ sees it) if one failed."""
        if self._future is None:
            if len(self._works) == 1:  # its value is the same list of outputs
                self._future = self._works[0].get_future()
            elif self._works:  # collect_all fails (in C++) if a part failed
                self._future = torch.futures.collect_all([w.get_future() for w in self._works]).then(self._done)
            else:
                self._future = torch.futures.Future()
                self._future.set_result(self._result)
        return self._future


def _work(handle: Work | None, result: list[torch.Tensor]) -> RingddpWork:
    """``handle`` (None when the call ran to completion already) as torch's Work."""
    return RingddpWork([] if handle is None else [handle], result)


def _op(reduce_op: object, op_name: str) -> ReduceOp:
    try:
        return ReduceOp.coerce(reduce_op)
    except ValueError as exc:
        raise ValueError(
            f"{op_name}: backend '{NAME}' supports SUM, PRODUCT, MIN, MAX and AVG, not {reduce_op!r} "
            "(PREMUL_SUM and the bitwise ops are not implemented)"
        ) from exc


def _async(opts: Any) -> bool:
    """Whether torch marked the call async (``opts.asyncOp``; C++ callers leave it at its default, True)."""
    return bool(getattr(opts, "asyncOp", True))


def _one(tensors: Sequence[torch.Tensor], op_name: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{op_name}: backend '{NAME}' takes one tensor per call (one device per process), got {len(tensors)}")
    return tensors[0]


class RingddpProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives are ours (see the module docstring).

    Args:
        group: the collectives group the calls run on (its ranks are torch's group ranks, its
            ``ranks`` the members' global ranks).
    """

    def __init__(self, group: Group):
        super().__init__(group.rank(), group.size())
        self.group = group
        self._group_name = ""
        self._group_desc = ""

    def __repr__(self) -> str:
        return f"RingddpProcessGroup({self.group!r})"

    # ---- names torch's registry and functional collectives read -------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's spelling
        return NAME

    @property
    def name(self) -> str:  # type: ignore[override]
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._group_desc

    def _global(self, group_rank: int) -> int:
        return self.group.ranks[group_rank]

    # ---- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingddpWork:
        t = _one(tensors, "allreduce")
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        return _work(api.all_reduce(t, op, self.group, _async(opts)), [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingddpWork:
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce_coalesced")
        works = [api.all_reduce(t, op, self.group, True) for t in tensors]
        return RingddpWork(works, list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> RingddpWork:
        t = _one(tensors, "broadcast")
        return _work(api.broadcast(t, self._global(opts.rootRank), self.group, _async(opts)), [t])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> RingddpWork:
        t = _one(tensors, "reduce")
        op = _op(opts.reduceOp, "reduce")
        return _work(api.reduce(t, self._global(opts.rootRank), op, self.group, _async(opts)), [t])

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> RingddpWork:
        outs, inp = _one(output_lists, "allgather"), _one(inputs, "allgather")
        return _work(api.all_gather(outs, inp, self.group, _async(opts)), outs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingddpWork:
        """``output_lists[r][j]`` receives rank ``r``'s ``inputs[j]`` (torch's layout)."""
        if len(output_lists) != self.group.size():
            raise ValueError(f"allgather_coalesced: output lists ({len(output_lists)}) must be one per rank ({self.group.size()})")
        works = [
            api.all_gather([outs[j] for outs in output_lists], inp, self.group, True) for j, inp in enumerate(inputs)
        ]
        return RingddpWork(works, [t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingddpWork:
        return _work(api.all_gather_into_tensor(output, input, self.group, _async(opts)), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingddpWork:
        works = [api.all_gather_into_tensor(o, i, self.group, True) for o, i in zip(outputs, inputs, strict=True)]
        return RingddpWork(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the C++ name

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> RingddpWork:
        out, ins = _one(outputs, "reduce_scatter"), _one(input_lists, "reduce_scatter")
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        return _work(api.reduce_scatter(out, ins, op, self.group, _async(opts)), [out])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingddpWork:
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_single")
        return _work(api.reduce_scatter_tensor(output, input, op, self.group, _async(opts)), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingddpWork:
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor_coalesced")
        works = [api.reduce_scatter_tensor(o, i, op, self.group, True) for o, i in zip(outputs, inputs, strict=True)]
        return RingddpWork(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # the C++ name

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> RingddpWork:
        return _work(api.all_to_all(outputs, inputs, self.group, _async(opts)), list(outputs))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> RingddpWork:
        handle = api.all_to_all_single(output, input, output_split_sizes, input_split_sizes, self.group, _async(opts))
        return _work(handle, [output])

    alltoall_base = all_to_all_single  # the C++ name

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> RingddpWork:
        inp = _one(inputs, "gather")
        outs = output_lists[0] if output_lists else None
        return _work(api.gather(inp, outs, self._global(opts.rootRank), self.group, _async(opts)), outs or [])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> RingddpWork:
        out = _one(outputs, "scatter")
        pieces = input_lists[0] if input_lists else None
        return _work(api.scatter(out, pieces, self._global(opts.rootRank), self.group, _async(opts)), [out])

    def barrier(self, opts: Any = None) -> RingddpWork:
        return _work(api.barrier(self.group, _async(opts)), [])

    # ---- point-to-point (group ranks, as torch passes them) ------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> RingddpWork:
        t = _one(tensors, "send")
        return _work(p2p.isend(t, group=self.group, tag=tag, group_dst=dst), [t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> RingddpWork:
        t = _one(tensors, "recv")
        return _work(p2p.irecv(t, group=self.group, tag=tag, group_src=src), [t])

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: release the group (its thread, its transports)."""
        self.group.close()

    abort = shutdown

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> RingddpWork:
        """``recv`` / ``irecv`` without ``src``: the first message from any rank (``collectives.p2p``);
        the handle's ``_source_rank()`` names the sender once waited for."""
        t = _one(tensors, "recv")
        return _work(p2p.irecv(t, group=self.group, tag=tag), [t])


def create(opts: Any, pg_options: Options | None = None) -> RingddpProcessGroup:
    """torch's creator (``extended_api=True``): the group torch describes in ``opts``."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(
            f"backend '{NAME}': pg_options must be collectives.torch_backend.Options, got {type(pg_options).__name__}"
        )
    backend = pg_options.backend if pg_options is not None else None
    adopt_bytes = _adopt_bytes(pg_options)
    ranks = list(opts.global_ranks_in_group) or None
    group = Group.from_store(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, backend=backend, ranks=ranks,
        name=f"{NAME}:{opts.group_id}",
    )
    if group.backend == "torch":
        group.close()
        raise ValueError(
            f"backend '{NAME}' with our 'torch' backend would run torch's collectives on a bare gloo wire: "
            "use backend='gloo' in init_process_group instead"
        )
    group.tuning.adopt_bytes = adopt_bytes
    log.debug("backend %s: %r", NAME, group)
    return RingddpProcessGroup(group)


def register() -> None:
    """Make ``"ringddp"`` a torch.distributed backend (CPU tensors); importing collectives does it."""
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
