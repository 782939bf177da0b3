"""Soak the fault-tolerant loop: kill and stop members at random steps, then report.

    python scripts/chaos.py --world-size 3 --steps 600 --events 20 --seed 0 [--zero 2]

Runs ``ddp.elastic.run`` twice on the synthetic job: once without failures (the reference and
the failure-free time), once with ``--events`` signals (SIGKILL or SIGSTOP, to a random slot,
after a random committed step, from the launcher: outside the members). Prints each event, the
recovery time of each (signal to the first step committed by a newer generation: p50, p99,
max), goodput (failure-free seconds / seconds with failures), and whether the final parameters
and optimizer state are bitwise the reference's. Exits 1 if they are not.
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import statistics
import sys
import time

import torch

from ddp import elastic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="shm", choices=["shm", "p2p"])
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="0: DDP; 1, 2: ZeRO-1/2 with shard replicas")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=a.steps), world_size=a.world_size, backend=a.backend,
                         heartbeat=a.heartbeat, report_progress=True, zero=a.zero)
    rnd = random.Random(a.seed)
    chaos = sorted((rnd.randrange(1, a.steps - 1), rnd.randrange(a.world_size), rnd.choice([signal.SIGKILL, signal.SIGSTOP]))
                   for _ in range(a.events))
    t = time.monotonic()
    reference = elastic.run(cfg)
    clean = time.monotonic() - t
    t = time.monotonic()
    out = elastic.run(cfg, chaos)
    chaotic = time.monotonic() - t
    for e in out.events:
        print(e)
    ref, got = reference.reports[0], out.reports[0]
    same = all(torch.equal(ref["state"][k], got["state"][k]) for k in ref["state"]) and all(
        torch.equal(ref["optimizer"]["state"][i]["momentum_buffer"], got["optimizer"]["state"][i]["momentum_buffer"])
        for i in ref["optimizer"]["state"])
    r = sorted(out.recovery_seconds)
    if r:
        p99 = r[min(len(r) - 1, round(0.99 * (len(r) - 1)))]
        print(f"recovery over {len(r)} signals: p50 {statistics.median(r):.2f}s, p99 {p99:.2f}s, max {r[-1]:.2f}s")
    print(f"{a.steps} steps, {a.world_size} members: {clean:.1f}s without failures, {chaotic:.1f}s with {len(chaos)} "
          f"signals ({out.recoveries} members replaced); goodput {100 * clean / chaotic:.0f}%; "
          f"final state bitwise the reference's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
