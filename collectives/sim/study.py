"""Time one collective at scale on a modelled network, and sweep ops, sizes, algorithms and n.

:func:`time_collective` runs one collective on every virtual rank of a :class:`Network`, through
the same :class:`~collectives.engine.AlgorithmEngine` a real group uses (so ``auto`` is the
engine's own choice), and returns the virtual time the slowest rank took.

Timing only. The message count of a ring grows as ``n²`` whatever the size, but the bytes need
not be real: by default a collective of ``S`` bytes runs on a small buffer of ``m`` elements
(one per segment of the real buffer: the same chunks and segments, so the same messages) and the
network charges each message ``S / (4 m)`` times its bytes; the tuning's byte thresholds are
divided by the same factor, so the engine picks the algorithm it would pick for ``S``. With
``exact=True`` the buffer is real (and its result could be checked).

Sizes follow nccl-tests: ``S`` is the bytes of the whole buffer (all_gather: the output;
reduce_scatter: the input); ``algbw = S / time`` and ``busbw = algbw × factor``, the factor
making busbw comparable with one link's bandwidth: ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
all_gather, reduce_scatter and all_to_all, 1 for broadcast and reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from ..engine import AlgorithmEngine
from ..ops import ReduceOp
from ..sizes import human_size
from ..transport.sim import Simulation, SimTransport
from ..tuning import Tuning
from .network import Network

#: the ops a study sweeps and the algorithms each can force ("auto": the engine's choice).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "recursive_doubling", "hierarchical", "auto"),
    "broadcast": ("chain", "binomial", "hierarchical", "auto"),
    "all_gather": ("auto",),
    "reduce_scatter": ("auto",),
    "all_to_all": ("auto",),
}
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
_ITEM = 4  # float32


@dataclasses.dataclass(frozen=True)
class Result:
    """One simulated collective: what ran, how long it took, and its nccl-tests bandwidths."""

    op: str
    world_size: int
    nbytes: int
    algorithm: str
    seconds: float
    messages: int

    @property
    def algbw(self) -> float:
        """Bytes per second of the buffer (GB/s × 1e9)."""
        return self.nbytes / self.seconds if self.seconds > 0 else math.inf

    @property
    def busbw(self) -> float:
        return self.algbw * _BUS_FACTOR[self.op](self.world_size)

    def row(self) -> dict[str, Any]:
        return {
            "op": self.op, "n": self.world_size, "bytes": self.nbytes, "algorithm": self.algorithm,
            "time_us": self.seconds * 1e6, "algbw_GBps": self.algbw / 1e9, "busbw_GBps": self.busbw / 1e9,
            "messages": self.messages,
        }


def shrink(op: str, nbytes: int, n: int, tuning: Tuning) -> tuple[int, float, Tuning]:
    """(elements of the stand-in buffer, bytes each of its bytes stands for, the scaled tuning)
    for a timing-only ``op`` of ``nbytes`` on ``n`` ranks (module docstring).

    The stand-in has ``n × K`` elements, ``K`` the number of segments of the whole real buffer:
    a multiple of ``n`` (equal chunks for every op) and at least one element per segment of a
    chunk, so the algorithms cut as many segments (hence messages) as on the real buffer. A
    buffer already that small runs as it is (factor 1).
    """
    m = n * max(1, math.ceil(nbytes / tuning.segment_bytes))
    real = nbytes // _ITEM
    if real <= m:
        return real if op in ("all_reduce", "broadcast") else _round_up(real, n), 1.0, tuning
    scale = nbytes / (m * _ITEM)
    scaled = dataclasses.replace(
        tuning,
        small_bytes=int(tuning.small_bytes / scale),
        chain_bytes=int(tuning.chain_bytes / scale),
        segment_bytes=max(_ITEM, int(tuning.segment_bytes / scale)),
    )
    return m, scale, scaled


def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def time_collective(
    network: Network,
    op: str,
    nbytes: int,
    algorithm: str = "auto",
    *,
    exact: bool = False,
    contention: bool = True,
    tuning: Tuning | None = None,
    trace: bool = False,
    delays: dict[int, float] | None = None,
    reduce_beta: float = 0.0,
) -> tuple[Result, Simulation]:
    """Run ``op`` of ``nbytes`` with ``algorithm`` on every rank of ``network``; its :class:`Result`
    (the virtual time until the last rank returned) and the :class:`Simulation` (its trace).
    ``reduce_beta``: seconds per byte combined by the reductions (default 0: free)."""
    if op not in ALGORITHMS:
        raise ValueError(f"time_collective: unknown op {op!r}; expected one of {tuple(ALGORITHMS)}")
    base = tuning or Tuning(chain_bytes=Tuning().small_bytes)  # a real network: see Tuning.chain_bytes
    n = network.world_size
    if exact:
        numel = nbytes // _ITEM if op in ("all_reduce", "broadcast") else _round_up(nbytes // _ITEM, n)
        scale, tuned = 1.0, base
    else:
        numel, scale, tuned = shrink(op, nbytes, n, base)
    sim = Simulation(
        network, contention=contention, byte_scale=scale, copy=exact, trace=trace, delays=delays, reduce_beta=reduce_beta
    )
    layout = network.layout()
    cpu = torch.device("cpu")

    def body(rank: int) -> None:
        engine = AlgorithmEngine(SimTransport(sim, rank), tuned, cpu, layout)
        with engine.transport_op(op):
            run(engine, op, algorithm, numel, n, rank)

    sim.run(body)
    return Result(op, n, nbytes, algorithm, sim.now, sim.messages), sim


def run(engine: AlgorithmEngine, op: str, algorithm: str, numel: int, n: int, rank: int) -> None:
    """One ``op`` on ``engine`` over a buffer of ``numel`` float32 (the whole buffer, as sized above)."""
    buf = torch.full((numel,), float(rank + 1))
    if op == "all_reduce":
        engine.all_reduce(buf, ReduceOp.SUM, algorithm)
    elif op == "broadcast":
        engine.broadcast(buf, 0, algorithm)
    elif op == "all_gather":
        m = numel // n
        engine.all_gather(list(buf.split(m)) if m else [buf[:0]] * n, buf[rank * m : (rank + 1) * m].clone())
    elif op == "reduce_scatter":
        m = numel // n
        engine.reduce_scatter(torch.empty(m), list(buf.split(m)) if m else [buf[:0]] * n, ReduceOp.SUM)
    else:
        m = numel // n
        outs = list(torch.empty(numel).split(m)) if m else [buf[:0]] * n
        engine.all_to_all(outs, list(buf.split(m)) if m else [buf[:0]] * n)


def applicable(op: str, algorithm: str, network: Network) -> bool:
    """Whether ``algorithm`` can run ``op`` on ``network`` (hierarchical: several hosts)."""
    return algorithm != "hierarchical" or network.hosts > 1


def sweep(
    networks: Sequence[Network], ops: Sequence[str], sizes: Sequence[int], algorithms: Sequence[str] | None = None,
    **options: Any,
) -> list[Result]:
    """Every (network, op, size, algorithm): :func:`time_collective`'s results, in that order."""
    results = []
    for network in networks:
        for op in ops:
            for nbytes in sizes:
                for algorithm in ALGORITHMS[op]:
                    if (algorithms is None or algorithm in algorithms) and applicable(op, algorithm, network):
                        results.append(time_collective(network, op, nbytes, algorithm, **options)[0])
    return results


