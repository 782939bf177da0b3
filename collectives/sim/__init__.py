"""Study at scale: our real algorithms on thousands of virtual ranks, on a virtual clock.

The ``sim`` backend runs every rank of a job inside this process (greenlets scheduled on a
virtual clock, :mod:`collectives.transport.sim`) over a modelled network
(:class:`~collectives.sim.network.Network`: hosts × ranks per host, NICs, a switch tier with
oversubscription, contention on shared links). The collectives are the real ones: the same
``ring.py``, ``tree.py``, ``direct.py``, ``hierarchical.py`` and the engine's choice of
algorithm, on real tensors, so results can be checked exactly and the time they would take on
that network is read off the clock::

    import collectives as dist
    from collectives import sim

    def main(rank, world_size):
        t = torch.full((1 << 20,), float(rank))
        start = sim.clock()
        dist.all_reduce(t)
        return sim.clock() - start          # virtual seconds on the modelled network

    times = dist.launch(main, 1024, backend="sim")                          # 1,024 hosts of 1 rank
    times = sim.launch(main, 1024, network=sim.Network(hosts=128, ranks_per_host=8))

Inside ``main``, ``dist.*`` acts on the calling virtual rank's default group. ``async_op=True``
runs the collective before the call returns (a virtual rank has no communication thread) and
returns a completed handle, so such code runs unchanged, but its virtual time shows no overlap
of communication with what follows. User point-to-point (``send``, ``recv``, ``isend``,
``irecv``, ``batch_isend_irecv``) travels on the same links, on a channel of its own
(``collectives/p2p.py``); a receive without a source takes the message whose header arrives
first in virtual time, ties to the lowest rank (chosen when waited for, in posting order). ``dist.new_group(ranks)`` makes a group of
virtual ranks whose collectives and user messages match apart from every other group's (as
separate process groups do) and share the same links. Model compute with :func:`compute`.

``python -m collectives.sim`` sweeps ops, sizes, algorithms and world sizes and prints tables,
crossovers, a plot and a Chrome trace (:mod:`collectives.sim.study`);
:func:`collectives.sim.ddp.simulate_step` models a DDP training step at scale.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch.distributed as dist

from ..errors import timeout_seconds
from ..group import Group, NonMember, bind_default_group, unbind_default_group
from ..transport.sim import Simulation, current, in_simulation
from .network import DEFAULT_INTER, DEFAULT_INTRA, Network, links_from_bench

__all__ = [
    "DEFAULT_INTER", "DEFAULT_INTRA", "Network", "Simulation", "clock", "compute", "in_simulation", "launch",
    "links_from_bench",
]


class _VirtualProcessGroup:
    """What a :class:`~collectives.group.Group` of a virtual rank holds as its torch process
    group: the rank, the group's pair of channels (``channel``: its collectives'; the next one:
    its user messages, :data:`~collectives.transport.sim.USER_CHANNEL`), and nothing to send on.
    Asking its size is what building the gloo user channel does first; that raises
    ``RuntimeError``, which the group's mailbox takes as "no wire" (user point-to-point goes over
    the simulation's own channel instead).

    The world's makes the subgroups of its virtual rank (:meth:`new_subgroup`, which
    ``new_group`` calls): every rank calls ``new_group`` in the same order, so the ``k``-th
    subgroup gets channels ``2k`` and ``2k + 1`` on every member.
    """

    def __init__(self, rank: int, channel: int = 0):
        self._rank = rank
        self.channel = channel
        self.subgroups: list[Group] = []
        self._made = 0  # new_group calls (members or not), for the channels

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        raise RuntimeError("a virtual rank has no gloo wire (the sim backend carries user messages itself)")

    def new_subgroup(self, world: Group, members: list[int], backend: str, seconds: float) -> Group | NonMember:
        """``new_group(members)`` on this virtual rank: a group on channels of its own, closed with
        the world (``backend`` must be ``sim``)."""
        if backend != "sim":
            raise ValueError(f"new_group: virtual ranks run only the sim backend, got backend={backend!r}")
        self._made += 1
        if world.rank() not in members:
            return NonMember(members)
        pg = _VirtualProcessGroup(members.index(world.rank()), 2 * self._made)
        store = dist.PrefixStore(f"ringddp/sim-group{self._made}/", world.store)
        hosts = [world.hosts[r] for r in members]
        group = Group(pg, members, "sim", seconds, f"group{members}", store=store, hosts=hosts)
        self.subgroups.append(group)
        return group


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    network: Network | None = None,
    simulation: Simulation | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` virtual ranks; their results by rank.

    ``collectives.launch(fn, n, backend="sim")`` calls this with the defaults.

    Args:
        network: the modelled network (default :meth:`Network.flat`: ``world_size`` hosts of one
            rank on one switch); its world size must be ``world_size``.
        simulation: a :class:`Simulation` to run in (for its options: contention, stragglers,
            tracing; and to read its clock afterwards); made from ``network`` if not given.
        timeout: the groups' timeout (kept for the API; a simulated wait never runs out of time:
            a wait that cannot end raises at once).
    Raises:
        the first virtual rank's exception, with a note naming every failed rank.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if simulation is not None:
        network = simulation.fabric  # type: ignore[assignment]
    net = network if network is not None else Network.flat(world_size)
    if net.world_size != world_size:
        raise ValueError(f"sim.launch: the network has {net.world_size} ranks, world_size is {world_size}")
    sim = simulation if simulation is not None else Simulation(net)
    seconds = timeout_seconds(timeout, 1800.0)
    store = dist.HashStore()
    hosts = net.host_keys()

    def body(rank: int) -> Any:
        pg = _VirtualProcessGroup(rank)
        group = Group(pg, range(world_size), "sim", seconds, "world", store=store, hosts=hosts)
        token = bind_default_group(group)
        try:
            return fn(rank, world_size, *args)
        finally:
            for subgroup in pg.subgroups:
                subgroup.close()
            group.close()
            unbind_default_group(token)

    return sim.run(body)


def clock() -> float:
    """The virtual clock of the calling virtual rank, in seconds (``ValueError`` outside a simulation)."""
    return current()[0].now


def compute(seconds: float) -> None:
    """Model ``seconds`` of computation on the calling virtual rank (times its slowdown, if any)."""
    current()[0].sleep(seconds)
