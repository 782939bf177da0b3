"""A userspace link emulator (netem's ``delay`` and ``rate``) for kernels without ``sch_netem``.

:class:`~collectives.testing.hosts.HostNet` shapes each emulated host's link with ``tc``; where the
kernel has no netem qdisc (``tc`` answers "Specified qdisc kind is unknown"), it gives each host a
TUN device as ``eth0`` instead of a veth, and this process forwards IPv4 packets between them:

    host 0 eth0 (TUN) --fd--> forwarder --fd--> host 1 eth0 (TUN)

The forwarder runs in the network namespace that would hold the bridge, opens one TUN device per
host (``IFF_TUN | IFF_NO_PI``: whole IP packets, no header), prints ``ready``, and the parent moves
each device into its host's namespace (a TUN device keeps working with the fd held across
namespaces). Each packet read from host ``s`` goes to the host whose address is its destination
(bytes 16..20 of the IPv4 header; anything else is dropped), like netem on ``s``'s ``eth0``:

* ``rate R``: host ``s``'s link sends one packet at a time at ``R`` bits/s, so a packet of ``L``
  bytes departs at ``max(now, previous departure) + 8L/R`` (serialisation, store and forward);
* ``delay D``: it arrives ``D`` after its departure (one way: a ping-pong between two hosts takes
  ``2D`` plus the serialisation of both messages);
* ``limit N``: at most ``N`` packets wait on one link (netem's default 1000); more are dropped and
  TCP retransmits them, so memory stays bounded.

The devices get a large MTU (65000 by default): TCP then sends 64 KB segments and the Python loop
handles a few thousand packets per second at 1 Gbit/s instead of ~80 000 at 1500 bytes. The price
is granularity: a 64 KB segment takes 0.52 ms to serialise at 1 Gbit/s, and it arrives whole.

Cost: the forwarder is one Python process on the same cores as the ranks; it sleeps in ``select``
when idle and costs tens of microseconds of CPU per packet when busy (with the kernel's copies and
the receiving host's TCP work, which runs in its ``write``). On the 2-core development VM, loaded,
it forwarded 370-700 MB/s of bulk TCP with no rate set and used about 0.2 of a core to carry a
saturated 1 Gbit/s link (docs/multinode.md), so 1 Gbit/s (125 MB/s) is well within reach. It runs
at real-time priority (``SCHED_FIFO`` 1, where allowed) so that it preempts busy ranks when a
packet is due, as the kernel's softirq would: without that, a loaded machine delays deliveries by
whole scheduler time slices (round trips of 1 ms links with a 30 ms tail).

It runs as a standalone script (``python linkemu.py``, not ``-m``) so it imports only the standard
library: importing the ``collectives`` package would load torch (seconds, hundreds of MB).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import fcntl
import os
import re
import select
import signal
import socket
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_BYTES = 1 << 16  # the largest IPv4 packet
BATCH = 64  # packets read from one device per wake-up, so one busy host cannot starve the others

_TIME_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
               "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "": 1e-6}  # tc: a bare number is microseconds
_RATE_UNITS = {"": 1, "bit": 1, "bps": 8}  # tc: a bare number is bits/s; "bps" is bytes/s
for _prefix, _si, _iec in (("k", 1e3, 2**10), ("m", 1e6, 2**20), ("g", 1e9, 2**30), ("t", 1e12, 2**40)):
    _RATE_UNITS.update({f"{_prefix}bit": _si, f"{_prefix}bps": 8 * _si, f"{_prefix}ibit": _iec, f"{_prefix}ibps": 8 * _iec})
SUPPORTED = "netem [delay TIME] [rate RATE] [limit PACKETS] (TIME like 1ms, 500us, 0.1s; RATE like 1gbit, 100mbit)"


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """What the emulator does to each host's outgoing traffic (netem's meaning of the same words)."""

    delay: float = 0.0  # seconds from departure to arrival
    rate: float | None = None  # bits per second; None sends at once
    limit: int = 1000  # packets waiting on one link

    @classmethod
    def parse(cls, spec: str) -> "LinkSpec":
        """Parse ``"netem delay 1ms rate 1gbit"`` (the leading ``netem`` is optional); ValueError otherwise."""
        words = spec.split()
        if words[:1] == ["netem"]:
            words = words[1:]
        values: dict[str, float | int] = {}
        for i in range(0, len(words), 2):
            key = words[i]
            if key in values or key not in ("delay", "rate", "limit"):
                raise ValueError(f"link {spec!r}: {key!r} is {'repeated' if key in values else 'not supported'}; "
                                 f"the userspace emulator supports {SUPPORTED}")
            if i + 1 == len(words):
                raise ValueError(f"link {spec!r}: {key!r} needs a value; the userspace emulator supports {SUPPORTED}")
            text = words[i + 1]
            m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", text.lower())
            units = {"delay": _TIME_UNITS, "rate": _RATE_UNITS, "limit": {"": 1}}[key]
            if not m or m.group(2) not in units or (key == "rate" and float(m.group(1)) == 0):
                raise ValueError(f"link {spec!r}: bad {key} {text!r}; the userspace emulator supports {SUPPORTED}")
            values[key] = float(m.group(1)) * units[m.group(2)]
        if "limit" in values:
            if values["limit"] != int(values["limit"]) or values["limit"] < 1:
                raise ValueError(f"link {spec!r}: limit must be a whole number of packets >= 1")
            values["limit"] = int(values["limit"])
        return cls(**values)

    def argv(self) -> list[str]:
        """This spec as the forwarder's command-line options."""
        return ["--delay", repr(self.delay), "--rate", repr(self.rate or 0.0), "--limit", str(self.limit)]


