"""Every collective against torch's built-in, on random cases, for world sizes 1-5 and 8.

Cases (see ``collectives.testing.strategies``) cover every dtype and reduce op, 0-d and empty
tensors, sizes smaller than and not divisible by the world size, non-contiguous views, and every
root and algorithm. Values make results exact, so outputs are compared with ``torch.equal``;
all-reduce results are also checked bitwise identical across ranks, and no element outside any
tensor's view may be written.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from collectives.testing import assert_matches_reference, cases

EXAMPLES = {1: 40, 2: 150, 3: 120, 4: 100, 5: 80, 8: 40}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_collective_matches_torch(pools, world_size):
    pool = pools(world_size)

    @settings(max_examples=EXAMPLES[world_size], deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(world_size))
    def check(case):
        assert_matches_reference(pool, case)

    check()
