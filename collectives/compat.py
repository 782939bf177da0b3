"""The rest of ``torch.distributed``'s everyday surface: group introspection, ``Backend``, availability.

So that scripts written for torch run with ``import collectives as dist``:

* ``dist.ProcessGroup`` is our :class:`~collectives.group.Group` (annotations, ``isinstance``);
  ``dist.group.WORLD`` and ``dist.GroupMember.WORLD`` are the default group, read when accessed
  (``None`` before ``init_process_group``); ``GroupMember.NON_GROUP_MEMBER`` is torch's marker.
* ``get_backend``, ``get_process_group_ranks``, ``get_global_rank``, ``get_group_rank``,
  ``new_subgroups``, ``new_subgroups_by_enumeration``: as torch's, on our groups.
* ``is_available`` (always true), ``is_gloo_available``, ``is_nccl_available``, ``is_mpi_available``,
  ``is_ucc_available``, ``is_xccl_available``, ``is_torchelastic_launched``, ``Backend``.
* ``monitored_barrier``: a barrier that names the ranks that did not arrive in time.

``docs/api-coverage.md`` lists every public name of torch.distributed and where it stands here.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Sequence

import torch
import torch.distributed as dist

from . import api, debug, trace
from .backends import resolve_backend
from .errors import CollectiveTimeoutError, timed_out, timeout_seconds
from .group import (
    DEFAULT_TIMEOUT, NON_GROUP_MEMBER, Group, NonMember, get_default_group, get_group, get_rank, get_world_size,
    group_count, is_initialized, member, new_group,
)
from .ops import ReduceOp

#: torch's name for a group; ours is :class:`~collectives.group.Group`.
ProcessGroup = Group

#: torch's exceptions and rendezvous stores, re-exported: ours derive from them / accept them.
DistError = dist.DistError
DistBackendError = dist.DistBackendError
DistNetworkError = dist.DistNetworkError
DistStoreError = dist.DistStoreError
QueueEmptyError = dist.QueueEmptyError
Store = dist.Store
TCPStore = dist.TCPStore
FileStore = dist.FileStore
HashStore = dist.HashStore
PrefixStore = dist.PrefixStore

#: default deadline of every wait (torch's, 30 minutes).
default_pg_timeout = DEFAULT_TIMEOUT

#: torch's other names for :func:`all_gather_into_tensor` and :func:`reduce_scatter_tensor`.
all_gather_single = api.all_gather_into_tensor
reduce_scatter_single = api.reduce_scatter_tensor

#: torch's ``record_comm(name)``: label the collectives issued inside the block (traces, errors).
record_comm = trace.label


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> Group | None:  # noqa: N802 - torch's spelling
        """The default group, or ``None`` before ``init_process_group`` (read at access time)."""
        return get_default_group() if is_initialized() else None


class GroupMember(metaclass=_GroupMemberMeta):
    """torch's ``GroupMember``: ``WORLD`` (the default group) and ``NON_GROUP_MEMBER``.

    ``new_group`` returns a :class:`~collectives.group.NonMember` on ranks outside the new group,
    which compares equal to ``NON_GROUP_MEMBER`` (torch's -100), so ``g ==
    GroupMember.NON_GROUP_MEMBER`` works as in torch; either one makes collectives no-ops there.
    """

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class Backend(str):
    """Backend names as lowercase strings, like torch's ``Backend``.

    torch's constants (``GLOO``, ``NCCL``, ...) plus ours; ``Backend("GLOO")`` gives ``"gloo"``.
    ``gloo`` and ``nccl`` are accepted by ``init_process_group`` as aliases of ``p2p`` and
    ``nccl-cupy``.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    AUTO = "auto"
    P2P = "p2p"
    NCCL_CUPY = "nccl-cupy"
    TORCH = "torch"

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        return str.__new__(cls, name.lower())


def get_backend(group: Group | None = None) -> Backend:
    """The backend name of ``group`` (default: the default group): ``"p2p"``, ``"auto"``, ...

    Our names, not torch's: a group created with ``backend="gloo"`` reports ``"p2p"``.
    """
    return Backend(get_group(group, "get_backend").backend)


def get_process_group_ranks(group: Group | NonMember | None) -> list[int]:
    """Global ranks of ``group``'s members, ordered by group rank (also on a rank outside it)."""
    return list(group.ranks if isinstance(group, NonMember) else get_group(group).ranks)


def get_global_rank(group: Group | NonMember | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    ranks = get_process_group_ranks(group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int):
        raise TypeError(f"get_global_rank: group_rank must be an int, got {type(group_rank).__name__}")
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of the group of ranks {ranks}")
    return ranks[group_rank]


def get_group_rank(group: Group | NonMember | None, global_rank: int) -> int:
    """The rank within ``group`` of global rank ``global_rank``."""
    ranks = get_process_group_ranks(group)
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise TypeError(f"get_group_rank: global_rank must be an int, got {type(global_rank).__name__}")
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of the group of ranks {ranks}")
    return ranks.index(global_rank)


def new_subgroups(
    group_size: int | None = None,
    group: Group | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[Group | None, list[Group | NonMember]]:
    """Split ``group`` (default: the world) into consecutive subgroups of ``group_size`` ranks.

    Every rank of the default group must call it. Returns ``(the subgroup of this rank, all
    subgroups)``; entries for subgroups this rank is not in are ``NonMember`` (see ``new_group``).
    ``pg_options`` and ``group_desc`` are accepted and ignored. ``group_size`` has no default on
    CPU (torch's default is the number of GPUs).
    """
    if group_size is None:
        if not torch.cuda.is_available():
            raise ValueError("new_subgroups: pass group_size (its default, the number of GPUs, needs CUDA)")
        group_size = torch.cuda.device_count()
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"new_subgroups: group_size must be an int, got {type(group_size).__name__}")
    ranks = get_process_group_ranks(group)
    if group_size <= 0:
        raise ValueError(f"new_subgroups: group_size ({group_size}) must be positive")
    if len(ranks) % group_size:
        raise ValueError(f"new_subgroups: the group size ({len(ranks)}) must be divisible by group_size={group_size}")
    return new_subgroups_by_enumeration(
        [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)], timeout, backend
    )


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[Group | None, list[Group | NonMember]]:
    """One subgroup per list of global ranks (disjoint); returns ``(this rank's, all)``."""
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise ValueError(f"new_subgroups_by_enumeration: ranks {sorted(overlap)} are in more than one subgroup")
        seen.update(ranks)
    subgroups = [new_group(list(ranks), timeout=timeout, backend=backend) for ranks in ranks_per_subgroup_list]
    mine = next((g for g in subgroups if isinstance(g, Group)), None)
    return mine, subgroups


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node: ``$LOCAL_RANK`` (set by torchrun), else ``fallback_rank``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not in the environment and no fallback_rank was given")


def get_pg_count() -> int:
    """How many groups exist: the default group plus every subgroup this rank is a member of."""
    return group_count()


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` names one of our backends (or an alias such as ``gloo``)."""
    try:
        resolve_backend(backend)
    except (ValueError, TypeError, ImportError):
        return False
    return True


def supports_complex(reduceOp: ReduceOp) -> bool:  # noqa: N803 - torch's parameter name
    """Always ``False``: complex dtypes are not among the supported dtypes."""
    ReduceOp.coerce(reduceOp)
    return False


def is_available() -> bool:
    """Always true: collectives need only torch's gloo process group."""
    return True


def is_gloo_available() -> bool:
    return dist.is_gloo_available()


def is_nccl_available() -> bool:
    """Whether the ``nccl-cupy`` backend can run here (CUDA and CuPy with NCCL)."""
    if not torch.cuda.is_available():
        return False
    try:
        from .transport.cupy_nccl import import_cupy_nccl

        import_cupy_nccl()
    except ImportError:
        return False
    return True


def is_mpi_available() -> bool:
    return False


def is_ucc_available() -> bool:
    return False


def is_xccl_available() -> bool:
    return False


def is_torchelastic_launched() -> bool:
    """Whether this process was started by torchrun / torchelastic (``TORCHELASTIC_RUN_ID`` is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


#: gloo tag of monitored_barrier's messages (a channel apart from collectives and user messages).
_MONITOR_TAG = 2


def monitored_barrier(
    group: Group | None = None, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Group rank 0 waits for a message from every other rank, then answers each. If some rank is not
    there in time, rank 0 raises :class:`~collectives.errors.CollectiveTimeoutError` naming it
    (with ``wait_all_ranks=True``: naming all of them, after waiting for the rest) — the message
    reads like torch's: ``Rank 1 failed to pass monitoredBarrier in 2000 ms``. The other ranks
    then time out waiting for the answer. ``timeout`` defaults to the group's. The group is
    unusable after a failure (the late rank's connection is closed). Cost: ``2(n - 1)`` messages
    through rank 0, ``2α`` latency; meant for debugging, like torch's.
    """
    name = "monitored_barrier"
    if (g := member(group, name)) is None:  # not a member: nothing, as in torch
        return
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"{name}: wait_all_ranks must be a bool, got {type(wait_all_ranks).__name__}")
    seconds = timeout_seconds(timeout, g.timeout)
    if seconds is None or seconds <= 0:
        raise ValueError(f"{name}: timeout must be positive, got {timeout!r}")
    pg, me, n = g.process_group, get_rank(g), get_world_size(g)

    def wait(work: dist.Work, deadline: float) -> bool:
        try:
            return bool(work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))))
        except RuntimeError:
            return False

    def run() -> None:
        deadline = time.monotonic() + seconds
        token = torch.zeros(1, dtype=torch.uint8)
        if me != 0:
            arrived = wait(pg.send([token], 0, _MONITOR_TAG), deadline)
            if not (arrived and wait(pg.recv([token.clone()], 0, _MONITOR_TAG), deadline)):
                raise CollectiveTimeoutError(
                    f"{name}: rank {g.ranks[me]} got no answer from rank {g.ranks[0]}: {timed_out(seconds)} "
                    "(rank 0 reports which ranks did not arrive)",
                    op=name,
                    peer=0,
                )
            return
        arrivals = {r: pg.recv([torch.zeros(1, dtype=torch.uint8)], r, _MONITOR_TAG) for r in range(1, n)}
        missing = []
        for r, work in arrivals.items():
            if not wait(work, deadline):
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            ms = int(seconds * 1000)
            ranks = [g.ranks[r] for r in missing]
            text = (
                f"Rank {ranks[0]} failed to pass monitoredBarrier in {ms} ms"
                if not wait_all_ranks
                else f"Ranks {', '.join(map(str, ranks))} failed to pass monitoredBarrier in {ms} ms"
            )
            raise CollectiveTimeoutError(f"{name}: {text}", op=name, peer=missing[0])
        for work in [pg.send([token], r, _MONITOR_TAG) for r in range(1, n)]:
            work.wait()

    g.submit(name, run, False, debug.signature(name, None))

