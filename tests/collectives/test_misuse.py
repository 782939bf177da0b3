"""Bad input and misuse on 2 ranks: every case ends in the exact answer or a clear error, and the
group stays usable (issue 17)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import collectives

W = 2


def _healthy() -> bool:
    t = torch.ones(3)
    collectives.all_reduce(t)
    return t.tolist() == [float(W)] * 3


def _expect(exc_type, call, *needles):
    """Run ``call``; return None if it raised ``exc_type`` with every needle in the message, else a complaint."""
    try:
        call()
    except exc_type as exc:
        missing = [n for n in needles if n not in str(exc)]
        return f"{exc_type.__name__} lacks {missing}: {exc}" if missing else None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
    return f"expected {exc_type.__name__}, no error"


# ---------------------------------------------------------------------------- aliasing: exact


def aliasing_exact(rank, world_size):
    """Inputs that overlap outputs give the exact answer (staged or torch's in-place forms)."""
    n, r, wrong = world_size, rank, []
    base = lambda k, m: torch.arange(m, dtype=torch.float32) + 1000 * k  # noqa: E731 - rank k's data

    # all_to_all_single(t, t): rank r gets chunk r of every rank's t, in rank order
    m = 1 << 16
    t = base(r, n * m)
    collectives.all_to_all_single(t, t)
    expected = torch.cat([base(k, n * m)[r * m : (r + 1) * m] for k in range(n)])
    wrong.append(("all_to_all_single(t, t)", int((t != expected).sum())))

    # the same with a non-contiguous in-place view
    full = base(r, 2 * n * 8).view(n * 8, 2)
    t = full[:, 0]  # every other element
    collectives.all_to_all_single(t, t)
    expected = torch.cat([base(k, 2 * n * 8).view(n * 8, 2)[r * 8 : (r + 1) * 8, 0] for k in range(n)])
    untouched = base(r, 2 * n * 8).view(n * 8, 2)[:, 1]
    wrong.append(("all_to_all_single(view, view)", int((t != expected).sum()) + int((full[:, 1] != untouched).sum())))

    # all_to_all with the output list equal to the input list (in place, element by element)
    ts = [base(r, 5) + 10 * j for j in range(n)]
    collectives.all_to_all(ts, ts)
    wrong.append(("all_to_all(ts, ts)", sum(int((ts[k] != base(k, 5) + 10 * r).sum()) for k in range(n))))

    # all_gather_into_tensor: input is this rank's chunk (torch's in-place form) and input is chunk 0
    out = torch.zeros(n * 4)
    out[r * 4 : (r + 1) * 4] = base(r, 4)
    collectives.all_gather_into_tensor(out, out[r * 4 : (r + 1) * 4])
    wrong.append(("all_gather_into_tensor in place", int((out != torch.cat([base(k, 4) for k in range(n)])).sum())))
    out = torch.zeros(n * 4)
    out[:4] = base(r, 4)
    collectives.all_gather_into_tensor(out, out[:4])
    wrong.append(("all_gather_into_tensor input=chunk 0", int((out != torch.cat([base(k, 4) for k in range(n)])).sum())))

    # reduce_scatter_tensor: output is this rank's chunk of the input, and chunk 0
    for idx in (r, 0):
        inp = base(r, n * 4)
        expected = sum(base(k, n * 4) for k in range(n))[r * 4 : (r + 1) * 4]
        collectives.reduce_scatter_tensor(inp[idx * 4 : (idx + 1) * 4], inp)
        wrong.append((f"reduce_scatter_tensor output=chunk {idx}", int((inp[idx * 4 : (idx + 1) * 4] != expected).sum())))

    # scatter: the root's output tensor is one of its scatter_list pieces
    pieces = [base(0, 4) + 10 * j for j in range(n)]
    tensor = pieces[1] if r == 0 else torch.zeros(4)
    collectives.scatter(tensor, pieces if r == 0 else None, src=0)
    wrong.append(("scatter tensor=scatter_list[1]", int((tensor != base(0, 4) + 10 * r).sum())))

    # gather: the root's input overlaps gather_list[1]
    buf = torch.zeros(n * 4)
    buf[4:8] = base(r, 4)
    tensor = buf[4:8] if r == 0 else base(r, 4)
    outs = [buf[k * 4 : (k + 1) * 4] for k in range(n)] if r == 0 else None
    collectives.gather(tensor, outs, dst=0)
    if r == 0:
        wrong.append(("gather tensor overlaps gather_list[1]", int((buf != torch.cat([base(k, 4) for k in range(n)])).sum())))
    return wrong, _healthy()


@pytest.mark.timeout(120)
def test_aliasing_gives_exact_results(pools):
    for wrong, healthy in pools(W).run(aliasing_exact):
        assert healthy
        assert all(count == 0 for _, count in wrong), wrong


# ---------------------------------------------------------------------------- aliasing: refused


def aliasing_refused(rank, world_size):
    n, problems = world_size, []
    t = torch.ones(4)
    problems.append(_expect(ValueError, lambda: collectives.all_gather([t] * n, torch.ones(4)), "all_gather", "tensor_list[0] and tensor_list[1] overlap"))
    buf = torch.zeros(6)
    problems.append(_expect(ValueError, lambda: collectives.all_gather([buf[0:4], buf[2:6]], torch.ones(4)), "overlap in memory"))
    problems.append(_expect(ValueError, lambda: collectives.all_to_all([t] * n, [torch.ones(4)] * n), "output_tensor_list[0] and output_tensor_list[1] overlap"))
    problems.append(_expect(ValueError, lambda: collectives.all_reduce(torch.ones(1).expand(8)), "all_reduce", "share memory", "clone"))
    problems.append(_expect(ValueError, lambda: collectives.all_to_all_single(torch.ones(1, 3).expand(2 * n, 3), torch.ones(2 * n, 3)), "all_to_all_single: output"))
    problems.append(_expect(ValueError, lambda: collectives.broadcast(torch.ones(2, 1).expand(2, 4), src=0), "broadcast"))
    # interleaved views share no element: accepted, and exact
    out = torch.zeros(4 * n)
    collectives.all_gather([out[k::n] for k in range(n)], torch.full((4,), float(rank)))
    problems.append(None if out.tolist() == [float(k % n) for k in range(4 * n)] else f"interleaved all_gather wrong: {out}")
    if rank == 0:  # only the root checks gather_list; the other rank stays out of the call
        problems.append(_expect(ValueError, lambda: collectives.gather(t, [t] * n, dst=0), "gather", "overlap"))
    return [p for p in problems if p], _healthy()


@pytest.mark.timeout(120)
def test_overlapping_outputs_are_refused_before_traffic(pools):
    for problems, healthy in pools(W).run(aliasing_refused):
        assert not problems, problems
        assert healthy


# ---------------------------------------------------------------------------- requires_grad


def grad_tensors(rank, world_size):
    n, problems = world_size, []
    param = torch.nn.Parameter(torch.full((6,), float(rank + 1)))
    collectives.broadcast(param, 0)  # the common "sync the initial weights" pattern
    problems.append(None if param.tolist() == [1.0] * 6 else f"broadcast param: {param}")
    collectives.all_reduce(param)
    problems.append(None if param.tolist() == [float(n)] * 6 else f"all_reduce param: {param}")
    leaf = torch.full((3, 2), float(rank), requires_grad=True)
    collectives.all_reduce(leaf.t())  # non-contiguous view of a leaf: copied and written back
    problems.append(None if leaf.tolist() == [[float(sum(range(n)))] * 2] * 3 else f"view of leaf: {leaf}")
    x = torch.ones(4, requires_grad=True)
    y = x * (rank + 1)  # non-leaf with a grad_fn
    collectives.all_reduce(y)
    problems.append(None if y.tolist() == [float(sum(range(1, n + 1)))] * 4 else f"non-leaf: {y}")
    outs = [torch.zeros(2, requires_grad=True) for _ in range(n)]
    collectives.all_gather(outs, torch.full((2,), float(rank), requires_grad=True))
    problems.append(None if [o.tolist() for o in outs] == [[float(k)] * 2 for k in range(n)] else f"all_gather: {outs}")
    work = collectives.all_reduce(torch.ones(2, requires_grad=True), async_op=True)  # on the comm thread
    work.wait()
    # the collective is not part of the autograd graph, like torch's
    z = torch.ones(2, requires_grad=True)
    w = z * 2
    collectives.all_reduce(w)
    w.sum().backward()
    problems.append(None if z.grad.tolist() == [2.0, 2.0] else f"grad through a collective: {z.grad}")
    return [p for p in problems if p], _healthy()


@pytest.mark.timeout(120)
def test_requires_grad_tensors_are_accepted_like_torch(pools):
    for problems, healthy in pools(W).run(grad_tensors):
        assert not problems, problems
        assert healthy


# ---------------------------------------------------------------------------- layouts and huge views


def layouts(rank, world_size):
    problems = []
    dense = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {
            "sparse_coo": dense.to_sparse(),
            "sparse_csr": dense.to_sparse_csr(),
            "sparse_csc": dense.to_sparse_csc(),
            "sparse_bsr": dense.to_sparse_bsr((2, 2)),
            "sparse_bsc": dense.to_sparse_bsc((2, 2)),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "meta": torch.ones(4, device="meta"),
            "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
        }
    for layout, t in cases.items():
        problems.append(_expect(TypeError, lambda: collectives.all_reduce(t), "all_reduce", layout, "dense"))
        problems.append(_expect(TypeError, lambda: collectives.broadcast(t, 0), "broadcast", layout))
        problems.append(_expect(TypeError, lambda: collectives.all_gather([torch.ones(4)] * world_size, t), layout))
    huge = torch.ones(1).expand(2**40)
    problems.append(_expect(ValueError, lambda: collectives.broadcast(huge, 0), "broadcast", "4398046511104 bytes", "contiguous copy"))
    problems.append(_expect(ValueError, lambda: collectives.all_gather_into_tensor(torch.ones(4), huge), "input_tensor", "bytes"))
    # a modest expanded *input* is fine: it is copied
    out = torch.zeros(3 * world_size)
    collectives.all_gather_into_tensor(out, torch.full((1,), float(rank)).expand(3))
    problems.append(None if out.tolist() == [float(k) for k in range(world_size) for _ in range(3)] else f"expanded input: {out}")
    return [p for p in problems if p], _healthy()


@pytest.mark.timeout(120)
def test_unsupported_layouts_and_huge_views_raise_clearly(pools):
    for problems, healthy in pools(W).run(layouts):
        assert not problems, problems
        assert healthy


# ---------------------------------------------------------------------------- threads


def two_threads(rank, world_size):
    if rank == 1:
        time.sleep(1.0)  # keeps rank 0's async all_reduce pending
        collectives.all_reduce(torch.ones(4))
        return None, _healthy()
    work = collectives.all_reduce(torch.ones(4), async_op=True)
    caught: list[BaseException] = []

    def other() -> None:
        try:
            collectives.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            caught.append(exc)

    thread = threading.Thread(target=other, name="worker-2")
    thread.start()
    thread.join()
    work.wait()
    message = str(caught[0]) if caught else "no error"
    return message, _healthy()


@pytest.mark.timeout(120)
def test_second_thread_while_calls_are_queued_is_refused(pools):
    (message, healthy0), (_, healthy1) = pools(W).run(two_threads)
    assert healthy0 and healthy1
    assert "worker-2" in message and "MainThread" in message and "one thread" in message and "new_group" in message, message
