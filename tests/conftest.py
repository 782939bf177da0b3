"""Shared fixtures: persistent rank pools (one per world size), started on first use."""

from __future__ import annotations

import pytest

from collectives.testing import WorkerPool

_pools: dict[int, WorkerPool] = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a WorkerPool of ``n`` ranks, shared by the whole test session."""

    def get(world_size: int) -> WorkerPool:
        if world_size not in _pools:
            _pools[world_size] = WorkerPool(world_size, timeout=20.0, job_timeout=90.0)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
