"""Persistent all-reduce (``collectives.all_reduce_init``): the same bits and the same checks as
the call it stands for, whichever ranks use it."""

from __future__ import annotations

import sys

import pytest
import torch

import collectives
from tests.collectives.test_shm import _wide_floats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory")

#: one-shot (a 2-D tensor); one-shot near its limit at 3 ranks; two-shot in pieces.
SHAPES = ((10, 100), (170_001,), (600_001,))


def planned_and_plain(rank: int, world_size: int) -> dict:
    """Ranks 0 and 2 start plans (four times each, refilling the buffer in place: the first
    start plans, the last is async), rank 1 calls ``all_reduce``; then a planned start meets a
    different collective."""
    out: dict = {"sums": [], "avg": None}
    with pytest.raises(ValueError, match="unknown algorithm"):
        collectives.all_reduce_init(torch.ones(4), algorithm="nope")
    for shape in SHAPES:
        numel = int(torch.Size(shape).numel())
        t = torch.empty(shape)
        plan = collectives.all_reduce_init(t) if rank != 1 else None
        results = []
        for i in range(4):
            if i == 2:  # the planned start then follows another collective: it publishes its header anew
                collectives.barrier()
            t.copy_(_wide_floats(rank, numel).view(shape))
            if plan is None:
                collectives.all_reduce(t)
            elif i == 3:
                plan.start(async_op=True).wait()
            else:
                assert plan.planned == (i > 0)
                plan.start()
            results.append(t.clone())
        out["sums"].append(results)
    avg = torch.full((64,), float(rank + 1))
    avg_plan = collectives.all_reduce_init(avg, op=collectives.ReduceOp.AVG)
    avg_plan.start()
    out["avg"] = avg.clone()
    try:
        if rank == 0:
            assert avg_plan.planned
            avg_plan.start()
        else:
            collectives.broadcast(avg, src=0)
    except collectives.CollectiveError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.timeout(180)
def test_plans_give_the_rank_order_fold_mixed_with_plain_calls_and_keep_the_wire_check():
    """README/DESIGN: every rank gets the same bits, the fold in rank order 0, 1, 2 (as
    ``test_shm``'s check of the plain call), whether it starts a plan or calls ``all_reduce``;
    a plan whose peers call something else raises ``CollectiveError`` on every rank, not a
    timeout."""
    results = collectives.launch(planned_and_plain, 3, backend="shm", timeout=20.0, join_timeout=300)
    for i, shape in enumerate(SHAPES):
        numel = int(torch.Size(shape).numel())
        expected = _wide_floats(0, numel)
        for q in (1, 2):
            expected = expected + _wide_floats(q, numel)
        for rank, result in enumerate(results):
            for start, got in enumerate(result["sums"][i]):
                assert torch.equal(got.view(-1).view(torch.int32), expected.view(torch.int32)), (shape, rank, start)
    for result in results:
        assert torch.equal(result["avg"], torch.full((64,), 2.0))
        assert "called a different collective" in result.get("mismatch", ""), result.get("mismatch")
