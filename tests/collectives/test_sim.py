"""The simulated backend: our real algorithms on many virtual ranks, exact results, virtual time.

Exactness: every rank checks its own results against closed-form references (integer-valued
float64 data, so every order of additions gives the same bits). Timing: the virtual clock
against the α/β formulas of the algorithms' docstrings.
"""

from __future__ import annotations

import pytest
import torch

import collectives as dist
from collectives import sim
from collectives.costmodel import Link
from collectives.sim import Network, Simulation

F64 = torch.float64


def _input(rank: int, m: int) -> torch.Tensor:
    return torch.arange(m, dtype=F64) * 3 + rank


def _battery(rank: int, n: int, sizes: list[int], quadratic: bool, hier: bool) -> list[str]:
    """Run every collective and algorithm on this virtual rank; the failures, described.

    ``quadratic``: also the algorithms that send ~n² messages in all (ring, chain, direct
    all-gather, all-to-all), which at 1,024 ranks take minutes of wall time each; without it the
    latency-optimal and hierarchical ones, scatter, gather and barrier.
    """
    bad: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            bad.append(f"rank {rank}: {what}")

    total = n * (n - 1) / 2
    for m in sizes:
        base = torch.arange(m, dtype=F64) * 3
        algs = ["recursive_doubling"] + (["ring", "auto"] if quadratic else []) + (["hierarchical"] if hier else [])
        for alg in algs:
            t = _input(rank, m)
            dist.all_reduce(t, algorithm=alg)
            check(f"all_reduce {alg} m={m}", t, base * n + total)
        for op, want in ((dist.ReduceOp.MAX, base + (n - 1)), (dist.ReduceOp.AVG, (base * n + total) / n)):
            t = _input(rank, m)
            dist.all_reduce(t, op=op, algorithm="recursive_doubling")
            check(f"all_reduce {op} m={m}", t, want)
        src = n - 1
        for alg in ["binomial"] + (["chain"] if quadratic else []) + (["hierarchical"] if hier else []):
            t = _input(rank, m)
            dist.broadcast(t, src, algorithm=alg)
            check(f"broadcast {alg} m={m}", t, _input(src, m))
        dst = n // 2
        for alg in ["binomial"] + (["ring"] if quadratic else []):
            t = _input(rank, m)
            dist.reduce(t, dst, algorithm=alg)
            check(f"reduce {alg} m={m}", t, base * n + total if rank == dst else _input(rank, m))
    for m in (1, 3):  # per rank
        mine = torch.empty(m, dtype=F64)
        pieces = [_input(q, m) for q in range(n)] if rank == 0 else None
        dist.scatter(mine, pieces, src=0)
        check(f"scatter m={m}", mine, _input(rank, m))
        outs = [torch.empty(m, dtype=F64) for _ in range(n)] if rank == n - 1 else None
        dist.gather(_input(rank, m), outs, dst=n - 1)
        if outs is not None:
            check(f"gather m={m}", torch.cat(outs), torch.cat([_input(q, m) for q in range(n)]))
        if quadratic:
            out = torch.empty(n * m, dtype=F64)
            dist.all_gather_into_tensor(out, _input(rank, m))
            check(f"all_gather m={m}", out, torch.cat([_input(q, m) for q in range(n)]))
            dist.reduce_scatter_tensor(mine, torch.arange(n * m, dtype=F64) + rank)
            check(f"reduce_scatter m={m}", mine, (torch.arange(m, dtype=F64) + rank * m) * n + total)
    if quadratic:
        out = torch.empty(n, dtype=F64)
        dist.all_to_all_single(out, torch.arange(n, dtype=F64) + 100 * rank)
        check("all_to_all", out, torch.arange(n, dtype=F64) * 100 + rank)
    dist.barrier()
    return bad


@pytest.mark.parametrize(
    "hosts, per_host, quadratic",
    [
        (1, 1, True), (2, 1, True), (3, 1, True), (1, 5, True), (17, 1, True), (4, 8, True),  # 17: prime
        (33, 1, True), (5, 13, True),  # 2^5 + 1, 2^6 + 1
        (64, 16, False), (1, 1021, False), (5, 205, False),  # 1,024; 1,021 (prime); 1,025 = 2^10 + 1
    ],
)
def test_every_collective_exact_at_scale(hosts: int, per_host: int, quadratic: bool) -> None:
    n = hosts * per_host
    sizes = [0, 1, max(1, n - 1), 3 * n + 1]  # empty, one element, fewer than n, not divisible by n
    net = Network(hosts, per_host)
    failures = sim.launch(_battery, n, sizes, quadratic, hosts > 1, network=net)
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, flat[:10]