def crossovers(results: Sequence[Result]) -> list[str]:
    """For each (op, n): which forced algorithm is fastest from which size on ("auto" excluded)."""
    lines = []
    keys = sorted({(r.op, r.world_size) for r in results})
    for op, n in keys:
        best: list[tuple[int, str]] = []
        for nbytes in sorted({r.nbytes for r in results if (r.op, r.world_size) == (op, n)}):
            rows = [r for r in results if (r.op, r.world_size, r.nbytes) == (op, n, nbytes) and r.algorithm != "auto"]
            if len(rows) < 2:
                continue
            winner = min(rows, key=lambda r: r.seconds).algorithm
            if not best or best[-1][1] != winner:
                best.append((nbytes, winner))
        if best:
            steps = ", then ".join(f"{alg} from {human_size(size)}" for size, alg in best)
            lines.append(f"{op} n={n}: {steps}")
    return lines


def table(results: Sequence[Result]) -> str:
    """nccl-tests-style rows: op, n, size, algorithm, time (µs), algbw and busbw (GB/s)."""
    lines = [f"{'op':<15}{'n':>6}{'size':>12}  {'algorithm':<19}{'time(us)':>12}{'algbw':>9}{'busbw':>9}"]
    for r in results:
        lines.append(
            f"{r.op:<15}{r.world_size:>6}{human_size(r.nbytes):>12}  {r.algorithm:<19}{r.seconds * 1e6:>12.1f}"
            f"{r.algbw / 1e9:>9.2f}{r.busbw / 1e9:>9.2f}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str, op: str = "all_reduce") -> None:
    """Two panels for ``op``: time vs size per algorithm at the largest n, and time vs n per
    algorithm at the largest size. Written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.op == op and r.algorithm != "auto"] or [r for r in results if r.op == op]
    if not rows:
        raise ValueError(f"plot: no {op} results")
    n_max = max(r.world_size for r in rows)
    size_max = max(r.nbytes for r in rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for alg in sorted({r.algorithm for r in rows}):
        mine = sorted((r.nbytes, r.seconds) for r in rows if r.algorithm == alg and r.world_size == n_max)
        if mine:
            left.plot([s for s, _ in mine], [t * 1e6 for _, t in mine], marker="o", label=alg)
        by_n = sorted((r.world_size, r.seconds) for r in rows if r.algorithm == alg and r.nbytes == size_max)
        if by_n:
            right.plot([n for n, _ in by_n], [t * 1e6 for _, t in by_n], marker="o", label=alg)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("simulated time (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    left.set_xlabel("bytes")
    left.set_title(f"{op}, n = {n_max}")
    right.set_xlabel("ranks")
    right.set_title(f"{op}, {human_size(size_max)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
