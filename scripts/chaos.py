"""Soak the fault-tolerant loop: kill and stop members at random steps, then report.

    python scripts/chaos.py --world-size 3 --steps 600 --events 20 --seed 0 [--zero 2]
    python scripts/chaos.py --world-size 2 --steps 4000 --events 30 --signals kill --spares 1   # recovery table
    python scripts/chaos.py -n 2 --steps 60000 --events 13 --rounds 4 --spares 1 --heartbeat 0.5   # the soak in the README

Runs ``ddp.elastic.run`` twice on the synthetic job: once without failures (the reference and
the failure-free time), once with ``--events`` signals (SIGKILL or SIGSTOP, to a random slot,
after a random committed step, from the launcher: outside the members). Prints each event, the
recovery time of each (signal to the first step committed by a newer generation: p50, p99,
max), goodput (failure-free seconds / seconds with failures), and whether the final parameters
and optimizer state are bitwise the reference's. Exits 1 if they are not. ``--spares K`` keeps K
warm spares (the launcher then waits until they are ready again before the next signal, so each
recovery is measured with a warm spare at hand); ``--signals kill`` sends SIGKILL only.

On a machine shared with other work the step rate drifts by more than the failures cost (one
soak measured 122 %: its failure-free run met more load than the run with failures).
``--rounds R`` runs R pairs, alternating which of the two goes first (ABBA: a drift in load
falls on both alike), each with ``--events`` signals at steps drawn afresh; goodput is then the
sum of the failure-free times over the sum of the times with failures. Also printed: the time
the members stood still (the recovery times summed), as a share of the time with failures.
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

from collectives.launch import start_process
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
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, alternating which goes first (default 1)")
    a = p.parse_args()
    if a.spares < 0 or a.rounds < 1:
        p.error("--spares must be >= 0 and --rounds >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=a.steps), world_size=a.world_size, backend=a.backend,
                         heartbeat=a.heartbeat, report_progress=True, spares=a.spares, zero=a.zero)
    kinds = {"kill": [signal.SIGKILL], "stop": [signal.SIGSTOP], "both": [signal.SIGKILL, signal.SIGSTOP]}[a.signals]
    rnd = random.Random(a.seed)
    start_process(int, (), "ringddp-warm-up").join()  # the forkserver imports torch now, outside any timed run
    clean = chaotic = 0.0
    recovery: list[float] = []
    sent = replaced = 0
    same = True
    for r in range(a.rounds):
        chaos = sorted((rnd.randrange(1, a.steps - 1), rnd.randrange(a.world_size), rnd.choice(kinds))
                       for _ in range(a.events))
        runs: dict[str, tuple[float, elastic.Outcome]] = {}
        for name in ("reference", "chaos")[:: -1 if r % 2 else 1]:
            if name == "reference" and not a.reference:
                continue
            t = time.monotonic()
            run_cfg, signals = (dataclasses.replace(cfg, spares=0), []) if name == "reference" else (cfg, chaos)
            outcome = elastic.run(run_cfg, signals, join_timeout=3600)
            runs[name] = time.monotonic() - t, outcome
        seconds, out = runs["chaos"]
        for e in out.events:
            print(e)
        round_sent = sum(" sent " in e for e in out.events)
        sent, replaced, chaotic = sent + round_sent, replaced + out.recoveries, chaotic + seconds
        recovery += out.recovery_seconds
        line = f"round {r + 1}: {a.steps} steps, {a.world_size} members, {a.spares} spares: {seconds:.1f}s with {round_sent} of {len(chaos)} signals sent"
        if "reference" in runs:
            clean += runs["reference"][0]
            ref, got = runs["reference"][1].reports[0], out.reports[0]
            same_here = all(torch.equal(ref["state"][k], got["state"][k]) for k in ref["state"]) and all(
                torch.equal(ref["optimizer"]["state"][i]["momentum_buffer"], got["optimizer"]["state"][i]["momentum_buffer"])
                for i in ref["optimizer"]["state"])
            same = same and same_here
            line += f"; {runs['reference'][0]:.1f}s without failures; final state bitwise the reference's: {same_here}"
        print(line, flush=True)
    times = sorted(recovery)
    if times:
        p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(f"recovery over {len(times)} signals: p50 {statistics.median(times):.2f}s, p99 {p99:.2f}s, max {times[-1]:.2f}s; "
              f"members stood still {sum(times):.1f}s, {100 * sum(times) / chaotic:.1f} % of the time with failures")
        print("recovery seconds:", " ".join(f"{x:.3f}" for x in times))
    summary = (f"{a.rounds} x {a.steps} steps, {a.world_size} members, {a.spares} spares: {chaotic:.1f}s with {sent} signals "
               f"sent ({replaced} members replaced)")
    if not a.reference:
        print(summary)
        return 0
    print(f"{summary}, {clean:.1f}s without failures; goodput {100 * clean / chaotic:.0f}%; "
          f"final state bitwise the reference's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
