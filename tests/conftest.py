"""Shared fixtures: persistent rank pools (one per world size), started on first use.

The pools run the backend under test — ``p2p`` unless ``pytest --collectives-backend NAME`` says
otherwise — never ``$RINGDDP_BACKEND``: with ``RINGDDP_BACKEND=torch`` in the environment the
property tests would otherwise compare torch's collectives with themselves.
"""

from __future__ import annotations

import pytest

from collectives.testing import WorkerPool
from collectives.testing.plugin import check_collective  # noqa: F401  (the kit's fixture, on these pools)

_pools: dict[int, WorkerPool] = {}


def pytest_addoption(parser):
    parser.addoption("--collectives-backend", default="p2p", help="backend the rank pools test (default p2p)")


@pytest.fixture(scope="session")
def pools(request):
    """``pools(n)`` -> a WorkerPool of ``n`` ranks, shared by the whole test session."""
    backend = request.config.getoption("--collectives-backend")

    def get(world_size: int) -> WorkerPool:
        if world_size not in _pools:
            _pools[world_size] = WorkerPool(world_size, backend=backend, timeout=20.0, job_timeout=90.0)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture(scope="session")
def collective_pools(pools):
    """The kit plugin's pools are the suite's pools."""
    return pools
