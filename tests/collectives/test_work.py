"""Work handles and the group queue: futures with torch's value and error semantics, callbacks that chain
collectives, the inline, queued and async paths, and waits that leave the GIL."""

from __future__ import annotations

import time

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
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError: all_reduce: no message from rank 1"):
        fut.wait()  # the collective's error, its type named in the message
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError"):
        chained.wait()  # and through callbacks
    with pytest.raises(CollectiveTimeoutError, match="rank 1"):
        work.wait()  # the handle re-raises the error itself


def test_a_failed_future_is_an_error_for_cpp_consumers():
    """C++ sees the failure as an error, not as a value (Future.set_exception would be a value):
    torch's collect_all runs in C++ and fails only if a child future failed in C++."""
    failed, ok = Work("all_reduce", [torch.ones(1)]), Work("broadcast", [torch.zeros(1)])
    both = torch.futures.collect_all([failed.get_future(), ok.get_future()])
    ok.finish(None)
    failed.finish(CollectiveTimeoutError("all_reduce: no message from rank 1", op="all_reduce", peer=1))
    with pytest.raises(RuntimeError, match="no message from rank 1"):
        both.wait()
    done = Work("barrier")
    done.finish(None)
    assert torch.futures.collect_all([done.get_future()]).wait()[0].wait() == []


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
    work = collectives.all_reduce(torch.ones(4), group=group, async_op=True)
    fut = work.get_future()
    try:
        fut.wait()
    except RuntimeError:  # the future fails as C++ sees it; the handle raises the error itself
        pass
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = ("none", "")
    collectives.barrier()
    return outcome


@pytest.mark.timeout(120)
def test_handle_of_a_failed_all_reduce_raises_its_error():
    kind, message = collectives.launch(_failing, 2, timeout=30)[0]
    assert kind == "CollectiveTimeoutError" and "all_reduce" in message, message


def _chained(rank: int, world_size: int) -> list[float]:
    """A callback that issues a collective and waits for it (torch's PowerSGD hook does), while
    the main thread queues more: the chained collective runs right after its parent on every rank."""
    t = torch.full((3,), float(rank + 1))
    seen = []

    def chain(fut: torch.futures.Future) -> torch.Tensor:
        x = fut.value()[0] * 10
        collectives.all_reduce(x, async_op=True).get_future().wait()  # async + wait, as PowerSGD
        collectives.all_reduce(x)  # and blocking
        seen.append(x.clone())
        return x

    first = collectives.all_reduce(t, async_op=True).get_future().then(chain)
    later = [collectives.all_reduce(torch.full((2,), float(rank + i)), async_op=True) for i in range(3)]
    result = first.wait()
    for w in later:
        w.wait()
    return result.tolist() + [float(later[0].result()[0][0])]


@pytest.mark.timeout(120)
def test_future_callbacks_may_issue_and_wait_on_collectives(pools):
    n = 3
    total = sum(range(1, n + 1))
    for res in pools(n).run(_chained):
        assert res == [float(total * 10 * n * n)] * 3 + [float(sum(range(n)))]


def _paths(rank: int, world_size: int) -> dict:
    """The same all_reduce four ways: inline (blocking, queue idle), planned (inline again, its
    shape having run), queued (blocking behind an async call) and async; then a peer that stays
    away, so each way times out."""
    import collectives as c

    x = torch.arange(1000, dtype=torch.float64) * (rank + 1) + 0.1 * rank
    inline, planned, queued, background = x.clone(), x.clone(), x.clone(), x.clone()
    c.all_reduce(inline)
    c.all_reduce(planned)  # its shape ran: on shm the planned path
    ahead = c.all_reduce(torch.ones(1 << 16), async_op=True)  # the blocking call below queues behind it
    c.all_reduce(queued)
    ahead.wait()
    c.all_reduce(background, async_op=True).wait()
    errors = []
    for how in ("inline", "planned", "queued", "async"):
        g = c.new_group(timeout=1)  # a failed collective breaks its group: one per attempt
        if how == "planned":  # a shape that ran on g: rank 0's next call of it is planned (shm)
            c.all_reduce(torch.ones(4), group=g)
        if rank == 1:
            errors.append(None)
            c.barrier()  # rank 1 never joins g's all_reduce; it waits here until rank 0 timed out
            continue
        started = time.monotonic()
        try:
            if how in ("inline", "planned"):
                c.all_reduce(torch.ones(4), group=g)
            elif how == "queued":
                first = c.all_reduce(torch.ones(4), group=g, async_op=True)
                c.all_reduce(torch.ones(4), group=g)
                first.wait()
            else:
                c.all_reduce(torch.ones(4), group=g, async_op=True).wait()
        except c.CollectiveError as exc:  # spin, then sleep in poll, then the 1 s deadline
            queued_behind = "unusable after an earlier failure" in str(exc) and "Timed out after 1s" in str(exc)
            errors.append((type(exc).__name__, exc.op, exc.peer, 1.0 <= time.monotonic() - started < 4.0, queued_behind))
        c.barrier()
    return {"inline": inline, "planned": planned, "queued": queued, "async": background, "errors": errors}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "p2p"])
