"""Every collective against torch's built-in and a hand-computed expectation, on random cases.

Cases (see ``collectives.testing.strategies``) cover world sizes 1-5 and 8, every dtype and reduce
op, 0-d and empty tensors, sizes smaller than and not divisible by the world size, non-contiguous
views, every root and algorithm, and all-to-all with unequal pieces. Values make results exact,
so every tensor of every rank is compared byte for byte with the expectation computed from all
ranks' inputs (inputs must come back unchanged); all-reduce results are also checked bitwise
identical across ranks, and no byte outside any tensor's view may be written. torch's own
collective, called directly on a separate gloo group, is checked against the same expectation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from collectives.testing import assert_matches_reference, cases

EXAMPLES = {1: 40, 2: 150, 3: 120, 4: 100, 5: 80, 8: 40}
LARGE = ("all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_collective_matches_torch(pools, world_size):
    pool = pools(world_size)

    @settings(max_examples=EXAMPLES[world_size], deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(world_size))
    def check(case):
        assert_matches_reference(pool, case)

    check()


@pytest.mark.timeout(300)
def test_large_tensors_take_the_pipelined_ring(pools):
    """Above ``Tuning.small_bytes`` (4 MiB) ``auto`` picks the ring, which then pipelines 2-3 segments."""
    pool = pools(2)

    @settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(2, LARGE, dtypes=["float32", "int64"], min_bytes=(4 << 20) + 1, max_bytes=10 << 20,
                      layouts=["contiguous", "strided"], algorithms=["auto"]))
    def check(case):
        assert_matches_reference(pool, case)

    check()
