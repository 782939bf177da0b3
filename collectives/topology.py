"""Which ranks share a host: the layout hierarchical collectives are built on.

A *host key* names the machine a rank runs on. Two ranks with the same key can reach each other
through the machine's memory (loopback, shared memory); ranks with different keys talk over the
network. The key is the hostname **plus the network namespace** and the ``/dev/shm`` file system:
the emulated hosts of :mod:`collectives.testing.hosts` are namespaces of one machine, and they
must count as different hosts, since their traffic has to cross the (emulated) network.

Each rank publishes its key in the rendezvous store under its global rank; a group reads the keys
of its members (:func:`hosts_of`) and derives a :class:`Layout`: the hosts in order of their
lowest group rank, and each rank's *local rank* (its position among the ranks of its host).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, Sequence

import torch.distributed as dist

_KEY = "ringddp/host/{}"


def host_key() -> str:
    """This process's host: ``hostname/net:<netns inode>/shm:<device of /dev/shm>``."""
    net = os.stat("/proc/self/ns/net").st_ino if os.path.exists("/proc/self/ns/net") else 0
    shm = os.stat("/dev/shm").st_dev if os.path.isdir("/dev/shm") else 0
    return f"{socket.gethostname()}/net:{net}/shm:{shm}"


def hosts_of(group: Any) -> list[str]:
    """The host key of every rank of ``group`` (index = group rank), learned through the store.

    Every member publishes its own key under its global rank, then reads the others' (each read
    waits up to the store's timeout). Cached on the group.
    """
    hosts = getattr(group, "hosts", None)
    if hosts is not None:
        return list(hosts)
    store = dist.distributed_c10d._get_default_store()
    store.set(_KEY.format(dist.get_rank()), host_key())
    hosts = [store.get(_KEY.format(r)).decode() for r in group.ranks]
    group.hosts = hosts
    return hosts


@dataclasses.dataclass(frozen=True)
class Layout:
    """Group ranks per host, hosts ordered by their lowest rank.

    Attributes:
        hosts: ``hosts[h]`` lists the group ranks on host ``h``, ascending.
    """

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> "Layout":
        order: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            order.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()))

    @property
    def spans_hosts(self) -> bool:
        return len(self.hosts) > 1

    @property
    def uniform(self) -> bool:
        """Every host runs the same number of ranks of the group."""
        return len({len(h) for h in self.hosts}) == 1

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def local(self, rank: int) -> tuple[int, ...]:
        """The group ranks on ``rank``'s host."""
        return self.hosts[self.host_of(rank)]

    def rail(self, rank: int) -> tuple[int, ...]:
        """The group ranks with ``rank``'s local rank, one per host (a uniform layout's "rail")."""
        j = self.local(rank).index(rank)
        return tuple(ranks[j] for ranks in self.hosts)
