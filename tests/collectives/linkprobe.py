"""TCP probes of a HostNet link: round-trip times and bulk throughput between host 0 and host 1.

    python tests/collectives/linkprobe.py --link "netem delay 1ms rate 1gbit" --bytes 200000000

(as root, from the repository root). The halves run inside the hosts as
``python -I linkprobe.py serve|ping|bulk ADDRESS ...`` (standard library only, so they start fast);
each prints one JSON line. Every socket has a timeout, so a dead link fails instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import subprocess
import sys
import time

PORT = 5201
TIMEOUT_S = 60.0
CHUNK = 1 << 20


def serve(address: str) -> None:
    """Answer connections forever: ``p`` echoes each byte back, ``b`` counts bytes until EOF and replies the count."""
    server = socket.create_server((address, PORT))
    print(json.dumps({"listening": address}), flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind, count = conn.recv(1), 0
            while data := conn.recv(CHUNK):
                if kind == b"p":
                    conn.sendall(data)
                count += len(data)
            if kind == b"b":
                conn.sendall(str(count).encode())


def _connect(address: str, kind: bytes, timeout: float) -> socket.socket:
    conn = socket.create_connection((address, PORT), timeout=timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(kind)
    return conn


def ping(address: str, count: int, timeout: float = TIMEOUT_S) -> dict:
    """``count`` one-byte round trips, after one to warm up."""
    rtts = []
    with _connect(address, b"p", timeout) as conn:
        for _ in range(count + 1):
            start = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise ConnectionError("echo server closed the connection")
            rtts.append(time.perf_counter() - start)
    return {"rtts": rtts[1:]}


def bulk(address: str, nbytes: int, timeout: float = TIMEOUT_S) -> dict:
    """Send ``nbytes``; the time until the server confirms it has them all."""
    buf = bytes(CHUNK)
    with _connect(address, b"b", timeout) as conn:
        start = time.perf_counter()
        for offset in range(0, nbytes, CHUNK):
            conn.sendall(buf[: min(CHUNK, nbytes - offset)])
        conn.shutdown(socket.SHUT_WR)
        received = int(conn.recv(64))
        seconds = time.perf_counter() - start
    return {"bytes": received, "seconds": seconds, "MB/s": received / seconds / 1e6}


def measure(net, pings: int = 50, nbytes: int = 0, timeout: float = TIMEOUT_S) -> dict:
    """Ping (and with ``nbytes`` > 0 bulk-send) from host 0 to host 1 of the running HostNet ``net``.

    ``timeout`` bounds every socket operation of the clients; RuntimeError if one fails.
    """
    address = net.address(1)
    server = net.popen(1, [sys.executable, "-I", __file__, "serve", address], stdout=subprocess.PIPE)
    try:
        # it prints one line once it listens; EOF if it died
        if not (select.select([server.stdout], [], [], TIMEOUT_S)[0] and server.stdout.readline()):
            raise RuntimeError(f"probe server in host 1 did not start (exit code {server.poll()})")
        result = {}
        for mode, arg in (("ping", pings), ("bulk", nbytes)):
            if arg:
                argv = [sys.executable, "-I", __file__, mode, address, str(arg), str(timeout)]
                client = net.popen(0, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                try:
                    out, _ = client.communicate(timeout=2 * timeout + 10)
                finally:  # also when it timed out: no client outlives its measurement
                    if client.poll() is None:
                        client.kill()
                    client.wait()
                    client.stdout.close()
                if client.returncode:
                    raise RuntimeError(f"probe {mode} from host 0 failed with code {client.returncode}")
                result.update(json.loads(out))
        return result
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("serve", "ping", "bulk"), help="one half, inside a host")
    p.add_argument("address", nargs="?")
    p.add_argument("arg", nargs="?", type=int, help="ping: round trips; bulk: bytes")
    p.add_argument("timeout", nargs="?", type=float, default=TIMEOUT_S, help="seconds for each socket operation")
    p.add_argument("--link", help="the HostNet link, e.g. 'netem delay 1ms rate 1gbit'")
    p.add_argument("--emulator", default="auto", choices=("auto", "tc", "user"))
    p.add_argument("--pings", type=int, default=50)
    p.add_argument("--bytes", type=int, default=100_000_000)
    args = p.parse_args()
    if args.mode == "serve":
        serve(args.address)
    elif args.mode:
        print(json.dumps((ping if args.mode == "ping" else bulk)(args.address, args.arg, args.timeout)), flush=True)
    else:
        import statistics

        from collectives.testing.hosts import HostNet

        with HostNet(hosts=2, link=args.link, emulator=args.emulator) as net:
            got = measure(net, args.pings, args.bytes)
        rtts = sorted(got["rtts"])
        print(f"link {args.link!r}: round trip median {statistics.median(rtts) * 1e3:.3f} ms "
              f"(min {rtts[0] * 1e3:.3f}); bulk {got['bytes'] / 1e6:.0f} MB in {got['seconds']:.2f} s "
              f"= {got['MB/s']:.0f} MB/s")


if __name__ == "__main__":
    main()
