"""``python -m collectives.sim``: study collectives at scale on a simulated network.

Four commands (``study`` when none is given)::

    python -m collectives.sim study --hosts 16 --ranks-per-host 8 --world-sizes 16,128 \\
        --sizes 4K,256K,16M --plot sim.png --trace ring.json
    python -m collectives.sim ddp --hosts 16 --ranks-per-host 8 --model-mb 400 --bucket-mb 25 --backward-ms 120
    python -m collectives.sim bench --world-size 1024 --mb 64          # the ring's simulation speed
    python -m collectives.sim validate run1.json run2.json --hosts 2   # against measured runs

``--world-sizes`` scales the topology: each n keeps ``--ranks-per-host`` and takes n / that many
hosts. ``--links FILE`` starts from this machine's fitted links (``collectives.bench --model
--json FILE``) instead of the defaults (a 100 Gb/s NIC, shared memory inside a host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import statistics
import sys
import time
from typing import Sequence

import torch

from ..api import all_reduce
from ..costmodel import Link
from ..ops import ReduceOp
from ..sizes import human_size, parse_size
from ..transport.sim import Simulation
from ..tuning import Tuning
from . import clock, launch
from .ddp import StepReport, simulate_step
from .network import DEFAULT_INTER, DEFAULT_INTRA, Network, links_from_bench
from .study import ALGORITHMS, crossovers, plot, sweep, table, time_collective

log = logging.getLogger("collectives.sim")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x]


def _network_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument("--hosts", type=int, default=16, help="hosts (default 16)")
    g.add_argument("--ranks-per-host", type=int, default=8, help="ranks per host (default 8)")
    g.add_argument("--nics", type=int, default=1, help="NICs per host (default 1)")
    g.add_argument("--hosts-per-switch", type=int, default=0, help="hosts per leaf switch (0: one switch)")
    g.add_argument("--oversubscription", type=float, default=1.0, help="leaf uplink oversubscription (default 1)")
    g.add_argument("--links", help="fitted links from `collectives.bench --model --json FILE`")
    g.add_argument("--inter-us", type=float, help="NIC latency α in µs (default 5)")
    g.add_argument("--inter-gbps", type=float, help="NIC bandwidth in GB/s (default 12.5)")
    g.add_argument("--intra-us", type=float, help="intra-host latency α in µs (default 2)")
    g.add_argument("--intra-gbps", type=float, help="intra-host bandwidth in GB/s (default 20)")
    g.add_argument("--nic-burst", type=parse_size, default=0, help="a NIC's token bucket in bytes (tbf burst; default 0)")
    g.add_argument("--cores", type=int, default=0,
                   help="cores per CPU, shared by its ranks' CPU work (default 0: a core per rank)")
    g.add_argument("--hosts-per-cpu", type=int, default=1, help="hosts sharing one CPU (default 1)")
    g.add_argument("--recv-cpu-ns", type=float, default=0.0,
                   help="CPU ns per byte received from another host (default 0; with --links: its recv_cpu fit)")
    g.add_argument("--no-contention", action="store_true", help="every message as if alone on its links")


def network_from(args: argparse.Namespace, hosts: int | None = None) -> Network:
    """The :class:`Network` the arguments describe (``hosts`` overrides ``--hosts``)."""
    inter, intra, recv_cpu = DEFAULT_INTER, DEFAULT_INTRA, args.recv_cpu_ns * 1e-9
    if args.links:
        fitted = links_from_bench(args.links)
        inter = fitted.get("net", inter)
        intra = fitted.get("local", intra)
        if not args.recv_cpu_ns and "recv_cpu" in fitted:
            recv_cpu = fitted["recv_cpu"].beta
    if args.inter_us is not None or args.inter_gbps is not None:
        inter = Link(
            inter.alpha if args.inter_us is None else args.inter_us * 1e-6,
            inter.beta if args.inter_gbps is None else 1 / (args.inter_gbps * 1e9),
        )
    if args.intra_us is not None or args.intra_gbps is not None:
        intra = Link(
            intra.alpha if args.intra_us is None else args.intra_us * 1e-6,
            intra.beta if args.intra_gbps is None else 1 / (args.intra_gbps * 1e9),
        )
    return Network(
        args.hosts if hosts is None else hosts, args.ranks_per_host, intra, inter, args.nics,
        args.hosts_per_switch, args.oversubscription, args.nic_burst, args.cores, args.hosts_per_cpu, recv_cpu,
    )


def _scaled(args: argparse.Namespace) -> list[Network]:
    if not args.world_sizes:
        return [network_from(args)]
    nets = []
    for n in _ints(args.world_sizes):
        if n % args.ranks_per_host:
            raise SystemExit(f"--world-sizes: {n} is not a multiple of --ranks-per-host {args.ranks_per_host}")
        nets.append(network_from(args, n // args.ranks_per_host))
    return nets


def study(args: argparse.Namespace) -> None:
    networks = _scaled(args)
    for net in networks:
        print(f"# {net.describe()}")
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown}; choose from {list(ALGORITHMS)}")
    algorithms = args.algorithms.split(",") if args.algorithms else None
    start = time.perf_counter()
    results = sweep(networks, ops, _sizes(args.sizes), algorithms, contention=not args.no_contention)
    print(table(results))
    print("\n# crossovers (fastest forced algorithm)")
    for line in crossovers(results) or ["(need two or more algorithms per op)"]:
        print(line)
    print(f"# {len(results)} collectives simulated in {time.perf_counter() - start:.1f} s of wall time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.row() for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot, ops[0])
        print(f"# plot: {args.plot}")
    if args.trace:
        net = dataclasses.replace(networks[0], hosts=max(1, args.trace_ranks // networks[0].ranks_per_host))
        result, sim = time_collective(
            net, ops[0], _sizes(args.trace_size)[0], args.trace_algorithm, trace=True, contention=not args.no_contention
        )
        with open(args.trace, "w") as f:
            json.dump(sim.chrome_trace(), f)
        print(
            f"# trace: {args.trace} ({ops[0]} {args.trace_algorithm} of {human_size(result.nbytes)} on {net.world_size} "
            f"ranks, {result.seconds * 1e6:.1f} µs; open in https://ui.perfetto.dev)"
        )


def ddp(args: argparse.Namespace) -> None:
    print(StepReport.HEADER)
    slowdown = {args.straggler: args.straggler_factor} if args.straggler is not None else None
    for net in _scaled(args):
        report = simulate_step(
            net, int(args.model_mb * 2**20), int(args.bucket_mb * 2**20), args.backward_ms / 1e3, slowdown=slowdown
        )
        print(report.row(), f"  # {net.describe()}")


def _ring_rank(rank: int, world_size: int, numel: int) -> float:
    t = torch.full((numel,), float(rank))
    all_reduce(t, ReduceOp.SUM, algorithm="ring")
    expected = world_size * (world_size - 1) / 2
    if not bool((t == expected).all()):
        raise AssertionError(f"rank {rank}: ring all-reduce result differs from {expected}")
    return clock()


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (on a loaded machine the fair measure of
    the simulator's own cost: wall time adds whatever else ran on the cores)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench(args: argparse.Namespace) -> None:
    """A ring all-reduce of ``--mb`` MiB on ``--world-size`` flat ranks: timing-only, then exact
    on a small buffer through ``collectives.launch``; wall time, CPU time (user + system) and the
    process's peak memory after each (``--exact-only``: the exact run alone, for its own peak)."""
    n, nbytes = args.world_size, int(args.mb * 2**20)
    net = Network.flat(n)
    if not args.exact_only:
        start, cpu = time.perf_counter(), _cpu_seconds()
        result, sim = time_collective(net, "all_reduce", nbytes, "ring")
        wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"timing only: ring all_reduce of {human_size(nbytes)} on {n} ranks: {result.seconds * 1e3:.3f} ms "
            f"simulated, {sim.messages} messages, {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {rss:.0f} MiB"
        )
    if args.exact_numel:
        start, cpu = time.perf_counter(), _cpu_seconds()
        simulation = Simulation(net)
        launch(_ring_rank, n, args.exact_numel, simulation=simulation)
        wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"exact: ring all_reduce of {args.exact_numel} float32 per rank on {n} ranks through "
            f"collectives.launch, results checked: {simulation.now * 1e3:.3f} ms simulated, {simulation.messages} "
            f"messages, {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {rss:.0f} MiB"
        )


