"""The Reducer's objects without processes: Bucket (fill, write-back) and GradBucket (a hook's view)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddp.reducer import Bucket, GradBucket


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(1))]


def test_bucket_slots_are_views_in_order():
    params = _params()
    bucket = Bucket(0, [2, 0], params, ["c", "a", "b"])
    assert bucket.params == [params[2], params[0]]
    assert bucket.buffer.numel() == 7 and bucket.info.param_names == ("b", "c")
    assert [v.shape for v in bucket.views] == [(1,), (2, 3)]
    assert bucket.views[1].data_ptr() == bucket.buffer[1:].data_ptr()


def test_fill_copies_or_adopts_the_view_and_zeroes_missing_gradients():
    params = _params()
    bucket = Bucket(0, [0, 1], params, ["a", "b", "c"])
    params[0].grad = torch.ones(2, 3)
    bucket.fill(0, as_view=False)
    assert torch.equal(bucket.views[0], torch.ones(2, 3)) and params[0].grad.data_ptr() != bucket.buffer.data_ptr()
    bucket.buffer.fill_(5.0)
    bucket.fill(1, as_view=False)  # no .grad: zeros in its slot
    assert torch.equal(bucket.views[1], torch.zeros(4))
    bucket.fill(0, as_view=True)
    assert params[0].grad.data_ptr() == bucket.buffer.data_ptr()  # .grad is now the slot


def test_write_back_copies_clones_or_leaves_unused_alone():
    params = _params()
    bucket = Bucket(0, [0, 1], params, ["a", "b", "c"])
    params[0].grad = torch.zeros(2, 3)
    bucket.buffer.copy_(torch.arange(10.0))
    bucket.write_back(as_view=False, used_anywhere=[True, False, True])
    assert torch.equal(params[0].grad.reshape(-1), torch.arange(6.0))
    assert params[1].grad is None  # used on no rank: stays None
    bucket.write_back(as_view=False, used_anywhere=None)
    assert torch.equal(params[1].grad, torch.arange(6.0, 10.0)) and params[1].grad.data_ptr() != bucket.buffer.data_ptr()


def test_grad_bucket_surface():
    params = _params()
    bucket = Bucket(3, [1, 0], params, ["a", "b", "c"])
    gb = GradBucket(bucket, is_last=True)
    assert gb.index() == 3 and gb.is_last() and gb.buffer() is bucket.buffer
    assert gb.parameters() == [params[1], params[0]]
    assert [g.shape for g in gb.gradients()] == [(4,), (2, 3)]
    other = torch.arange(10.0)
    gb.set_buffer(other)
    assert gb.buffer() is other and torch.equal(gb.gradients()[1].reshape(-1), torch.arange(4.0, 10.0))
    assert torch.equal(bucket.buffer, torch.zeros(10))  # the bucket's own buffer is untouched
    with pytest.raises(ValueError, match="set_buffer"):
        gb.set_buffer(torch.zeros(9))
    with pytest.raises(ValueError, match="set_buffer"):
        gb.set_buffer(torch.zeros(10, dtype=torch.float64))
