"""nccl-tests-style benchmark: our collectives next to torch's built-in, in the same run.

    python -m collectives.bench --ops all_reduce --world-sizes 2,4 --dtypes float32,float16
    python -m collectives.bench --backend nccl-cupy --world-sizes 1      # GPU: ours over NCCL vs torch NCCL

For every (world size, op, dtype, size) it times our collective, torch's built-in collective
(``torch.distributed`` called directly on a torch group: gloo on CPU, NCCL with ``--backend
nccl-cupy``) and — for all_reduce and reduce_scatter — a *wire* row: the same ring exchanges with
no reduction (two ring all-gathers for all_reduce, one for reduce_scatter), the practical limit of
the transport. Calls are interleaved (ours, torch, wire, ours, ...) on reused buffers; the input
is restored *before* the barrier that starts each timed call, so only the collective is timed (on
GPU the device is synchronised before the barrier and before the clock stops); the reported time
is the median over iterations of the slowest rank. Results are checked against torch's (#wrong =
elements that differ; ours and torch's write separate output buffers, pre-filled with 0xFF bytes,
from the same restored input; inputs are small integers so the sums are exact).

Columns: ``time`` in microseconds; ``algbw`` = size / time; ``busbw`` = algbw × the nccl-tests
factor (all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all, scatter, gather (n-1)/n;
broadcast 1), which makes numbers comparable across world sizes: it is the bandwidth each rank's
link actually sustained. ``vs torch`` is our busbw / torch's busbw (> 1: we are faster), computed as
torch's time / ours so that it stays defined at world size 1, where busbw is 0.
``--cpu`` adds the CPU time per call (user + system, every thread of the process, so gloo's I/O
threads and the kernel's socket copies count; median per rank, mean over ranks): on a host with
fewer cores than busy threads, it is CPU, not the wire, that sets the pace.
``--timing loop`` times the way nccl-tests does instead: after one barrier and, as nccl-tests' warm-up
iterations, up to 5 untimed calls (``calls`` if fewer: none at one call), ``calls`` calls back to back
(``8 MiB / size``, 1 to 50), their mean, without restoring the input between calls (sums grow,
floats may reach inf: the time does not depend on the values). The warm-up takes the barrier's exit
skew and the first call after other work (its code and data out of the caches: 100-400 µs for a
4 KiB all-reduce on the 2-core VM) out of the mean: 4 KiB over shared memory at 2 ranks measured
23.2-23.6 µs a call without it, 15.1-15.5 µs with it (two runs each, alternating; gloo's the same
within its noise). The per-call barrier mode measures
one call from a common start, but the ranks leave torch's barrier tens to hundreds of µs apart
(median exit skew measured on the 2-core machine: 20-70 µs at 2 ranks, 220-290 µs at 4; the bench
logs it per world size and stores it as ``barrier_skew_us``), which the first rank out waits
through: at small sizes that is more than the collective itself. The loop mode is the rate a
training loop issuing the op repeatedly sees; both modes treat every column alike.
``--check-cost`` adds an ``off`` row, ours again at level ``OFF`` (``RINGDDP_DEBUG=OFF``: payload
tags but no header exchange, :mod:`collectives.wire`), interleaved with the others, and the column
``check`` = ours / off - 1: what the header exchange costs at the level the benchmark runs under
(``RINGDDP_DEBUG``, default CHECK).

``--peers mpi,deepspeed`` adds, for all_reduce, other libraries' call timed the same way in the same
processes (:mod:`collectives.peers`, the optional extra ``ringddp[peers]``): MPI's ``MPI_Allreduce``
through mpi4py (the ranks are then started by that MPI's ``mpiexec`` and join our group through
``env://``) and DeepSpeed's CPU shared-memory ``inference_all_reduce``, with ``<peer>_us`` and
``ours_vs_<peer>`` = its time / ours (above 1: ours is faster); each peer's results are checked
against torch's like ours (``#wrong`` counts them all).
``--persistent`` adds, for all_reduce, ours again through a persistent all-reduce
(:func:`collectives.all_reduce_init`: checked and planned once per buffer, started at every
call), as a column like a peer's, first among them: ``persistent_us``, and ``ours_vs_persistent``
= its time / the plain call's.

``--placement ROUNDS`` runs instead a placement report for the shared-memory transport (2 ranks):
each round puts both ranks on one CPU, gives them their affinity masks back, runs 100 all-reduces
of 4 KiB back to back and records where each rank ended, whether its mask is the one it had, and
the moves its waits made off the peer's CPU (:class:`~collectives.transport.shm.waiting.Moves`).
It prints in how many rounds the ranks ended apart, which is the scheduler's as much as ours (on
an idle 2-core VM all of them; with eight ``yes > /dev/null`` beside it, 3-10 of 10), the moves,
and the load average; it fails (exit 1) only on what is ours alone: a mask left changed, or a
move made on a peer's word older than ``CPU_FRESH``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import resource
import shlex
import statistics
import sys
import time
from math import nan
from typing import Any, Callable, Sequence

import torch
import torch.distributed as tdist

import collectives

from . import costmodel, debug, ring
from . import peers as peer_libraries
from .backends import backend_argument, describe_backends, device_type_of
from .engine import AlgorithmEngine, Engine
from .group import get_default_group, new_group
from .launch import launch
from .peers import PEERS
from .sizes import human_size, parse_size
from .topology import Layout
from .transport.shm import ShmTransport
from .transport.shm.waiting import CPU_FRESH, MOVE_INTERVAL

log = logging.getLogger(__name__)

OPS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "scatter", "gather", "all_to_all")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}


class _Case:
    """Buffers for one (op, dtype, size), allocated once and reused by every iteration.

    Ours and torch's write into separate output buffers, and every call starts from the same
    input: ``prepare`` restores it from ``source``, which no collective ever sees. ``poison``
    fills the outputs with 0xFF bytes before the correctness check, so an implementation that
    writes nothing into an output is counted wrong.
    """

    def __init__(self, op: str, dtype: torch.dtype, nbytes: int, rank: int, n: int, device: torch.device,
                 algorithm: str = "auto", shm_group: Any = None):
        self.op, self.rank, self.n, self.algorithm = op, rank, n, algorithm
        esize = torch.empty((), dtype=dtype).element_size()
        count = max(n, nbytes // esize // n * n)  # divisible by n: every op can use it
        self.count = count
        self.piece = count // n
        g = torch.Generator().manual_seed(rank)
        self.source = torch.randint(0, 5, (count,), generator=g).to(device=device, dtype=dtype)
        self.inp = self.source.clone()
        self.outs = {v: (torch.empty(count, dtype=dtype, device=device), torch.empty(self.piece, dtype=dtype, device=device))
                     for v in ("ours", "torch", "shm", "sym")}
        self.copy = torch.empty_like(self.source)
        # all_reduce over shm also runs on an input in symmetric memory (the "sym" variant)
        self.sym = (collectives.symmetric_empty(count, dtype=dtype, group=shm_group)
                    if shm_group is not None and op == "all_reduce" else None)

    def prepare(self) -> None:
        """Restore the input (in-place ops overwrite it); runs before the timed region, never inside it."""
        self.inp.copy_(self.source)
        if self.sym is not None:
            self.sym.copy_(self.source)

    def poison(self) -> None:
        for outs in self.outs.values():
            for out in outs:
                out.view(torch.uint8).fill_(0xFF)

    def memcpy(self) -> None:
        """One copy of the op's buffer on every rank at once: the machine's memory-speed yardstick."""
        self.copy.copy_(self.source)

    def run(self, variant: str, group: Any) -> None:
        """One call of ``variant``: ``"ours"`` (this package, default group, ``self.algorithm``),
        ``"shm"`` (this package on the shared-memory group ``group``), ``"sym"`` (all_reduce over
        ``group`` of an input in symmetric memory), ``"torch"`` (``torch.distributed`` itself on
        the torch process group ``group``) or a peer library's all_reduce (``group`` is the
        :mod:`collectives.peers` object: in place on the input, like ours)."""
        if variant in PEERS or variant == _Persistent.name:
            group.all_reduce(self.inp)
            return
        lib = tdist if variant == "torch" else collectives
        op, n = self.op, self.n
        inp = self.sym if variant == "sym" else self.inp
        out, small = self.outs["shm" if variant == "sym" else variant]
        chosen = {"algorithm": self.algorithm} if variant == "ours" else {}  # torch's have no algorithms
        if op == "all_reduce":
            lib.all_reduce(inp, group=group, **chosen)
        elif op == "broadcast":
            lib.broadcast(inp, src=0, group=group, **chosen)
        elif op == "reduce_scatter":
            lib.reduce_scatter_tensor(small, inp, group=group)
        elif op == "all_gather":
            lib.all_gather_into_tensor(out, inp[: self.piece], group=group)
        elif op == "scatter":
            lib.scatter(small, list(inp.chunk(n)) if self.rank == 0 else None, src=0, group=group)
        elif op == "gather":
            lib.gather(inp[: self.piece], list(out.chunk(n)) if self.rank == 0 else None, dst=0, group=group)
        elif op == "all_to_all":
            lib.all_to_all_single(out, inp, group=group)

    def result(self, variant: str) -> torch.Tensor:
        out, small = self.outs.get(variant, self.outs["ours"])
        if variant == "sym":
            return self.sym.clone()
        if self.op in ("all_reduce", "broadcast"):
            return self.inp.clone()
        if self.op in ("reduce_scatter", "scatter"):
            return small.clone()
        if self.op == "gather" and self.rank != 0:
            return torch.empty(0)
        return out.clone()

    def wrong(self, reference: Any, shm_group: Any = None, peers: Sequence[Any] = ()) -> int:
        """Elements where our result (and shm's, each peer's) differs from torch's, each from the same input."""
        results = {}
        variants = (("torch", reference), ("ours", None)) + ((("shm", shm_group),) if shm_group else ())
        variants += (("sym", shm_group),) if self.sym is not None else ()
        variants += tuple((peer.name, peer) for peer in peers)
        for variant, group in variants:
            self.prepare()
            self.poison()
            self.run(variant, group)
            results[variant] = self.result(variant)
        return sum(int((results[v] != results["torch"]).sum()) for v, _ in variants[1:])

    def wire(self, engine: Engine) -> bool:
        """The ring exchanges of this op without reduction; False if the op (or the engine) has no wire row."""
        if self.op not in ("all_reduce", "reduce_scatter") or not isinstance(engine, AlgorithmEngine):
            return False
        bounds = ring.balanced_bounds(self.count, self.n)
        seg = max(1, engine.tuning.segment_bytes // self.inp.element_size())
        with engine.transport_op("wire"):
            for _ in range(2 if self.op == "all_reduce" else 1):
                ring.all_gather(engine.transport, self.inp, bounds, seg, engine.tuning.depth)
        return True

    def size_bytes(self) -> int:
        """nccl-tests' "size": the op's whole buffer (all_gather: output; reduce_scatter: input)."""
        return self.count * self.inp.element_size()


class _Persistent:
    """Ours again, through a persistent all-reduce (:func:`collectives.all_reduce_init`, planned
    once per buffer): a column of its own beside the peers (``--persistent``)."""

    name = "persistent"
    library = "ours, planned once (collectives.all_reduce_init)"

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._tensor: torch.Tensor | None = None
        self._plan: Any = None

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        return op == "all_reduce"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if tensor is not self._tensor:  # a new case's buffer
            self._tensor, self._plan = tensor, collectives.all_reduce_init(tensor, group=self.group)
        self._plan.start()


def _cpu_seconds() -> float:
    """CPU time of this process so far, all threads (ours, gloo's I/O threads) and the kernel's share."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: untimed calls before a ``--timing loop`` sample's clock starts, as nccl-tests' warm-up iterations.
LOOP_WARMUP = 5


def _timed(prepare: Callable[[], Any], fn: Callable[[], Any], sync: Callable[[], Any],
           calls: int = 1) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per call of ``calls`` back-to-back calls of ``fn``, started
    after a barrier (``calls`` > 1: ``--timing loop``, the input restored only before the first,
    and the clock started after :data:`LOOP_WARMUP` more calls, at most ``calls``)."""
    prepare()
    sync()
    tdist.barrier()
    if warmup := _warmup_calls(calls):
        for _ in range(warmup):
            fn()
        sync()
    start, cpu = time.perf_counter(), _cpu_seconds()
    for _ in range(calls):
        fn()
    sync()  # torch's NCCL collectives return before the GPU is done
    return (time.perf_counter() - start) / calls, (_cpu_seconds() - cpu) / calls


def _warmup_calls(calls: int) -> int:
    """Untimed calls before a sample of ``calls`` timed ones: none in the per-call barrier mode."""
    return min(LOOP_WARMUP, calls) if calls > 1 else 0


def _barrier_skew(n: int, rounds: int = 50) -> float:
    """Median seconds between the first and the last rank leaving torch's barrier: the start
    offset that ``--timing barrier`` charges to the first rank out."""
    exits = torch.zeros(rounds, dtype=torch.float64)
    for i in range(rounds):
        tdist.barrier()
        exits[i] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the host
    every = [torch.zeros_like(exits) for _ in range(n)]
    tdist.all_gather(every, exits)
    stacked = torch.stack(every)
    spread = stacked.amax(0) - stacked.amin(0)
    return float(spread[rounds // 5 :].median())


def _loop_calls(nbytes: int) -> int:
    """Back-to-back calls per sample in ``--timing loop``: enough to hide the barrier at small sizes."""
    return max(1, min(50, (8 << 20) // max(nbytes, 1)))


def _setup(rank: int, n: int, backend: str) -> tuple[torch.device, Any, Callable[[], Any]]:
    """The device, torch's process group for the reference (its own collectives, called directly)
    and a device sync for ``backend``.

    A CPU backend (``p2p``, ...): CPU tensors, a torch gloo group. A CUDA one (``nccl-cupy``):
    rank ``r`` on ``cuda:r % device_count``, a torch NCCL group.
    """
    if device_type_of(backend) == "cpu":
        return torch.device("cpu"), tdist.new_group(backend="gloo"), lambda: None
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device, tdist.new_group(backend="nccl"), torch.cuda.synchronize


def _iterations(nbytes: int, iters: int | None) -> tuple[int, int]:
    if iters:
        return max(1, iters // 5), iters
    timed = int(min(40, max(10, (512 << 20) // max(nbytes, 1))))
    return 2, timed


@contextlib.contextmanager
def _checks_off():
    """Run ours at checking level ``OFF`` inside the block (:func:`collectives.debug.set_level`,
    on every rank at the same point)."""
    previous = debug.set_level("OFF")
    try:
        yield
    finally:
        debug.set_level(previous)


def bench_rank(rank: int, n: int, ops: list[str], dtypes: list[str], sizes: list[int], iters: int | None,
               tuning: dict[str, int], backend: str = "p2p", algorithm: str = "auto", model: bool = False,
               check_cost: bool = False, shm: bool = False, timing: str = "barrier",
               peers: Sequence[str] = (), persistent: bool = False) -> list[dict]:
    """One rank of the benchmark; ``tuning`` overrides fields of the group's :class:`Tuning`.

    ``algorithm`` is forced on our all_reduce / broadcast; ``model`` fits α/β by ping-pong first
    and adds the cost model's prediction to every row (:mod:`collectives.costmodel`);
    ``check_cost`` also times ours with ``RINGDDP_DEBUG=OFF``; ``shm`` also times the op over
    the shared-memory transport, all_reduce also on an input in symmetric memory
    (:func:`collectives.symmetric_empty`), and one memcpy of the op's buffer; ``timing`` is
    ``barrier`` (one call after each barrier) or ``loop`` (back-to-back calls, see the module doc);
    ``peers`` adds a column per peer library (:mod:`collectives.peers`; all_reduce only; the ranks
    must have been started by that library's launcher, see :func:`main`); ``persistent`` one for
    ours through :func:`collectives.all_reduce_init`, first among them.
    """
    torch.set_num_threads(1)
    ours = get_default_group()
    for field, value in tuning.items():
        setattr(ours.tuning, field, value)
    device, reference, sync = _setup(rank, n, backend)
    engine = ours.engine(device, "bench")
    layout = Layout.from_keys(ours.hosts)
    if model and not isinstance(engine, AlgorithmEngine):
        raise ValueError(f"--model needs a backend running our algorithms over a transport, not {type(engine).__name__}")
    regions = None  # the hierarchical algorithms' intra-host shared memory, if they have it
    if model and layout.spans_hosts and layout.uniform:
        regions = engine.hierarchy().intra.shared_regions()
    links = costmodel.measure(engine.transport, layout, regions) if model else None
    if links and rank == 0:
        log.warning("fitted links: %s", "; ".join(f"{k} {link}" for k, link in links.items()))
    skew = _barrier_skew(n) if not layout.spans_hosts else nan  # clocks are per host
    if rank == 0 and skew == skew:
        log.warning("torch barrier exit skew at %d ranks: median %.0f us", n, skew * 1e6)
    shm_group = new_group(backend="shm") if shm else None
    peer_objects = [peer_libraries.make(p, rank, n) for p in peers]
    if persistent:
        peer_objects.insert(0, _Persistent())
    variants = ("ours", "torch", "wire", "off", "shm", "sym", "memcpy") + tuple(p.name for p in peer_objects)
    rows = []
    for op in ops:
        for dtype_name in dtypes:
            for nbytes in sizes:
                case = _Case(op, DTYPES[dtype_name], nbytes, rank, n, device, algorithm, shm_group)
                warm, timed = _iterations(nbytes, iters)
                calls = _loop_calls(nbytes) if timing == "loop" else 1
                times: dict[str, list[float]] = {k: [] for k in variants}
                cpu: dict[str, list[float]] = {k: [] for k in variants}
                running = [peer for peer in peer_objects if peer.supports(op, DTYPES[dtype_name])]
                wrong = case.wrong(reference, shm_group, running)
                has_wire = case.wire(engine)
                for i in range(warm + timed):
                    measured = {
                        "ours": _timed(case.prepare, lambda: case.run("ours", None), sync, calls),
                        "torch": _timed(case.prepare, lambda: case.run("torch", reference), sync, calls),
                        "wire": _timed(case.prepare, lambda: case.wire(engine), sync, calls) if has_wire else (nan, nan),
                    }
                    if check_cost:
                        with _checks_off():
                            measured["off"] = _timed(case.prepare, lambda: case.run("ours", None), sync, calls)
                    if shm_group is not None:
                        measured["shm"] = _timed(case.prepare, lambda: case.run("shm", shm_group), sync, calls)
                        if case.sym is not None:
                            measured["sym"] = _timed(case.prepare, lambda: case.run("sym", shm_group), sync, calls)
                        measured["memcpy"] = _timed(case.prepare, case.memcpy, sync, calls)
                    for peer in running:
                        measured[peer.name] = _timed(case.prepare, lambda: case.run(peer.name, peer), sync, calls)
                    if i >= warm:
                        for k, (wall, used) in measured.items():
                            times[k].append(wall)
                            cpu[k].append(used)
                med = torch.tensor([statistics.median(times[k] or [nan]) for k in variants] + [wrong], dtype=torch.float64)
                tdist.all_reduce(med, op=tdist.ReduceOp.MAX)  # the slowest rank sets the pace
                cpu_med = torch.tensor([statistics.median(cpu[k] or [nan]) for k in variants], dtype=torch.float64)
                tdist.all_reduce(cpu_med)  # CPU per call: the mean over ranks
                cpu_med /= n
                if rank == 0:
                    size = case.size_bytes()
                    factor = BUS_FACTOR[op](n)
                    row = {"op": op, "world_size": n, "dtype": dtype_name, "bytes": size, "count": case.count,
                           "wrong": int(med[-1]), "backend": backend, "timing": timing, "calls": calls,
                           "warmup": _warmup_calls(calls),
                           "barrier_skew_us": skew * 1e6, "load_average": os.getloadavg()[0]}
                    for k, t, c in zip(variants, med[:-1].tolist(), cpu_med.tolist()):
                        row[f"{k}_us"] = t * 1e6
                        row[f"{k}_cpu_ms"] = c * 1e3
                        row[f"{k}_algbw"] = size / t / 1e9 if t == t and t > 0 else nan
                        row[f"{k}_busbw"] = row[f"{k}_algbw"] * factor
                    # busbw ratios, taken as time ratios: the same at n > 1, defined at n = 1 (busbw 0)
                    row["vs_torch"] = row["torch_us"] / row["ours_us"]
                    row["vs_wire"] = row["wire_us"] / row["ours_us"] if has_wire else nan
                    row["check"] = row["ours_us"] / row["off_us"] - 1 if check_cost else nan
                    row["shm_vs_torch"] = row["torch_us"] / row["shm_us"]
                    row["sym_vs_torch"] = row["torch_us"] / row["sym_us"]
                    row["shm_vs_memcpy"] = row["shm_us"] / row["memcpy_us"]  # time: copies' worth
                    row["algorithm"] = costmodel.algorithm_for(op, algorithm, size, layout, ours.tuning)
                    if peer_objects:
                        row["peers"] = {peer.name: peer.library for peer in peer_objects}
                        for peer in peer_objects:  # above 1: ours is faster
                            row[f"ours_vs_{peer.name}"] = row[f"{peer.name}_us"] / row["ours_us"]
                    if links:
                        row["model_us"] = 1e6 * costmodel.predict(
                            op, size, layout, links["net"], links["local"], ours.tuning, algorithm, links.get("shm"))
                        for kind, link in links.items():  # every fitted link: collectives.sim validate
                            row[f"{kind}_alpha"], row[f"{kind}_beta"] = link.alpha, link.beta
                        row["tuning"] = dataclasses.asdict(ours.tuning)  # what chose the algorithm
                    rows.append(row)
                    log.info("%s", format_row(row, check_cost=check_cost, shm=shm))
    return rows


HEADER = (f"{'op':<15}{'n':>2} {'dtype':<9}{'size':>7}{'count':>11} |{'ours us':>10}{'algbw':>7}{'busbw':>7}"
          f"{'#wrong':>7} |{'torch us':>10}{'busbw':>7} |{'wire us':>10}{'busbw':>7} |{'vs torch':>9}{'vs wire':>8}")


CPU_HEADER = f" |{'cpu ms: ours':>14}{'torch':>7}{'wire':>7}"
CHECK_HEADER = f" |{'off us':>10}{'check':>8}{'cpu ms: off':>13}"
SHM_HEADER = (f" |{'shm us':>10}{'busbw':>7}{'vs torch':>9} |{'sym us':>10}{'vs torch':>9}"
              f" |{'memcpy us':>10}{'shm/cpy':>8}")


def format_row(r: dict, cpu: bool = False, check_cost: bool = False, shm: bool = False) -> str:
    def num(x: float, width: int, digits: int, suffix: str = "") -> str:
        text = f"{x:.{digits}f}{suffix}" if x == x else "-"  # NaN: no such row (e.g. no wire row)
        return text.rjust(width)

    return (f"{r['op']:<15}{r['world_size']:>2} {r['dtype']:<9}{human_size(r['bytes']):>7}{r['count']:>11} |"
            f"{num(r['ours_us'], 10, 1)}{num(r['ours_algbw'], 7, 2)}{num(r['ours_busbw'], 7, 2)}{r['wrong']:>7} |"
            f"{num(r['torch_us'], 10, 1)}{num(r['torch_busbw'], 7, 2)} |"
            f"{num(r['wire_us'], 10, 1)}{num(r['wire_busbw'], 7, 2)} |"
            f"{num(r['vs_torch'], 9, 2, 'x')}{num(r['vs_wire'], 8, 2, 'x')}"
            + (f" |{num(r['ours_cpu_ms'], 14, 2)}{num(r['torch_cpu_ms'], 7, 2)}{num(r['wire_cpu_ms'], 7, 2)}" if cpu else "")
            + (f" |{num(r['off_us'], 10, 1)}{num(r['check'] * 100, 7, 1, '%')}{num(r['off_cpu_ms'], 13, 2)}" if check_cost else "")
            + (f" |{num(r['shm_us'], 10, 1)}{num(r['shm_busbw'], 7, 2)}{num(r['shm_vs_torch'], 9, 2, 'x')} |"
               f"{num(r['sym_us'], 10, 1)}{num(r['sym_vs_torch'], 9, 2, 'x')} |"
               f"{num(r['memcpy_us'], 10, 1)}{num(r['shm_vs_memcpy'], 8, 2, 'x')}" if shm else "")
            + (f" | {r['algorithm']:<18}{num(r['model_us'], 10, 1)}{num(r['model_us'] / r['ours_us'], 7, 2, 'x')}"
               if "model_us" in r else "")
            + "".join(f" |{num(r[f'{p}_us'], 10, 1)}{num(r[f'{p}_busbw'], 7, 2)}{num(r[f'ours_vs_{p}'], 9, 2, 'x')}"
                      for p in r.get("peers", ())))


MODEL_HEADER = f" | {'algorithm':<18}{'model us':>10}{'/ours':>7}"


def peer_header(peer: str) -> str:
    """A peer library's columns: its time, its busbw, and its time / ours (above 1: ours is faster)."""
    return f" |{peer + ' us':>10}{'busbw':>7}{'ours vs':>9}"


def header(cpu: bool = False, check_cost: bool = False, shm: bool = False, model: bool = False,
           peers: Sequence[str] = ()) -> str:
    """The column titles above :func:`format_row`'s rows printed with the same flags (rows of a
    ``--peers`` run carry their peer columns last)."""
    return (HEADER + (CPU_HEADER if cpu else "") + (CHECK_HEADER if check_cost else "")
            + (SHM_HEADER if shm else "") + (MODEL_HEADER if model else "") + "".join(map(peer_header, peers)))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["op"], r["world_size"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 3.2 * len(keys)), squeeze=False)
    for ax, (op, n, dtype) in zip(axes[:, 0], keys):
        sel = [r for r in rows if (r["op"], r["world_size"], r["dtype"]) == (op, n, dtype)]
        x = [r["bytes"] for r in sel]
        for backend, style in (("ours", "o-"), ("torch", "s--"), ("wire", "^:"), ("shm", "D-")):
            y = [r[f"{backend}_busbw"] for r in sel]
            if any(v == v for v in y):
                ax.plot(x, y, style, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, world size {n}, {dtype}")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def placement_rank(rank: int, n: int, rounds: int) -> list[dict]:
    """One rank of ``--placement`` (module doc), over the default group's shm transport: per
    round, the CPU this rank ended on, whether its affinity mask is the one it had, the moves its
    waits made in the round and the age (s) of the oldest peer's word any of its moves acted on."""
    current_cpu = ctypes.CDLL(None).sched_getcpu
    mask = os.sched_getaffinity(0)
    t = torch.ones(1024)
    collectives.all_reduce(t)  # sets the transport up
    transport = get_default_group().engine(t.device, "placement").transport
    if not isinstance(transport, ShmTransport):
        raise ValueError(f"--placement needs the shm transport, this group runs {type(transport).__name__}")
    rows = []
    for _ in range(rounds):
        collectives.barrier()
        time.sleep(MOVE_INTERVAL)  # the barrier's waits may have moved a rank: a round starts past the interval
        before = transport.moves.count
        os.sched_setaffinity(0, {min(mask)})
        os.sched_setaffinity(0, mask)
        for _ in range(100):
            collectives.all_reduce(t)
        moves = transport.moves
        rows.append({"cpu": current_cpu(), "mask_kept": os.sched_getaffinity(0) == mask,
                     "moves": moves.count - before, "oldest_word_s": moves.oldest_word})
    return rows


def placement(rounds: int) -> int:
    """``--placement``: run :func:`placement_rank` on 2 ranks over shm and print the report."""
    per_rank = launch(placement_rank, 2, rounds, backend="shm", log_level=logging.WARNING)
    apart = sum(a["cpu"] != b["cpu"] for a, b in zip(*per_rank))
    kept = all(r["mask_kept"] for rows in per_rank for r in rows)
    oldest = max(r["oldest_word_s"] for rows in per_rank for r in rows)
    moved = [sum(r["moves"] > 0 for r in rows) for rows in per_rank]
    print(f"placement, 2 ranks over shm: both put on one CPU, masks given back, 100 all-reduces of 4 KiB; "
          f"{rounds} rounds (load average {os.getloadavg()[0]:.1f})")
    print(f"  ranks apart at the end of {apart} of {rounds} rounds")
    print(f"  rounds in which a rank moved itself off its peer's CPU: rank 0 {moved[0]}, rank 1 {moved[1]} "
          f"({sum(r['moves'] for rows in per_rank for r in rows)} moves, on peer words at most "
          f"{oldest * 1e6:.0f} us old)")
    print(f"  affinity masks as they were: {'yes' if kept else 'NO'}")
    return 0 if kept and oldest <= CPU_FRESH else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collectives.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="p2p", type=backend_argument,
                   help="ours on this backend vs torch's collectives: CPU backends (p2p, or package.module:name "
                        "for your own) against gloo; CUDA ones (nccl-cupy; rank r on cuda:r %% device count) "
                        "against torch's NCCL. " + describe_backends().replace("%", "%%"))
    p.add_argument("--ops", default="all_reduce", help=f"comma list or 'all' ({','.join(OPS)})")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--dtypes", default="float32", help=f"comma list of {','.join(DTYPES)}")
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size, 10-40)")
    p.add_argument("--segment-bytes", type=parse_size, default=None,
                   help="ring/chain pipelining segment (default: the group's tuning)")
    p.add_argument("--small-bytes", type=parse_size, default=None,
                   help="largest message for the latency-optimal algorithms (default: the group's tuning)")
    p.add_argument("--chain-bytes", type=parse_size, default=None,
                   help="largest broadcast for the binomial tree; larger ones use the chain (default: the group's tuning)")
    p.add_argument("--depth", type=int, default=None,
                   help="segments a ring keeps on the wire ahead of the one being reduced (default: the group's tuning)")
    p.add_argument("--cpu", action="store_true",
                   help="also print CPU ms per call (user + system, all threads, mean over ranks)")
    p.add_argument("--algorithm", default="auto",
                   help="force our all_reduce / broadcast algorithm (ring, recursive_doubling, hierarchical, ...)")
    p.add_argument("--model", action="store_true",
                   help="fit alpha/beta by ping-pong and print the cost model's prediction next to each row")
    p.add_argument("--hosts", type=int, default=0,
                   help="run the ranks on this many emulated hosts (network namespaces; needs root), "
                        "world size / hosts ranks on each")
    p.add_argument("--netem", help="with --hosts: netem on every host's link, e.g. 'delay 1ms rate 1gbit' (emulated "
                                    "in userspace where the kernel has no netem: delay, rate and limit only)")
    p.add_argument("--emulator", default="auto", choices=("auto", "tc", "user"),
                   help="with --netem: the kernel's qdisc (tc), the userspace emulator (user), or tc where it exists")
    p.add_argument("--tbf", help="with --hosts: tc tbf on every host's link, e.g. 'rate 1gbit burst 256kb latency 50ms'")
    p.add_argument("--check-cost", action="store_true",
                   help="also time ours with RINGDDP_DEBUG=OFF (interleaved) and print the wire check's cost")
    p.add_argument("--shm", action="store_true",
                   help="CPU: also time the op over the shared-memory transport (shm columns) and one "
                        "memcpy of the op's buffer (memcpy us; shm/cpy = shm time / memcpy time)")
    p.add_argument("--timing", default="barrier", choices=("barrier", "loop"),
                   help="barrier: one call after each barrier, input restored (default); loop: nccl-tests style, "
                        "8 MiB / size calls (1-50) back to back after one barrier and up to 5 untimed ones, their mean")
    p.add_argument("--placement", type=int, metavar="ROUNDS",
                   help="instead of timing: where 2 ranks over shm end up after being put on one CPU, ROUNDS "
                        "times (module doc)")
    p.add_argument("--peers", default="",
                   help=f"CPU, all_reduce: also time other libraries' all_reduce in the same processes, comma list of "
                        f"{','.join(PEERS)} (MPI's MPI_Allreduce in place through mpi4py, the ranks then started by "
                        "that MPI's mpiexec; DeepSpeed's CPU shm inference_all_reduce, its op JIT-built on first use): "
                        "pip install 'ringddp[peers]'")
    p.add_argument("--persistent", action="store_true",
                   help="all_reduce: also time ours through collectives.all_reduce_init (planned once per buffer, "
                        "started at every call), a column like a peer's")
    p.add_argument("--peer-job", nargs=2, metavar=("PORT", "ROWS"), help=argparse.SUPPRESS)  # a rank under mpiexec
    p.add_argument("--json", help="write the rows to this JSON file (each with the load average when it was measured)")
    p.add_argument("--plot", help="write busbw-vs-size curves to this PNG")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.placement is not None:
        if args.placement < 1 or len(os.sched_getaffinity(0)) < 2:
            p.error("--placement: ROUNDS must be at least 1, and this process's affinity mask must hold two CPUs")
        return placement(args.placement)
    ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    bad = [o for o in ops if o not in OPS] + [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad:
        p.error(f"unknown op/dtype: {bad}")
    if device_type_of(args.backend) == "cuda" and not torch.cuda.is_available():
        p.error(f"--backend {args.backend} needs CUDA: a CUDA build of torch, a visible GPU (and for nccl-cupy "
                "CuPy: pip install 'ringddp[cuda]'); this torch sees no GPU")
    sizes, s = [], parse_size(args.min_bytes)
    while s <= parse_size(args.max_bytes):
        sizes.append(s)
        s *= 2
    tuning = {k: v for k, v in (("segment_bytes", args.segment_bytes), ("small_bytes", args.small_bytes),
                                 ("chain_bytes", args.chain_bytes), ("depth", args.depth)) if v is not None}
    rows: list[dict] = []
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    link = f"netem {args.netem}" if args.netem else f"tbf {args.tbf}" if args.tbf else None
    if args.hosts:
        from .testing.hosts import link_unavailable, unavailable

        reason = unavailable() or (link_unavailable(link, args.emulator) if link else None)
        if reason or any(n % args.hosts for n in world_sizes):
            p.error(reason or f"--hosts {args.hosts}: every world size must be a multiple of it")
    if args.shm and (device_type_of(args.backend) != "cpu" or args.hosts):
        p.error("--shm compares CPU backends on one host: use it with a CPU --backend and no --hosts")
    peers = [name for name in args.peers.split(",") if name]
    if peers and (device_type_of(args.backend) != "cpu" or args.hosts or args.model):
        p.error("--peers compares CPU libraries on one host: use it with a CPU --backend, no --hosts, no --model")
    if reason := next(filter(None, map(peer_libraries.unavailable, peers)), None):
        p.error(reason)
    job = (bench_rank, ops, args.dtypes.split(","), sizes, args.iters, tuning, args.backend, args.algorithm,
           args.model, args.check_cost, args.shm, args.timing, peers, args.persistent)
    if args.peer_job:
        return _peer_rank(job, *args.peer_job)
    print(header(args.cpu, args.check_cost, args.shm, args.model, ["persistent"] * args.persistent + peers))
    for n in world_sizes:
        if args.hosts:
            result = _run_hosts(args.hosts, link, args.emulator, n, job)
            for row in result:  # what `collectives.sim validate` models: the shaped link, the shared cores
                row.update(hosts=args.hosts, link=link, cpus=len(os.sched_getaffinity(0)))
        elif "mpi" in peers:
            result = _run_under_mpiexec(argv if argv is not None else sys.argv[1:], n)
        else:
            result = launch(job[0], n, *job[1:], backend=args.backend, log_level=logging.WARNING)[0]
        for r in result:
            print(format_row(r, args.cpu, args.check_cost, args.shm))
        sys.stdout.flush()
        rows += result
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 1 if any(r["wrong"] for r in rows) else 0


def _run_under_mpiexec(argv: list[str], n: int) -> list[dict]:
    """Rank 0's rows of this benchmark run at ``n`` ranks started by MPI's ``mpiexec`` (``--peers``):
    each process is one MPI rank and joins our group through ``env://`` (:func:`_peer_rank`)."""
    import socket
    import subprocess
    import tempfile

    with socket.socket() as s:  # a free port for the rendezvous of our group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "rows.json")
        child = _without(argv, ("--json", "--plot", "--world-sizes"))  # the parent writes the files
        command = [peer_libraries.mpiexec() or "mpiexec", "-n", str(n), sys.executable, "-m", "collectives.bench",
                   *child, "--world-sizes", str(n), "--peer-job", str(port), rows]
        done = subprocess.run(command, stdout=subprocess.DEVNULL)
        if done.returncode != 0 or not os.path.exists(rows):
            raise RuntimeError(f"the ranks started by {shlex.join(command)} exited with status {done.returncode}")
        with open(rows) as f:
            return json.load(f)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt VALUE`` or ``--opt=VALUE``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            kept.append(arg)
    return kept


def _peer_rank(job: tuple, port: str, rows: str) -> int:
    """One rank started by ``mpiexec``: join our group as the MPI launcher numbers it, run ``job``,
    and (rank 0) write its rows to ``rows``."""
    found = peer_libraries.rank_from_launcher()
    if found is None:
        raise RuntimeError("--peer-job: no MPI launcher variables (PMI_RANK or OMPI_COMM_WORLD_RANK) in the environment")
    rank, size = found
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    result = launch(job[0], size, *job[1:], backend=job[6], log_level=logging.WARNING)[rank]
    if rank == 0:
        with open(rows, "w") as f:
            json.dump(result, f)
    return 0


def _run_hosts(hosts: int, link: str | None, emulator: str, n: int, job: tuple) -> list[dict]:
    """Rank 0's rows of ``job`` run on ``hosts`` emulated hosts, ``n / hosts`` ranks on each."""
    from .testing.hosts import HostNet

    with HostNet(hosts, link, emulator) as net:
        return net.launch(job[0], n // hosts, *job[1:], backend=job[6], join_timeout=3600)[0]


if __name__ == "__main__":
    sys.exit(main())
