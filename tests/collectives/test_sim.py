"""The simulated backend: our real algorithms on many virtual ranks, exact results, virtual time.

Exactness: every rank checks its own results against closed-form references (integer-valued
float64 data, so every order of additions gives the same bits). Timing: the virtual clock
against the α/β formulas of the algorithms' docstrings.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import collectives as dist
from collectives import sim
from collectives.costmodel import Link
from collectives.sim import Network, Simulation, ddp, study
from collectives.mailbox import MessageMismatchError
from collectives.sim.__main__ import main
from collectives.transport.base import wait_all
from collectives.transport.sim import SimTransport
from collectives.tuning import Tuning

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
            if m != sizes[-1]:
                continue
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
    for m in (1, 3) if quadratic else (1,):  # per rank
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
        (1, 1021, False), (1, 1025, False),  # 1,021 (prime), 2^10 + 1
    ],
)
def test_every_collective_exact_at_scale(hosts: int, per_host: int, quadratic: bool) -> None:
    n = hosts * per_host
    # empty, one element, fewer than n, not divisible by n
    # at 1,000+ ranks only algorithms that send whole buffers run: sizes below n add nothing there
    sizes = [0, 1, max(1, n - 1), 3 * n + 1] if quadratic else [0, n + 3]
    net = Network(hosts, per_host)
    failures = sim.launch(_battery, n, sizes, quadratic, hosts > 1, network=net)
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, flat[:10]


# ---------------------------------------------------------------------------- virtual time

INTRA, INTER = Link(2e-6, 1 / 20e9), Link(5e-6, 1 / 10e9)


def _timed(rank: int, n: int, numel: int, algorithm: str) -> float:
    t = torch.ones(numel)
    start = sim.clock()
    dist.all_reduce(t, algorithm=algorithm)
    assert torch.equal(t, torch.full((numel,), float(n)))
    return sim.clock() - start


def test_one_message_takes_alpha_plus_bytes_times_beta() -> None:
    net = Network(2, 2, INTRA, INTER, hosts_per_switch=1, oversubscription=2.0)
    s = Simulation(net)
    nbytes = 1 << 20

    def body(rank: int) -> float:
        t = torch.zeros(nbytes // 4)
        if rank == 0:
            SimTransport(s, 0).send(t, 1)  # same host
            SimTransport(s, 0).send(t, 2)  # another host, through both leaves' uplinks
        elif rank in (1, 2):
            SimTransport(s, rank).recv(t, 0)
        return s.now

    times = s.run(body)
    assert times[1] == pytest.approx(INTRA.alpha + nbytes * INTRA.beta, rel=1e-12)
    uplink = INTER.beta * 2.0  # one host and one NIC per leaf, oversubscribed 2:1: half a NIC
    assert times[2] == pytest.approx(times[1] + INTER.alpha + nbytes * uplink, rel=1e-12)


def test_links_share_their_bandwidth_max_min_fairly() -> None:
    """The messages in progress share each link, as TCP's flows do (one host per rank here).
    Rank 0 posts A to 1 and B to 2 at once while ranks 3, 4 send C, D to 2: rank 2's in port
    gives B, C, D a third each, and A takes the 2/3 left on rank 0's out port (an equal split
    of each link would give it 1/2): A ends at 1.5·Sβ, then B, C, D at 3·Sβ. And a message that
    joins late: rank 0 to 1 from 0, rank 2 to 1 from Sβ/2: half each until the first ends at
    1.5·Sβ, then the second alone until 2·Sβ."""
    nbytes, link = 1 << 20, Link(1e-5, 1e-9)
    sb = nbytes * link.beta

    def run(n: int, body) -> list[float]:
        s = Simulation(Network.flat(n, link))
        return s.run(lambda rank: body(s, SimTransport(s, rank), rank))

    def shared(s: Simulation, tr: SimTransport, rank: int) -> float:
        t = torch.zeros(nbytes // 4)
        if rank == 0:
            wait_all(tr.post(sends=[(t, 1), (t, 2)]))
        elif rank in (3, 4):
            tr.send(t, 2)
        else:
            wait_all(tr.post(recvs=[(torch.empty_like(t), 0)] + ([(torch.empty_like(t), 3), (torch.empty_like(t), 4)] if rank == 2 else [])))
        return s.now

    assert run(5, shared)[1:3] == pytest.approx([link.alpha + 1.5 * sb, link.alpha + 3 * sb], rel=1e-9)

    def late(s: Simulation, tr: SimTransport, rank: int) -> float:
        t = torch.zeros(nbytes // 4)
        if rank == 1:
            tr.recv(t, 0)
            first = s.now
            tr.recv(t, 2)
            return s.now - first
        s.sleep(sb / 2 if rank == 2 else 0.0)
        tr.send(t, 1)
        return s.now

    times = run(3, late)
    assert times[0] == pytest.approx(link.alpha + 1.5 * sb, rel=1e-9)
    assert times[1] == pytest.approx(0.5 * sb, rel=1e-9)  # the second arrives at α + 2·Sβ


def test_user_point_to_point_runs_on_the_virtual_clock() -> None:
    """send/recv/isend/irecv between virtual ranks: the data (non-contiguous too), the time of a
    message (header and payload share the path: α + (S + 24)β), a mismatch raised with the pair
    still in step."""
    numel = 1 << 16

    def body(rank: int, n: int) -> float:
        t = torch.arange(2 * numel, dtype=F64)[::2] + rank
        start = spent = sim.clock()
        if rank == 0:
            dist.send(t, 1)
            dist.isend(torch.ones(3), 1, tag=7).wait()
            dist.send(torch.full((5,), 2.0), dst=1)
        elif rank == 1:
            got = torch.empty(numel, dtype=F64)
            assert dist.recv(got, 0) == 0 and torch.equal(got, t - 1)
            spent = sim.clock() - start
            with pytest.raises(MessageMismatchError, match="tag=7"):
                dist.irecv(torch.empty(4), 0).wait()
            after = torch.empty(5)
            dist.recv(after, src=0)
            assert torch.equal(after, torch.full((5,), 2.0))
        dist.barrier()  # collectives after user messages: their own channel
        return spent

    link = Network.flat(3).inter
    times = dist.launch(body, 3, backend="sim")
    assert times[1] == pytest.approx(link.alpha + (numel * 8 + 24) * link.beta, rel=1e-9)


def test_any_source_receives_take_the_earliest_arrival_ties_to_the_lowest_rank() -> None:
    """recv without src on virtual ranks (2 hosts of 3): the message whose header arrives first in
    virtual time wins, so one posted later inside the host overtakes one from the other host;
    equal arrivals go in rank order; a message of another tag is passed over; two waited for in
    reverse order choose in posting order; if none can come, the wait raises naming "any rank"."""

    def body(rank: int, n: int) -> list[int]:
        big = 1 << 16
        if rank == 0:
            got, small = torch.empty(big), torch.empty(1)
            order = [dist.recv(small) for _ in range(2)]  # ranks 1 and 2 (2 µs late, 2 µs away) tie
            order.append(dist.recv(got))  # rank 3's, posted first but 5 µs away
            assert torch.equal(got, torch.full((big,), 3.0))
            work = dist.irecv(small, tag=5)
            work.wait()
            order.append(work.source_rank())  # rank 5's tag-5 message, though rank 4's untagged one came first
            dist.recv(small, src=4)
            first, second = torch.empty(1), torch.empty(1)
            late = [dist.irecv(first), dist.irecv(second)]
            late[1].wait()  # the receive posted first chooses first: rank 1's message, then rank 2's
            late[0].wait()
            assert (first.item(), second.item()) == (11.0, 12.0)
            return order + [w.source_rank() for w in late]
        if rank == 3:
            dist.send(torch.full((big,), 3.0), 0)
        else:
            sim.compute(2e-6 if rank < 3 else 1e-4 * (rank - 3))
            dist.send(torch.full((1,), float(rank)), 0, tag=5 if rank == 5 else 0)
        if rank in (1, 2):
            sim.compute(1e-3 * rank)
            dist.send(torch.full((1,), 10.0 + rank), 0)
        return []

    assert sim.launch(body, 6, network=Network(2, 3))[0] == [1, 2, 3, 5, 1, 2]

    def lonely(rank: int, n: int) -> None:
        if rank == 0:
            dist.recv(torch.empty(1))

    with pytest.raises(dist.CollectiveError, match="virtual rank 0 waits .* for a message from any rank"):
        dist.launch(lonely, 2, backend="sim")


def test_new_group_on_virtual_ranks() -> None:
    """dist.new_group on virtual ranks: collectives on disjoint subgroups exact (sizes 0, 1, < m,
    not divisible by m) and each at its closed-form time while the other runs (no shared link);
    a group's messages never meet another's (rank 1 takes the subgroup's broadcast before the
    world's, which rank 0 sent first); non-members get NonMember; only the sim backend."""
    n = 7
    link = Network.flat(n).inter

    def body(rank: int, world: int) -> float:
        evens = dist.new_group(range(0, n, 2))
        odds = dist.new_group(range(1, n, 2))
        pair = dist.new_group([0, 1])
        g = evens if rank % 2 == 0 else odds
        assert (odds if rank % 2 == 0 else evens) == dist.GroupMember.NON_GROUP_MEMBER
        mine = list(range(rank % 2, n, 2))
        m, total = len(mine), float(sum(mine))
        for size in (0, 1, m - 1, 3 * m + 1):
            for alg in ("ring", "recursive_doubling", "auto"):
                t = _input(rank, size)
                dist.all_reduce(t, group=g, algorithm=alg)
                assert torch.equal(t, torch.arange(size, dtype=F64) * 3 * m + total), (rank, alg, size)
            t = _input(rank, size)
            dist.broadcast(t, mine[-1], group=g)
            assert torch.equal(t, _input(mine[-1], size))
            out = torch.empty(m * size, dtype=F64)
            dist.all_gather_into_tensor(out, _input(rank, size), group=g)
            assert torch.equal(out, torch.cat([_input(q, size) for q in mine]))
        numel = 3 * 4 * 1000
        t = torch.ones(numel)
        dist.barrier()
        start = sim.clock()
        dist.all_reduce(t, group=g, algorithm="ring")
        spent = sim.clock() - start
        if rank < 2:  # eager sends: rank 0's world message waits, rank 1 takes the subgroup's first
            x, y = torch.full((3,), 10.0 + rank), torch.full((3,), 20.0 + rank)
            if rank == 0:
                dist.broadcast(x, 0, algorithm="binomial")
                dist.broadcast(y, 0, group=pair, algorithm="binomial")
            else:
                dist.broadcast(y, 0, group=pair, algorithm="binomial")
                assert torch.equal(y, torch.full((3,), 20.0))
        else:
            dist.broadcast(torch.empty(3), 0, algorithm="binomial")
        if rank == 1:
            dist.broadcast(x, 0, algorithm="binomial")
            assert torch.equal(x, torch.full((3,), 10.0))
        with pytest.raises(ValueError, match="only the sim backend"):
            dist.new_group([0, 1], backend="p2p")
        assert dist.get_pg_count() == (3 if rank < 2 else 2)  # the world and this rank's subgroups
        return spent

    times = dist.launch(body, n, backend="sim")
    for rank, spent in enumerate(times):
        m = 4 if rank % 2 == 0 else 3
        want = 2 * (m - 1) * (link.alpha + 4 * 3 * 4 * 1000 / m * link.beta)
        assert spent == pytest.approx(want, rel=1e-9), rank


@pytest.mark.parametrize("n", [2, 7, 16])
def test_ring_takes_the_closed_form_time(n: int) -> None:
    """2(n-1)(α + S/n β), through collectives.launch and sim.clock (S divisible by n, one segment)."""
    numel = n * 1000
    times = dist.launch(_timed, n, numel, "ring", backend="sim")
    want = 2 * (n - 1) * (Network.flat(n).inter.alpha + numel * 4 / n * Network.flat(n).inter.beta)
    assert times == pytest.approx([want] * n, rel=1e-9)


@pytest.mark.parametrize("n, steps", [(8, 3), (6, 4)])
def test_recursive_doubling_takes_the_closed_form_time(n: int, steps: int) -> None:
    """log2(n) exchanges of the whole buffer; two more when n is not a power of two. With 6
    ranks, ranks 2 and 3 (no extra partner) run ahead and their round-2 message reaches rank 0
    while rank 1's round-1 message still holds its link: contention, so only >= the formula."""
    nbytes = 20000
    formula = steps * (INTER.alpha + nbytes * INTER.beta)
    net = Network(n, 1, INTRA, INTER)
    alone = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True, contention=False)[0]
    assert alone.seconds == pytest.approx(formula, rel=1e-9)
    shared = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True)[0]
    assert shared.seconds >= formula * (1 - 1e-12)
    if n == 8:
        assert shared.seconds == pytest.approx(formula, rel=1e-9)


