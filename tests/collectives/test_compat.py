"""Group introspection, subgroups, Backend, errors and monitored_barrier against torch.distributed."""

from __future__ import annotations

import time
import warnings

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


def misc(rank, world_size, lib):
    """The small names, called the same way on both libraries."""
    dist = LIBS[lib]
    n = world_size
    out = {}
    inp = torch.arange(3.0) + 10 * rank
    gathered = torch.zeros(3 * n)
    dist.all_gather_single(gathered, inp)
    out["all_gather_single"] = gathered.tolist()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    out["work"] = isinstance(work, dist.Work) and work.wait()
    with dist.record_comm("labelled"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
    out["record_comm"] = t.item()
    outs = [torch.zeros(2) for _ in range(n)]
    if lib == "ours":
        dist.all_to_all(outs, [torch.full((2,), float(10 * rank + j)) for j in range(n)])
    else:  # gloo has no list all_to_all: the same exchange as one tensor
        flat = torch.zeros(2 * n)
        dist.all_to_all_single(flat, torch.cat([torch.full((2,), float(10 * rank + j)) for j in range(n)]))
        outs = list(flat.split(2))
    out["all_to_all"] = [o.tolist() for o in outs]
    mine, groups = dist.new_subgroups_by_enumeration([[r] for r in range(n)])
    out["by_enumeration"] = (dist.get_process_group_ranks(mine), len(groups))
    out["node_local_rank"] = dist.get_node_local_rank(fallback_rank=rank)
    out["available"] = (
        dist.is_backend_available("gloo"),
        dist.is_mpi_available(),
        dist.is_ucc_available(),
        dist.is_xccl_available(),
        dist.is_nccl_available() and torch.cuda.is_available(),
    )
    return out


def ours_only(rank, world_size):
    """Names whose answer is ours by design (reduce_scatter: gloo has none to compare against)."""
    n = world_size
    out = torch.zeros(2)
    collectives.reduce_scatter(out, [torch.full((2,), float(rank + j)) for j in range(n)])
    single = torch.zeros(2)
    collectives.reduce_scatter_single(single, torch.arange(2.0 * n) + rank)
    expected_single = sum(torch.arange(2.0 * n) + r for r in range(n))[2 * rank : 2 * rank + 2]
    return (
        out.tolist() == [float(sum(r + rank for r in range(n)))] * 2,
        single.tolist() == expected_single.tolist(),
        collectives.get_backend() in collectives.backend_names(),
        collectives.get_pg_count() >= 1,
        collectives.supports_complex(collectives.ReduceOp.SUM) is False,
        collectives.is_backend_available("no-such-backend") is False,
        collectives.default_pg_timeout == tdist.default_pg_timeout,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 3])
def test_small_names_match_torch(pools, world_size):
    pool = pools(world_size)
    assert pool.run(misc, "ours") == pool.run(misc, "torch")
    assert all(all(flags) for flags in pool.run(ours_only))


def test_reexported_torch_names_are_torchs():
    for name in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError",
                 "Store", "TCPStore", "FileStore", "HashStore", "PrefixStore"):
        assert getattr(collectives, name) is getattr(tdist, name)
    collectives.destroy_process_group()  # not initialised here: a no-op, as in torch


