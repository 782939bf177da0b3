"""The algorithm choices of a group: the names each collective accepts, and :class:`Tuning`.

Both the engine (which picks an algorithm by size) and the wire check (which compares the
choice across ranks) read these; the cost model derives a :class:`Tuning` from a measured link
(:func:`collectives.costmodel.tuning`). Nothing here moves data.
"""

from __future__ import annotations

import dataclasses

#: the ``algorithm=`` choices of all_reduce, broadcast and reduce.
ALL_REDUCE_ALGORITHMS = ("auto", "ring", "recursive_doubling", "hierarchical")
BROADCAST_ALGORITHMS = ("auto", "chain", "binomial", "hierarchical")
REDUCE_ALGORITHMS = ("auto", "ring", "binomial")


@dataclasses.dataclass
class Tuning:
    """Algorithm choices of a group; must be the same on every rank.

    Attributes:
        small_bytes: messages up to this size use the latency-optimal algorithms (recursive
            doubling, binomial reduce, direct all-gather); larger ones the bandwidth-optimal ring.
        chain_bytes: broadcasts up to this size use the binomial tree, larger ones the pipelined
            chain. The tree sends ``n - 1`` messages, the chain ``(n - 1) k``; when ranks share
            cores (the loopback benchmarks) every message costs CPU and the tree wins up to at
            least 64 MiB at 4 ranks. On a real network set it to ``small_bytes``.
        segment_bytes: pipelining segment of the ring and chain algorithms.
        depth: how many segments a ring keeps on the wire ahead of the one being reduced.
        adopt_bytes: on shared memory, buffers that are all-reduced again and again (torch DDP's
            buckets) move into symmetric memory in place, up to this many bytes per rank
            (:mod:`collectives.adoption`); 0 (the default here) turns that off. The ``ringddp``
            torch backend sets it (``Options.adopt_bytes``).
    """

    small_bytes: int = 4 << 20
    chain_bytes: int = 64 << 20
    segment_bytes: int = 4 << 20
    depth: int = 4
    adopt_bytes: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_key", None)  # key() is computed again on next use

    def key(self) -> tuple[int, ...]:
        """The field values as a tuple (what the wire check hashes), kept until a field changes."""
        key = self.__dict__.get("_key")
        if key is None:
            key = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            object.__setattr__(self, "_key", key)
        return key
