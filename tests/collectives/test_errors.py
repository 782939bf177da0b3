"""Bad arguments fail before any traffic; communication failures fail fast and name op and peer."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Callable

import pytest
import torch

import collectives
from collectives import CollectiveError, CollectiveTimeoutError, LaunchError, ReduceOp
from tests.collectives.faults import failure_text, survivor_line, survivors

F = torch.float32


def bad_calls(rank, world_size):
    """Each entry: (expected exception type, the call). Every rank makes the same bad calls."""
    t = torch.ones(4)
    return [
        (ValueError, lambda: collectives.all_gather([torch.ones(4)], t)),  # list length != world size
        (ValueError, lambda: collectives.broadcast(t, src=world_size)),  # src out of range
        (ValueError, lambda: collectives.reduce(t, dst=-1)),
        (TypeError, lambda: collectives.all_reduce(torch.ones(2, dtype=torch.complex64))),  # dtype
        (TypeError, lambda: collectives.all_reduce([1.0, 2.0])),  # not a tensor
        (ValueError, lambda: collectives.all_reduce(torch.ones(2, dtype=torch.int64), op=ReduceOp.AVG)),
        (ValueError, lambda: collectives.all_reduce(t, op="median")),
        (ValueError, lambda: collectives.all_reduce(t, algorithm="butterfly")),
        (TypeError, lambda: collectives.all_reduce(torch.ones(2, device="meta"))),  # meta: no data
        (TypeError, lambda: collectives.all_gather([torch.ones(4, dtype=torch.int32)] * world_size, t)),
        (ValueError, lambda: collectives.all_gather_into_tensor(torch.ones(4 * world_size + 1), t)),
        (ValueError, lambda: collectives.reduce_scatter_tensor(torch.ones(3), torch.ones(3 * world_size + 2))),
        (ValueError, lambda: collectives.scatter(t, None if rank == 0 else [t] * world_size, src=0)),
        (ValueError, lambda: collectives.gather(t, None if rank == 0 else [t] * world_size, dst=0)),
        (ValueError, lambda: collectives.all_to_all_single(torch.ones(5), torch.ones(5), [1] * world_size, [5] + [0] * (world_size - 1))),
        (ValueError, lambda: collectives.all_to_all_single(torch.ones(4), torch.ones(4), None, [9] * world_size)),
        (TypeError, lambda: collectives.all_reduce(t, async_op="yes")),
        (TypeError, lambda: collectives.broadcast(t, src=0.0)),
    ]


def run_bad_calls(rank, world_size):
    messages = []
    for expected, call in bad_calls(rank, world_size):
        try:
            call()
        except expected as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
        else:
            messages.append(f"NO ERROR for a call expecting {expected.__name__}")
    # nothing was sent: the group still works
    t = torch.ones(3)
    collectives.all_reduce(t)
    return messages, t.tolist()


@pytest.mark.timeout(120)
def test_bad_arguments_raise_before_traffic(pools):
    results = pools(3).run(run_bad_calls)
    for messages, after in results:
        assert after == [3.0, 3.0, 3.0]
        assert not [m for m in messages if m.startswith("NO ERROR")], messages
        # messages name the collective
        for m in messages:
            assert any(name in m for name in ("all_", "broadcast", "reduce", "scatter", "gather")), m


BACKENDS = ["p2p", "shm"]

#: what torch's own tests expect of a timeout's message (distributed_test.py, _test_barrier_timeout).
TORCH_TIMEOUT = " (Timed out|closed|timeout) "


def silent_peer(rank, world_size):
    collectives.all_reduce(torch.ones(1))  # the transport is set up: the wait below is a collective's own
    if rank == 1:
        time.sleep(3.5)  # never takes part in the all-reduce (the others time out at 2 s)
        return None
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(10))
    except CollectiveTimeoutError as exc:
        elapsed = time.monotonic() - start
        handling = exc.__context__ is not None and not exc.__suppress_context__  # "During handling of ..."
        try:
            collectives.all_reduce(torch.ones(1))
        except CollectiveError as again:
            return str(exc), exc.op, exc.peer, elapsed, str(again), handling
    return "no timeout"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_that_never_sends_times_out_with_a_clear_error(backend):
    """README, *No hangs*: every wait has a deadline; a timeout raises CollectiveTimeoutError
    naming the collective and the peer rank, in words torch's own tests match (with no second
    exception raised while handling the first); the group is then unusable and says so."""
    message, op, peer, elapsed, again, handling = collectives.launch(silent_peer, 2, backend=backend, timeout=2.0,
                                                                     join_timeout=60)[0]
    assert op == "all_reduce" and peer == 1
    assert "all_reduce" in message and "rank 1" in message and re.search(TORCH_TIMEOUT, message), message
    assert not handling
    assert 2.0 - 0.1 <= elapsed < 5.0  # at the deadline: neither early nor much later
    assert "unusable" in again


def dead_peer(rank, world_size):
    """Rank 1 is SIGKILLed while the others wait for it in an all-reduce; each survivor reports."""
    collectives.barrier()
    if rank == 1:
        time.sleep(0.5)  # the others are waiting in the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(1 << 16))
    except CollectiveError as exc:
        again = lambda: collectives.all_reduce(torch.ones(1))  # noqa: E731
        raise RuntimeError(survivor_line(rank, exc, time.monotonic() - start, again)) from None
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_makes_the_others_fail_fast(backend):
    """README, *No hangs*: a dead peer raises CollectiveError naming the collective and the peer
    rank (not the deadline's CollectiveTimeoutError: the deadline is 10 s here and every survivor
    must raise within 5 s); the group is then unusable and says so."""
    with pytest.raises((LaunchError, RuntimeError)) as info:  # whichever failure the launcher saw first
        collectives.launch(dead_peer, 3, backend=backend, timeout=10.0, join_timeout=100)
    text = failure_text(info.value)
    assert "rank 1 died without reporting (killed by signal 9)" in text, text
    found = {rank: s for (rank, _), s in survivors(text).items()}
    assert sorted(found) == [0, 2], text
    for s in found.values():
        assert s.kind == "CollectiveError" and s.op == "all_reduce" and s.seconds < 5.0, found
        assert f"rank {s.peer}" in s.message and "unusable" in s.next_call, found
    assert any(s.peer == 1 for s in found.values()), found


def _p2p_wait(kind: str, group) -> Callable[[], object]:
    """A point-to-point receive from rank 1 on ``group``, of the kind named."""
    if kind == "recv":
        return lambda: collectives.recv(torch.empty(4), src=1, group=group)
    if kind == "irecv":
        return lambda: collectives.irecv(torch.empty(4), src=1, group=group).wait()
    return lambda: collectives.recv_object_list([None], src=1, group=group)


P2P_WAITS = {0: "recv", 2: "irecv", 3: "recv_object_list"}  # which rank waits how for rank 1


def point_to_point_deadlines(rank, world_size):
    """Ranks 0, 2 and 3 receive from rank 1 (recv, irecv().wait(), recv_object_list): first while
    rank 1 stays silent past a 2 s deadline, then on another group while rank 1 is SIGKILLed."""
    silent = collectives.new_group(timeout=2.0)
    dead = collectives.new_group(timeout=10.0)
    collectives.barrier()  # start together: new_group returns at different times on different ranks
    lines = []

    def attempt(group, label: str) -> None:
        wait = _p2p_wait(P2P_WAITS[rank], group)
        start = time.monotonic()
        try:
            wait()
            lines.append(f"{label}: no error")
        except CollectiveError as exc:
            lines.append(survivor_line(rank, exc, time.monotonic() - start, wait, label))

    if rank != 1:
        attempt(silent, "silent")
    else:
        time.sleep(3.5)  # silent past the others' deadline
    collectives.barrier()
    if rank == 1:
        time.sleep(0.5)  # the others are waiting by now
        os.kill(os.getpid(), signal.SIGKILL)
    attempt(dead, "dead")
    raise RuntimeError(" ".join(lines))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_point_to_point_waits_have_deadlines_and_see_dead_peers(backend):
    """README, *No hangs*: every wait has a deadline: ``recv``, ``irecv().wait()`` and
    ``recv_object_list`` from a silent peer raise CollectiveTimeoutError at the group's timeout;
    from a dead peer CollectiveError at once; both name the peer, and the group is then unusable."""
    with pytest.raises((LaunchError, RuntimeError)) as info:
        collectives.launch(point_to_point_deadlines, 4, backend=backend, timeout=20.0, join_timeout=30)
    text = failure_text(info.value)
    assert "rank 1 died without reporting (killed by signal 9)" in text, text
    found = survivors(text)
    assert sorted(found) == [(r, label) for r in (0, 2, 3) for label in ("dead", "silent")], text
    for (rank, label), s in found.items():
        assert s.peer == 1 and "rank 1" in s.message and "unusable" in s.next_call, s
        assert s.op in ("recv", "irecv"), s  # recv_object_list receives with recv
        if label == "silent":
            assert s.kind == "CollectiveTimeoutError" and 2.0 - 0.1 <= s.seconds < 5.0, s
        else:
            assert s.kind == "CollectiveError" and s.seconds < 5.0, s
