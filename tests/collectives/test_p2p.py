"""User point-to-point (collectives.p2p) against torch.distributed's own send/recv on the same ranks.

Every scenario runs twice on the same pool: once with ``torch.distributed`` (the oracle, on the
pool's gloo process group) and once with ``collectives``; the results must be identical. The
any-source scenario runs four ways (gloo, ours on p2p and on shm, torch's calls on a ringddp
group), and its failures (silent and dead senders) in processes of their own.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as tdist

import collectives
from collectives.mailbox import MessageMismatchError

LIBS = {"torch": tdist, "ours": collectives}


def _seq(rank: int, n: int = 5, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n) + 10 * rank).to(dtype)


def pipeline(rank, world_size, lib):
    """Stage r receives from r - 1, adds its rank, sends to r + 1 (blocking calls)."""
    dist = LIBS[lib]
    t = torch.zeros(4, 3)
    if rank > 0:
        src = dist.recv(t, src=rank - 1)
        assert src == rank - 1
    t += rank
    if rank < world_size - 1:
        dist.send(t, dst=rank + 1)
    return t.tolist()


def ring_exchange(rank, world_size, lib, recv_first):
    """isend right / irecv left, in either order, then wait both."""
    dist = LIBS[lib]
    out = torch.zeros(5, dtype=torch.int64)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if recv_first:
        works = [dist.irecv(out, src=left), dist.isend(_seq(rank, dtype=torch.int64), dst=right)]
    else:
        works = [dist.isend(_seq(rank, dtype=torch.int64), dst=right), dist.irecv(out, src=left)]
    for w in works:
        w.wait()
    return out.tolist()


def batch_exchange(rank, world_size, lib):
    """Every rank sends a different tensor to each other rank in one batch (various dtypes/layouts)."""
    dist = LIBS[lib]
    ops, outs = [], []
    for peer in range(world_size):
        if peer == rank:
            continue
        send = (torch.arange(12.0).view(3, 4) + 100 * rank + peer).t()  # non-contiguous: ours only
        if lib == "torch":
            send = send.contiguous()  # torch's p2p refuses non-contiguous tensors
        recv = torch.zeros(4, 3)
        outs.append(recv)
        ops.append(dist.P2POp(dist.isend, send, peer))
        ops.append(dist.P2POp(dist.irecv, recv, peer))
        ops.append(dist.P2POp(dist.isend, torch.zeros(0), peer))  # empty messages are fine
        ops.append(dist.P2POp(dist.irecv, torch.zeros(0), peer))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    return [o.tolist() for o in outs]


def dtypes_and_layouts(rank, world_size, lib):
    """Rank 0 sends several dtypes to rank 1, including a non-contiguous receive target."""
    dist = LIBS[lib]
    if world_size < 2 or rank > 1:
        return None
    cases = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.bfloat16, torch.float16, torch.float64]
    got = []
    for dtype in cases:
        if rank == 0:
            dist.send((torch.arange(6) % 3).to(dtype), dst=1)
        else:
            t = torch.zeros(6, dtype=dtype)
            dist.recv(t, src=0)
            got.append(t.tolist())
    if rank == 0:
        dist.send(torch.arange(8.0), dst=1, tag=7)
    else:
        big = torch.zeros(4, 4)
        view = big[:, 1:3]  # non-contiguous receive target: ours only, torch refuses it
        if lib == "torch":
            tmp = view.contiguous()
            dist.recv(tmp, src=0, tag=7)
            view.copy_(tmp)
        else:
            dist.recv(view, src=0, tag=7)
        got.append(big.tolist())
    return got


def subgroup_ranks(rank, world_size, lib):
    """On a subgroup of the odd ranks: group_dst/group_src and global dst/src."""
    dist = LIBS[lib]
    members = list(range(1, world_size, 2))
    g = collectives.new_group(members) if lib == "ours" else tdist.new_group(members)
    if rank not in members or len(members) < 2:
        return None
    me = members.index(rank)
    t = torch.full((3,), float(rank))
    if me == 0:
        dist.send(t, group_dst=1, group=g)
        dist.recv(t, src=members[1], group=g)
    elif me == 1:
        dist.recv(t, group_src=0, group=g)
        t += 1
        dist.send(t, dst=members[0], group=g)
    return t.tolist()


def keeps_order_with_collectives(rank, world_size, lib):
    """isend/irecv, then a collective, then wait: the messages pair up as issued."""
    dist = LIBS[lib]
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    out = torch.zeros(3)
    works = [dist.isend(torch.full((3,), float(rank)), dst=right), dist.irecv(out, src=left)]
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    for w in works:
        w.wait()
    w = dist.isend(torch.full((2,), 5.0 + rank), dst=right)
    dist.barrier()
    back = torch.zeros(2)
    dist.recv(back, src=left)
    w.wait()
    return out.tolist(), total.tolist(), back.tolist()


SCENARIOS = [
    (pipeline, ()),
    (ring_exchange, (True,)),
    (ring_exchange, (False,)),
    (batch_exchange, ()),
    (dtypes_and_layouts, ()),
    (subgroup_ranks, ()),
    (keeps_order_with_collectives, ()),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_torch(pools, world_size):
    pool = pools(world_size)
    for fn, args in SCENARIOS:
        expected = pool.run(fn, "torch", *args)
        got = pool.run(fn, "ours", *args)
        assert got == expected, fn.__name__


def single_rank(rank, world_size):
    """World of one: every peer is this rank, so every call is refused before traffic."""
    errors = []
    for call in (lambda: collectives.send(torch.ones(1), dst=0), lambda: collectives.irecv(torch.ones(1), src=0)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(60)
def test_world_of_one(pools):
    (errors,) = pools(1).run(single_rank)
    assert len(errors) == 2 and all("cannot message itself" in e for e in errors)


def bad_calls(rank, world_size, lib):
    """Bad arguments: the exception type must match torch's where torch raises cleanly."""
    dist = LIBS[lib]
    t = torch.ones(3)
    other = 1 - rank
    calls = {
        "self": lambda: dist.send(t, dst=rank),
        "both": lambda: dist.send(t, dst=other, group_dst=other),
        "neither": lambda: dist.send(t),
        "list": lambda: dist.send([t], dst=other),
        "float_dst": lambda: dist.send(t, dst=float(other)),
        "float_tag": lambda: dist.isend(t, dst=other, tag=1.5),
        "recv_self": lambda: dist.recv(t, src=rank),
    }
    return error_kinds(calls)


