"""What the fault-tolerant loop costs when nothing fails: its step next to the plain step.

    python -m ddp.bench_elastic                                   # main job's model: DDP, ZeRO-1, ZeRO-2 at 2 and 3 ranks
    python -m ddp.bench_elastic --model bench --world-sizes 2,4   # ddp.bench's MLP (16.8 M parameters)
    python -m ddp.bench_elastic --modes ddp,aa --json ft.json       # DDP and the A/A control beside it

Every rank builds two copies of the model and, for each mode of ``--modes``, runs rounds of
``--steps`` steps of each variant on the same group, alternating (every other round in reverse
order, a barrier before each): neighbouring rounds share the machine's load, so the overhead is
the median over rounds of the ratio of the two variants' times in a round (what survives a
machine shared with other work; separate runs of each variant swing more than the overhead).
The last column is the same median for rank 0's CPU time (every thread of the process, the
heartbeat's too): the work the loop adds, without the scheduler's noise of more ranks than
cores (a rank that waits for a descheduled peer spins at most 50 µs, then sleeps).

* ``ddp``: *plain* is our ``DistributedDataParallel`` (zero_grad, forward, backward, SGD step);
  *fault-tolerant* is :class:`ddp.elastic.ReplicatedTrainer`'s step, what ``ddp.elastic.member``
  runs: the same, plus the buffers saved for a roll-back and the step's RNG reseeded.
* ``zero1``, ``zero2``: *plain* is ``ZeroDataParallel`` + ``ZeroRedundancyOptimizer``;
  *fault-tolerant* is :class:`ddp.elastic.ShardedTrainer`'s step: the gradient shift to the
  replica holder, the undo copy, the replica's update, then the plain step's update and
  all-gather.
* ``aa``, a control (an A/A test): both variants are the plain DDP step, each on its own copy of
  the model, the second in the rounds (and with the heartbeat) of the fault-tolerant one. There
  is nothing to find, so what it reads is the method's own resolution in that run: an overhead
  of ``ddp`` is only measured when it stands out of ``aa``'s.

Each overhead comes with the spread of the rounds' ratios (the middle half: 25th to 75th
percentile).

During the fault-tolerant rounds each rank also runs the heartbeat thread of an
:class:`~collectives.ElasticGroup` (``--heartbeat`` bound: a beat every bound/4, one store
write and one read each); its reads of the peers' counters (one ``multi_get`` per beat) are left
out. Models: ``digits`` is the main job's (``ddp.train``: 64 -> ``--hidden`` -> ``--hidden`` ->
10 with BatchNorm, 32 rows per rank); ``bench`` is ``ddp.bench``'s (``--layers`` x ``--width``
Linear layers, 64 rows per rank). Buckets: ``--bucket-mb``. Torch threads per rank:
``cpu_count // world_size``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives.elastic import Heartbeat, Member

from . import elastic
from .bench import make_model as wide_model
from .distributed import DistributedDataParallel
from .train import make_model as digits_model
from .zero import ZeroDataParallel, ZeroRedundancyOptimizer

log = logging.getLogger("ddp.bench_elastic")

MODES = ("ddp", "zero1", "zero2", "aa")


def _model(a: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A fresh copy of the model (the same on every rank) and this rank's fixed batch."""
    torch.manual_seed(a.seed)
    if a.model == "digits":
        model, rows, features, classes = digits_model(a.hidden), 32, 64, 10
    else:
        model, rows, features, classes = wide_model(a.width, a.layers), 64, a.width, a.width
    g = torch.Generator().manual_seed(a.seed * 1_009 + collectives.get_rank())
    return model, torch.randn(rows, features, generator=g), torch.randint(0, classes, (rows,), generator=g)


def _plain(mode: str, model: nn.Module, a: argparse.Namespace, group: collectives.Group,
           x: torch.Tensor, y: torch.Tensor) -> tuple[Callable[[int], None], nn.Module]:
    """The plain step of ``mode`` on ``model``, and the wrapped module (its hooks removed by the caller)."""
    if mode in ("ddp", "aa"):
        module: nn.Module = DistributedDataParallel(model, group=group, bucket_cap_mb=a.bucket_mb)
        opt: Any = torch.optim.SGD(module.parameters(), lr=a.lr, momentum=0.9)
    else:
        module = ZeroDataParallel(model, stage=int(mode[-1]), group=group, bucket_cap_mb=a.bucket_mb)
        opt = ZeroRedundancyOptimizer(module.parameters(), torch.optim.SGD, lr=a.lr, momentum=0.9)

    def plain(step: int) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        opt.step()

    return plain, module


