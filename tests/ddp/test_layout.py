"""Bucket layout and its table: pure functions, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from ddp.bucket import MiB, BucketInfo, assign_buckets, cap_from_mb, format_bucket_table


def test_reverse_order_and_cap():
    # parameters 0..4 of 4 bytes; a cap of 8 bytes holds two of them
    assert assign_buckets([4] * 5, ["f"] * 5, 8) == [[4, 3], [2, 1], [0]]


def test_zero_cap_gives_one_bucket_per_parameter():
    assert assign_buckets([4, 8, 2], ["f"] * 3, 0) == [[2], [1], [0]]


def test_infinite_cap_gives_one_bucket_per_key():
    assert assign_buckets([4, 8, 2], ["f"] * 3, math.inf) == [[2, 1, 0]]


def test_large_parameter_gets_its_own_bucket():
    assert assign_buckets([1, 100, 1, 1], ["f"] * 4, 10) == [[3, 2], [1], [0]]


def test_one_dtype_per_bucket():
    keys = ["f32", "f64", "f32", "f64", "f32"]
    buckets = assign_buckets([4] * 5, keys, 100)
    assert buckets == [[4, 2, 0], [3, 1]]
    for b in buckets:
        assert len({keys[i] for i in b}) == 1


def test_first_bucket_cap():
    assert assign_buckets([4] * 6, ["f"] * 6, 16, first_cap_bytes=4) == [[5], [4, 3, 2, 1], [0]]


def test_every_parameter_exactly_once():
    sizes = [3, 17, 1, 64, 9, 9, 2, 40]
    keys = ["a", "b"] * 4
    buckets = assign_buckets(sizes, keys, 20)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    for b in buckets:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= 20


def test_bad_arguments():
    with pytest.raises(ValueError):
        assign_buckets([1, 2], ["f"], 10)
    with pytest.raises(ValueError):
        cap_from_mb(-1)
    assert cap_from_mb(1) == MiB
    assert cap_from_mb(None) == math.inf


def test_table_lists_names_sizes_and_total():
    infos = [
        BucketInfo(0, torch.float32, torch.device("cpu"), ("fc2.bias", "fc2.weight"), ((4,), (4, 8)), 36, 144),
        BucketInfo(1, torch.float32, torch.device("cpu"), ("fc1.weight (= tied.weight)",), ((8, 8),), 64, 256),
    ]
    table = format_bucket_table(infos)
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["bucket", "dtype", "device", "params", "elements", "bytes"]
    assert "fc2.bias, fc2.weight" in lines[2] and "144 B" in lines[2]
    assert "fc1.weight (= tied.weight)" in lines[3]
    assert lines[-1].startswith("total") and "100" in lines[-1] and "2 buckets" in lines[-1]
