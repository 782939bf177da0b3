"""``Work.get_future()``: a ``torch.futures.Future`` with torch's value and error semantics."""

from __future__ import annotations

import pytest
import torch

import collectives
from collectives import CollectiveTimeoutError, ReduceOp
from collectives.work import Work


def test_future_of_a_finished_work_holds_the_result_list():
    t = torch.ones(3)
    work = Work("all_reduce", [t])
    work.finish(None)
    fut = work.get_future()
    assert fut.done() and fut.value()[0] is t
    assert work.get_future() is fut  # one future per work


def test_future_asked_for_before_the_end_settles_at_the_end():
    work = Work("barrier")
    fut = work.get_future()
    assert not fut.done()
    work.finish(None)
    assert fut.wait() == []  # a collective that writes nothing


def test_error_reaches_the_future_and_then_callbacks():
    work = Work("all_reduce", [torch.ones(1)])
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    work.finish(CollectiveTimeoutError("all_reduce: no message from rank 1", op="all_reduce", peer=1))
    with pytest.raises(CollectiveTimeoutError, match="rank 1"):
        fut.wait()  # the collective's own error, type kept
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError"):
        chained.wait()  # torch wraps errors raised inside callbacks


def _futures(rank: int, world_size: int) -> dict:
    t = torch.full((5,), float(rank + 1))
    work = collectives.all_reduce(t, ReduceOp.SUM, async_op=True)
    fut = work.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)  # torch's hook idiom
    value = fut.wait()
    # a collective started while the first may still be in flight; its future is waited second
    u = torch.arange(4, dtype=torch.float64)
    second = collectives.all_reduce(u, ReduceOp.AVG, async_op=True).get_future().then(lambda f: f.value()[0] + 1)
    return {
        "same_tensor": value[0] is t,
        "value": value[0].tolist(),
        "doubled": doubled.wait().tolist(),
        "second": second.wait().tolist(),
        "done": work.is_completed(),
    }


@pytest.mark.timeout(120)
def test_future_of_a_real_all_reduce(pools):
    total = float(sum(range(1, 4)))
    for res in pools(3).run(_futures):
        assert res["same_tensor"] and res["done"]
        assert res["value"] == [total] * 5
        assert res["doubled"] == [2 * total] * 5
        assert res["second"] == [1.0, 2.0, 3.0, 4.0]


def _failing(rank: int, world_size: int) -> tuple[str, str]:
    group = collectives.new_group([0, 1], timeout=1)
    if rank == 1:
        collectives.barrier()  # takes no part in the group's all-reduce
        return ("skipped", "")
    fut = collectives.all_reduce(torch.ones(4), group=group, async_op=True).get_future()
    try:
        fut.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = ("none", "")
    collectives.barrier()
    return outcome


@pytest.mark.timeout(120)
def test_future_of_a_failed_all_reduce_raises_its_error():
    kind, message = collectives.launch(_failing, 2, timeout=30)[0]
    assert kind == "CollectiveTimeoutError" and "all_reduce" in message, message
