"""Which ranks share a host: the layout hierarchical collectives are built on.

Every group knows a *host key* per rank (``Group.hosts``, learned through the store at init; see
:func:`collectives.group.host_key`). Two ranks with the same key can reach each other through the
machine's memory (loopback, shared memory); ranks with different keys talk over the network. The
key includes the network namespace: the emulated hosts of :mod:`collectives.testing.hosts` are
namespaces of one machine, and they must count as different hosts, since their traffic has to
cross the (emulated) network.

A :class:`Layout` is the group's ranks grouped by host: the hosts in order of their lowest group
rank, and each rank's *local rank* (its position among the ranks of its host).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


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
