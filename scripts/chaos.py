"""Soak the fault-tolerant loop: kill and stop members at random steps, then report.

    python scripts/chaos.py --world-size 3 --steps 600 --events 20 --seed 0 [--zero 2]
    python scripts/chaos.py --world-size 2 --steps 4000 --events 30 --signals kill --spares 1   # recovery table

Runs ``ddp.elastic.run`` twice on the synthetic job: once without failures (the reference and
the failure-free time), once with ``--events`` signals (SIGKILL or SIGSTOP, to a random slot,
after a random committed step, from the launcher: outside the members). Prints each event, the
recovery time of each (signal to the first step committed by a newer generation: p50, p99,
max), goodput (failure-free seconds / seconds with failures), and whether the final parameters
and optimizer state are bitwise the reference's. Exits 1 if they are not. ``--spares K`` keeps K
warm spares (the launcher then waits until they are ready again before the next signal, so each
recovery is measured with a warm spare at hand); ``--signals kill`` sends SIGKILL only.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    p.add_argument("--spares", type=int, default=0, help="warm spares (default 0: a new process replaces a lost one)")
    p.add_argument("--signals", default="both", choices=["kill", "stop", "both"])
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the failure-free run (recovery times only: no goodput, no bitwise check)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="0: DDP; 1, 2: ZeRO-1/2 with shard replicas")
    a = p.parse_args()
    if a.spares < 0:
        p.error("--spares must be >= 0")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=a.steps), world_size=a.world_size, backend=a.backend,
                         heartbeat=a.heartbeat, report_progress=True, spares=a.spares, zero=a.zero)
    kinds = {"kill": [signal.SIGKILL], "stop": [signal.SIGSTOP], "both": [signal.SIGKILL, signal.SIGSTOP]}[a.signals]
    rnd = random.Random(a.seed)
    chaos = sorted((rnd.randrange(1, a.steps - 1), rnd.randrange(a.world_size), rnd.choice(kinds))
                   for _ in range(a.events))
    t = time.monotonic()
    reference = elastic.run(dataclasses.replace(cfg, spares=0), join_timeout=3600) if a.reference else None
    clean = time.monotonic() - t
    t = time.monotonic()
    out = elastic.run(cfg, chaos, join_timeout=3600)
    chaotic = time.monotonic() - t
    for e in out.events:
        print(e)
    sent = sum(" sent " in e for e in out.events)
    r = sorted(out.recovery_seconds)
    if r:
        p99 = r[min(len(r) - 1, round(0.99 * (len(r) - 1)))]
        print(f"recovery over {len(r)} signals: p50 {statistics.median(r):.2f}s, p99 {p99:.2f}s, max {r[-1]:.2f}s")
        print("recovery seconds:", " ".join(f"{x:.3f}" for x in r))
    if reference is None:
        print(f"{a.steps} steps, {a.world_size} members, {a.spares} spares: {chaotic:.1f}s with {sent} of {len(chaos)} "
              f"signals sent ({out.recoveries} members replaced)")
        return 0
    ref, got = reference.reports[0], out.reports[0]
    same = all(torch.equal(ref["state"][k], got["state"][k]) for k in ref["state"]) and all(
        torch.equal(ref["optimizer"]["state"][i]["momentum_buffer"], got["optimizer"]["state"][i]["momentum_buffer"])
        for i in ref["optimizer"]["state"])
    print(f"{a.steps} steps, {a.world_size} members, {a.spares} spares: {clean:.1f}s without failures, {chaotic:.1f}s with {sent} of {len(chaos)} "
          f"signals sent ({out.recoveries} members replaced); goodput {100 * clean / chaotic:.0f}%; "
          f"final state bitwise the reference's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