def _outcome(call):
    """(what ``call`` returned or raised, how many 'not a member' warnings it gave), comparable across libs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = call()
            result = ("returns", "work" if hasattr(value, "wait") else value)
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            result = ("raises", type(exc).__name__)
    return result, sum("does not belong to the given group" in str(w.message) for w in caught)


def non_members(rank, world_size, lib):
    """Group ``[1, 2]``: its members run collectives on it while the other ranks call everything
    with the non-member handle ``new_group`` gave them; then all use the world again."""
    dist = LIBS[lib]
    members = [1, 2]
    g = dist.new_group(members)
    t, out = torch.full((3,), float(rank + 1)), {}
    out["handle"] = (g == dist.GroupMember.NON_GROUP_MEMBER, dist.get_rank(g), dist.get_world_size(g))
    out["ranks"] = (dist.get_process_group_ranks(g), dist.get_global_rank(g, 0), dist.get_group_rank(g, 2))
    sender, receiver = (rank == 1, rank == 2)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t, group=g),
        "all_reduce async": lambda: dist.all_reduce(t, group=g, async_op=True).wait() if rank in members
        else dist.all_reduce(t, group=g, async_op=True),
        "broadcast": lambda: dist.broadcast(t, src=1, group=g),
        "reduce": lambda: dist.reduce(t.clone(), dst=2, group=g),  # torch's gloo reduce writes off the root too
        "all_gather": lambda: dist.all_gather([torch.zeros(3), torch.zeros(3)], t, group=g),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(6), t, group=g),
        "scatter": lambda: dist.scatter(t, [t, t] if rank == 1 else None, src=1, group=g),
        "gather": lambda: dist.gather(t, [torch.zeros(3), torch.zeros(3)] if rank == 1 else None, dst=1, group=g),
        "barrier": lambda: dist.barrier(group=g),
        "all_gather_object": lambda: dist.all_gather_object([None, None], rank, group=g),
        "gather_object": lambda: dist.gather_object(rank, [None, None] if rank == 1 else None, dst=1, group=g),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank], src=1, group=g),
        "scatter_object_list": lambda: dist.scatter_object_list([None], [1, 2] if rank == 1 else None, src=1, group=g),
    }
    if rank not in members:  # calls that members cannot make here (gloo has no list all_to_all) or that pair up
        calls.update({
            "reduce_scatter": lambda: dist.reduce_scatter(t, [t, t], group=g),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t, torch.zeros(6), group=g),
            "all_to_all": lambda: dist.all_to_all([t, t], [t, t], group=g),
            "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4), group=g),
            "send": lambda: dist.send(t, dst=1, group=g),
            "recv": lambda: dist.recv(t, src=1, group=g),
            "isend": lambda: dist.isend(t, dst=1, group=g),
            "irecv": lambda: dist.irecv(t, src=1, group=g),
            "send_object_list": lambda: dist.send_object_list([1], dst=1, group=g),
            "recv_object_list": lambda: dist.recv_object_list([None], src=1, group=g),
            "monitored_barrier": lambda: dist.monitored_barrier(group=g),
            "get_backend": lambda: dist.get_backend(g),
        })
    elif sender or receiver:
        peer = 3 - rank
        calls.update({
            "send/recv": lambda: dist.send(t, dst=peer, group=g) if sender else dist.recv(t, src=peer, group=g),
            "isend/irecv": lambda: (dist.isend(t, dst=peer, group=g) if sender else dist.irecv(t, src=peer, group=g)).wait(),
            "send/recv_object_list": lambda: dist.send_object_list([7], dst=peer, group=g) if sender
            else dist.recv_object_list([None], src=peer, group=g),
        })
    for name, call in calls.items():
        out[name] = _outcome(call)
    if lib == "ours" and rank not in members:  # torch's P2POp refuses its int handle: ours acts as isend does
        out["batch_isend_irecv"] = _outcome(lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, group=g)]))
    out["tensor"] = t.tolist()
    world = torch.tensor([float(rank)])
    dist.all_reduce(world)  # every rank, members or not, carries on with the world
    out["world"] = world.item()
    return out


def tutorial_broadcast(rank, world_size, lib):
    """A tutorial's pattern: every rank calls broadcast on new_group([0, 1]); only 0 and 1 take part."""
    dist = LIBS[lib]
    t = torch.tensor([float(rank + 1)] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.broadcast(t, src=1, group=dist.new_group([0, 1]))
    dist.barrier()
    return t.tolist()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [3, 4])
def test_non_members_behave_as_torch(pools, world_size):
    """Ranks outside a new group: torch's NON_GROUP_MEMBER semantics, call by call, against torch itself."""
    pool = pools(world_size)
    expected = pool.run(non_members, "torch")
    got = pool.run(non_members, "ours")
    for r in range(world_size):
        assert got[r].pop("batch_isend_irecv", (("returns", []), 1)) == (("returns", []), 1)
    assert got == expected
    outside = [r for r in range(world_size) if r not in (1, 2)]
    for r in outside:  # the oracle says what we think it says
        assert expected[r]["handle"] == (True, -1, -1) and expected[r]["ranks"] == ([1, 2], 1, 1)
        assert expected[r]["all_reduce"] == (("returns", None), 1) and expected[r]["recv"] == (("returns", -1), 1)
        assert expected[r]["send"] == (("raises", "ValueError"), 0)
        assert expected[r]["tensor"] == [float(r + 1)] * 3  # untouched
    assert pool.run(tutorial_broadcast, "ours") == pool.run(tutorial_broadcast, "torch")
    assert pool.run(tutorial_broadcast, "ours")[:2] == [[2.0, 2.0]] * 2


def entry_points(rank, world_size):
    """Our ddp/data entry points given a non-member handle: a clear error, or a warning and nothing."""
    import ddp
    import data

    g = collectives.new_group([1, 2])
    if rank in (1, 2):
        collectives.all_reduce(torch.ones(1), group=g)  # the members' side of all_reduce_gradients below
        collectives.broadcast(torch.ones(4), 1, group=g)  # ... and of broadcast_module
        return None
    model = torch.nn.Linear(2, 2)
    out = {}
    for name, call in {
        "DistributedDataParallel": lambda: ddp.DistributedDataParallel(model, process_group=g),
        "DistributedSampler": lambda: data.DistributedSampler(range(10), group=g),
        "ScatterDataset": lambda: data.ScatterDataset({"x": torch.zeros(4, 2)}, group=g),
    }.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = "not a member" in str(exc) and name in str(exc)
    model.weight.grad = torch.ones(2, 2)
    out["all_reduce_gradients"] = _outcome(lambda: ddp.all_reduce_gradients(model, g))
    out["broadcast_module"] = _outcome(lambda: ddp.broadcast_module(model, group=g))
    out["grad"] = model.weight.grad.tolist()
    return out


@pytest.mark.timeout(120)
def test_ddp_and_data_entry_points_with_a_non_member(pools):
    for r, result in enumerate(pools(4).run(entry_points)):
        if r in (0, 3):
            assert result == {
                "DistributedDataParallel": True, "DistributedSampler": True, "ScatterDataset": True,
                "all_reduce_gradients": (("returns", None), 1), "broadcast_module": (("returns", None), 1),
                "grad": [[1.0, 1.0], [1.0, 1.0]],
            }