def test_contention_on_a_shared_nic_costs_more_than_the_formula() -> None:
    """4 hosts x 4 ranks, one NIC each: recursive doubling's rounds 1, 2 stay in the host; in
    rounds 4, 8 the 4 ranks of a host cross the NIC at once and queue on it: each such round
    takes between one and four messages' bytes on the NIC."""
    nbytes = 1 << 20
    net = Network(4, 4, INTRA, INTER)
    alone = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True, contention=False)[0]
    shared = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True)[0]
    local = 2 * (INTRA.alpha + nbytes * INTRA.beta)
    formula = local + 2 * (INTER.alpha + nbytes * INTER.beta)
    assert alone.seconds == pytest.approx(formula, rel=1e-9)
    assert formula + nbytes * INTER.beta < shared.seconds <= local + 2 * (INTER.alpha + 4 * nbytes * INTER.beta)


def test_all_to_all_on_an_oversubscribed_switch_is_slower_by_the_ratio() -> None:
    """8 hosts on 2 leaves: with full bisection a host's NIC is the bottleneck (7/8 of the
    buffer); at 4:1 the leaf uplink is (4 hosts x 4 peers across x S/8 at 4/4 of a NIC's rate)."""
    nbytes, link = 8 << 20, Link(0.0, INTER.beta)
    full = Network(8, 1, link, link, hosts_per_switch=4, oversubscription=1.0)
    over = Network(8, 1, link, link, hosts_per_switch=4, oversubscription=4.0)
    t_full = study.time_collective(full, "all_to_all", nbytes)[0].seconds
    t_over = study.time_collective(over, "all_to_all", nbytes)[0].seconds
    nic_bound = 7 / 8 * nbytes * link.beta
    uplink_bound = 4 * 4 * nbytes / 8 * over.uplink_beta
    assert t_full == pytest.approx(nic_bound, rel=1e-9)
    assert t_over == pytest.approx(uplink_bound, rel=0.02)
    assert t_over / t_full == pytest.approx(uplink_bound / nic_bound, rel=0.02)


