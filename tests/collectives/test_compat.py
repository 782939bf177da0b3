"""Group introspection, subgroups, Backend, errors and monitored_barrier against torch.distributed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as tdist

import collectives
from collectives import CollectiveError, CollectiveTimeoutError

LIBS = {"torch": tdist, "ours": collectives}


def introspection(rank, world_size, lib):
    dist = LIBS[lib]
    world = dist.group.WORLD
    out = {
        "is_pg": isinstance(world, dist.ProcessGroup) and isinstance(dist.GroupMember.WORLD, dist.ProcessGroup),
        "world_ranks": dist.get_process_group_ranks(world),
        "default_ranks": dist.get_process_group_ranks(None),
        "non_member": dist.GroupMember.NON_GROUP_MEMBER == tdist.GroupMember.NON_GROUP_MEMBER,
        "available": (dist.is_available(), dist.is_gloo_available(), dist.is_torchelastic_launched()),
        "backend_str": (dist.Backend("GLOO"), dist.Backend.NCCL, isinstance(dist.Backend.GLOO, str)),
    }
    odd = [r for r in range(world_size) if r % 2]
    members = odd or [0]
    g = dist.new_group(members)
    if rank in members:
        out["sub"] = (
            dist.get_process_group_ranks(g),
            [dist.get_global_rank(g, i) for i in range(len(members))],
            dist.get_group_rank(g, rank),
            dist.get_rank(g),
            dist.get_world_size(g),
        )
        try:
            dist.get_group_rank(g, [r for r in range(world_size) if r not in members][0] if world_size > 1 else 99)
            out["bad_group_rank"] = "no error"
        except ValueError:
            out["bad_group_rank"] = "ValueError"
    return out


def subgroups(rank, world_size, lib):
    dist = LIBS[lib]
    out = {}
    for size in (1, 2, world_size):
        if world_size % size:
            continue
        mine, all_groups = dist.new_subgroups(group_size=size)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mine)
        out[size] = (dist.get_process_group_ranks(mine), len(all_groups), t.item())
    bad = []
    for size in (0, world_size + 1, None):
        try:
            dist.new_subgroups(group_size=size)
            bad.append("no error")
        except ValueError:
            bad.append("ValueError")
    out["bad"] = bad
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_introspection_and_subgroups_match_torch(pools, world_size):
    pool = pools(world_size)
    for fn in (introspection, subgroups):
        expected = pool.run(fn, "torch")
        assert pool.run(fn, "ours") == expected, fn.__name__


def test_backend_and_processgroup_names():
    assert collectives.Backend("GLOO") == "gloo" and collectives.Backend.P2P == "p2p"
    assert collectives.ProcessGroup is collectives.Group
    assert collectives.group.WORLD is None  # read at access time: not initialised in this process
    with pytest.raises(AttributeError):
        collectives.group.NOT_A_NAME  # noqa: B018
    with pytest.raises(ValueError):
        collectives.Backend(3)


def test_errors_are_torch_dist_errors():
    err = CollectiveTimeoutError("x", op="all_reduce", peer=1)
    assert isinstance(err, tdist.DistBackendError) and isinstance(err, tdist.DistError)
    assert isinstance(err, RuntimeError) and isinstance(err, TimeoutError) and isinstance(err, CollectiveError)


def monitored(rank, world_size, lib, late, wait_all):
    """Ranks in ``late`` arrive 3 s late to a barrier with a 1 s timeout; report what rank 0 saw."""
    dist = LIBS[lib]
    dist.monitored_barrier(timeout=20.0 if lib == "ours" else __import__("datetime").timedelta(seconds=20))
    if rank in late:
        time.sleep(3)
    try:
        timeout = __import__("datetime").timedelta(seconds=1)
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all)
        return "passed"
    except RuntimeError as exc:  # torch raises a plain RuntimeError here; ours a CollectiveTimeoutError
        import re

        m = re.search(r"Ranks? [\d, ]+ failed to pass monitoredBarrier in \d+ ms", str(exc))
        return m.group(0) if rank == 0 and m else "error"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("late,wait_all", [((), False), ((2,), False), ((1, 2), True)])
def test_monitored_barrier_matches_torch(late, wait_all):
    """Each run on fresh ranks: a failed monitored barrier leaves the group unusable (as in torch)."""
    expected = collectives.launch(monitored, 3, "torch", late, wait_all, timeout=30, join_timeout=120)
    got = collectives.launch(monitored, 3, "ours", late, wait_all, timeout=30, join_timeout=120)
    assert got == expected
    if late:
        assert got[0] == ("Ranks 1, 2" if wait_all else "Rank 2") + " failed to pass monitoredBarrier in 1000 ms"
    else:
        assert got == ["passed"] * 3


def bad_monitored(rank, world_size):
    out = []
    for kwargs in ({"timeout": -1.0}, {"wait_all_ranks": "yes"}, {"group": "world"}):
        try:
            collectives.monitored_barrier(**kwargs)
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(type(exc).__name__)
    collectives.monitored_barrier(timeout=10.0)  # nothing was sent: it still works
    return out


@pytest.mark.timeout(60)
def test_monitored_barrier_bad_arguments(pools):
    assert pools(2).run(bad_monitored) == [["ValueError", "TypeError", "TypeError"]] * 2