def test_inline_queued_and_async_paths_agree(backend):
    """Results bitwise equal whichever way a call runs (inline, planned: a shape that ran before,
    queued, async); the same error (type, op, peer) too, at the group's deadline: a waiter spins, then sleeps, and still wakes for its deadline. The
    blocking call queued behind the async one that timed out does not wait a deadline of its
    own: it fails when the first does, naming the first failure."""
    results = collectives.launch(_paths, 2, backend=backend, timeout=20, join_timeout=90)
    for r in results:
        assert all(torch.equal(r["inline"], r[how]) for how in ("planned", "queued", "async"))
    assert torch.equal(results[0]["inline"], results[1]["inline"])
    timed_out = ("CollectiveTimeoutError", "all_reduce", 1, True, False)  # named, at the deadline
    assert results[0]["errors"] == [timed_out, timed_out, ("CollectiveError", "all_reduce", 1, True, True), timed_out]


def _gil_while_waiting(rank: int, world_size: int) -> int:
    """Rank 0's communication thread waits 1.5 s for rank 1; the main thread counts meanwhile.
    With a switch interval of 2 s, a waiting thread that held the GIL would stop the count."""
    import sys
    import time as _time

    import collectives as c

    c.all_reduce(torch.ones(4))  # set up: the wait below is on the control block, not the store
    if rank == 1:
        _time.sleep(1.5)
        c.all_reduce(torch.ones(4))
        return 0
    sys.setswitchinterval(2.0)
    start = _time.perf_counter()
    work = c.all_reduce(torch.ones(4), async_op=True)  # its thread spins briefly, then sleeps in poll
    _time.sleep(0.2)  # past the spin; the main thread needs the GIL back to go on
    count, end = 0, start + 0.7  # a fixed window, long before rank 1 comes at 1.5 s
    while _time.perf_counter() < end:
        count += 1
    work.wait()
    return count


@pytest.mark.timeout(60)
def test_a_waiting_communication_thread_leaves_the_gil():
    counted = collectives.launch(_gil_while_waiting, 2, backend="shm", timeout=20, join_timeout=50)[0]
    assert counted > 10_000, counted  # a GIL-holding waiter would leave it at 0 until the peer came


def _priorities(rank: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """(nice, scheduling policy) of this thread, of the world group's communication thread, of a
    group made with RINGDDP_COMM_NICE=0's, and of a group's whose thread was started by a
    SCHED_IDLE thread, read on each thread's id."""
    import os
    import threading

    import collectives as c

    def of(native_id: int) -> tuple[int, int]:
        return os.getpriority(os.PRIO_PROCESS, native_id), os.sched_getscheduler(native_id)

    def comm_thread(group: c.Group | None = None) -> tuple[int, int]:
        """Start ``group``'s communication thread (an async call) and read it."""
        before = set(threading.enumerate())
        c.all_reduce(torch.ones(4), group=group, async_op=True).wait()
        (thread,) = set(threading.enumerate()) - before
        return of(thread.native_id)

    mine = of(threading.get_native_id())
    world = comm_thread()
    os.environ["RINGDDP_COMM_NICE"] = "0"
    plain = comm_thread(c.new_group([0, 1]))
    del os.environ["RINGDDP_COMM_NICE"]
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread; the next comm thread inherits it
    return mine, world, plain, comm_thread(c.new_group([0, 1]))


@pytest.mark.timeout(60)
def test_the_communication_thread_yields_the_core_to_the_caller(monkeypatch):
    """It runs COMM_NICE steps below its process (never above 19) as SCHED_BATCH (a woken thread
    does not preempt the caller), or as set by RINGDDP_COMM_NICE (0: the process's priority and
    policy); a thread started under another policy than the normal one keeps it (SCHED_IDLE here)."""
    import os

    from collectives import work

    for mine, world_thread, plain_thread, idle_thread in collectives.launch(
        _priorities, 2, backend="shm", timeout=20, join_timeout=50
    ):
        assert mine[1] == os.SCHED_OTHER, mine
        assert world_thread == (min(19, mine[0] + work.COMM_NICE), os.SCHED_BATCH), (mine, world_thread)
        assert plain_thread == mine
        assert idle_thread == (min(19, mine[0] + work.COMM_NICE), os.SCHED_IDLE), (mine, idle_thread)
    for bad in ("-1", "20", "low"):
        monkeypatch.setenv("RINGDDP_COMM_NICE", bad)
        with pytest.raises(ValueError, match="RINGDDP_COMM_NICE must be an integer from 0 to 19"):
            work.comm_nice()
    monkeypatch.setenv("RINGDDP_COMM_NICE", "3")
    assert work.comm_nice() == 3


@pytest.mark.timeout(60)
def test_executor_keeps_submission_order_across_inline_queued_and_async_calls():
    """One thread mixing async, blocking-while-queued and blocking-idle calls: every call runs
    once, in submission order, and a sleeping communication thread wakes for each (a lost wake-up
    would hang here, under the timeout); close() with the thread asleep stops it."""
    import threading

    from collectives.work import Executor

    ex = Executor("order")
    ran: list[int] = []
    handles = []
    for i in range(3000):
        if i % 3 == 0:
            handles.append(ex.submit(Work("async"), lambda i=i: ran.append(i), True))
        else:
            ex.call("blocking", lambda i=i: ran.append(i))  # inline when idle, else behind the queue
        if i % 50 == 0:
            handles[-1].wait(10.0)
            time.sleep(0.001)  # lets the thread fall asleep before the next call must wake it
    for work in handles:
        assert work.wait(10.0)
    assert ran == list(range(3000))
    thread = next(t for t in threading.enumerate() if t.name == "ringddp-order")
    time.sleep(0.01)
    ex.close()
    thread.join(5.0)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="destroyed"):
        ex.call("late", lambda: None)