@pytest.mark.parametrize("op, algorithm", [("all_reduce", "ring"), ("all_reduce", "hierarchical"), ("broadcast", "chain"), ("reduce_scatter", "auto")])
def test_timing_only_mode_times_like_the_real_buffer(op: str, algorithm: str) -> None:
    """Tiny stand-in buffers with scaled bytes and thresholds: the same time as the real buffer."""
    net = Network(2, 4, INTRA, INTER)
    nbytes = 24 << 20  # 6 segments of 4 MiB: pipelining included
    exact = study.time_collective(net, op, nbytes, algorithm, exact=True)[0]
    tiny = study.time_collective(net, op, nbytes, algorithm)[0]
    assert tiny.messages == exact.messages
    assert tiny.seconds == pytest.approx(exact.seconds, rel=1e-3)


def test_reductions_cost_their_bytes_times_reduce_beta() -> None:
    """A ring's n - 1 reduce-scatter steps each combine S/n bytes before sending them on: that
    much more on the critical path; timing-only charges the bytes its stand-ins stand for."""
    n, nbytes, per_byte = 4, 24 << 20, 0.5e-9
    net = Network(n, 1, INTRA, INTER)
    free = study.time_collective(net, "all_reduce", nbytes, "ring", exact=True)[0].seconds
    charged = study.time_collective(net, "all_reduce", nbytes, "ring", exact=True, reduce_beta=per_byte)[0]
    tiny = study.time_collective(net, "all_reduce", nbytes, "ring", reduce_beta=per_byte)[0]
    segments = nbytes // n // Tuning().segment_bytes + 1  # 6 MiB chunks: 2 segments, the last one's combines wait
    assert charged.seconds > free + (n - 1) * nbytes / n / segments * per_byte * (1 - 1e-9)
    assert charged.seconds <= free + (n - 1) * nbytes / n * per_byte * (1 + 1e-9)
    assert tiny.seconds == pytest.approx(charged.seconds, rel=1e-3)
    one = study.time_collective(net, "all_reduce", 4 * 4000, "ring", exact=True, reduce_beta=per_byte)[0].seconds
    alone = study.time_collective(net, "all_reduce", 4 * 4000, "ring", exact=True)[0].seconds
    assert one == pytest.approx(alone + (n - 1) * 4000 * per_byte, rel=1e-9)  # one segment: every combine waits