def _variants(mode: str, a: argparse.Namespace, group: collectives.Group) -> tuple[Callable[[int], None], Callable[[int], None], Callable[[], None]]:
    """The plain and the fault-tolerant step of ``mode`` (each on its own copy of the model), and
    what closes them (the caller calls it)."""
    plain_model, x, y = _model(a)
    ft_model, _, _ = _model(a)
    plain, module = _plain(mode, plain_model, a, group, x, y)
    if mode == "aa":  # the control: the plain step again
        tolerant, twin = _plain(mode, ft_model, a, group, x, y)
        return plain, tolerant, lambda: (module.remove_hooks(), twin.remove_hooks())
    cfg = elastic.Config(world_size=group.size(), zero=0 if mode == "ddp" else int(mode[-1]), bucket_mb=a.bucket_mb,
                         lr=a.lr, seed=a.seed, heartbeat=a.heartbeat)
    trainer: Any = elastic.ReplicatedTrainer(cfg, ft_model) if mode == "ddp" else elastic.ShardedTrainer(cfg, ft_model, replacement=False)
    trainer.heal(group, 0)
    rank = group.rank()

    def tolerant(step: int) -> None:
        torch.default_generator.manual_seed(a.seed * 1_000_003 + rank * 10_007 + step)
        trainer.step(group, x, y, step)

    return plain, tolerant, lambda: (module.remove_hooks(), trainer.close())


def _heartbeat(group: collectives.Group, bound: float, rank: int, round_: int) -> Heartbeat:
    """A heartbeat thread as an elastic member runs, under a key prefix of this round."""
    store = dist.PrefixStore(f"ringddp/bench-elastic/{round_}/", group.store)
    return Heartbeat(store, Member(rank, rank), bound, False, lambda *_: None, lambda *_: None)


def bench_rank(rank: int, world_size: int, a: argparse.Namespace) -> dict[str, Any] | None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = collectives.get_group()
    out: dict[str, Any] = {}
    rounds = 0
    for mode in a.modes:
        plain, tolerant, close = _variants(mode, a, group)
        times: dict[str, list[float]] = {"plain": [], "fault-tolerant": []}
        cpu: dict[str, list[float]] = {"plain": [], "fault-tolerant": []}
        step = 0
        for r in range(a.warmup + a.rounds):
            for name in ("plain", "fault-tolerant") if r % 2 else ("fault-tolerant", "plain"):
                beat = _heartbeat(group, a.heartbeat, rank, rounds) if name == "fault-tolerant" else None
                rounds += 1
                collectives.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.steps):
                    (tolerant if beat else plain)(step)
                    step += 1
                seconds, cpu_seconds = (time.perf_counter() - t0) / a.steps, (time.process_time() - c0) / a.steps
                if beat is not None:
                    beat.stop()
                if r >= a.warmup:
                    times[name].append(seconds)
                    cpu[name].append(cpu_seconds)
        close()
        ratios = [t / p for p, t in zip(times["plain"], times["fault-tolerant"])]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[mode] = {"plain_ms": 1e3 * statistics.median(times["plain"]),
                     "fault_tolerant_ms": 1e3 * statistics.median(times["fault-tolerant"]),
                     "overhead": statistics.median(ratios) - 1, "spread": (quartiles[0] - 1, quartiles[2] - 1), "rounds": times,
                     "cpu_overhead": statistics.median(t / p for p, t in zip(cpu["plain"], cpu["fault-tolerant"])) - 1}
    return out if rank == 0 else None


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | ranks | mode | plain step ms | fault-tolerant step ms | overhead | middle half of the rounds "
             "| overhead in CPU time (rank 0) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        low, high = r["spread"]
        lines.append(f"| {r['model']} | {r['world_size']} | {r['mode']} | {r['plain_ms']:.2f} | "
                     f"{r['fault_tolerant_ms']:.2f} | {100 * r['overhead']:+.1f} % | {100 * low:+.1f} .. {100 * high:+.1f} % "
                     f"| {100 * r['cpu_overhead']:+.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddp.bench_elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("digits", "bench"), default="digits", help="digits: the main job's (default); bench: ddp.bench's")
    p.add_argument("--modes", default="ddp,zero1,zero2", help=f"comma list of {', '.join(MODES)} (default: all but aa)")
    p.add_argument("--world-sizes", default="2,3", help="comma list (default 2,3)")
    p.add_argument("--rounds", type=int, default=16, help="timed rounds of each variant (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    p.add_argument("--hidden", type=int, default=256, help="digits: hidden width (default 256, the main job's)")
    p.add_argument("--width", type=int, default=2048, help="bench: width (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="bench: Linear layers (default 4)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB (default 25)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat bound in seconds (default 2, the loop's)")
    p.add_argument("--backend", default="shm", choices=("shm", "p2p"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json")
    a = p.parse_args(argv)
    a.modes = a.modes.split(",")
    if bad := [m for m in a.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    sizes = [int(n) for n in a.world_sizes.split(",")]
    if any(n < 2 for n in sizes) or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        p.error("need world sizes >= 2, --rounds and --steps >= 1, --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for n in sizes:
        per_mode = next(r for r in collectives.launch(bench_rank, n, a, backend=a.backend) if r is not None)
        for mode in a.modes:
            rows.append({"model": a.model, "world_size": n, "mode": mode, **per_mode[mode]})
            log.info("%s, %d ranks, %s: overhead %+.1f %%", a.model, n, mode, 100 * rows[-1]["overhead"])
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