def intra_from_shm(shm: Link) -> Link:
    """The intra-host link of a simulation standing for a host whose ranks share memory.

    The measured runs' hierarchical phases inside a host run over shared memory
    (``shm_algorithms``), whose fitted ``shm`` link is one synchronisation (``α``) and seconds
    per byte *copied* (``β``). The simulation moves those phases as messages; a message through
    shared regions is two copies (into the sender's half, out of it), so it is charged
    ``α + 2Sβ``.
    """
    return Link(shm.alpha, 2 * shm.beta)


_TC_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
             "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8}


def tbf_burst(spec: str | None) -> float:
    """The bucket depth in bytes of a ``tbf ... burst SIZE ...`` qdisc spec (tc's units: ``kb`` and
    ``k`` are 1,024 bytes, ``kbit`` 1,024 bits); 0 for any other spec or none."""
    words = (spec or "").split()
    if not words or words[0] != "tbf":
        return 0.0
    for key in ("burst", "buffer", "maxburst"):  # tc's synonyms
        if key in words[:-1]:
            value = words[words.index(key) + 1].split("/")[0].lower()
            number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
            unit = value[len(number):] or "b"
            if unit not in _TC_UNITS:
                raise ValueError(f"tbf spec {spec!r}: unknown size unit {unit!r}")
            return float(number) * _TC_UNITS[unit]
    return 0.0