def open_tun(name: str) -> int:
    """A non-blocking fd of a new TUN device ``name`` (gone when the fd closes)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(fds: list[int], addresses: list[str], spec: LinkSpec) -> None:
    """Forward packets between the TUN fds (host ``k`` has ``fds[k]`` and ``addresses[k]``) forever."""
    route = {socket.inet_aton(a): k for k, a in enumerate(addresses)}
    host_of = {fd: k for k, fd in enumerate(fds)}
    links = [collections.deque() for _ in fds]  # per source host: (arrival time, destination fd, packet)
    free_at = [0.0] * len(fds)  # when each source link has finished sending its last packet
    seconds_per_byte = 8.0 / spec.rate if spec.rate else 0.0
    while True:
        heads = [q[0][0] for q in links if q]
        wait = max(0.0, min(heads) - time.monotonic()) if heads else None
        readable = select.select(fds, [], [], wait)[0]
        now = time.monotonic()
        for fd in readable:
            src = host_of[fd]
            queue = links[src]
            for _ in range(BATCH):
                try:
                    packet = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                dst = route.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
                if dst is None or len(queue) >= spec.limit:
                    continue  # not IPv4, nobody's address, or the link's queue is full: dropped
                departure = max(now, free_at[src]) + len(packet) * seconds_per_byte
                free_at[src] = departure
                queue.append((departure + spec.delay, fds[dst], packet))
        now = time.monotonic()
        for queue in links:
            while queue and queue[0][0] <= now:
                _, out, packet = queue.popleft()
                try:
                    os.write(out, packet)
                except OSError:  # the destination's link is down (EIO) or its host is being removed
                    pass


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG (as collectives.launch does; not imported from there to keep torch out)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="forward IPv4 between TUN devices with netem-like delay and rate")
    p.add_argument("--names", required=True, help="comma list of TUN device names, one per host")
    p.add_argument("--addresses", required=True, help="comma list of the hosts' IPv4 addresses, same order")
    p.add_argument("--delay", type=float, default=0.0, help="seconds")
    p.add_argument("--rate", type=float, default=0.0, help="bits per second, 0: unlimited")
    p.add_argument("--limit", type=int, default=1000, help="packets waiting per link")
    args = p.parse_args(argv)
    _die_with_parent()
    try:  # preempt the ranks when a packet is due, as the kernel's softirq would (RT throttling still applies)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:  # without CAP_SYS_NICE: ordinary priority, so deliveries may be late on a busy host
        pass
    fds = [open_tun(name) for name in args.names.split(",")]
    print("ready", flush=True)
    forward(fds, args.addresses.split(","), LinkSpec(args.delay, args.rate or None, args.limit))


if __name__ == "__main__":
    main()