def error_kinds(calls: dict) -> dict[str, str]:
    """Run each call; the name of the exception it raised, or ``"no error"``."""
    kinds = {}
    for key, call in calls.items():
        try:
            call()
            kinds[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - the type is what we compare
            kinds[key] = type(exc).__name__
    return kinds


def our_extra_checks(rank, world_size):
    """Where torch hangs, times out or crashes, we raise before any traffic."""
    t = torch.ones(3)
    out = []
    for call in (
        lambda: collectives.send(t, dst=world_size),  # torch: store timeout
        lambda: collectives.send(t, dst=-1),
        lambda: collectives.send(t, group_dst=world_size),
        lambda: collectives.batch_isend_irecv([]),
        lambda: collectives.batch_isend_irecv([1]),
        lambda: collectives.P2POp(collectives.all_reduce, t, 0),
        lambda: collectives.send(torch.ones(2, dtype=torch.complex64), dst=1 - rank),
    ):
        try:
            call()
            out.append("no error")
        except (ValueError, TypeError) as exc:
            out.append(type(exc).__name__)
    # nothing was sent: the pair still works
    x = torch.full((2,), float(rank))
    works = [collectives.isend(x, dst=1 - rank), collectives.irecv(y := torch.zeros(2), src=1 - rank)]
    try:
        works[0].get_future()  # as torch's gloo point-to-point Work: not implemented
        out.append("no error")
    except RuntimeError:
        out.append("RuntimeError")
    for w in works:
        w.wait()
        assert w.is_completed() and w.is_success() and w.exception() is None
    return out, y.tolist()


@pytest.mark.timeout(120)
def test_bad_arguments(pools):
    pool = pools(2)
    expected = pool.run(bad_calls, "torch")
    got = pool.run(bad_calls, "ours")
    for theirs, ours in zip(expected, got):
        assert all(v != "no error" for v in theirs.values())
        # torch raises RuntimeError (from gloo) for a receive from oneself; ours is a ValueError,
        # like torch's own send to oneself
        assert theirs.pop("recv_self") == "RuntimeError" and ours.pop("recv_self") == "ValueError"
        assert ours == theirs
    for rank, (kinds, y) in enumerate(pool.run(our_extra_checks)):
        assert kinds == ["ValueError"] * 4 + ["TypeError", "ValueError", "TypeError", "RuntimeError"], kinds
        assert y == [float(1 - rank)] * 2


def mismatched(rank, world_size):
    """A tag / size / dtype mismatch raises on the receiver; the pair stays usable."""
    errors = []
    for send, recv_kwargs in (
        ((torch.ones(4), {"tag": 1}), (torch.zeros(4), {"tag": 2})),
        ((torch.ones(8), {}), (torch.zeros(4), {})),  # longer than the receive: gloo would abort
        ((torch.ones(4), {}), (torch.zeros(4, dtype=torch.int32), {})),
    ):
        if rank == 0:
            collectives.send(send[0], dst=1, **send[1])
        else:
            try:
                collectives.recv(recv_kwargs[0], src=0, **recv_kwargs[1])
            except MessageMismatchError as exc:
                errors.append(str(exc))
    t = torch.tensor([float(rank)])
    collectives.all_reduce(t)
    return errors, t.item()


@pytest.mark.timeout(120)
def test_mismatch_is_an_error_not_a_hang(pools):
    results = pools(2).run(mismatched)
    assert results[0] == ([], 1.0)
    errors, total = results[1]
    assert total == 1.0 and len(errors) == 3
    assert "tag=1" in errors[0] and "expected tag=2" in errors[0]
    assert "numel=8" in errors[1] and "dtype=torch.int32" in errors[2]


def reference_backend_job(rank, world_size):
    """The torch (reference) backend has no transport of its own: p2p uses the user channel."""
    assert collectives.get_backend() == "torch"
    out = ring_exchange(rank, world_size, "ours", True)
    objs = [None]
    collectives.broadcast_object_list(objs if rank else [{"from": 0}], src=0)
    return out, objs if rank else [{"from": 0}]


@pytest.mark.timeout(120)
def test_torch_backend():
    results = collectives.launch(reference_backend_job, 3, backend="torch", timeout=30, join_timeout=100)
    for rank, (out, objs) in enumerate(results):
        assert out == _seq((rank - 1) % 3, dtype=torch.int64).tolist()
        assert objs == [{"from": 0}]


# ---------------------------------------------------------------------------- any-source receives

#: the ways a scenario calls point-to-point: torch on the pool's gloo world (the oracle), ours on
#: the world (p2p) and on a shm group, torch's functions on a ringddp group.
WAYS = ("gloo", "p2p", "shm", "ringddp")


def _api(way: str, members: list[int] | None = None):
    """(module, group) of ``way``: a group of ``members`` (every rank must call), or the world."""
    lib = tdist if way in ("gloo", "ringddp") else collectives
    if way == "gloo":
        return lib, None if members is None else tdist.new_group(members)
    if way == "p2p":
        return lib, None if members is None else collectives.new_group(members)
    backend = {"shm": "shm", "ringddp": "ringddp"}[way]
    return lib, lib.new_group(members, backend=backend)


def any_source(rank, world_size, way):
    """Any-source receives with several senders, tags, async handles, a receive from a given rank
    posted first, a subgroup; what gloo and ours must agree on (the order across senders is not
    theirs to agree on, the order from one sender is)."""
    dist, g = _api(way)
    out = {}
    sends = []  # every rank sends every other rank 100r, 100r+1 (tag 0), then 100r+50 (tag 5)
    for q in range(world_size):
        if q != rank:
            sends += [dist.isend(torch.full((3,), 100.0 * rank + i), dst=q, group=g) for i in range(2)]
            sends.append(dist.isend(torch.full((3,), 100.0 * rank + 50), dst=q, group=g, tag=5))
    fives = [(dist.irecv(t, group=g, tag=5), t) for t in [torch.zeros(3) for _ in range(world_size - 1)]]
    by_sender: dict[int, list[float]] = {}
    for _ in range(2 * (world_size - 1)):  # tag 0: blocking, posted after the tag-5 handles
        t = torch.zeros(3)
        src = dist.recv(t, group=g)
        assert t.eq(t[0]).all() and int(t[0]) // 100 == src, (src, t)
        by_sender.setdefault(src, []).append(t[0].item())
    out["tag 0 per sender, in order"] = sorted(by_sender.items())
    for w, _ in fives:
        w.wait()
    out["tag 5 (source_rank, value)"] = sorted((w._source_rank(), t[0].item()) for w, t in fives)
    for w in sends:
        w.wait()

    last = world_size - 1  # rank 0: a receive from `last`, then an any-source one; `last` sends twice
    if rank == 0:  # (tag 7: a receive above still waiting for another sender must not take these)
        a, b = torch.zeros(2), torch.zeros(2)
        works = [dist.irecv(a, src=last, group=g, tag=7), dist.irecv(b, group=g, tag=7)]
        for w in works:
            w.wait()
        out["given, then any"] = (a.tolist(), b.tolist(), works[1]._source_rank())
    elif rank == last:
        for v in (1.0, 2.0):
            dist.send(torch.full((2,), v), dst=0, group=g, tag=7)

    if world_size >= 3:  # on a group of ranks 1.., its first member receives from any other: global ranks
        members = list(range(1, world_size))
        sub_dist, sub = _api(way, members)
        if rank == 1:
            got = []
            for _ in range(world_size - 2):
                got.append(sub_dist.recv(t := torch.zeros(1, dtype=torch.int64), group=sub))
                assert t.item() == got[-1]
            out["subgroup"] = sorted(got)
        elif rank > 1:
            sub_dist.send(torch.tensor([rank]), dst=1, group=sub)
    return out


def fairness(rank, world_size):
    """Rank 1 has 12 messages for rank 0, rank 2 one (then one of tag 9). Rank 0 first lets both
    senders' first headers arrive (its any-source receive of tag 9 makes both streams read, and
    matches neither), then makes 13 any-source receives: the first or the second takes rank 2's
    message (first come, first served; gloo serves the lowest rank with a message waiting first,
    so rank 2's would come last)."""
    if rank == 0:
        late = collectives.irecv(torch.zeros(1), tag=9)
        time.sleep(1.0)  # both first headers arrive, and wait: tag 0
        order = [collectives.recv(torch.zeros(1)) for _ in range(13)]
        late.wait()
        return order.index(2), late.source_rank()
    works = [collectives.isend(torch.full((1,), float(rank)), dst=0) for _ in range(12 if rank == 1 else 1)]
    if rank == 2:
        works.append(collectives.isend(torch.zeros(1), dst=0, tag=9))
    for w in works:
        w.wait()
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_any_source_receive_matches_gloo(pools, world_size):
    pool = pools(world_size)
    expected = pool.run(any_source, "gloo")
    for way in WAYS[1:]:
        assert pool.run(any_source, way) == expected, way
    if world_size == 3:
        position, late = pool.run(fairness)[0]
        assert position in (0, 1) and late == 2, (position, late)


#: what torch's own tests expect of a timeout's message (distributed_test.py, _test_barrier_timeout).
TORCH_TIMEOUT = " (Timed out|closed|timeout) "


def any_source_failures(rank, world_size, tmp):
    """Rank 0, while the others stay silent: torch's test_barrier_timeout_full_group (a barrier on a
    ringddp group the others never join), an any-source recv nobody answers through collectives,
    and one through torch's recv on a ringddp group (2 s deadlines); then an any-source recv whose
    sender rank 2 dies (SIGKILL; rank 1 stays silent; a 60 s deadline). Outcomes go to a file:
    the launch itself fails (rank 2 died)."""
    import datetime
    import json
    import os
    import signal

    deadline = datetime.timedelta(seconds=2)
    silent = [tdist.new_group(backend="ringddp", timeout=deadline), collectives.new_group(timeout=2.0),
              tdist.new_group(backend="ringddp", timeout=deadline)]  # fmt: skip
    dying = collectives.new_group(timeout=60.0)
    outcomes = {}

    def attempt(key, call):
        start = time.monotonic()
        try:
            call()
            outcomes[key] = ["no error"]
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            chained = exc.__context__ is not None and not exc.__suppress_context__  # "During handling ..."
            outcomes[key] = [type(exc).__name__, str(exc), time.monotonic() - start, chained]

    if rank == 0:
        attempt("barrier", lambda: tdist.barrier(silent[0]))
        attempt("collectives recv", lambda: collectives.recv(torch.zeros(2), group=silent[1]))
        attempt("torch recv", lambda: tdist.recv(torch.zeros(2), group=silent[2]))
        attempt("dead sender", lambda: collectives.irecv(torch.zeros(2), group=dying).wait())
        with open(os.path.join(tmp, "0.json"), "w") as f:
            json.dump(outcomes, f)
    else:
        time.sleep(3 * 2.0 + 2.0)  # silent through rank 0's three deadlines
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10.0)  # rank 1 stays connected: rank 0 must name rank 2


@pytest.mark.timeout(240)
def test_any_source_failures_are_clear_and_prompt():
    import json
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(collectives.LaunchError, match="rank 2 died"):
            collectives.launch(any_source_failures, 3, tmp, timeout=60, join_timeout=180)
        with open(f"{tmp}/0.json") as f:
            outcomes = json.load(f)
    for key in ("barrier", "collectives recv", "torch recv"):
        kind, message, seconds, chained = outcomes[key]
        assert kind == "CollectiveTimeoutError" and re.search(TORCH_TIMEOUT, message), (key, message)
        assert not chained and 2.0 - 0.1 <= seconds < 6.0, (key, seconds)
    assert "barrier" in outcomes["barrier"][1] and "rank 1" in outcomes["barrier"][1]
    for key in ("collectives recv", "torch recv"):
        assert "recv from any rank" in outcomes[key][1] and "[1, 2]" in outcomes[key][1], outcomes[key]
    kind, message, seconds, _ = outcomes["dead sender"]
    assert kind == "CollectiveError" and "recv from any rank: rank 2 failed" in message, message
    assert seconds < 30.0  # found when rank 2 died (about 2 s after the call), not at the 60 s deadline
