"""Process groups: who takes part in a collective, over which backend, with which deadline.

A :class:`Group` wraps a torch process group (used for rendezvous and as the point-to-point wire)
and adds what our collectives need: the backend choice, a FIFO communication queue, reusable
buffers, a timeout, and a "broken" flag set by the first communication failure.

Backends (``backend=`` argument, or the ``RINGDDP_BACKEND`` environment variable):

=============  ===========================================================================
``auto``       (default) ``p2p`` for CPU tensors, ``nccl-cupy`` for CUDA tensors
``p2p``        our algorithms over torch point-to-point (gloo) — CPU tensors
``nccl-cupy``  our algorithms over NCCL send/recv through CuPy — CUDA tensors
``torch``      torch.distributed's own collectives: the reference, for tests and benchmarks
=============  ===========================================================================

``gloo`` and ``nccl`` are accepted as aliases of ``p2p`` and ``nccl-cupy`` so code written for
``torch.distributed.init_process_group`` works unchanged.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Sequence

import torch
import torch.distributed as dist

from .buffers import Workspace
from .engine import AlgorithmEngine, TorchEngine, Tuning
from .errors import CollectiveError, CollectiveTimeoutError
from .topology import Layout, hosts_of
from .transport.torch_p2p import TorchP2PTransport
from .work import Executor

log = logging.getLogger(__name__)

BACKENDS = ("auto", "p2p", "nccl-cupy", "torch")
_ALIASES = {"gloo": "p2p", "nccl": "nccl-cupy", "cupy": "nccl-cupy", "reference": "torch"}
#: torch's default for CPU process groups.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def resolve_backend(backend: str | None) -> str:
    """Normalise a backend name; ``None`` means ``$RINGDDP_BACKEND`` or ``auto``."""
    name = backend if backend is not None else os.environ.get("RINGDDP_BACKEND", "auto")
    name = _ALIASES.get(name.lower(), name.lower())
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} (or gloo / nccl)")
    return name


def _seconds(timeout: datetime.timedelta | float | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT.total_seconds()
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class Group:
    """A set of ranks that run collectives together.

    Attributes:
        ranks: global ranks of the members, sorted; group rank ``i`` is global rank ``ranks[i]``.
        rank: this process's rank within the group.
        size: number of members.
        backend: resolved backend name.
        timeout: seconds any single wait inside a collective may block.
        tuning: algorithm thresholds and pipelining (:class:`~collectives.engine.Tuning`); change
            them identically on every rank, between collectives.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        ranks: Sequence[int],
        backend: str,
        timeout: float,
        name: str,
    ):
        self.process_group = process_group
        self.ranks = list(ranks)
        self.rank = process_group.rank()
        self.size = len(self.ranks)
        self.backend = backend
        self.timeout = timeout
        self.name = name
        self.workspace = Workspace()
        self.tuning = Tuning()
        self.executor = Executor(name)
        self.broken: str | None = None
        self._engines: dict[str, AlgorithmEngine | TorchEngine] = {}

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, rank={self.rank}, backend={self.backend!r})"

    def group_rank(self, global_rank: int, what: str, op_name: str) -> int:
        """Map a global ``src``/``dst`` rank to this group, or raise ``ValueError``."""
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"{op_name}: {what} must be an int rank, got {type(global_rank).__name__}")
        if global_rank not in self.ranks:
            raise ValueError(f"{op_name}: {what}={global_rank} is not a rank of this group (ranks {self.ranks})")
        return self.ranks.index(global_rank)

    def engine(self, device: torch.device, op_name: str) -> AlgorithmEngine | TorchEngine:
        """The engine that runs collectives on tensors of ``device`` (created on first use)."""
        kind = self.backend
        if kind == "auto":
            kind = "nccl-cupy" if device.type == "cuda" else "p2p"
        if kind == "p2p" and device.type != "cpu":
            raise ValueError(
                f"{op_name}: the p2p (gloo) backend moves CPU tensors only, got a {device.type} tensor; "
                "use backend='nccl-cupy' (pip install ringddp[cuda]) or 'auto'"
            )
        if kind == "nccl-cupy" and device.type != "cuda":
            raise ValueError(f"{op_name}: the nccl-cupy backend moves CUDA tensors only, got {device.type}")
        key = f"{kind}:{device}"
        engine = self._engines.get(key)
        if engine is None:
            engine = self._make_engine(kind, device)
            self._engines[key] = engine
        return engine

    def host_engine(self) -> AlgorithmEngine | TorchEngine:
        """An engine for small CPU metadata (debug checks), whatever device the payloads live on.

        With the NCCL backend this is our algorithms over the group's gloo process group.
        """
        kind = "torch" if self.backend == "torch" else "p2p"
        key = f"{kind}:cpu"
        if key not in self._engines:
            self._engines[key] = self._make_engine(kind, torch.device("cpu"))
        return self._engines[key]

    def _make_engine(self, kind: str, device: torch.device) -> AlgorithmEngine | TorchEngine:
        if kind == "torch":
            return TorchEngine(self.process_group, self.rank, self.size)
        if kind == "p2p":
            transport = TorchP2PTransport(self.process_group, self.rank, self.timeout)
        else:
            from .transport.cupy_nccl import CupyNcclTransport

            transport = CupyNcclTransport.create(self.process_group, self.rank, self.timeout, device)
        return AlgorithmEngine(transport, self.workspace, self.tuning, Layout.from_keys(hosts_of(self)))

    def close(self) -> None:
        self.executor.close()
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self.workspace.clear()