def validate(args: argparse.Namespace) -> None:
    """Simulate every row of ``collectives.bench --hosts H --model --json`` runs with the links
    each fitted, on ``H`` hosts, and print measured vs simulated time; given several runs, also
    the median and range of simulated / measured per row over them (measured times on shared
    cores spread with the load: take several runs).

    The simulation runs what the measured run ran: the run's :class:`Tuning` (so the engine
    picks the same algorithms and segments), between hosts its ``net`` link, inside a host
    :func:`intra_from_shm` of its ``shm`` link where it has one (else ``local``; ``--intra
    local`` forces it), and its ``reduce`` link's β for every reduction
    (``Simulation(reduce_beta=...)``; ``--free-reductions``: none): each fitted from the fastest
    repetitions, or with ``--fits median`` from the medians (:func:`collectives.costmodel.measure`).
    The emulated hosts' three terms beyond α/β (``Network``): the shaped link's token bucket
    (``nic_burst``, from the run's ``tbf`` spec; ``--burst`` sets it, ``--no-burst`` drops it);
    one CPU for all hosts (they are namespaces of one machine: ``cores`` = the run's ``cpus``, or
    this machine's for a run that did not record them; ``--cores`` sets it) on which every reduction and every receive between hosts (the run's
    ``recv_cpu`` fit) is CPU work, sharing the cores with as many threads of other work as the
    row's load average (``cpu_background``; ``--no-background``: none; ``--no-cpu`` drops the CPU);
    and, with the fastest fits, the wake-up: a receive its rank waits for completes the expected wake-up after its
    arrival (``wake_latency``: the mean one-way latency's α less the fastest's; ``--no-wake``: at once)."""
    ratios: dict[tuple[str, int, int], list[float]] = {}
    loads: list[float] = []
    for path in args.bench:
        for key, ratio in _validate_run(path, args):
            ratios.setdefault(key, []).append(ratio)
        with open(path) as f:
            loads += [row["load_average"] for row in json.load(f) if "load_average" in row]
    if len(args.bench) > 1:
        print(f"# {len(args.bench)} runs: simulated / measured, median (min-max)"
              + (f"; load average (1 min) at their rows {min(loads):.1f}-{max(loads):.1f}" if loads else ""))
        for (op, n, nbytes), values in ratios.items():
            print(f"{op:<12}{n:>3}{args.hosts:>6}{human_size(nbytes):>8}  {statistics.median(values):.2f} "
                  f"({min(values):.2f}-{max(values):.2f} of {len(values)})")


