"""Bad arguments fail before any traffic; communication failures fail fast and name op and peer."""

from __future__ import annotations

import os
import time

import pytest
import torch

import collectives
from collectives import CollectiveError, CollectiveTimeoutError, LaunchError, ReduceOp

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


def silent_peer(rank, world_size):
    if rank == 1:
        time.sleep(6)  # never takes part in the all-reduce
        return None
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(10))
    except CollectiveTimeoutError as exc:
        elapsed = time.monotonic() - start
        try:
            collectives.all_reduce(torch.ones(1))
        except CollectiveError as again:
            return str(exc), exc.op, exc.peer, elapsed, str(again)
    return "no timeout"


@pytest.mark.timeout(120)
def test_peer_that_never_sends_times_out_with_a_clear_error():
    message, op, peer, elapsed, again = collectives.launch(silent_peer, 2, timeout=2.0, join_timeout=60)[0]
    assert op == "all_reduce" and peer == 1
    assert "all_reduce" in message and "rank 1" in message and "timed out" in message
    assert elapsed < 5.0
    assert "unusable" in again


def dying_peer(rank, world_size):
    collectives.barrier()
    if rank == 2:
        os._exit(3)
    collectives.all_reduce(torch.ones(1 << 20))
    return "finished"


@pytest.mark.timeout(120)
def test_dead_peer_makes_the_others_fail_fast():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        collectives.launch(dying_peer, 3, timeout=60.0, join_timeout=100)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 2 died" in text and "exit code 3" in text
    # the survivors raised a communication error naming the collective, well before the 60 s timeout
    assert "all_reduce" in text and "CollectiveError" in text
    assert elapsed < 40, elapsed
    assert info.value.failed_ranks[0] == 2
