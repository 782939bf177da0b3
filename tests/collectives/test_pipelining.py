"""The ring and chain algorithms with many tiny segments, so that pipelining, staging-slot reuse
and uneven segment counts are exercised on small, fast inputs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives
from collectives.tuning import Tuning
from collectives.testing import assert_matches_reference, cases

RING_USERS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def set_tuning(rank, world_size, segment_bytes, depth, small_bytes, chain_bytes):
    t = collectives.get_default_group().tuning
    t.segment_bytes, t.depth, t.small_bytes, t.chain_bytes = segment_bytes, depth, small_bytes, chain_bytes


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pipelined_rings_match_torch(pools, world_size):
    pool = pools(world_size)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(world_size, RING_USERS, max_bytes=2400), seg=st.sampled_from([2, 8, 24, 100]), depth=st.integers(1, 5))
    def check(case, seg, depth):
        pool.run(set_tuning, seg, depth, 0, 0)  # small_bytes = chain_bytes = 0: always ring / chain
        assert_matches_reference(pool, case)

    try:
        check()
    finally:
        default = Tuning()
        pool.run(set_tuning, default.segment_bytes, default.depth, default.small_bytes, default.chain_bytes)