_world: Group | None = None
_owns_torch_group = False
_subgroups: list[Group] = []


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
) -> Group:
    """Join the default group (like ``torch.distributed.init_process_group``).

    If torch.distributed is already initialised (say by your own code or a framework) its default
    group is reused as the wire; otherwise a gloo group is created with the given rendezvous
    (``init_method``, ``store``, or ``env://`` with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
    ``WORLD_SIZE`` as under torchrun).

    Args:
        backend: see the module docstring; ``None`` reads ``$RINGDDP_BACKEND``, else ``auto``.
        timeout: deadline of every blocking wait (and of the rendezvous); default 30 minutes.
    """
    global _world, _owns_torch_group
    if _world is not None:
        raise RuntimeError("init_process_group: already initialised; call destroy_process_group first")
    name = resolve_backend(backend)
    seconds = _seconds(timeout)
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                timeout=datetime.timedelta(seconds=seconds),
                world_size=world_size,
                rank=rank,
                store=store,
            )
        except (RuntimeError, dist.DistError) as exc:  # name the phase; torch's text says who is missing
            joined = _joined(str(exc))
            raise CollectiveTimeoutError(
                f"init_process_group: rendezvous failed after up to {seconds:g}s as rank {rank} of "
                f"{world_size}{joined}: {str(exc).splitlines()[0][:300]}",
                op="init_process_group",
            ) from exc
        _owns_torch_group = True
    pg = dist.group.WORLD
    _world = Group(pg, range(dist.get_world_size()), name, seconds, "world")
    log.debug("rank %d/%d joined the default group (backend %s)", _world.rank, _world.size, name)
    return _world


def _joined(text: str) -> str:
    """' (1 of 2 ranks joined)' from torch's 'N/M clients joined' message, if present."""
    import re

    m = re.search(r"(\d+)/(\d+) clients joined", text)
    return f" ({m.group(1)} of {m.group(2)} ranks joined)" if m else ""


def destroy_process_group() -> None:
    """Leave the default group and every subgroup; destroys torch's group if we created it."""
    global _world, _owns_torch_group
    for g in _subgroups:
        g.close()
    _subgroups.clear()
    if _world is not None:
        _world.close()
        _world = None
    if _owns_torch_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_torch_group = False


def is_initialized() -> bool:
    return _world is not None


def get_default_group() -> Group:
    if _world is None:
        raise RuntimeError("collectives are not initialised: call collectives.init_process_group() first")
    return _world


def _resolve(group: Group | None) -> Group:
    g = get_default_group() if group is None else group
    if not isinstance(g, Group):
        raise TypeError(f"group must be a collectives Group (from new_group), got {type(g).__name__}")
    return g


def get_rank(group: Group | None = None) -> int:
    """This process's rank in ``group`` (default: the default group)."""
    return _resolve(group).rank


def get_world_size(group: Group | None = None) -> int:
    return _resolve(group).size


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
) -> Group | None:
    """Create a group of a subset of ranks (every rank of the default group must call this).

    Returns ``None`` on ranks that are not members, like torch; passing ``None`` as ``group`` to a
    collective then means the default group, so guard calls with ``if g is not None``.
    """
    world = get_default_group()
    members = sorted(set(range(world.size) if ranks is None else ranks))
    bad = [r for r in members if not 0 <= r < world.size]
    if bad or not members:
        raise ValueError(f"new_group: ranks {list(ranks or [])} must be a non-empty subset of 0..{world.size - 1}")
    seconds = _seconds(timeout) if timeout is not None else world.timeout
    pg = dist.new_group(members, timeout=datetime.timedelta(seconds=seconds), backend="gloo")
    if world.rank not in members:
        return None
    g = Group(pg, members, resolve_backend(backend) if backend else world.backend, seconds, f"group{members}")
    _subgroups.append(g)
    return g


def mark_broken(group: Group, error: CollectiveError) -> None:
    """Record the first communication failure; the group refuses further collectives."""
    if group.broken is None:
        group.broken = str(error)
        log.error("group %s is unusable after: %s", group.name, error)
