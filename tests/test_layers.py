"""The import graph runs one way, and no module reaches into another's private names.

Every module of ``collectives``, ``data`` and ``ddp`` stands on a floor (:data:`FLOORS`, lowest
first). A module may import only modules of lower floors: type-only imports (``if
TYPE_CHECKING:``) and imports inside functions count too, so neither a cycle nor an arrow running
back up can hide. A new module must be given a floor here: where it stands is a design decision.
The floors read as the architecture: what the transports know, what the algorithms know, and so on.

The private-name check reads every ``x._name`` with ``x`` other than ``self``/``cls``, and every
``from ... import _name``: a ``_name`` of ours that the file does not define itself, or any
``_name`` of a module or class the file imported from ours (``Work._finish(self)`` in a
subclass), is a reach into another module, which should use (or add) a public seam instead.
Tests are not checked.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("collectives", "data", "ddp")

#: Floors, lowest first; a module imports only modules of floors below its own.
FLOORS: list[tuple[str, ...]] = [
    # foundations: errors, values, names; nothing of the package
    ("collectives.errors", "collectives.ops", "collectives.tuning", "collectives.topology",
     "collectives.buffers", "collectives.sizes", "collectives.trace", "collectives.procfs", "collectives.faults"),
    # what a call is: argument checks, signatures (DETAIL), handles and the FIFO queue
    ("collectives.validate", "collectives.debug", "collectives.work"),
    # the wire check's header and tags
    ("collectives.wire",),
    # transports: the interface, then its implementations (shm falls back to p2p)
    ("collectives.transport.base", "collectives.transport"),
    ("collectives.transport.subset", "collectives.transport.torch_p2p", "collectives.transport.cupy_nccl",
     "collectives.transport.sim"),
    # the shared-memory transport, one concept per file (see its package docstring)
    ("collectives.transport.shm.control",),
    ("collectives.transport.shm.config",),
    ("collectives.transport.shm.segment",),
    ("collectives.transport.shm.rendezvous", "collectives.transport.shm.waiting", "collectives.transport.shm.native"),
    ("collectives.transport.shm.wirecheck",),
    ("collectives.transport.shm.fifo", "collectives.transport.shm.cma"),
    ("collectives.transport.shm.regions",),
    ("collectives.transport.shm.transport",),
    ("collectives.transport.shm",),
    # algorithms over a transport, and the user point-to-point protocol
    ("collectives.ring", "collectives.tree", "collectives.direct", "collectives.mailbox"),
    ("collectives.shm_algorithms", "collectives.adoption"),
    ("collectives.hierarchical",),
    ("collectives.costmodel",),
    ("collectives.engine", "collectives.sim.network"),
    # the simulator's studies: engines on virtual ranks (below the groups; collectives.sim binds them)
    ("collectives.sim.study",),
    ("collectives.sim.ddp",),
    ("collectives.backends",),
    ("collectives.group",),
    ("collectives.sim",),
    # the public API
    ("collectives.api", "collectives.launch", "collectives.elastic"),
    ("collectives.p2p", "collectives.persistent"),
    ("collectives.objects", "collectives.compat", "collectives.torch_backend"),
    ("collectives",),
    # tools on top of the API
    ("collectives.testing.strategies", "collectives.testing.linkemu"),
    ("collectives.testing.calls", "collectives.testing.pool", "collectives.testing.hosts"),
    ("collectives.testing.checks",),
    ("collectives.testing.runner",),
    ("collectives.testing.plugin", "collectives.testing.__main__"),
    ("collectives.testing",),
    ("collectives.peers",),
    ("collectives.bench", "collectives.sim.__main__"),
    # data: ways to feed ranks
    ("data.sampler",),
    ("data.scatter",),
    ("data.compare", "data"),
    # ddp: layout and state sync, then the reducer, then the module wrapper; ZeRO on top of both
    ("ddp.bucket", "ddp.sync", "ddp.zero.flat"),
    ("ddp.naive", "ddp.reducer", "ddp.join", "ddp.zero.units"),
    ("ddp.comm_hooks", "ddp.distributed", "ddp.zero.buckets", "ddp.zero.schedule"),
    ("ddp.zero.memory",),
    ("ddp.zero.model",),
    ("ddp.zero.optimizer",),
    ("ddp.zero.checkpoint", "ddp.zero.replica"),
    ("ddp.zero",),
    ("ddp",),
    ("ddp.checkpoint", "ddp.elastic"),
    ("ddp.train", "ddp.bench"),
    ("ddp.bench_checkpoint", "ddp.bench_elastic"),
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: set[str]) -> list[tuple[str, int]]:
    """The modules of ours that ``name`` imports anywhere in its file, with line numbers."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import submodule`` imports the submodule; ``from pkg import name`` the package
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t.split(".")[0] in PACKAGES]
    return found


def test_every_module_has_a_floor():
    placed = [m for floor in FLOORS for m in floor]
    assert len(placed) == len(set(placed)), "a module is on two floors"
    missing = sorted(set(_sources()) - set(placed))
    assert not missing, f"give these modules a floor in tests/test_layers.py: {missing}"
    stale = sorted(set(placed) - set(_sources()))
    assert not stale, f"these modules no longer exist: {stale}"


def test_imports_run_one_way():
    floor = {m: i for i, names in enumerate(FLOORS) for m in names}
    sources = _sources()
    upward = []
    for name, path in sources.items():
        for target, line in _imports(name, path, set(sources)):
            if target in floor and floor[target] >= floor.get(name, -1):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {name} (floor {floor.get(name)}) imports {target} "
                              f"(floor {floor[target]})")
    assert not upward, "imports that run sideways or back up:\n" + "\n".join(upward)


def _defined(tree: ast.AST, text: str) -> set[str]:
    """Every name a file defines or binds: functions, classes, assignments, attributes, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    for slots in re.findall(r"__slots__\s*=\s*\(([^)]*)\)", text):
        names.update(re.findall(r"\"(\w+)\"", slots))
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_reach_into_private_names():
    trees = {path: (ast.parse(path.read_text()), path.read_text()) for path in _sources().values()}
    defined = {path: _defined(tree, text) for path, (tree, text) in trees.items()}
    ours = set().union(*defined.values())
    reaches = []
    for path, (tree, _) in trees.items():
        imported = {  # names bound by importing a module or a name of ours: their _names are never ours
            (a.asname or a.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and (isinstance(node, ast.Import) or node.level or (node.module or "").split(".")[0] in PACKAGES)
            for a in node.names
            if isinstance(node, ast.ImportFrom) or a.name.split(".")[0] in PACKAGES
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner in ("self", "cls"):
                    continue
                if owner in imported or (node.attr in ours and node.attr not in defined[path]):
                    reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner or ''}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
                reaches += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    assert not reaches, "private names of other modules used (add a public seam):\n" + "\n".join(reaches)
