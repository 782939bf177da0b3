"""Object collectives (collectives.objects) against torch.distributed's on the same ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as tdist

import collectives
from tests.collectives.test_p2p import error_kinds

LIBS = {"torch": tdist, "ours": collectives}


@dataclasses.dataclass
class Point:
    x: int
    label: str


def _obj(rank: int):
    """Objects of very different pickled sizes per rank."""
    return [None, rank, "x" * (rank * 37), {"rank": rank, "t": torch.arange(rank + 1)}, Point(rank, "p" * rank)][
        rank % 5
    ] if rank % 2 else {"rank": rank, "items": list(range(rank * 50)), "point": Point(rank, "r")}


def _plain(obj):
    """Comparable form (tensors to lists)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.tolist())
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def object_scenarios(rank, world_size, lib):
    dist = LIBS[lib]
    out = {}
    for src in {0, world_size - 1}:
        objs = [_obj(i) for i in range(4)] if rank == src else [None] * 4
        dist.broadcast_object_list(objs, src=src)
        out[f"broadcast{src}"] = _plain(objs)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, _obj(rank))
    out["all_gather"] = _plain(gathered)

    dst = world_size - 1
    target = [None] * world_size if rank == dst else None
    dist.gather_object(_obj(rank + 1), target, dst=dst)
    out["gather"] = _plain(target)

    received = [None]
    dist.scatter_object_list(received, [_obj(i + 2) for i in range(world_size)] if rank == 0 else None, src=0)
    out["scatter"] = _plain(received)

    if world_size > 1:
        if rank == 0:
            dist.send_object_list([_obj(3), "hello", Point(7, "seven")], dst=world_size - 1)
        elif rank == world_size - 1:
            got = [None, None, None]
            dist.recv_object_list(got, src=0)
            out["p2p"] = _plain(got)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_torch(pools, world_size):
    pool = pools(world_size)
    expected = pool.run(object_scenarios, "torch")
    assert pool.run(object_scenarios, "ours") == expected


def subgroup_objects(rank, world_size, lib):
    """group_src / group_dst on a subgroup of ranks 1..n-1."""
    dist = LIBS[lib]
    members = list(range(1, world_size))
    g = collectives.new_group(members) if lib == "ours" else tdist.new_group(members)
    if rank == 0:
        return None
    objs = [f"from {rank}", rank] if rank == members[-1] else [None, None]
    dist.broadcast_object_list(objs, group=g, group_src=len(members) - 1)
    target = [None] * len(members) if rank == members[0] else None
    dist.gather_object({"r": rank}, target, group=g, group_dst=0)
    return objs, target


@pytest.mark.timeout(120)
def test_subgroup_matches_torch(pools):
    pool = pools(3)
    assert pool.run(subgroup_objects, "ours") == pool.run(subgroup_objects, "torch")


def bad_object_calls(rank, world_size, lib):
    dist = LIBS[lib]
    calls = {
        "all_gather_short": lambda: dist.all_gather_object([None] * (world_size + 1), 1),
        "scatter_no_output": lambda: dist.scatter_object_list([], [1] * world_size if rank == 0 else None, src=0),
        "scatter_no_input": lambda: dist.scatter_object_list([None], None, src=0),
        "broadcast_both": lambda: dist.broadcast_object_list([1], src=0, group_src=0),
        "send_self": lambda: dist.send_object_list([1], dst=rank),
    }
    if rank != 0:
        del calls["scatter_no_input"]
    if lib == "torch":
        del calls["all_gather_short"]  # torch indexes past the list (IndexError after traffic); ours checks first
    return error_kinds(calls)


@pytest.mark.timeout(120)
def test_bad_arguments(pools):
    pool = pools(2)
    theirs = pool.run(bad_object_calls, "torch")
    ours = pool.run(bad_object_calls, "ours")
    for t, o in zip(theirs, ours):
        assert o.pop("all_gather_short") == "ValueError"
        assert o == t
        assert "no error" not in o.values()
    # the group still works: nothing was sent
    assert pool.run(object_scenarios, "ours") == pool.run(object_scenarios, "torch")
