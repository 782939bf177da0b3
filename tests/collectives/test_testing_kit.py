"""The property-testing kit itself: it passes correct implementations and catches broken ones.

Negative controls: each broken all-reduce below has one classic bug, and the kit must find a
counterexample that names it. Positive controls: the student-style examples in ``examples/``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings

from collectives import ReduceOp
from collectives.testing import Counterexample, cases, property_test
from examples.broadcast import broadcast
from examples.ring_all_reduce import combine, ring_all_reduce

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dropped_rank(tensor, op=dist.ReduceOp.SUM, group=None):
    """Gathers every rank's tensor but reduces all but the last (an off-by-one)."""
    parts = [torch.empty_like(tensor.contiguous()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    result = parts[0].clone()
    for p in parts[1:-1]:
        result = combine(op, result, p)
    tensor.copy_(result)


def ignored_op(tensor, op=dist.ReduceOp.SUM, group=None):
    """Always sums, whatever ``op`` says."""
    buf = tensor.contiguous()
    dist.all_reduce(buf, group=group)
    tensor.copy_(buf)


def writes_outside(tensor, op=dist.ReduceOp.SUM, group=None):
    """Right result, but the write-back copies one element too many into the storage."""
    ring_all_reduce(tensor, op, group)
    if tensor.numel() == 0:
        return
    last = tensor.storage_offset() + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride()))
    storage = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())
    if last + 1 < storage.numel():
        storage[last + 1] = storage[last]


def wrong_dtype(tensor, op=dist.ReduceOp.SUM, group=None):
    """Reduces through float32, whatever the tensor's dtype."""
    buf = tensor.to(torch.float32)
    ring_all_reduce(buf, op, group)
    tensor.copy_(buf)


def differs_across_ranks(tensor, op=dist.ReduceOp.SUM, group=None):
    """The last rank forgets to copy the result back."""
    buf = tensor.clone()
    ring_all_reduce(buf, op, group)
    if dist.get_rank(group) != dist.get_world_size(group) - 1:
        tensor.copy_(buf)


def writes_nothing(output, input, op=dist.ReduceOp.SUM, group=None):
    """A reduce_scatter_tensor that returns without touching ``output``."""


BROKEN = {
    # name: (impl, filters that keep shrinking quick, text the counterexample must contain)
    "dropped_rank": (dropped_rank, {}, "elements differ"),
    "ignored_op": (ignored_op, {"ops": ["max", "min", "product"]}, "elements differ"),
    "writes_outside": (writes_outside, {"layouts": ["offset", "strided"]}, "wrote outside the tensor's view"),
    "wrong_dtype": (wrong_dtype, {"dtypes": ["float64", "int64", "int32"]}, "elements differ"),
    "differs_across_ranks": (differs_across_ranks, {}, "result differs from rank 0's"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_kit_catches_a_broken_all_reduce(pools, name):
    impl, filters, symptom = BROKEN[name]
    with pytest.raises(Counterexample) as caught:
        property_test(impl, "all_reduce", 3, examples=60, pools=pools, max_bytes=256, **filters)
    text = str(caught.value)
    assert symptom in text, text
    for rank in range(3):  # the counterexample shows every rank's inputs, and expected vs got
        assert f"rank {rank} tensor = " in text, text
    if name != "writes_outside":  # the view itself holds the right values there
        assert "expected = " in text and "got      = " in text, text


@pytest.mark.timeout(300)
def test_kit_catches_an_output_never_written(pools):
    with pytest.raises(Counterexample) as caught:
        property_test(writes_nothing, "reduce_scatter_tensor", 2, examples=20, pools=pools, max_bytes=64)
    assert "output: never written" in str(caught.value), str(caught.value)


@pytest.mark.timeout(300)
def test_examples_pass(check_collective):
    assert check_collective(ring_all_reduce, "all_reduce", world_size=[2, 3], examples=40) == 40
    assert check_collective(broadcast, "broadcast", world_size=3, examples=25) == 25


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "collectives.testing", *args], cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_command_line_passes_and_fails():
    ok = _cli("examples.ring_all_reduce:ring_all_reduce", "--collective", "all_reduce", "--world-size", "2",
              "--ops", "sum,max", "--dtypes", "float32,int64", "--examples", "15")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: examples.ring_all_reduce:ring_all_reduce passed 15 examples" in ok.stdout
    bad = _cli("tests.collectives.test_testing_kit:ignored_op", "--world-size", "2", "--ops", "max",
               "--dtypes", "int32", "--examples", "30", "--max-bytes", "64")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED: tests.collectives.test_testing_kit:ignored_op" in bad.stdout
    assert "Counterexample: all_reduce, world size 2, int32" in bad.stdout and "op MAX" in bad.stdout, bad.stdout
    usage = _cli("no_such_module:f")
    assert usage.returncode == 2 and "no_such_module" in usage.stderr


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases([2, 3], ["all_reduce", "reduce_scatter", "broadcast", "all_to_all", "all_to_all_single"],
                  ops=["max", "avg"], dtypes=["float16", "int32"], min_bytes=8, max_bytes=512,
                  layouts=["strided"], roots=[1, 5], uneven=True))
def test_cases_respect_every_filter(case):
    assert case.world_size in (2, 3) and case.layout == "strided"
    assert case.dtype in (torch.float16, torch.int32)
    assert 8 <= math.prod(case.shape) * case.dtype.itemsize <= 512
    if case.collective in ("all_reduce", "reduce_scatter"):
        assert case.op in (ReduceOp.MAX, ReduceOp.AVG)
        assert case.op is not ReduceOp.AVG or case.dtype == torch.float16  # AVG needs a floating dtype
    if case.collective == "broadcast":
        assert case.root == 1
    if case.collective.startswith("all_to_all"):
        assert case.splits is not None and len(case.splits) == case.world_size
        assert all(len(row) == case.world_size for row in case.splits)


def test_cases_reject_impossible_filters():
    with pytest.raises(ValueError, match="AVG needs a floating dtype"):
        cases(2, ["all_reduce"], ops=["avg"], dtypes=["int32"])
    with pytest.raises(ValueError, match="unknown collectives"):
        cases(2, ["allreduce"])
    with pytest.raises(ValueError, match="no root"):
        cases(2, ["broadcast"], roots=[7])
