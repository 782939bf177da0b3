"""The backend registry: which engine runs a group's collectives on a given device.

A backend is a small frozen :class:`Backend` record: its name and aliases, the device types it
moves, and how to build the engine of one group on one device: either a ``make_transport`` (our
algorithms then run over it, in an :class:`~collectives.engine.AlgorithmEngine`) or a full
``make_engine``. The record also says where the group's small CPU metadata travels (the
``RINGDDP_DEBUG`` checks) and where its barriers run.

Built-in backends (registered at the bottom of this file):

=============  ===========================================================================
``auto``       (default) per device type, the usable backend of highest ``auto_priority``:
               ``shm`` for CPU tensors when every rank is on one host, else ``p2p``;
               ``nccl-cupy`` for CUDA tensors
``shm``        our algorithms over shared memory (``transport/shm/``), ranks of one host
``p2p``        our algorithms over torch point-to-point (gloo); alias ``gloo``. A group that
               spans hosts runs the hierarchical algorithms' intra-host phases over shared memory
``nccl-cupy``  our algorithms over NCCL send/recv through CuPy; aliases ``nccl``, ``cupy``
``torch``      torch.distributed's own collectives: the reference; alias ``reference``
``sim``        our algorithms on virtual ranks in one process, over a modelled network, on a
               virtual clock (``transport/sim.py``; start them with ``collectives.sim.launch``)
=============  ===========================================================================

Your own transport, in your own file, becomes a backend with one call::

    register_backend("counting", "cpu", make_transport=lambda group, device: MyTransport(...))

and is then selected by name wherever a backend is (``init_process_group(backend=...)``,
``launch``, ``WorkerPool``, ``RINGDDP_BACKEND``, the ``--backend`` of the CLIs). Spawned ranks
start from a fresh interpreter, so name it ``"package.module:counting"`` there: the module is
imported (and registers) before the name is looked up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import logging
import os
import sys
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .engine import AlgorithmEngine, Engine, TorchEngine
from .hierarchical import HostTransport
from .topology import Layout
from .transport.base import GroupInfo, Transport
from .transport.shm import ShmTransport
from .transport.sim import SimTransport
from .transport.torch_p2p import TorchP2PTransport

log = logging.getLogger(__name__)

AUTO = "auto"
DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend is: see :func:`register_backend` for the meaning of each field."""

    name: str
    device_types: tuple[str, ...]
    make_transport: Callable[[GroupInfo, torch.device], Transport] | None = None
    make_engine: Callable[[GroupInfo, torch.device], Engine] | None = None
    aliases: tuple[str, ...] = ()
    metadata_backend: str | None = None
    barrier_on_device: bool = False
    auto_priority: int | None = None
    usable: Callable[[GroupInfo], bool] | None = None
    description: str = ""
    threadless: bool = False

    def build(self, group: GroupInfo, device: torch.device) -> Engine:
        """The engine of ``group`` on ``device``.

        A transport backend's CPU engine for a group that spans hosts also gets shared memory
        inside each host for the intra-host phases of the hierarchical algorithms
        (:func:`_shm_host_transport`).
        """
        if self.make_transport is not None:
            layout = Layout.from_keys(group.hosts)
            shm = device.type == "cpu" and layout.spans_hosts and sys.platform.startswith("linux")
            host = _shm_host_transport(group) if shm else None
            return AlgorithmEngine(self.make_transport(group, device), group.tuning, device, layout, host)
        engine = self.make_engine(group, device)
        if not isinstance(engine, Engine):
            raise TypeError(
                f"backend {self.name}: make_engine returned {type(engine).__name__}, which lacks Engine methods"
            )
        return engine

    def metadata(self) -> str:
        """The backend that carries this one's small CPU metadata."""
        if self.metadata_backend is not None:
            return self.metadata_backend
        return self.name if "cpu" in self.device_types else AUTO


_registry: dict[str, Backend] = {}
_aliases: dict[str, str] = {}