def _validate_run(path: str, args: argparse.Namespace) -> list[tuple[tuple[str, int, int], float]]:
    """One run of :func:`validate`: its rows printed; ``((op, n, bytes), simulated / measured)`` per row."""
    with open(path) as f:
        rows = json.load(f)
    fitted = links_from_bench(path)
    fits = args.fits
    if fits == "median" and "net_median" not in fitted:
        raise SystemExit(f"{path}: no median fits (net_median_alpha...): a run from before they were recorded")
    suffix = "_median" if fits == "median" else ""
    links = {kind: fitted[kind + suffix] for kind in ("net", "local", "shm", "reduce", "recv_cpu")
             if kind + suffix in fitted}
    if args.intra == "shm" and "shm" in links:
        intra = intra_from_shm(links["shm"])
    else:
        intra = links.get("local", DEFAULT_INTRA)
    reduce_beta = links["reduce"].beta if "reduce" in links and not args.free_reductions else 0.0
    burst = 0.0 if args.no_burst else args.burst if args.burst is not None else tbf_burst(rows[0].get("link"))
    cores = 0 if args.no_cpu else args.cores or rows[0].get("cpus") or len(os.sched_getaffinity(0))
    recv_cpu = links["recv_cpu"].beta if "recv_cpu" in links and cores else 0.0
    wake = 0.0
    if fits == "fastest" and not args.no_wake and "net_mean" in fitted:  # the expected message's extra: a wake-up
        wake = max(0.0, fitted["net_mean"].alpha - fitted["net"].alpha)
    print(f"# {path} ({fits} fits): inter {links.get('net', DEFAULT_INTER)}; intra {intra}; "
          f"reductions {reduce_beta * 1e9:.3f} ns/B; NIC burst {burst:.0f} B; wake-up {wake * 1e6:.0f} us; "
          + (f"{cores} cores for all hosts, receive CPU {recv_cpu * 1e9:.3f} ns/B" if cores else "no CPU model"))
    loads = [row["load_average"] for row in rows if "load_average" in row]
    if loads:  # the measured times drift with the machine's load (docs/DESIGN.md §11)
        print(f"# load average (1 min) at the measured rows: {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'op':<12}{'n':>3}{'hosts':>6}{'size':>8}  {'algorithm':<19}{'measured us':>13}{'simulated us':>14}{'sim/meas':>10}")
    found = []
    for row in rows:
        n = row["world_size"]
        background = row.get("load_average", 0.0) if cores and not args.no_background else 0.0
        net = Network(args.hosts, n // args.hosts, intra, links.get("net", DEFAULT_INTER), nic_burst=burst,
                      cores=cores, hosts_per_cpu=args.hosts, recv_cpu=recv_cpu, cpu_background=background,
                      wake_latency=wake)
        algorithm = row["algorithm"] if row["algorithm"] in ALGORITHMS.get(row["op"], ()) else "auto"
        tuning = Tuning(**row["tuning"]) if "tuning" in row else Tuning()  # the bench's group default
        result, _ = time_collective(net, row["op"], row["bytes"], algorithm, exact=True, tuning=tuning,
                                    reduce_beta=reduce_beta)
        ratio = result.seconds * 1e6 / row["ours_us"]
        found.append(((row["op"], n, row["bytes"]), ratio))
        print(
            f"{row['op']:<12}{n:>3}{args.hosts:>6}{human_size(row['bytes']):>8}  {algorithm:<19}{row['ours_us']:>13.0f}"
            f"{result.seconds * 1e6:>14.0f}{ratio:>10.2f}"
        )
    return found


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m collectives.sim", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("study", help="sweep ops, sizes, algorithms and world sizes (the default)")
    _network_arguments(s)
    s.add_argument("--world-sizes", default="16,128", help="comma-separated n (default 16,128)")
    s.add_argument("--ops", default="all_reduce", help=f"comma-separated, of {','.join(ALGORITHMS)}")
    s.add_argument("--sizes", default="1K,16K,256K,4M,64M", help="comma-separated bytes (default 1K..64M)")
    s.add_argument("--algorithms", help="only these (default: every one the op has)")
    s.add_argument("--json", help="write the rows to this file")
    s.add_argument("--plot", help="write a PNG: time vs size and time vs n per algorithm")
    s.add_argument("--trace", help="write a Chrome trace of one collective (every virtual rank a row)")
    s.add_argument("--trace-ranks", type=int, default=16, help="ranks of the traced collective (default 16)")
    s.add_argument("--trace-size", default="1M", help="bytes of the traced collective (default 1M)")
    s.add_argument("--trace-algorithm", default="ring", help="algorithm of the traced collective (default ring)")
    s.set_defaults(fn=study)
    d = sub.add_parser("ddp", help="how much of a DDP step's all-reduce hides behind backward")
    _network_arguments(d)
    d.add_argument("--world-sizes", default="16,128", help="comma-separated n (default 16,128)")
    d.add_argument("--model-mb", type=float, default=100.0, help="gradient bytes, MiB (default 100)")
    d.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap, MiB (default 25)")
    d.add_argument("--backward-ms", type=float, default=60.0, help="backward compute time, ms (default 60)")
    d.add_argument("--straggler", type=int, help="this rank computes --straggler-factor times slower")
    d.add_argument("--straggler-factor", type=float, default=1.5)
    d.set_defaults(fn=ddp)
    b = sub.add_parser("bench", help="how fast the simulator runs a large ring all-reduce")
    b.add_argument("--world-size", type=int, default=1024)
    b.add_argument("--mb", type=float, default=64.0, help="MiB all-reduced (default 64)")
    b.add_argument("--exact-numel", type=int, default=0, help="also run exact with this many floats per rank")
    b.add_argument("--exact-only", action="store_true",
                   help="skip the timing-only run (the exact run's own peak memory)")
    b.set_defaults(fn=bench)
    v = sub.add_parser("validate", help="simulated vs measured times of a collectives.bench --hosts --model run")
    v.add_argument("bench", nargs="+",
                   help="the JSON of `collectives.bench --hosts H --model --json FILE` (several: their medians too)")
    v.add_argument("--hosts", type=int, required=True, help="the --hosts of that run")
    v.add_argument("--intra", choices=("shm", "local"), default="shm",
                   help="intra-host link: from the shared-memory fit (default, what the run's hierarchical phases use) "
                        "or the transport's loopback fit")
    v.add_argument("--free-reductions", action="store_true", help="reductions take no virtual time")
    v.add_argument("--fits", choices=("fastest", "median"), default="fastest",
                   help="links fitted from the fastest of each size's repetitions (default: what the links can do) "
                        "or from the medians (the typical message on the loaded machine: docs/DESIGN.md §11 "
                        "measured both)")
    v.add_argument("--burst", type=parse_size, help="NIC token bucket in bytes (default: the run's tbf burst)")
    v.add_argument("--no-burst", action="store_true", help="no token bucket")
    v.add_argument("--cores", type=int, help="cores shared by all hosts' CPU work (default: the run's cpus)")
    v.add_argument("--no-background", action="store_true",
                   help="the CPU's cores are the ranks' alone (default: shared with as many threads of other work "
                        "as the row's load average)")
    v.add_argument("--no-wake", action="store_true", help="no wake-up latency")
    v.add_argument("--no-cpu", action="store_true",
                   help="no CPU model: reductions last their time on a core of their own, receives cost no CPU")
    v.set_defaults(fn=validate)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "study")
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
