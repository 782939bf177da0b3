"""Soak: many random collectives in a row on one group of 4 ranks, checked against torch's.

Each case is drawn from ``collectives.testing.cases`` (every collective, dtype, reduce op, root,
algorithm, memory layout and all-to-all split, sizes up to 256 KiB) and run on our collectives
and on torch's built-in ones; every rank's tensors must hold the hand-computed expectation and
all-reduce results must be bitwise identical on every rank. The group's tuning is shrunk for the
soak (8 KiB segments, ring above 16 KiB), so the ring and chain algorithms run pipelined over up
to 32 segments — the test asserts that some cases did. Then the same cases run again, and the
ranks' open file descriptors and resident memory must not grow during that second pass: a leak
per collective would show up as growth.

CI runs a short version; ``RINGDDP_SOAK_CASES=1000 pytest -m soak`` runs the full one.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from collectives.tuning import Tuning
from collectives.testing import assert_matches_reference, cases
from tests.collectives.test_pipelining import set_tuning

WORLD_SIZE = 4
CASES = int(os.environ.get("RINGDDP_SOAK_CASES", "200"))
SEGMENT = 8 << 10
MAX_BYTES = 32 * SEGMENT


def resources(rank: int, world_size: int) -> tuple[int, int]:
    """(open file descriptors, resident set size in bytes) of this rank.

    Freed memory that glibc keeps in its heaps (it raises its mmap threshold after large frees)
    is handed back first, so RSS counts live memory rather than the allocator's cache.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return fds, rss


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and glibc")
def test_random_collectives_soak(pools):
    pool = pools(WORLD_SIZE)
    drawn: list = []

    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # plain random cases, no shrinking or replay
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(WORLD_SIZE, max_bytes=MAX_BYTES))
    def first_pass(case):
        assert_matches_reference(pool, case)
        drawn.append(case)

    pool.run(set_tuning, SEGMENT, 4, 2 * SEGMENT, 2 * SEGMENT)  # segment, depth, small, chain bytes
    try:
        first_pass()
        assert len(drawn) >= CASES * 0.9, len(drawn)  # hypothesis may skip a few duplicates
        pipelined = [c for c in drawn if math.prod(c.shape) * c.dtype.itemsize >= 4 * SEGMENT]
        assert len(pipelined) >= CASES // 20, f"only {len(pipelined)} cases of 4+ segments"
        # Scratch buffers grow to the largest size seen and stay (by design), so a leak shows as
        # growth while the *same* cases run a second time.
        before = pool.run(resources)
        for case in drawn:
            assert_matches_reference(pool, case)
        after = pool.run(resources)
    finally:
        default = Tuning()
        pool.run(set_tuning, default.segment_bytes, default.depth, default.small_bytes, default.chain_bytes)
    for rank, ((fd0, rss0), (fd1, rss1)) in enumerate(zip(before, after)):
        assert fd1 <= fd0, f"rank {rank}: file descriptors grew from {fd0} to {fd1}"
        assert rss1 - rss0 < 16 << 20, f"rank {rank}: resident memory grew by {(rss1 - rss0) / 2**20:.1f} MiB"
