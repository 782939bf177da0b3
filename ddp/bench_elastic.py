"""What the fault-tolerant loop costs when nothing fails: its step next to the plain DDP step.

    python -m ddp.bench_elastic                                  # both models, 2 and 4 ranks
    python -m ddp.bench_elastic --jobs digits --world-sizes 2 --rounds 5 --json ft.json

Each *round* runs the same job twice, one after the other (every other round in reverse order, so
slow drifts of the machine hit both alike): ``plain``, our :class:`~ddp.DistributedDataParallel`
on a normal group started by :func:`collectives.launch`, the textbook loop (batch, zero_grad,
forward and backward, optimizer step); and ``fault-tolerant``, :func:`ddp.elastic.run` with no
failure: the members of an :class:`~collectives.ElasticGroup` (heartbeat thread, its store
connection), the step's RNG reseeded, the buffers saved for a roll-back, and the same DDP. Both
time every step from fetching the batch to the end of the optimizer step, on every rank; a step's
time is the slowest rank's (the job's pace), and a run's is the median over its steps after
``--warmup``. The overhead is the median over rounds of (fault-tolerant / plain - 1). On a
machine shared with other work the wall times swing more than the overhead sought, so each step's
CPU time is reported too (the rank's process, all threads: the heartbeat's included), with its
overhead computed the same way.

Jobs: ``digits`` is the main job (``python -m ddp.train``'s MLP on the digits, its batches);
``bench`` is ``ddp.bench``'s model (``--layers`` x ``--width`` Linear layers, 16.8 M parameters
by default) on random batches, with 25 MiB buckets like ``ddp.bench``. Torch threads per rank:
``cpu_count // world_size``, for both loops.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import collectives

from . import elastic
from .bench import make_model
from .distributed import DistributedDataParallel
from .train import DigitsJob

log = logging.getLogger("ddp.bench_elastic")


@dataclasses.dataclass(frozen=True)
class WideJob:
    """``ddp.bench``'s MLP as an elastic :class:`~ddp.elastic.Job`: random rows and classes per
    ``(step, slot)``."""

    steps: int
    width: int = 2048
    layers: int = 4
    batch_size: int = 64
    seed: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return make_model(self.width, self.layers)

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + slot)
        return torch.randn(self.batch_size, self.width, generator=g), torch.randint(0, self.width, (self.batch_size,), generator=g)


@dataclasses.dataclass(frozen=True)
class FirstSteps:
    """The first ``steps`` steps of ``job``."""

    job: Any
    steps: int

    def model(self) -> nn.Module:
        return self.job.model()

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.job.batch(step, slot, world_size)


def plain_rank(rank: int, world_size: int, cfg: elastic.Config) -> list[tuple[float, float]]:
    """The plain loop on one rank: the wall and CPU seconds of each step."""
    model = cfg.job.model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb)
    seconds = []
    for step in range(cfg.job.steps):
        begun = time.perf_counter(), time.process_time()
        x, y = cfg.job.batch(step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        seconds.append((time.perf_counter() - begun[0], time.process_time() - begun[1]))
    ddp.remove_hooks()
    return seconds


def _pace(per_rank: list[list[tuple[float, float]]], warmup: int) -> tuple[float, float]:
    """Median over steps (after ``warmup``) of the slowest rank's step, and the mean CPU time of
    a rank's step (its process: every thread, the heartbeat's included), in ms."""
    steps = list(zip(*per_rank))[warmup:]
    wall = statistics.median(max(w for w, _ in ranks) for ranks in steps)
    cpu = statistics.mean(c for ranks in steps for _, c in ranks)
    return 1e3 * wall, 1e3 * cpu


def measure(cfg: elastic.Config, rounds: int, warmup: int) -> dict[str, Any]:
    """``rounds`` rounds of plain and fault-tolerant runs of ``cfg`` (module docstring)."""
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "fault-tolerant": []}
    for r in range(rounds):
        for kind in ("plain", "fault-tolerant") if r % 2 == 0 else ("fault-tolerant", "plain"):
            if kind == "plain":
                per_rank = collectives.launch(plain_rank, cfg.world_size, cfg, backend=cfg.backend, timeout=cfg.timeout)
            else:
                for _ in range(3):  # a loaded machine can starve a healthy member past the bound
                    out = elastic.run(cfg)
                    if not out.recoveries:
                        break
                    log.warning("a member was replaced in a run without failures (%s): running it again", out.events)
                else:
                    raise RuntimeError(f"ddp.bench_elastic: 3 runs in a row lost a member: {out.events}; try a larger --heartbeat")
                per_rank = [out.reports[s]["step_seconds"] for s in range(cfg.world_size)]
            runs[kind].append(_pace(per_rank, warmup))
            log.info("round %d %s: step %.2f ms, CPU %.2f ms", r, kind, *runs[kind][-1])
    plain, tolerant = runs["plain"], runs["fault-tolerant"]
    return {
        "plain_ms": statistics.median(w for w, _ in plain),
        "fault_tolerant_ms": statistics.median(w for w, _ in tolerant),
        "overhead": statistics.median(t[0] / p[0] - 1 for p, t in zip(plain, tolerant)),
        "plain_cpu_ms": statistics.median(c for _, c in plain),
        "fault_tolerant_cpu_ms": statistics.median(c for _, c in tolerant),
        "cpu_overhead": statistics.median(t[1] / p[1] - 1 for p, t in zip(plain, tolerant)),
        "rounds": runs,
    }


def job_config(name: str, world_size: int, a: argparse.Namespace) -> elastic.Config:
    if name == "digits":
        job: Any = FirstSteps(DigitsJob(epochs=1_000, world_size=world_size, batch_size=32, hidden=256, seed=a.seed), a.steps)
    else:
        job = WideJob(a.steps, width=a.width, layers=a.layers, seed=a.seed)
    return elastic.Config(job=job, world_size=world_size, bucket_mb=25.0, seed=a.seed, backend=a.backend,
                          heartbeat=a.heartbeat, timeout=120.0)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| job | ranks | plain step ms | fault-tolerant step ms | overhead | plain CPU ms | fault-tolerant CPU ms | CPU overhead |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['job']} | {r['world_size']} | {r['plain_ms']:.2f} | {r['fault_tolerant_ms']:.2f} | "
                     f"{100 * r['overhead']:+.1f} % | {r['plain_cpu_ms']:.2f} | {r['fault_tolerant_cpu_ms']:.2f} | "
                     f"{100 * r['cpu_overhead']:+.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddp.bench_elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="digits,bench", help="comma list of digits, bench (default both)")
    p.add_argument("--world-sizes", default="2,4", help="comma list (default 2,4)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of a run left out (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both loops (default 3)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="shm", choices=("shm", "p2p"))
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat bound of the fault-tolerant loop (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json")
    a = p.parse_args(argv)
    jobs = a.jobs.split(",")
    if bad := [j for j in jobs if j not in ("digits", "bench")]:
        p.error(f"--jobs: unknown {bad}; choose from digits, bench")
    sizes = [int(n) for n in a.world_sizes.split(",")]
    if any(n < 2 for n in sizes) or a.steps <= a.warmup or a.rounds < 1:
        p.error("need world sizes >= 2, --steps > --warmup and --rounds >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for name in jobs:
        for n in sizes:
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))  # the ranks inherit it
            rows.append({"job": name, "world_size": n, **measure(job_config(name, n, a), a.rounds, a.warmup)})
            log.info("%s at %d ranks: overhead %+.1f %%", name, n, 100 * rows[-1]["overhead"])
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
