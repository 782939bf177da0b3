"""pytest plugin: property-test your collective with no pool boilerplate.

Enable it with ``pytest -p collectives.testing.plugin``, or in your ``conftest.py``::

    pytest_plugins = ["collectives.testing.plugin"]

then::

    def test_my_all_reduce(check_collective):
        check_collective(my_all_reduce, "all_reduce", world_size=4, ops=["sum"], examples=100)

``check_collective(impl, collectives, world_size, examples=50, **filters)`` runs
:func:`~collectives.testing.property_test` on pools shared by the whole session
(``collective_pools(n)``), and fails the test with the shrunk counterexample.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import pytest

from .pool import WorkerPool
from .runner import property_test


@pytest.fixture(scope="session")
def collective_pools() -> Iterator[Callable[[int], WorkerPool]]:
    """``collective_pools(n)`` -> a pool of ``n`` ranks (p2p backend), started once per session."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, backend="p2p", timeout=20.0, job_timeout=90.0)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def check_collective(collective_pools: Callable[[int], WorkerPool]) -> Callable[..., int]:
    """``check_collective(impl, collectives="all_reduce", world_size=4, examples=50, **filters)``."""

    def check(impl: Callable[..., Any] | None, collectives: str | Iterable[str] = "all_reduce",
              world_size: int | Iterable[int] = 4, examples: int = 50, **filters: Any) -> int:
        return property_test(impl, collectives, world_size, examples=examples, pools=collective_pools, **filters)

    return check
