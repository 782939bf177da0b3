"""Failure-free cost of ZeRO-1/2's shard replicas (``ddp.elastic.ShardedTrainer``) vs plain ZeRO.

    python scripts/bench_ft_zero.py --world-size 3 --stage 2 --hidden 256          # the main job's model
    python scripts/bench_ft_zero.py --world-size 3 --stage 2 --hidden 2048 --batch 64

Each rank trains two copies of the same MLP (64 -> hidden -> hidden -> 10 with BatchNorm, the
main job's shape) on one fixed batch, alternating rounds: *plain*, ``ZeroDataParallel`` and
``ZeroRedundancyOptimizer`` (forward, backward, step); *replicas*, the fault-tolerant loop's step
(the same, plus the gradient shift to the replica holder, the undo copy, the replica's update).
Prints the median step time of each and the overhead: the median over rounds of the ratio of
the two variants' times in that round (neighbours in time share the machine's load). Heartbeats (the elastic group's thread,
off the critical path) are not part of either: this is the cost of the replica scheme alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import collectives
from ddp import ZeroDataParallel, ZeroRedundancyOptimizer, elastic
from ddp.train import make_model


def _rank(rank: int, world_size: int, a: argparse.Namespace) -> dict[str, float] | None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(0)
    plain_model, ft_model = make_model(a.hidden), make_model(a.hidden)
    ft_model.load_state_dict(plain_model.state_dict())
    group = collectives.get_group()
    zdp = ZeroDataParallel(plain_model, stage=a.stage, group=group, bucket_cap_mb=a.bucket_mb)
    zopt = ZeroRedundancyOptimizer(zdp.parameters(), torch.optim.SGD, lr=0.01, momentum=0.9)
    cfg = elastic.Config(world_size=world_size, zero=a.stage, bucket_mb=a.bucket_mb, lr=0.01)
    ft = elastic.ShardedTrainer(cfg, ft_model, replacement=False)
    ft.heal(group, 0)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(a.batch, 64, generator=g), torch.randint(0, 10, (a.batch,), generator=g)

    def plain(step: int) -> None:
        zopt.zero_grad(set_to_none=True)
        F.cross_entropy(zdp(x), y).backward()
        zopt.step()

    def replicas(step: int) -> None:
        ft.step(group, x, y, step)

    times: dict[str, list[float]] = {"plain": [], "replicas": []}
    step = 0
    for r in range(a.warmup + a.rounds):
        for name, fn in (("plain", plain), ("replicas", replicas)) if r % 2 else (("replicas", replicas), ("plain", plain)):
            collectives.barrier()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fn(step)
                step += 1
            if r >= a.warmup:
                times[name].append((time.perf_counter() - t0) / a.steps)
    ft.close()
    if rank != 0:
        return None
    ratios = [b / a for a, b in zip(times["plain"], times["replicas"])]  # rounds side by side share the load
    return {**{name: statistics.median(v) for name, v in times.items()}, "ratio": statistics.median(ratios)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=3)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--backend", default="shm", choices=["shm", "p2p"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--json", metavar="OUT.json")
    a = p.parse_args()
    out = next(r for r in collectives.launch(_rank, a.world_size, a, backend=a.backend) if r is not None)
    params = sum(t.numel() for t in make_model(a.hidden).parameters())
    overhead = out["ratio"] - 1
    print(f"ZeRO-{a.stage}, {a.world_size} ranks, {a.backend}, hidden {a.hidden} ({params:,} parameters), batch {a.batch}: "
          f"plain {1e3 * out['plain']:.2f} ms/step, with replicas {1e3 * out['replicas']:.2f} ms/step, "
          f"overhead {100 * overhead:+.1f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**vars(a), **out, "parameters": params, "overhead": overhead}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
