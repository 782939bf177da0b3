"""Is an emulated link full duplex? One-way against two-way transfers between namespace hosts.

    python scripts/duplex_probe.py --link "tbf rate 1gbit burst 256kb latency 50ms" --hosts 4 --mb 4

Issue 48's validation found recursive doubling's partner exchanges (4 hosts of 1 rank, 4 MiB)
at about 2/3 of the rate the simulator gives them, while one-way transfers matched. This
separates the suspects on :class:`~collectives.testing.hosts.HostNet` hosts (needs root):

1. **TCP alone** (hosts 0 and 1, plain sockets, one connection): ``S`` bytes one way, against
   ``S`` bytes each way at once (ACKs then ride behind data in each host's shaped queue), on one
   connection and on two; with ``--gap`` seconds idle between repetitions (TCP's restart after
   idle).
2. **Our transport** (backend ``p2p``, every host one rank): one way; one pair exchanging alone;
   every pair at once (a recursive-doubling round); two rounds with the same partner and with
   recursive doubling's partners; recursive doubling itself, the full ``all_reduce`` call, and
   torch's gloo all-reduce for comparison.

Each line: the median over ``--iters`` repetitions (each after a barrier) of the slowest rank,
and the CPU seconds the ranks spent in it, summed (compare with ``S·β`` of the link a
``collectives.bench --model`` run fits). The machine's load average is printed before and
after: on shared cores it decides much of the spread.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import torch
import torch.distributed as tdist

PORT = 31000


def _recv_exact(sock: socket.socket, n: int) -> None:
    view, got = memoryview(bytearray(n)), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError("peer closed")
        got += k


def tcp_side(role: str, address: str, nbytes: int, mode: str, conns: int, iters: int, gap: float) -> None:
    """One side of the plain-TCP probe (run inside a host); the client prints the median."""
    if role == "server":
        listener = socket.create_server(("0.0.0.0", PORT), reuse_port=True)
        socks = [listener.accept()[0] for _ in range(conns)]
    else:
        socks = []
        for _ in range(conns):
            for _ in range(200):
                try:
                    socks.append(socket.create_connection((address, PORT)))
                    break
                except OSError:
                    time.sleep(0.05)
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, inc = (socks[0], socks[-1]) if role == "client" else (socks[-1], socks[0])
    data, times = b"x" * nbytes, []
    for i in range(iters + 1):
        if role == "client":  # line up both sides
            socks[0].sendall(b"g")
            _recv_exact(socks[0], 1)
        else:
            _recv_exact(socks[0], 1)
            socks[0].sendall(b"g")
        start = time.perf_counter()
        if mode == "one-way":
            if role == "client":
                out.sendall(data)
                _recv_exact(out, 1)
            else:
                _recv_exact(inc, nbytes)
                inc.sendall(b"k")
        else:
            sender = threading.Thread(target=out.sendall, args=(data,))
            sender.start()
            _recv_exact(inc, nbytes)
            sender.join()
        if i:
            times.append(time.perf_counter() - start)
        time.sleep(gap)
    if role == "client":
        print(f"  TCP {mode:8s} {conns} connection(s), gap {gap:g} s: {statistics.median(times) * 1e3:7.1f} ms "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})", flush=True)


def transport_rank(rank: int, n: int, nbytes: int, iters: int) -> dict[str, tuple[float, float]]:
    """One rank of the transport probe: {case: (median seconds of the slowest rank, CPU s summed)}."""
    import collectives
    from collectives.buffers import Workspace
    from collectives.group import get_default_group
    from collectives.ops import ReduceOp
    from collectives.transport.base import wait_all
    from collectives.tree import recursive_doubling_all_reduce

    torch.set_num_threads(1)
    buf, inc = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    collectives.all_reduce(torch.zeros(1))
    transport = get_default_group().engine(torch.device("cpu"), "probe").transport
    workspace, reference = Workspace(), tdist.new_group(backend="gloo")

    def exchange(partner: int | None) -> None:
        if partner is not None and partner < n:
            with transport.operation("exchange"):
                wait_all(transport.post(sends=[(buf, partner)], recvs=[(inc, partner)]))

    def one_way() -> None:
        with transport.operation("one-way"):
            if rank == 0:
                transport.send(buf, 1)
            elif rank == 1:
                transport.recv(inc, 0)

    def doubling() -> None:
        with transport.operation("recursive doubling"):
            recursive_doubling_all_reduce(transport, buf, ReduceOp.SUM, workspace)

    cases = {
        "one way, rank 0 -> 1": one_way,
        "exchange, ranks 0 and 1 alone": lambda: exchange(rank ^ 1 if rank < 2 else None),
        "exchange, every pair at once": lambda: exchange(rank ^ 1),
        "two rounds, same partner": lambda: (exchange(rank ^ 1), exchange(rank ^ 1)),
        "two rounds, doubling's partners": lambda: (exchange(rank ^ 1), exchange(rank ^ 2)),
        "recursive doubling all-reduce": doubling,
        "collectives.all_reduce": lambda: collectives.all_reduce(buf),
        "torch (gloo) all_reduce": lambda: tdist.all_reduce(buf, group=reference),
    }
    found = {}
    for name, case in cases.items():
        walls, cpus = [], []
        for i in range(iters + 1):
            buf.fill_(1.0)
            tdist.barrier()
            cpu, start = time.process_time(), time.perf_counter()
            case()
            if i:
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
        wall, cpu = torch.tensor([statistics.median(walls)]), torch.tensor([statistics.median(cpus)])
        tdist.all_reduce(wall, op=tdist.ReduceOp.MAX)
        tdist.all_reduce(cpu)
        found[name] = (wall.item(), cpu.item())
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="tbf rate 1gbit burst 256kb latency 50ms",
                   help="tc qdisc spec of every host's link")
    p.add_argument("--hosts", type=int, default=4, help="hosts of one rank for the transport probe (power of 2)")
    p.add_argument("--mb", type=float, default=4.0, help="MiB per transfer")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--gap", type=float, default=0.5, help="seconds idle between TCP repetitions in the idle case")
    p.add_argument("--tcp-side", nargs=6, help=argparse.SUPPRESS)  # role address bytes mode conns gap (internal)
    args = p.parse_args(argv)
    if args.tcp_side:
        role, address, nbytes, mode, conns, gap = args.tcp_side
        tcp_side(role, address, int(nbytes), mode, int(conns), args.iters, float(gap))
        return
    from collectives.testing.hosts import HostNet

    nbytes = int(args.mb * 2**20)
    print(f"link {args.link!r}, {nbytes} bytes; load average before: {os.getloadavg()[0]:.2f}")
    with HostNet(2, args.link) as net:
        for mode, conns, gap in (("one-way", 1, 0.0), ("two-way", 1, 0.0), ("two-way", 2, 0.0),
                                 ("one-way", 1, args.gap), ("two-way", 1, args.gap)):
            argv = [sys.executable, os.path.abspath(__file__), "--iters", str(args.iters), "--tcp-side"]
            side = [net.address(1), str(nbytes), mode, str(conns), str(gap)]
            server = net.popen(1, argv + ["server"] + side)
            client = net.popen(0, argv + ["client"] + side)
            client.wait(300)
            server.wait(300)
    with HostNet(args.hosts, args.link) as net:
        found = net.launch(transport_rank, 1, nbytes, args.iters, backend="p2p", join_timeout=900)[0]
    for name, (wall, cpu) in found.items():
        print(f"  {name:34s} {wall * 1e3:7.1f} ms   CPU of all ranks {cpu * 1e3:6.1f} ms")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
