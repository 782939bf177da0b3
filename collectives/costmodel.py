"""The α/β cost model: measure a link, fit it, predict collectives, derive :class:`Tuning`.

Every algorithm's docstring gives its cost in two numbers per link: ``α``, the fixed time of one
message (latency, posting, waking the receiver), and ``β``, the seconds per byte (1 / bandwidth).
This module measures them and checks the formulas against the clock:

* :func:`ping_pong` times round trips between two ranks at several sizes; one way is half the
  fastest round trip (the minimum filters out the scheduling noise of a busy host, which only
  ever adds time). :func:`exchange` times both ranks of a pair sending at once, as a ring step
  does, on every host at the same time. Each keeps the median and the mean too: :func:`measure`
  fits all three, the fastest (what the links can do: ``predict``, ``tuning``), the *expected*
  (``*_mean``: the fastest's α less it is a waiting rank's wake-up, ``Network.wake_latency``) and the *typical* (``*_median``
  links: what a call on a busy host meets, the scheduling noise included; ``python -m
  collectives.sim validate --fits median`` simulates with these).
* :func:`receive_cpu` measures the CPU a rank spends receiving a stream of messages (its process's
  CPU time, every thread: the kernel's socket copies, the transport's I/O threads): its fit is
  the ``recv_cpu`` link, ``β`` CPU seconds per byte received (the simulator's ``Network.recv_cpu``).
* :func:`copy_times` times an all-gather over a host's shared regions, in which every rank
  copies the gathered bytes once: its fit is the ``shm`` link, ``α`` one synchronisation and
  ``β`` the seconds per byte *copied*, the unit of the shared-memory algorithms' costs.
* :func:`fit` fits ``t(S) = α + β S``: ``β`` by least squares (the large messages decide it),
  ``α`` from the smallest message.
* :func:`predict` evaluates the cost formula of the algorithm the engine picks (or the one
  forced) for an op, a size and a host layout, with the network link ``net`` between hosts, the
  ``local`` link inside a host (the group's transport, loopback) and, where the hierarchical
  algorithms' intra-host phases run over shared memory, the ``shm`` link.
* :func:`tuning` turns a fitted link into :class:`~collectives.tuning.Tuning`: the sizes where the
  formulas of two algorithms cross.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Sequence

import torch

from . import shm_algorithms
from .ops import ReduceOp, combine
from .topology import Layout
from .transport.base import SharedRegions, Transport, wait_all
from .tuning import Tuning

PING_SIZES = (8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
#: :func:`ping_pong` repeats messages up to 64 KiB this many times more than larger ones
SMALL_REPEAT = 5

#: ``(bytes, fastest seconds, median seconds, mean seconds)`` of one size
Sample = tuple[int, float, float, float]


def _sample(nbytes: int, times: Sequence[float], scale: float = 1.0) -> Sample:
    return nbytes, min(times) * scale, statistics.median(times) * scale, statistics.fmean(times) * scale


@dataclasses.dataclass(frozen=True)
class Link:
    """A fitted link: ``t(S) = alpha + beta * S`` seconds for one message of ``S`` bytes."""

    alpha: float
    beta: float

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta

    def __str__(self) -> str:
        bw = 1 / self.beta / 1e9 if self.beta > 0 else math.inf
        return f"alpha {self.alpha * 1e6:.1f} us, beta {self.beta * 1e9:.3f} ns/B ({bw:.2f} GB/s)"


def ping_pong(
    transport: Transport, a: int, b: int, sizes: Sequence[int] = PING_SIZES, iters: int = 10
) -> list[Sample]:
    """One-way times ``[(bytes, fastest, median, mean)]`` between ranks ``a`` and ``b`` (others return ``[]``).

    Rank ``a`` sends, ``b`` echoes; one way = the round trip / 2, of ``iters`` after one warm-up
    (``SMALL_REPEAT`` times as many for sizes up to 64 KiB: cheap, and the mean of the smallest
    is the expected latency, whose excess over the fastest is a wake-up on busy cores).
    """
    r = transport.rank
    if r not in (a, b) or a == b:
        return []
    peer = b if r == a else a
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        trips = []
        for i in range(iters * (SMALL_REPEAT if nbytes <= 64 << 10 else 1) + 1):
            start = time.perf_counter()
            if r == a:
                transport.send(buf, peer)
                transport.recv(buf, peer)
            else:
                transport.recv(buf, peer)
                transport.send(buf, peer)
            if i:
                trips.append(time.perf_counter() - start)
        samples.append(_sample(nbytes, trips, 0.5))
    return samples


def exchange(
    transport: Transport, partner: int | None, sizes: Sequence[int] = PING_SIZES, iters: int = 10
) -> list[Sample]:
    """Times ``[(bytes, fastest, median, mean)]`` of swapping ``S`` bytes with ``partner`` (``[]`` without one).

    Both sides send and receive at once, as in a ring step; when every host's pair runs this at
    the same moment, the fit includes what the pairs cost each other (shared cores and memory:
    all emulated hosts of one machine share its CPUs). Of ``iters`` after one warm-up.
    """
    if partner is None:
        return []
    samples = []
    for nbytes in sizes:
        out, inc = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        steps = []
        for i in range(iters + 1):
            start = time.perf_counter()
            wait_all(transport.post(sends=[(out, partner)], recvs=[(inc, partner)]))
            if i:
                steps.append(time.perf_counter() - start)
        samples.append(_sample(nbytes, steps))
    return samples


def receive_cpu(
    transport: Transport, src: int, dst: int, sizes: Sequence[int] = PING_SIZES, iters: int = 10
) -> list[Sample]:
    """CPU seconds ``[(bytes, fewest, median, mean)]`` rank ``dst`` spends per message of ``S`` bytes from ``src``
    (others return ``[]``).

    ``src`` sends ``iters`` messages back to back after one warm-up, ``dst`` receives them; each
    receive is charged the receiving process's CPU time since the previous one returned
    (``time.process_time``: every thread, its system time included: the kernel's copies out of
    the socket, the transport's I/O threads, even for bytes read before the receive was posted),
    not its wall time, so a loaded machine's waiting is left out.
    """
    r = transport.rank
    if r not in (src, dst) or src == dst:
        return []
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        if r == src:
            for _ in range(iters + 1):
                transport.send(buf, dst)
            continue
        transport.recv(buf, src)  # the warm-up
        used, last = [], time.process_time()
        for _ in range(iters):
            transport.recv(buf, src)
            now = time.process_time()
            used.append(now - last)
            last = now
        samples.append(_sample(nbytes, used))
    return samples


def copy_times(regions: SharedRegions, sizes: Sequence[int] = PING_SIZES, iters: int = 10) -> list[Sample]:
    """Times ``[(bytes, fastest, median, mean)]`` of an all-gather of ``S`` bytes in all over shared regions.

    Every rank copies its ``S / L`` bytes into its region, synchronises once and copies the
    other ``(L - 1)/L · S`` out: ``S`` bytes copied per rank, every rank of the host at once (as in
    a hierarchical collective's intra-host phase). Of ``iters`` after one warm-up.
    """
    samples = []
    for nbytes in sizes:
        m = max(1, nbytes // regions.world_size)
        inp = torch.zeros(m, dtype=torch.uint8)
        outs = [torch.empty(m, dtype=torch.uint8) for _ in range(regions.world_size)]
        times = []
        for i in range(iters + 1):
            start = time.perf_counter()
            shm_algorithms.all_gather(regions, outs, inp)
            if i:
                times.append(time.perf_counter() - start)
        samples.append(_sample(m * regions.world_size, times))
    return samples


def fit(samples: Sequence[tuple[int, float]]) -> Link:
    """Hockney's fit: ``β`` = least-squares slope of time over bytes, ``α`` = the smallest message's time.

    The slope is fitted on absolute error, so the large messages, where bandwidth shows, decide
    ``β``; ``α`` is what the smallest message costs beyond its bytes. (A relative-error fit of
    both is pulled off by any mid-size regime that is not on the line, e.g. a token bucket's
    burst, which lets the first burst-size bytes through at line rate.)
    """
    if len(samples) < 2:
        raise ValueError(f"fit: need at least two sizes, got {len(samples)}")
    sizes = torch.tensor([s for s, _ in samples], dtype=torch.float64)
    times = torch.tensor([t for _, t in samples], dtype=torch.float64)
    ds = sizes - sizes.mean()
    beta = max(0.0, float((ds * (times - times.mean())).sum() / (ds * ds).sum()))
    small = int(sizes.argmin())
    return Link(max(0.0, float(times[small] - beta * sizes[small])), beta)


def reduce_times(sizes: Sequence[int] = PING_SIZES, iters: int = 10) -> list[Sample]:
    """Times ``[(bytes, fastest, median, mean)]`` of one float32 sum of ``S`` bytes into its first
    operand (what a reduction step of an algorithm does: :func:`~collectives.ops.combine`), of
    ``iters`` after one warm-up. Its fit is the ``reduce`` link: ``β`` seconds per byte combined."""
    samples = []
    for nbytes in sizes:
        a, b = torch.zeros(max(1, nbytes // 4)), torch.ones(max(1, nbytes // 4))
        times = []
        for i in range(iters + 1):
            start = time.perf_counter()
            combine(ReduceOp.SUM, a, b, out=a)
            if i:
                times.append(time.perf_counter() - start)
        samples.append(_sample(a.numel() * 4, times))
    return samples


#: the links :func:`measure` fits from the fastest of its repetitions
FASTEST_KINDS = ("net", "local", "shm", "duplex", "reduce", "recv_cpu")
#: every link :func:`measure` fits, in the order of its numbers: each kind from the fastest
#: repetitions, then each from the medians (``net_median``, ...: the typical message), then from
#: the means (``net_mean``, ...: the expected message; ``net_mean``'s α less ``net``'s is the
#: expected wake-up of a waiting rank, ``python -m collectives.sim validate``)
SUFFIXES = ("", "_median", "_mean")
LINK_KINDS = tuple(f"{kind}{suffix}" for suffix in SUFFIXES for kind in FASTEST_KINDS)


def measure(
    transport: Transport, layout: Layout, regions: SharedRegions | None = None, sizes: Sequence[int] = PING_SIZES
) -> dict[str, Link]:
    """Fit ``"net"``, ``"local"``, ``"reduce"`` and, where they exist, ``"duplex"``, ``"recv_cpu"``
    and ``"shm"`` links on every rank of the group (all must call it).

    ``net``: ping-pong between rank 0 and the first rank of host 1, the others idle (one stream
    on the network, whose β is the host interface's). ``duplex``: the first ranks of hosts
    ``2i`` and ``2i + 1`` exchange, every pair at once (:func:`exchange`: both directions of every
    host's interface busy, as in a recursive-doubling step; emulated hosts that share a
    machine's cores show what that costs them); rank 0's pair is fitted. ``recv_cpu``: the first
    rank of host 1 streams to rank 0 (:func:`receive_cpu`: CPU seconds per message received over
    the network, not a time on the wire).
    ``local``: the first two ranks of *every*
    host exchange at once over ``transport`` (:func:`exchange`), like the intra-host steps of a
    flat algorithm. A missing kind of link gets the other's fit. ``shm``: every host's ranks time
    :func:`copy_times` on their shared ``regions`` (this rank's host's; the hierarchical
    algorithms' intra-host transport) at once; rank 0's host's fit is used. ``reduce``: every
    rank times :func:`reduce_times` at once (ranks share the cores); rank 0's fit. Rank 0 fits
    and sends the numbers to all, so every rank returns the same links. Each kind is fitted three
    times: from the fastest repetition of each size (``net``, ...), from the medians
    (``net_median``, ...) and from the means (``net_mean``, ...; the module docstring).
    """
    r = transport.rank
    fits = torch.full((2 * len(LINK_KINDS),), math.nan, dtype=torch.float64)
    for kind in ("net", "local"):
        for suffix in SUFFIXES:
            at = 2 * LINK_KINDS.index(kind + suffix)
            fits[at : at + 2] = 0.0

    def keep(kind: str, samples: list[Sample]) -> None:
        if r == 0:
            for column, suffix in enumerate(SUFFIXES, 1):
                name = kind + suffix
                at = 2 * LINK_KINDS.index(name)
                link = fit([(sample[0], sample[column]) for sample in samples])
                fits[at : at + 2] = torch.tensor(dataclasses.astuple(link), dtype=torch.float64)

    if layout.spans_hosts:
        keep("net", ping_pong(transport, 0, layout.hosts[1][0], sizes))
        leaders = [h[0] for h in layout.hosts[: len(layout.hosts) // 2 * 2]]  # host 2i with host 2i + 1
        partners = {a: b for x, y in zip(leaders[::2], leaders[1::2]) for a, b in ((x, y), (y, x))}
        keep("duplex", exchange(transport, partners.get(r), sizes))
        keep("recv_cpu", receive_cpu(transport, layout.hosts[1][0], 0, sizes))
    if len(layout.hosts[0]) > 1:
        pair = layout.local(r)[:2]
        keep("local", exchange(transport, pair[1 - pair.index(r)] if r in pair else None, sizes))
    if regions is not None:
        keep("shm", copy_times(regions, sizes))
    keep("reduce", reduce_times(sizes))
    if r == 0:
        wait_all(transport.post(sends=[(fits, peer) for peer in range(1, transport.world_size)]))
    else:
        transport.recv(fits, 0)
    found = {kind: Link(*fits[2 * i : 2 * i + 2].tolist()) for i, kind in enumerate(LINK_KINDS)}
    links = {}
    for suffix in SUFFIXES:
        net, local = found[f"net{suffix}"], found[f"local{suffix}"]
        links[f"net{suffix}"] = net if layout.spans_hosts else local
        links[f"local{suffix}"] = local if len(layout.hosts[0]) > 1 else net
        links[f"reduce{suffix}"] = found[f"reduce{suffix}"]
        for kind in ("shm", "duplex", "recv_cpu"):
            if not math.isnan(found[f"{kind}{suffix}"].alpha):
                links[f"{kind}{suffix}"] = found[f"{kind}{suffix}"]
    return links


def _log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _rd_steps(n: int) -> int:
    """Recursive doubling: ``log2 n`` exchanges, two more when ``n`` is not a power of two."""
    return _log2(n) + (2 if n & (n - 1) else 0)


def _contiguous(layout: Layout) -> bool:
    """Hosts hold consecutive ranks, the same power-of-two number each (host-major placement)."""
    per_host = len(layout.hosts[0])
    return per_host & (per_host - 1) == 0 and all(
        ranks == tuple(range(h * per_host, (h + 1) * per_host)) for h, ranks in enumerate(layout.hosts))


def algorithm_for(op: str, algorithm: str, nbytes: int, layout: Layout, tuning: Tuning) -> str:
    """The algorithm :class:`~collectives.engine.AlgorithmEngine` runs (mirrors its choices)."""
    spans = layout.spans_hosts and layout.uniform
    if op == "all_reduce":
        if algorithm != "auto":
            return algorithm
        return "hierarchical" if spans else "recursive_doubling" if nbytes <= tuning.small_bytes else "ring"
    if op == "broadcast":
        if algorithm in ("hierarchical", "chain", "binomial"):
            return algorithm
        return "hierarchical" if spans else "binomial" if nbytes <= tuning.chain_bytes else "chain"
    if op == "all_gather":
        return "direct" if nbytes <= tuning.small_bytes else "hierarchical" if spans else "ring"
    if op == "reduce_scatter":
        return "hierarchical" if spans else "ring"
    return "direct"


def predict(
    op: str, nbytes: int, layout: Layout, net: Link, local: Link,
    tuning: Tuning | None = None, algorithm: str = "auto", shm: Link | None = None,
) -> float:
    """Seconds the α/β model gives for ``op`` on ``nbytes`` (nccl-tests' size) over ``layout``.

    Steps that cross hosts pay ``net``; steps inside a host pay ``local``. A flat algorithm over a
    group that spans hosts is paced by its slowest hop, the network. The ``L`` rails of a
    hierarchical phase share one network interface per host, so they pay ``L`` times the bytes.
    With ``shm`` (the host's ranks share memory) the hierarchical algorithms' intra-host phases
    are the shared-memory algorithms instead: one synchronisation (``shm.alpha``) per phase and
    their copies per rank at ``shm.beta`` (see ``shm_algorithms.py``): the reduce-scatter copies
    ``(L - 1)/L · S`` in and combines ``S`` (``2 - 1/L`` copies), the all-gather and the
    broadcast copy ``S``.
    """
    tuning = tuning or Tuning()
    n, hosts, per_host = sum(len(h) for h in layout.hosts), len(layout.hosts), len(layout.hosts[0])
    flat = net if layout.spans_hosts else local
    s = float(nbytes)
    name = algorithm_for(op, algorithm, nbytes, layout, tuning)
    shm = shm if per_host > 1 else None  # a host of one rank has no intra-host phase
    if n == 1:
        return 0.0
    if op == "all_reduce":
        if name == "ring":
            return flat.time(2 * (n - 1) / n * s, 2 * (n - 1))
        if name == "recursive_doubling":
            # Rounds whose partners are closer than a host's size stay inside it; in the others
            # every rank of a host sends the whole buffer through the host's one interface.
            inside = _log2(per_host) if _contiguous(layout) and n & (n - 1) == 0 else 0
            crossing = _rd_steps(n) - inside
            sharing = per_host if layout.spans_hosts else 1
            return local.time(inside * s, inside) + flat.time(crossing * s * sharing, crossing)
        chunk = s / per_host
        if shm is not None:
            inside = shm.time((2 - 1 / per_host) * s + s, 2)
        else:
            inside = local.time(2 * (per_host - 1) / per_host * s, 2 * (per_host - 1))
        if chunk <= tuning.small_bytes:
            across = net.time(_rd_steps(hosts) * chunk * per_host, _rd_steps(hosts))
        else:
            across = net.time(2 * (hosts - 1) / hosts * s, 2 * (hosts - 1))
        return inside + across
    if op == "broadcast":
        chain = nbytes > tuning.chain_bytes

        def one(link: Link, m: int) -> float:
            if m == 1:
                return 0.0
            if chain:
                k = max(1, math.ceil(s / tuning.segment_bytes)) if m > 2 else 1
                return link.time((m - 2 + k) * s / k, m - 2 + k)
            return link.time(_log2(m) * s, _log2(m))

        if name == "hierarchical":
            inside = shm.time(s) if shm is not None else one(local, per_host)
            return one(net, hosts) + inside
        return one(flat, n)
    if op in ("all_gather", "reduce_scatter"):
        if name == "direct":
            return flat.time((n - 1) / n * s, n - 1)
        if name == "hierarchical":
            across = net.time((hosts - 1) / hosts * s, hosts - 1)
            if shm is not None:
                return across + shm.time((2 - 1 / per_host) * s if op == "reduce_scatter" else s)
            return across + local.time((per_host - 1) / per_host * s, per_host - 1)
        return flat.time((n - 1) / n * s, n - 1)
    return flat.time((n - 1) / n * s, n - 1)  # scatter, gather, all_to_all: direct


def tuning(link: Link, world_size: int, base: Tuning | None = None) -> Tuning:
    """:class:`Tuning` for a network with ``link``'s α and β and ``world_size`` ranks.

    * ``small_bytes``: where recursive doubling ``r(α + Sβ)`` (``r`` exchanges) meets the ring
      ``2(n - 1)α + 2(n - 1)/n · Sβ``: ``S* = α (2(n - 1) - r) / (β (r - 2(n - 1)/n))``. With two
      ranks both move ``S`` and recursive doubling always wins (one message instead of two).
    * ``segment_bytes``: large enough that a segment's ``α`` is at most 1/8 of its ``Sβ``
      (``8 α/β``), rounded to a power of two, between 64 KiB and 16 MiB.
    * ``chain_bytes``: on a network (ranks not sharing cores) the chain's ``≈ Sβ`` beats the
      tree's ``log2(n) Sβ`` once past the latency regime: equal to ``small_bytes``.
    """
    base = base or Tuning()
    n = world_size
    if link.beta <= 0:
        return dataclasses.replace(base)
    r = _rd_steps(n)
    ring_bw = 2 * (n - 1) / n
    if n <= 2 or r <= ring_bw:
        small = 1 << 40
    else:
        small = max(0, int(link.alpha * (2 * (n - 1) - r) / (link.beta * (r - ring_bw))))
    seg = 8 * link.alpha / link.beta
    seg = 1 << min(24, max(16, round(math.log2(max(seg, 1)))))
    small = min(small, 1 << 40)
    return dataclasses.replace(base, small_bytes=small, chain_bytes=small, segment_bytes=seg)