def register_backend(
    name: str,
    device_types: str | tuple[str, ...],
    *,
    make_transport: Callable[[GroupInfo, torch.device], Transport] | None = None,
    make_engine: Callable[[GroupInfo, torch.device], Engine] | None = None,
    aliases: tuple[str, ...] = (),
    metadata_backend: str | None = None,
    barrier_on_device: bool = False,
    auto_priority: int | None = None,
    usable: Callable[[GroupInfo], bool] | None = None,
    description: str = "",
    replace: bool = False,
    threadless: bool = False,
) -> Backend:
    """Add a backend to the registry (on every rank: register at import time of your module).

    Args:
        name: lower-case name, e.g. ``"counting"``; must not contain ``":"``.
        device_types: ``"cpu"``, ``"cuda"``, or a tuple of them: the tensors the backend moves.
        make_transport: ``(group, device) -> Transport``: the wire for ``group`` on ``device``;
            our algorithms run over it. ``group`` is a :class:`~collectives.transport.base.GroupInfo`:
            use ``group.process_group``, ``group.rank()``, ``group.timeout`` and ``group.store``
            (a store private to the group, for rendezvous).
        make_engine: ``(group, device) -> Engine``: a whole engine instead (exactly one of the two).
        aliases: other names that select this backend.
        metadata_backend: the backend that carries the group's small CPU metadata (debug checks)
            and, unless ``barrier_on_device``, its barriers. Default: this backend if it moves CPU
            tensors, else ``auto``'s CPU choice.
        barrier_on_device: run barriers on this backend's engine on the current device (so that
            they also order a device stream, as NCCL's do) instead of the metadata backend's.
        auto_priority: makes the backend a candidate of ``auto``; per device type, ``auto``
            takes the usable candidate with the highest priority (built-ins have 0).
        usable: ``(group) -> bool``: whether ``auto`` may pick the backend for ``group``
            (e.g. ``lambda g: len(set(g.hosts)) == 1``: all ranks on one host).
        description: one line for documentation and ``--help``.
        replace: overwrite a backend of the same name instead of raising. (Registering again from
            the same lines of the same file, as when a script is imported both as ``__main__``
            and by name, replaces silently.)
        threadless: its ranks cannot hand work to a communication thread (the virtual ranks of
            ``sim``, greenlets of one thread): ``async_op=True`` runs the collective before the
            call returns, and the handle it returns is complete.

    Raises:
        ValueError: a name or alias already taken, an unknown device type, or not exactly one
            of ``make_transport`` / ``make_engine``.
    """
    types = (device_types,) if isinstance(device_types, str) else tuple(device_types)
    name = name.lower()
    if not name or ":" in name or name == AUTO:
        raise ValueError(f"register_backend: invalid backend name {name!r}")
    bad = [t for t in types if t not in DEVICE_TYPES]
    if bad or not types:
        raise ValueError(f"register_backend({name!r}): device types must be among {DEVICE_TYPES}, got {types}")
    if (make_transport is None) == (make_engine is None):
        raise ValueError(f"register_backend({name!r}): pass exactly one of make_transport and make_engine")
    record = Backend(
        name, types, make_transport, make_engine, tuple(a.lower() for a in aliases), metadata_backend,
        barrier_on_device, auto_priority, usable, description, threadless,
    )
    if name in _registry and (replace or _same_source(_registry[name], record)):
        unregister_backend(name)  # replaced, or the same file imported again (as __main__ and by name)
    taken = [n for n in (name, *record.aliases) if n in _registry or n in _aliases]
    if taken:
        raise ValueError(f"register_backend: {taken} already registered; pass replace=True to overwrite")
    _registry[name] = record
    for alias in record.aliases:
        _aliases[alias] = name
    return record


def _same_source(a: Backend, b: Backend) -> bool:
    """Both records come from the same lines of the same file (a module imported twice)."""

    def origin(f: object) -> object:
        code = getattr(getattr(f, "__func__", f), "__code__", None)
        return (code.co_filename, code.co_firstlineno) if code is not None else f

    return a.device_types == b.device_types and origin(a.make_transport or a.make_engine) == origin(
        b.make_transport or b.make_engine
    )


def unregister_backend(name: str) -> None:
    """Remove a backend and its aliases (groups already using it keep their engines)."""
    record = _registry.pop(resolve_backend(name))
    for alias in record.aliases:
        _aliases.pop(alias, None)


def backend_names() -> tuple[str, ...]:
    """``"auto"`` and every registered backend name, in registration order (aliases excluded)."""
    return (AUTO, *_registry)


def resolve_backend(name: str | None = None) -> str:
    """The canonical name of a backend: ``None`` reads ``$RINGDDP_BACKEND``, else ``"auto"``.

    Aliases map to their backend; ``"package.module:name"`` imports ``package.module`` (which
    registers its backends) and resolves ``name``. Unknown names raise ``ValueError``.
    """
    given = name if name is not None else os.environ.get("RINGDDP_BACKEND", AUTO)
    if not isinstance(given, str):
        raise TypeError(f"backend must be a str, got {type(given).__name__}")
    key = given.strip()
    if ":" in key:
        module, _, key = key.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"backend {given!r}: cannot import module {module!r}: {exc}") from exc
    key = key.lower()
    key = _aliases.get(key, key)
    if key != AUTO and key not in _registry:
        aliases = ", ".join(f"{a}={n}" for a, n in _aliases.items())
        raise ValueError(
            f"unknown backend {given!r}; registered: {', '.join(backend_names())} (aliases {aliases}), "
            "or 'package.module:name' for a backend registered by that module"
        )
    return key


def get_backend(name: str) -> Backend:
    """The record of a registered backend (by name, alias or ``module:name``; not ``auto``)."""
    key = resolve_backend(name)
    if key == AUTO:
        raise ValueError("get_backend: 'auto' is a choice among backends, not a backend; see select_backend")
    return _registry[key]