def test_a_nic_token_bucket_lets_its_burst_out_at_once_and_refills_while_idle() -> None:
    """``Network.nic_burst`` (tc tbf's burst ``B``): the first message on an idle NIC takes ``α +
    (S - B)β``; the bucket refills at the NIC's rate while it is idle (here ``α`` between a send's
    arrival and the next post: ``α/β`` tokens), so idle time up to ``Bβ`` is given back; a message
    smaller than the tokens crosses at once."""
    nbytes, burst, link = 1 << 20, 256 << 10, Link(1e-5, 1e-9)
    a, sb, bb = link.alpha, nbytes * link.beta, burst * link.beta
    s = Simulation(dataclasses.replace(Network.flat(3, link), nic_burst=burst))

    def body(rank: int) -> list[float]:
        tr, t, times = SimTransport(s, rank), torch.zeros(nbytes // 4), []
        if rank == 0:
            for peer, idle in ((1, 0.0), (2, 0.0), (1, bb / 2), (1, 2 * bb)):
                s.sleep(idle)
                tr.send(t, peer)  # returns at the arrival
                times.append(s.now)
            tr.send(t[: 1000 // 4], 2)  # α/β = 10,000 tokens since the last flow ended: enough
            times.append(s.now)
        else:
            for m in ((nbytes, 1000) if rank == 2 else (nbytes,) * 3):
                tr.recv(torch.empty(m // 4), 0)
        return times

    first = a + sb - bb
    second = first + sb  # α/β tokens: its α is given back
    third = second + sb  # idle bb/2 more: given back too
    fourth = third + 2 * bb + a + sb - bb  # idle 2·Bβ: the bucket holds B, no more
    assert s.run(body)[0] == pytest.approx([first, second, third, fourth, fourth + a], rel=1e-9)


def test_cpu_work_shares_the_cores_and_receives_cost_their_cpu() -> None:
    """``Network.cores``: ranks computing at once share their CPU's cores, each on at most one;
    ``recv_cpu``: a receive between hosts costs its bytes times that in CPU work once it has
    arrived; reductions run on the cores too. Without cores, every rank has one of its own."""
    work, nbytes, link, per_byte = 1e-3, 1 << 20, Link(1e-5, 1e-9), 0.5e-9

    def computing(net: Network, ranks: list[int]) -> list[float]:
        s = Simulation(net)

        def body(rank: int) -> float:
            if rank in ranks:
                s.compute(work)
            return s.now

        return s.run(body)

    four = Network(4, 1, INTRA, link, cores=2, hosts_per_cpu=4)  # 4 hosts on one machine of 2 cores
    assert computing(four, [0, 1]) == pytest.approx([work, work, 0, 0], rel=1e-12)
    assert computing(four, [0, 1, 2, 3]) == pytest.approx([2 * work] * 4, rel=1e-12)
    own = Network(4, 1, INTRA, link, cores=2)  # a CPU per host: no sharing between hosts
    assert computing(own, [0, 1, 2, 3]) == pytest.approx([work] * 4, rel=1e-12)
    busy = dataclasses.replace(four, cpu_background=2.0)  # two threads of other work take their shares
    assert computing(busy, [0]) == pytest.approx([1.5 * work, 0, 0, 0], rel=1e-12)  # 2 cores / 3 threads
    assert computing(busy, [0, 1, 2, 3]) == pytest.approx([3 * work] * 4, rel=1e-12)  # 2 / 6
    assert computing(Network(4, 1, INTRA, link), [0, 1, 2, 3]) == pytest.approx([work] * 4, rel=1e-12)
    # every pair exchanges S at once (recursive doubling's round): each receive then costs S·c of
    # CPU, four ranks on two cores: 2·S·c after the arrival
    for cores, factor in ((2, 2.0), (4, 1.0)):
        net = Network(4, 1, INTRA, link, cores=cores, hosts_per_cpu=4, recv_cpu=per_byte)
        s = Simulation(net)

        def exchange(rank: int) -> float:
            t = torch.zeros(nbytes // 4)
            wait_all(SimTransport(s, rank).post(sends=[(t, rank ^ 1)], recvs=[(torch.empty_like(t), rank ^ 1)]))
            return s.now

        expected = link.alpha + nbytes * link.beta + factor * nbytes * per_byte
        assert s.run(exchange) == pytest.approx([expected] * 4, rel=1e-12)
    # reductions: a 4-rank recursive doubling combines S twice per rank, 4 ranks on 2 cores
    net = Network(4, 1, INTRA, link, cores=2, hosts_per_cpu=4)
    free = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True)[0].seconds
    charged = study.time_collective(net, "all_reduce", nbytes, "recursive_doubling", exact=True,
                                    reduce_beta=per_byte)[0].seconds
    assert charged == pytest.approx(free + 2 * 2 * nbytes * per_byte, rel=1e-9)


def test_a_waiting_receiver_resumes_its_wake_up_latency_after_the_arrival() -> None:
    """``Network.wake_latency`` ``ω``: a receive posted before its message arrives completes ``ω``
    after the arrival (its rank's thread is woken on busy cores); one posted after the arrival
    completes at once, and sends are not delayed."""
    nbytes, wake, link = 1 << 20, 2e-3, Link(1e-5, 1e-9)
    arrival = link.alpha + nbytes * link.beta
    s = Simulation(dataclasses.replace(Network.flat(3, link), wake_latency=wake))

    def body(rank: int) -> float:
        tr, t = SimTransport(s, rank), torch.zeros(nbytes // 4)
        if rank == 0:
            wait_all(tr.post(sends=[(t, 1), (t, 2)]))  # on one NIC: both arrive at α + 2Sβ
        elif rank == 1:
            tr.recv(t, 0)
        else:
            s.sleep(1.0)  # long after the arrival
            tr.recv(t, 0)
        return s.now

    shared = arrival + nbytes * link.beta
    assert s.run(body) == pytest.approx([shared, shared + wake, 1.0], rel=1e-12)


# ---------------------------------------------------------------------------- failures, DDP, CLI


def test_a_wait_that_cannot_end_raises_at_once_naming_the_peer() -> None:
    def body(rank: int, n: int) -> None:
        if rank == 1:
            raise ValueError("rank 1 gives up")
        dist.all_reduce(torch.ones(4), algorithm="ring")

    with pytest.raises(ValueError, match="rank 1 gives up") as info:
        dist.launch(body, 3, backend="sim")
    assert "3 virtual ranks failed" in "".join(getattr(info.value, "__notes__", []))

    s = Simulation(Network.flat(2))

    def stuck(rank: int) -> None:
        SimTransport(s, rank).recv(torch.zeros(1), 1 - rank)

    with pytest.raises(dist.CollectiveError, match="waits .* for a message from peer 1, which no rank will send"):
        s.run(stuck)


def test_an_interrupt_stops_the_simulation_as_itself() -> None:
    """KeyboardInterrupt, a test runner's timeout signal: not the failure of the rank it lands in.
    (A timed-out run at 1,021 ranks once read as "reduce_scatter_tensor failed at rank 866" while
    the other ranks ran on: any rank running when the signal came got the blame.)"""
    steps: list[int] = []

    def body(rank: int, n: int) -> None:
        dist.all_reduce(torch.ones(8), algorithm="ring")
        if rank == 3:
            raise KeyboardInterrupt("stop")
        steps.append(rank)
        dist.all_reduce(torch.ones(8), algorithm="ring")
        steps.append(rank)

    with pytest.raises(KeyboardInterrupt, match="stop") as info:
        dist.launch(body, 8, backend="sim")
    assert "interrupted while virtual rank 3 ran" in "".join(info.value.__notes__)
    assert len(steps) < 2 * 7  # nobody finished the second all-reduce: the simulation stopped at once


def test_async_collectives_complete_before_returning_on_virtual_ranks() -> None:
    def body(rank: int, n: int) -> tuple[bool, float, list[float]]:
        t = torch.ones(4)
        start = sim.clock()
        work = dist.all_reduce(t, async_op=True)
        done, spent = work.is_completed(), sim.clock() - start
        work.wait()
        return done, spent, work.get_future().value()[0].tolist()

    for done, spent, value in dist.launch(body, 4, backend="sim"):
        assert done and spent > 0 and value == [4.0] * 4


def test_ddp_step_hides_communication_behind_a_long_backward() -> None:
    net = Network(4, 2, INTRA, INTER)
    quick = ddp.simulate_step(net, 8 << 20, 2 << 20, backward_seconds=0.0)
    slow = ddp.simulate_step(net, 8 << 20, 2 << 20, backward_seconds=0.05)
    assert quick.buckets == 4 and quick.exposed == pytest.approx(quick.step) and quick.hidden < 0.01
    assert slow.communication == pytest.approx(quick.communication, rel=1e-6)
    assert slow.step < slow.backward + quick.communication / 2 and slow.hidden > 0.7
    straggler = ddp.simulate_step(net, 8 << 20, 2 << 20, backward_seconds=0.05, slowdown={3: 1.5})
    assert straggler.step >= 0.075


def test_study_command_prints_table_crossovers_plot_and_trace(tmp_path, capsys) -> None:
    png, trace = tmp_path / "sim.png", tmp_path / "ring.json"
    main(["--world-sizes", "4,8", "--ranks-per-host", "2", "--sizes", "1K,1M", "--plot", str(png),
          "--trace", str(trace), "--trace-ranks", "4"])
    out = capsys.readouterr().out
    assert "busbw" in out and "all_reduce n=8:" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    main(["bench", "--world-size", "8", "--mb", "1", "--exact-numel", "9"])  # the simulator's own cost
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["timing only", "exact"]
    assert all("112 messages" in line and "s CPU, peak RSS" in line for line in lines), lines


def test_a_straggler_delays_the_ring_by_its_lateness() -> None:
    nbytes, late = 4 * 4000, 1e-3
    net = Network(4, 1, INTRA, INTER)
    on_time = study.time_collective(net, "all_reduce", nbytes, "ring", exact=True)[0].seconds
    delayed = study.time_collective(net, "all_reduce", nbytes, "ring", exact=True, delays={2: late})[0].seconds
    assert delayed == pytest.approx(on_time + late, rel=1e-9)


def test_network_checks_its_arguments_and_reads_fitted_links(tmp_path) -> None:
    with pytest.raises(ValueError, match="ranks_per_host"):
        Network(2, 0)
    with pytest.raises(ValueError, match="oversubscription"):
        Network(2, 1, oversubscription=0.5)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([{"op": "all_reduce", "net_alpha": 1e-5, "net_beta": 1e-9, "local_alpha": 1e-6,
                                 "local_beta": 1e-10}]))
    links = sim.links_from_bench(str(path))
    assert links == {"net": Link(1e-5, 1e-9), "local": Link(1e-6, 1e-10)}


def test_validate_command_simulates_a_bench_run_with_its_fitted_links(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    row = {"op": "all_reduce", "world_size": 4, "bytes": 1 << 20, "algorithm": "ring", "ours_us": 1000.0,
           "net_alpha": 1e-4, "net_beta": 8e-9, "local_alpha": 1e-5, "local_beta": 1e-10}
    path.write_text(json.dumps([row, dict(row, load_average=3.5), dict(row, load_average=7.25)]))
    main(["validate", str(path), "--hosts", "4"])
    simulated = 6 * (1e-4 + (1 << 20) / 4 * 8e-9) * 1e6  # 4 hosts of one rank: a ring over the net link
    out = capsys.readouterr().out
    assert f"{simulated:.0f}" in out and "load average (1 min) at the measured rows: 3.5-7.2" in out
    # --fits median: the links fitted from the medians of each size's repetitions
    path.write_text(json.dumps([dict(row, net_median_alpha=2e-4, net_median_beta=9e-9)]))
    main(["validate", str(path), "--hosts", "4", "--fits", "median"])
    assert f"{6 * (2e-4 + (1 << 20) / 4 * 9e-9) * 1e6:.0f}" in capsys.readouterr().out
    path.write_text(json.dumps([row, dict(row, load_average=3.5), dict(row, load_average=7.25)]))
    main(["validate", str(path), str(path), "--hosts", "4"])  # several runs: the median and range per row
    ratio = simulated / 1000.0
    assert f"all_reduce    4     4      1M  {ratio:.2f} ({ratio:.2f}-{ratio:.2f} of 6)" in capsys.readouterr().out
    # the run's own tuning: a broadcast of 16 MiB under chain_bytes 64 MiB is a binomial tree, not a chain
    tree = dict(row, op="broadcast", bytes=16 << 20, algorithm="hierarchical", tuning=dataclasses.asdict(Tuning()),
                shm_alpha=2e-5, shm_beta=3e-10, reduce_alpha=1e-6, reduce_beta=1e-10)
    path.write_text(json.dumps([tree]))
    main(["validate", str(path), "--hosts", "4"])
    out = capsys.readouterr().out
    assert "intra alpha 20.0 us, beta 0.600 ns/B" in out and "reductions 0.100 ns/B" in out
    # the root posts its two sends at once and its link shares them (TCP measured so): both end
    # at 2Sβ (first come, first served would end the first at Sβ); then one forward: 3Sβ + 2α
    assert f"{(3 * (16 << 20) * 8e-9 + 2 * 1e-4) * 1e6:.0f}" in out
    # a run that recorded its shaped link, its CPUs and the fits of the terms beyond α/β
    spec = "tbf rate 1gbit burst 256kb latency 50ms"
    path.write_text(json.dumps([dict(tree, link=spec, cpus=2, load_average=3.0, recv_cpu_alpha=4e-5,
                                     recv_cpu_beta=3e-10, net_mean_alpha=1.1e-3, net_mean_beta=8e-9)]))
    main(["validate", str(path), "--hosts", "4"])
    out = capsys.readouterr().out
    assert "NIC burst 262144 B; wake-up 1000 us; 2 cores for all hosts, receive CPU 0.300 ns/B" in out
    from collectives.sim.__main__ import tbf_burst
    assert (tbf_burst(spec), tbf_burst("tbf rate 1gbit burst 32kbit latency 1ms"), tbf_burst("netem delay 1ms")) == (
        262144, 4096, 0)
