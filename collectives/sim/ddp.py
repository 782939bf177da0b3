"""A data-parallel training step at scale: how much all-reduce hides behind backward.

DDP cuts the gradients into buckets and all-reduces each one as soon as backward has produced
it, while backward goes on computing the next; the step ends when both are done. Here backward
is a schedule: the ``model_bytes`` of gradients come in buckets of ``bucket_bytes`` (the last
one smaller), bucket ``i`` ready after its share of ``backward_seconds`` (proportional to its
bytes, times the rank's slowdown if it is a straggler). Every virtual rank all-reduces the
buckets in order, each as soon as it is ready and the previous one is done (one communication
stream per rank, as our DDP has), with the engine's choice of algorithm, timing-only
(:func:`collectives.sim.study.shrink`).

The report: backward time (the slowest rank's), the all-reduces' total time (each from the
first rank's start to the last rank's end, so waiting for a straggler counts), the step time, and
the *exposed* communication: the step time beyond backward. ``hidden = 1 - exposed /
communication``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine import AlgorithmEngine
from ..ops import ReduceOp
from ..transport.sim import Simulation, SimTransport
from ..tuning import Tuning
from .network import Network
from .study import shrink


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One simulated step (seconds)."""

    world_size: int
    buckets: int
    backward: float
    communication: float
    step: float

    @property
    def exposed(self) -> float:
        """Communication time not hidden behind backward."""
        return max(0.0, self.step - self.backward)

    @property
    def hidden(self) -> float:
        """Fraction of communication that overlapped backward."""
        return 1.0 - self.exposed / self.communication if self.communication > 0 else 1.0

    def row(self) -> str:
        return (
            f"{self.world_size:>6}{self.buckets:>8}{self.backward * 1e3:>12.2f}{self.communication * 1e3:>12.2f}"
            f"{self.step * 1e3:>12.2f}{self.exposed * 1e3:>12.2f}{self.hidden * 100:>9.0f}%"
        )

    HEADER = f"{'n':>6}{'buckets':>8}{'backward ms':>12}{'comm ms':>12}{'step ms':>12}{'exposed ms':>12}{'hidden':>10}"


def bucket_sizes(model_bytes: int, bucket_bytes: int) -> list[int]:
    """The buckets' bytes, in the order backward produces them."""
    if model_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError(f"bucket_sizes: model_bytes and bucket_bytes must be positive, got {model_bytes}, {bucket_bytes}")
    full, rest = divmod(model_bytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def simulate_step(
    network: Network,
    model_bytes: int,
    bucket_bytes: int,
    backward_seconds: float,
    *,
    slowdown: dict[int, float] | None = None,
    tuning: Tuning | None = None,
) -> StepReport:
    """Simulate one step's backward and bucket all-reduces on every rank of ``network``."""
    sizes = bucket_sizes(model_bytes, bucket_bytes)
    n = network.world_size
    sim = Simulation(network, copy=False, slowdown=slowdown)
    base = tuning or Tuning(chain_bytes=Tuning().small_bytes)
    plans = [shrink("all_reduce", s, n, base) for s in sizes]
    ready = [backward_seconds * sum(sizes[: i + 1]) / model_bytes for i in range(len(sizes))]
    spans = [[0.0, 0.0] for _ in sizes]  # per bucket: (earliest start, latest end) over ranks
    for span in spans:
        span[0] = float("inf")
    cpu = torch.device("cpu")
    layout = network.layout()

    def body(rank: int) -> None:
        factor = sim.slowdown.get(rank, 1.0)
        for i, (numel, scale, tuned) in enumerate(plans):
            sim.sleep_until(ready[i] * factor)
            engine = AlgorithmEngine(SimTransport(sim, rank, byte_scale=scale), tuned, cpu, layout)
            start = sim.now
            with engine.transport_op(f"bucket {i}"):
                engine.all_reduce(torch.zeros(numel), ReduceOp.AVG, "auto")
            spans[i][0] = min(spans[i][0], start)
            spans[i][1] = max(spans[i][1], sim.now)

    sim.run(body)
    backward = backward_seconds * max([1.0, *(slowdown or {}).values()])
    communication = sum(end - start for start, end in spans)
    return StepReport(n, len(sizes), backward, communication, max(sim.now, backward))
