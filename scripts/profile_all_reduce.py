"""Where the time of one small or medium all_reduce on ``shm`` goes (docs/DESIGN.md §3).

    python scripts/profile_all_reduce.py                    # 4 KiB, 64 KiB, 1 MiB, float32 SUM, 2 ranks
    python scripts/profile_all_reduce.py --sizes 4K --calls 500 --samples 21
    python scripts/profile_all_reduce.py --count --sizes 4K          # work per call, no clock

Two parts, both on 2 ranks of the ``shm`` backend:

* **Layers**, timed back to back as ``collectives.bench --timing loop`` does (after a barrier and
  5 untimed calls, ``--calls`` calls, their mean; the layers interleaved sample by sample; min
  and median over ``--samples``, the slower rank's): the public call; its persistent form
  (:func:`collectives.all_reduce_init`, planned at its first start); the engine (wire check and
  algorithm choice, no argument checks, no queue); the shared-memory algorithm inside the
  transport's checked operation; the algorithm alone (unchecked). The differences are what each
  layer adds, waits included.
* **Steps**, each alone on every rank at once (no traffic; best of 9 runs of ``timeit``): the
  argument checks, the engine lookup, the call's signature and wire header, the copy into the
  region, the reduction, a fence.

The min is what the code costs; on a busy machine the median also carries other jobs' time.
``--count`` measures without a clock instead: the work of one call on rank 0 (its peer ahead of it,
so the call that did not wait: the min of ``--calls`` calls), as Python functions entered, C
functions called and bytecodes executed (``sys.settrace`` / ``sys.setprofile``), for the public
call and a planned start.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import collectives  # noqa: E402
from collectives import debug, shm_algorithms, validate, wire  # noqa: E402
from collectives.group import get_group, member  # noqa: E402
from collectives.launch import launch  # noqa: E402
from collectives.ops import ReduceOp, check_op_dtype, combine  # noqa: E402
from collectives.sizes import human_size, parse_size  # noqa: E402
from collectives.transport.shm.control import fence  # noqa: E402

SUM = ReduceOp.SUM


def _layers(t: torch.Tensor) -> dict[str, Callable[[], None]]:
    g = get_group(None)
    engine = g.engine(t.device, "profile")
    transport = engine.transport
    regions = transport.shared_regions()
    header = wire.header(debug.signature("all_reduce", t, SUM), g.tuning, "auto")

    def engine_call() -> None:
        previous = wire.swap(header)
        with engine.transport_op("all_reduce"):
            engine.all_reduce(t, SUM, "auto")
        wire.swap(previous)

    def checked_algorithm() -> None:
        previous = wire.swap(header)
        with transport.operation("all_reduce"):
            shm_algorithms.all_reduce(regions, t, SUM)
        wire.swap(previous)

    return {"collectives.all_reduce": lambda: collectives.all_reduce(t),
            "persistent start": collectives.all_reduce_init(t).start, "engine + wire check": engine_call,
            "algorithm, checked": checked_algorithm, "algorithm alone": lambda: shm_algorithms.all_reduce(regions, t, SUM)}


def _steps(t: torch.Tensor, rank: int) -> dict[str, Callable[[], object]]:
    g = get_group(None)
    regions = g.engine(t.device, "profile").transport.shared_regions()
    mine, theirs = (regions.view(q, 0, t.dtype, t.numel()) for q in (rank, 1 - rank))
    return {
        "argument checks": lambda: (validate.tensor(t, "all_reduce"), member(None, "all_reduce"),
                                    check_op_dtype(SUM, t.dtype, "all_reduce")),
        "engine lookup": lambda: g.engine(t.device, "all_reduce"),
        "signature + wire header": lambda: wire.header(debug.signature("all_reduce", t, SUM), g.tuning, "auto"),
        "copy into the region": lambda: mine.copy_(t),
        "reduction (t += peer's region)": lambda: combine(SUM, t, theirs, out=t),
        "fence": fence,
    }


def profile_rank(rank: int, n: int, sizes: list[int], calls: int, samples: int) -> dict:
    torch.set_num_threads(1)
    result = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        layers = _layers(t)
        for f in layers.values():
            for _ in range(20):
                f()
        times: dict[str, list[float]] = {k: [] for k in layers}
        k_calls = max(2, min(calls, (64 << 20) // nbytes))
        for _ in range(samples):
            for name, f in layers.items():
                collectives.barrier()
                for _ in range(5):
                    f()
                start = time.perf_counter()
                for _ in range(k_calls):
                    f()
                times[name].append((time.perf_counter() - start) / k_calls * 1e6)
        row = {name: (min(v), statistics.median(v)) for name, v in times.items()}
        collectives.barrier()
        number = max(10, min(2000, (64 << 20) // nbytes // 4))
        for name, f in _steps(t, rank).items():
            row[name] = (min(timeit.repeat(f, number=number, repeat=9)) / number * 1e6,) * 2
        collectives.barrier()
        result[nbytes] = row
    return result


def _work(fn: Callable[[], object]) -> tuple[int, int, int]:
    """(Python functions, C calls, bytecodes) that one ``fn()`` runs."""
    counts = [0, 0, 0]

    def trace(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call":
            counts[0] += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts[2] += 1
        return trace

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        counts[1] += event == "c_call"

    sys.setprofile(profile)
    sys.settrace(trace)
    fn()
    sys.settrace(None)
    sys.setprofile(None)
    return counts[0], counts[1], counts[2]


def count_rank(rank: int, n: int, sizes: list[int], calls: int) -> dict:
    """``--count``: rank 0 counts each call; rank 1 runs the same calls, ahead of it."""
    torch.set_num_threads(1)
    result: dict = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        for name, f in (("collectives.all_reduce", lambda: collectives.all_reduce(t)),
                        ("persistent start", collectives.all_reduce_init(t).start)):
            for _ in range(20):
                f()
            collectives.barrier()
            result[(nbytes, name)] = min(_work(f) for _ in range(calls)) if rank == 0 else [f() for _ in range(calls)]
            collectives.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K,64K,1M")
    p.add_argument("--calls", type=int, default=200, help="calls per sample (fewer for large sizes)")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--count", action="store_true", help="count the work of a call instead of timing")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.count:
        counted = launch(count_rank, 2, sizes, min(args.calls, 100), backend="shm", log_level=logging.WARNING)[0]
        print("float32 SUM, 2 ranks, shm: Python functions / C calls / bytecodes per call (rank 0)")
        for (nbytes, name), (functions, c_calls, bytecodes) in counted.items():
            print(f"  {human_size(nbytes):>6} {name:<24}{functions:5d} /{c_calls:4d} /{bytecodes:6d}")
        return 0
    per_rank = launch(profile_rank, 2, sizes, args.calls, args.samples, backend="shm", log_level=logging.WARNING)
    for nbytes in sizes:
        print(f"{human_size(nbytes)} float32 SUM, 2 ranks, shm: µs per call (min / median; the slower rank)")
        for name in per_rank[0][nbytes]:
            low, mid = (max(r[nbytes][name][i] for r in per_rank) for i in (0, 1))
            print(f"  {name:<34}{low:9.1f}{mid:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