def select_backend(name: str, device_type: str, group: GroupInfo | None, op_name: str = "select_backend") -> Backend:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors.

    ``name`` is a canonical name (from :func:`resolve_backend`); ``auto`` picks the usable
    candidate of highest priority (``usable`` predicates are skipped when ``group`` is None).
    Raises ``ValueError`` if the backend cannot move such tensors.
    """
    if name == AUTO:
        candidates = [
            b for b in _registry.values()
            if b.auto_priority is not None and device_type in b.device_types
            and (b.usable is None or group is None or b.usable(group))
        ]
        if not candidates:
            raise ValueError(f"{op_name}: no backend moves {device_type} tensors (registered: {describe_backends()})")
        return max(candidates, key=lambda b: b.auto_priority)  # first registered wins a tie
    record = _registry[name]
    if device_type not in record.device_types:
        movers = [b.name for b in _registry.values() if device_type in b.device_types]
        raise ValueError(
            f"{op_name}: the {name} backend moves {'/'.join(record.device_types)} tensors only, got a "
            f"{device_type} tensor; use one of {movers or 'no registered backend'} or 'auto'"
        )
    return record


def device_type_of(name: str) -> str:
    """The device type a job on backend ``name`` computes on: ``cpu`` unless it moves CUDA only."""
    key = resolve_backend(name)
    return "cpu" if key == AUTO or "cpu" in _registry[key].device_types else _registry[key].device_types[0]


def backend_argument(text: str) -> str:
    """An argparse ``type=`` for ``--backend``: checks the name, returns it as given.

    ``package.module:name`` stays as given so that spawned ranks import the module too.
    """
    try:
        resolve_backend(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def describe_backends() -> str:
    """One line per backend: name, device types, aliases, description (for ``--help``)."""
    lines = [f"{AUTO}: per device type, the usable backend of highest priority"]
    for b in _registry.values():
        alias = f" (alias {', '.join(b.aliases)})" if b.aliases else ""
        lines.append(f"{b.name} [{'/'.join(b.device_types)}]{alias}: {b.description}")
    return "; ".join(lines)


def _shm_host_transport(group: GroupInfo) -> HostTransport:
    """Shared memory among the ranks of one host, for the intra-host phases of the hierarchical
    collectives of a CPU group that spans hosts.

    Each host's ranks meet on a store of their own (``hier/<host>/`` inside the group's). If
    they cannot share memory (the check and the fallback are agreed by all of them), they log a
    warning and use ``fallback``: the view of the group's transport.
    """

    def make(host: int, members: Sequence[int], fallback: Callable[[], Transport]) -> Transport:
        store = dist.PrefixStore(f"hier/{host}/", group.store)
        return ShmTransport(list(members).index(group.rank()), len(members), group.timeout, store, fallback=fallback,
                            abandoned=lambda: group.broken)

    return make


# ---------------------------------------------------------------------------- built-in backends


def _nccl_transport(group: GroupInfo, device: torch.device) -> Transport:
    from .transport.cupy_nccl import CupyNcclTransport  # CuPy is optional: import on first use

    return CupyNcclTransport.create(group.process_group, group.rank(), group.timeout, device)


register_backend(
    "p2p", "cpu", make_transport=TorchP2PTransport.for_group, aliases=("gloo",), auto_priority=0,
    description="our algorithms over torch point-to-point (gloo), CPU tensors",
)
register_backend(
    "nccl-cupy", "cuda", make_transport=_nccl_transport, aliases=("nccl", "cupy"), auto_priority=0,
    metadata_backend="p2p", barrier_on_device=True,
    description="our algorithms over NCCL send/recv through CuPy (pip install 'ringddp[cuda]'), CUDA tensors",
)
register_backend(
    "torch", ("cpu", "cuda"), make_engine=lambda g, device: TorchEngine(g.process_group, g.timeout),
    aliases=("reference",), description="torch.distributed's own collectives: the reference for tests and benchmarks",
)
register_backend(
    "shm", "cpu", make_transport=ShmTransport.for_group, auto_priority=1, usable=ShmTransport.usable,
    description="our algorithms over shared memory, every rank on one host (falls back to p2p under auto)",
)


@functools.lru_cache(maxsize=16)
def _sim_layout(hosts: tuple[str, ...]) -> Layout:
    """The layout of a virtual group's hosts, made once for all its ranks (each of 1,024 virtual
    ranks held its own copy of the same 1,024 hosts before)."""
    return Layout.from_keys(hosts)


register_backend(
    "sim", "cpu",
    make_engine=lambda g, device: AlgorithmEngine(SimTransport.for_group(g), g.tuning, device, _sim_layout(tuple(g.hosts))),
    description="our algorithms on virtual ranks in one process, on a modelled network's virtual clock (collectives.sim)",
    threadless=True,
)
