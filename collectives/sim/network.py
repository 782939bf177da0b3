"""The simulated network: hosts of ranks, NICs, a switch tier, and the links they share.

A :class:`Network` is the :class:`~collectives.transport.sim.Fabric` of a simulation. Rank ``r``
runs on host ``r // ranks_per_host`` (consecutive ranks share a host, as under torchrun). A
message takes one of two kinds of path:

* **inside a host** (``intra`` link, α/β of loopback or shared memory, or NVLink): from the
  sender's *out port* to the receiver's *in port*. A rank sends one message at a time at full
  rate and receives one at a time, each direction on its own.
* **between hosts** (``inter`` link, α/β of one NIC): out of the sender's NIC (local rank
  ``j`` uses NIC ``j % nics_per_host``) into the receiver's NIC. Hosts hang off leaf switches
  of ``hosts_per_switch`` hosts (0: one switch for all, with full bisection); a message between
  leaves also crosses its leaf's *uplink* and the other leaf's *downlink*, each of bandwidth
  ``hosts_per_switch * nics_per_host * NIC bandwidth / oversubscription``.

Three optional terms model what an α/β link does not (all off by default, so a message alone on
its path still costs exactly the closed form):

* **a token bucket on each NIC's egress** (``nic_burst`` bytes: tc ``tbf``'s ``burst``, a cloud
  VM's burst allowance): after idling, a NIC sends up to ``nic_burst`` bytes at once (at the
  speed of what lies behind the shaper, taken as instant), refilling at the NIC's rate while it
  is idle. The first message posted on an idle NIC draws the bucket; the bytes it draws cross the
  whole path at once (so a receiver's ingress is not charged for them: tbf shapes egress only).
* **the hosts' CPUs** (``cores``): the CPU work of the ranks (``recv_cpu`` seconds per byte
  received from another host: the kernel's and the transport's copies out of the socket, charged
  when the receiving rank waits for the message, after its arrival; and the reductions'
  ``Simulation(reduce_beta)``) runs on their CPU's cores, each rank on at most one core, shared
  max-min fairly by the ranks computing at once (processor sharing, the same fluid as the
  links). ``hosts_per_cpu`` consecutive hosts share one CPU: emulated hosts of one machine
  (network namespaces) share its cores. ``cpu_background`` threads of other work stay runnable
  on every CPU and take their fair shares of its cores too (a loaded machine: its load
  average), so a rank computing alone there gets ``cores / (1 + background)`` of a core when
  that is less than one. Without ``cores`` every rank has a core of its own.
* **a wake-up latency** (``wake_latency``): a receive posted before its message arrives
  completes that much after the arrival (its rank's thread is woken on busy cores and waits
  for one); a message that was there first, and a send, cost nothing more.

The messages in progress share every link max-min fairly (:mod:`collectives.transport.sim`:
a fluid model of TCP's sharing): a message's last byte leaves its path when it has had its
share of each link for long enough, and it arrives ``α`` later. Alone on its path, a message
costs exactly the α/β formula of ``costmodel`` (``β`` of the path's slowest link); two
messages posted at once over one NIC both end at ``2Sβ``.

Limits of the model (what it does not see): α is pure latency (a rank can have many messages in
flight at once, each paying α without holding a link); the sharing is a fluid (no packets,
switch buffers, head-of-line blocking, slow start, congestion control or losses; exactly
max-min fair, where real flows with different round-trip times share unevenly); reductions
cost time only with ``Simulation(reduce_beta=...)``, copies only with ``recv_cpu`` (and then a
receive's CPU work follows its arrival: a rank that reads the socket while the bytes come in
overlaps some of it); other processes on the cores are not modelled; no adaptive routing, no PCIe
or memory-bandwidth limits beyond the links above.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ..costmodel import LINK_KINDS, Link
from ..topology import Layout

#: inside a host: a few µs per message, ~20 GB/s (a shared-memory copy).
DEFAULT_INTRA = Link(2e-6, 1 / 20e9)
#: between hosts: one 100 Gb/s NIC with ~5 µs of latency.
DEFAULT_INTER = Link(5e-6, 1 / 12.5e9)


@dataclasses.dataclass(frozen=True)
class Network:
    """``hosts`` × ``ranks_per_host`` ranks on a network of links (module docstring).

    Attributes:
        hosts: number of hosts.
        ranks_per_host: ranks on each host.
        intra: the link between two ranks of one host.
        inter: one NIC (the link between two hosts, through the switch).
        nics_per_host: NICs per host; local rank ``j`` uses NIC ``j % nics_per_host``.
        hosts_per_switch: hosts per leaf switch; 0: one switch for all hosts (no uplinks).
        oversubscription: a leaf's host-facing bandwidth over its uplink bandwidth (1: full bisection).
        nic_burst: bytes a NIC's token bucket lets out at once after idling (0: no bucket).
        cores: cores of one CPU, shared by its ranks' CPU work (0: every rank has a core of its own).
        hosts_per_cpu: consecutive hosts sharing one CPU (emulated hosts of one machine).
        recv_cpu: CPU seconds per byte a rank spends receiving a message from another host.
        cpu_background: threads of other work always runnable on each CPU (with ``cores``).
        wake_latency: seconds a rank waiting for a message takes to resume once it has arrived.
    """

    hosts: int
    ranks_per_host: int = 1
    intra: Link = DEFAULT_INTRA
    inter: Link = DEFAULT_INTER
    nics_per_host: int = 1
    hosts_per_switch: int = 0
    oversubscription: float = 1.0
    nic_burst: float = 0.0
    cores: int = 0
    hosts_per_cpu: int = 1
    recv_cpu: float = 0.0
    cpu_background: float = 0.0
    wake_latency: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hosts", "ranks_per_host", "nics_per_host", "hosts_per_cpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Network: {name} must be a positive int, got {value!r}")
        if not isinstance(self.hosts_per_switch, int) or self.hosts_per_switch < 0:
            raise ValueError(f"Network: hosts_per_switch must be an int >= 0, got {self.hosts_per_switch!r}")
        if not self.oversubscription >= 1.0 or math.isinf(self.oversubscription):
            raise ValueError(f"Network: oversubscription must be a finite number >= 1, got {self.oversubscription!r}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 0:
            raise ValueError(f"Network: cores must be an int >= 0, got {self.cores!r}")
        for name in ("nic_burst", "recv_cpu", "cpu_background", "wake_latency"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"Network: {name} must be a finite number >= 0, got {value!r}")
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if not (link.alpha >= 0 and link.beta >= 0):
                raise ValueError(f"Network: {name} link needs alpha, beta >= 0, got {link}")
        # derived constants, read on every message
        k = self.hosts_per_switch
        up_beta = self.inter.beta * self.oversubscription / (k * self.nics_per_host) if k else 0.0
        object.__setattr__(self, "_up_beta", up_beta)
        object.__setattr__(self, "_nic_base", 2 * self.world_size)
        object.__setattr__(self, "_leaf_base", 2 * self.world_size + 2 * self.hosts * self.nics_per_host)
        object.__setattr__(self, "_cpu_base", self._leaf_base + 2 * self.leaves)  # type: ignore[attr-defined]

    @classmethod
    def flat(cls, world_size: int, link: Link = DEFAULT_INTER) -> "Network":
        """``world_size`` hosts of one rank on one switch: every message crosses ``link``."""
        return cls(world_size, 1, link, link)

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def leaves(self) -> int:
        """Number of leaf switches."""
        return -(-self.hosts // self.hosts_per_switch) if self.hosts_per_switch else 1

    @property
    def cpus(self) -> int:
        """Number of CPUs (each ``hosts_per_cpu`` hosts share one)."""
        return -(-self.hosts // self.hosts_per_cpu)

    @property
    def link_count(self) -> int:
        """The links: ranks' intra-host ports, NIC ports, leaf up/downlinks, then (with ``cores``)
        a *thread* per rank (one core: 1 CPU-second per second) and each CPU's cores."""
        cpu = self.world_size + self.cpus if self.cores else 0
        return self._cpu_base + cpu  # type: ignore[attr-defined]

    @property
    def uplink_beta(self) -> float:
        """Seconds per byte of one leaf uplink (0 without a switch tier)."""
        return self._up_beta  # type: ignore[attr-defined]

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_keys(self) -> list[str]:
        """One host key per rank (what a group's ``hosts`` holds)."""
        return [f"sim-host{self.host_of(r)}" for r in range(self.world_size)]

    def layout(self) -> Layout:
        p = self.ranks_per_host
        return Layout(tuple(tuple(range(h * p, (h + 1) * p)) for h in range(self.hosts)))

    def route(self, src: int, dst: int) -> tuple[float, float, tuple[tuple[int, float], ...]]:
        """``(α, β, ((link, β_link), ...))`` of a message from ``src`` to ``dst`` (module docstring)."""
        p = self.ranks_per_host
        hs, hd = src // p, dst // p
        if hs == hd:
            b = self.intra.beta
            return self.intra.alpha, b, ((src, b), (self.world_size + dst, b))
        nics, b = self.nics_per_host, self.inter.beta
        base = self._nic_base  # type: ignore[attr-defined]
        out = (base + 2 * (hs * nics + (src % p) % nics), b)
        inn = (base + 2 * (hd * nics + (dst % p) % nics) + 1, b)
        k = self.hosts_per_switch
        if k and hs // k != hd // k:
            ub = self._up_beta  # type: ignore[attr-defined]
            leaf = self._leaf_base  # type: ignore[attr-defined]
            up, down = (leaf + 2 * (hs // k), ub), (leaf + 2 * (hd // k) + 1, ub)
            return self.inter.alpha, max(b, ub), (out, up, down, inn)
        return self.inter.alpha, b, (out, inn)

    def burst(self, src: int, dst: int) -> tuple[int, float, float] | None:
        """``(link, bytes, β)`` of the token bucket a message from ``src`` to ``dst`` draws from (its
        sender's NIC egress), or None (no bucket, or both ranks on one host)."""
        p = self.ranks_per_host
        if not self.nic_burst or src // p == dst // p:
            return None
        nics = self.nics_per_host
        link = self._nic_base + 2 * ((src // p) * nics + (src % p) % nics)  # type: ignore[attr-defined]
        return link, float(self.nic_burst), self.inter.beta

    def cpu_path(self, rank: int) -> tuple[tuple[int, float], ...]:
        """The ``(link, β)`` that ``rank``'s CPU work crosses, its "bytes" being CPU seconds: its
        thread (β 1: one core) and its CPU's cores (β ``1 / cores``); ``()`` without ``cores``."""
        if not self.cores:
            return ()
        base = self._cpu_base  # type: ignore[attr-defined]
        cpu = self.host_of(rank) // self.hosts_per_cpu
        return (base + rank, 1.0), (base + self.world_size + cpu, 1.0 / self.cores)

    @property
    def background_flows(self) -> dict[int, float]:
        """``{link: threads}``: the other work each CPU's cores carry besides the ranks' (``cpu_background``)."""
        if not (self.cores and self.cpu_background):
            return {}
        base = self._cpu_base + self.world_size  # type: ignore[attr-defined]
        return {base + cpu: float(self.cpu_background) for cpu in range(self.cpus)}

    def receive_cpu(self, src: int, dst: int) -> float:
        """CPU seconds per byte ``dst`` spends receiving a message from ``src`` (``recv_cpu`` between hosts)."""
        p = self.ranks_per_host
        return self.recv_cpu if src // p != dst // p else 0.0

    def describe(self) -> str:
        """One line: the topology and its links."""
        switch = (
            f", {self.leaves} leaf switches of {self.hosts_per_switch} hosts, oversubscription {self.oversubscription:g}:1"
            if self.hosts_per_switch else ", one switch"
        )
        return (
            f"{self.hosts} hosts x {self.ranks_per_host} ranks ({self.world_size}), {self.nics_per_host} NIC(s)/host"
            f"{switch}; intra {self.intra}; inter {self.inter}"
            + (f"; NIC burst {self.nic_burst:.0f} B" if self.nic_burst else "")
            + (f"; {self.cores} cores per {self.hosts_per_cpu} host(s)" if self.cores else "")
            + (f" and {self.cpu_background:g} threads of other work" if self.cores and self.cpu_background else "")
            + (f"; receive CPU {self.recv_cpu * 1e9:.3f} ns/B" if self.recv_cpu else "")
        )


def links_from_bench(path: str) -> dict[str, Link]:
    """The fitted links in a ``collectives.bench --model --json`` file: ``{"net": ..., "local": ...}``
    and, from runs that fitted them, ``"shm"``, ``"duplex"``, ``"reduce"`` and ``"recv_cpu"``, and each kind's
    fit from medians, ``"net_median"``, ... (:func:`collectives.costmodel.measure`). Use them as :attr:`Network.inter` /
    :attr:`Network.intra`: "this machine's links, at 1,024 ranks"."""
    with open(path) as f:
        rows: Any = json.load(f)
    found: dict[str, Link] = {}
    for row in rows if isinstance(rows, list) else [rows]:
        for kind in LINK_KINDS:
            if f"{kind}_alpha" in row and kind not in found:
                found[kind] = Link(float(row[f"{kind}_alpha"]), float(row[f"{kind}_beta"]))
    if not found:
        raise ValueError(f"{path}: no fitted links (net_alpha/net_beta); run collectives.bench with --model --json")
    return found
