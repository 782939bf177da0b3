"""Measure DistributedSampler against ScatterDataset and print a markdown table.

    python -m data.compare                      # 200 000 x 64 float32, world sizes 2 and 4
    python -m data.compare --rows 50000 --world-sizes 2 3 4 --epochs 5

Each world size runs one local job (``collectives.launch``: N processes over loopback gloo). In
it, for both approaches:

* **data held per rank** — bytes of tensor storage the rank keeps for the data set: the whole
  data set for the sampler approach; the shard (plus, on the source rank, the source tensors) for
  the scatter approach.
* **start-up** — wall time from "the source has its tensors" to "every rank can iterate": for the
  sampler, building it and drawing the first epoch's indices; for the scatter dataset, its
  construction (agreement round, metadata broadcast, one scatter per field). Generating the
  synthetic data, which stands in for reading it from storage, is not counted — but note that the
  sampler approach needs *every* rank to read the whole data set, the scatter approach only the
  source. **Bytes moved**: payload bytes received from other ranks, summed over ranks.
* **reshuffle / epoch** — wall time of ``set_epoch(e)`` plus, for the sampler, drawing the
  epoch's index list (what a DataLoader does at the start of an epoch); averaged over epochs.

Every timed step starts after a barrier and its time is the slowest rank's; start-up is the
median of ``--repeats`` constructions. Output goes to stdout; it is a CLI, so it prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import collectives

from .sampler import DistributedSampler
from .scatter import ScatterDataset


def _synthetic(rows: int, cols: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(rows, cols, generator=generator)


def _timed(fn) -> tuple[float, object]:
    collectives.barrier()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _measure(rank: int, world_size: int, rows: int, cols: int, epochs: int, repeats: int) -> dict:
    """One rank's measurements (plain Python values: launch cannot return tensors)."""
    torch.set_num_threads(1)  # N ranks share the machine's cores
    out: dict = {"rank": rank}

    # --- DistributedSampler: every rank holds everything
    full = _synthetic(rows, cols)
    startup = []
    for _ in range(repeats):
        seconds, sampler = _timed(lambda: DistributedSampler(full, seed=0))
        seconds += _timed(lambda: sampler.indices().tolist())[0]
        startup.append(seconds)
    reshuffle = []
    for epoch in range(1, epochs + 1):
        reshuffle.append(_timed(lambda: (sampler.set_epoch(epoch), sampler.indices().tolist()))[0])
    out["sampler"] = dict(held=full.untyped_storage().nbytes(), startup=startup, startup_bytes=0,
                          reshuffle=reshuffle, reshuffle_bytes=0)  # fmt: skip
    del full, sampler

    # --- ScatterDataset: only rank 0 holds the source
    source = _synthetic(rows, cols) if rank == 0 else None
    startup, received = [], []
    for _ in range(repeats):
        ds = None  # free the previous shard first
        seconds, ds = _timed(lambda: ScatterDataset(source, seed=0))
        startup.append(seconds)
        received.append(ds.bytes_received)
    reshuffle, reshuffle_bytes = [], []
    for epoch in range(1, epochs + 1):
        reshuffle.append(_timed(lambda: ds.set_epoch(epoch))[0])
        reshuffle_bytes.append(ds.last_round_bytes_received)
    out["scatter"] = dict(held=ds.nbytes + ds.source_nbytes, shard=ds.nbytes, source=ds.source_nbytes,
                          startup=startup, startup_bytes=received[-1],
                          reshuffle=reshuffle, reshuffle_bytes=reshuffle_bytes[-1])  # fmt: skip
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def summarize(world_size: int, reports: list[dict]) -> list[list[str]]:
    """Table rows for one world size: slowest rank per step, median over repeats / mean over epochs."""
    rows = []
    for name, label in (("sampler", "DistributedSampler"), ("scatter", "ScatterDataset")):
        per_rank = [r[name] for r in reports]
        startup = statistics.median(max(ts) for ts in zip(*(p["startup"] for p in per_rank)))
        reshuffle = statistics.mean(max(ts) for ts in zip(*(p["reshuffle"] for p in per_rank)))
        held_src, held_other = per_rank[0]["held"], max((p["held"] for p in per_rank[1:]), default=0)
        rows.append([
            label, str(world_size), _mb(held_src), _mb(held_other), _ms(startup),
            _mb(sum(p["startup_bytes"] for p in per_rank)), _ms(reshuffle),
            _mb(sum(p["reshuffle_bytes"] for p in per_rank)),
        ])  # fmt: skip
    return rows


HEADER = [
    "approach", "N", "held: rank 0", "held: other ranks", "start-up time", "start-up bytes moved",
    "reshuffle time / epoch", "reshuffle bytes / epoch",
]  # fmt: skip


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--epochs", type=int, default=3, help="reshuffles to average over")
    parser.add_argument("--repeats", type=int, default=3, help="start-ups to take the median of")
    args = parser.parse_args(argv)
    size = args.rows * args.cols * 4
    print(
        f"data set: {args.rows} x {args.cols} float32 = {_mb(size)}; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, loopback gloo (collectives p2p backend)"
    )
    rows = []
    for ws in args.world_sizes:
        reports = collectives.launch(
            _measure, ws, args.rows, args.cols, args.epochs, args.repeats, timeout=300, join_timeout=1800
        )
        rows += summarize(ws, reports)
    print(markdown(rows))


if __name__ == "__main__":
    main()
