"""Reduce ops: what ``ReduceOp.coerce`` accepts from torch and what it refuses, before any traffic."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from collectives import ReduceOp


@pytest.mark.parametrize("name", ["SUM", "PRODUCT", "MIN", "MAX", "AVG"])
def test_torch_ops_in_every_form_map_to_ours(name):
    ours = ReduceOp[name]
    constant = getattr(dist.ReduceOp, name)
    options = dist.AllreduceOptions()  # torch's C++ callers hand ops over in these structs
    options.reduceOp = constant
    for form in (ours, constant, dist.ReduceOp(constant), options.reduceOp, name.lower(), name):
        assert ReduceOp.coerce(form) is ours, form
    assert ours.to_torch() == constant


def test_ops_torch_has_and_we_do_not_are_refused():
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.BAND
    refused = [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR, dist.ReduceOp.PREMUL_SUM,
               dist._make_nccl_premul_sum(2.0), options.reduceOp, "sums", 3, None]  # fmt: skip
    for op in refused:
        with pytest.raises(ValueError, match="unsupported reduce op"):
            ReduceOp.coerce(op)


def test_ops_are_usable_as_keys():
    """Members hash by identity (cheap on the call path); equal members are the same object."""
    assert {ReduceOp.SUM: 1}[ReduceOp.coerce("sum")] == 1
    assert len({ReduceOp.coerce(dist.ReduceOp.MAX), ReduceOp.MAX, ReduceOp("max")}) == 1
