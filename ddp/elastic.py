"""Training that survives a member's death: the lost member is replaced, the step redone, and the
run ends bitwise where the same run without failures ends (our DDP, ZeRO-1/2).

:func:`run` starts the members on 127.0.0.1 and trains a :class:`Job` with our DDP (or ZeRO) on an
:class:`~collectives.ElasticGroup`; each member killed or stopped from outside (SIGKILL,
SIGSTOP) is replaced by a new process in its slot, which heals from a live peer. The main job
runs this with ``python -m ddp.train --fault-tolerant``.

**Why the result stays bitwise equal.** Every member starts step ``s`` with the same parameters
and optimizer state (data parallelism). The step's batch is a function of ``(seed, s)`` and the
slot, and the RNG is reseeded from ``(seed, slot, s)`` before it (dropout), so nothing a dead
member knew is needed to redo its step: only the step number. A member applies the optimizer
update only after DDP's all-reduce returned on it without error, and such an all-reduce holds
every member's contribution, summed in the same order as without failures (our algorithms are
deterministic): so any member that reached step ``s + 1`` holds exactly the failure-free state
of ``s + 1``. After a failure the members re-form (a replacement fills the lost slot), agree on
the most advanced member (all-gather of step numbers; the lowest rank among those ahead), and it
broadcasts parameters, buffers, optimizer state and the step number, bit for bit. Members behind
(who lost the step's all-reduce) thus roll forward; nobody rolls back, and no vote per step is
needed: the failure-free overhead is nil beyond the heartbeat thread.

**Warm spares** (``Config.spares``). A spare is a process started with the members that has
imported everything, connected to the store, built the model and run one forward and backward
(:func:`prepare`), and waits on its pipe. When a member dies the launcher sends its slot to a
spare, which joins the generation the survivors are forming and heals like any replacement: the
recovery skips the imports (seconds) and costs what is left: re-forming, the new group's set-up,
healing, the redone step. A new spare starts once the one that took the slot committed a step.

**Shrink mode** (``Config.shrink``, an :class:`EpochJob`). After ``max_respawns`` replacements a
lost slot stays empty; the survivors wait ``respawn_wait`` and form a smaller generation. The
healed state then also carries a data cursor ``(epoch, rows consumed)``: each step, rank ``r``
of ``N`` takes its first ``batch_size`` rows of the sampler started at the cursor, which moves by
``batch_size * N``, so every row of an epoch is trained on once whatever ``N`` was. The global
batch shrinks with ``N`` and DDP averages over ``N`` (same learning rate), so the result differs
from the full world's; it is a function of the membership history ``[(step, slots), ...]``
carried and reported with it, and ``Config(schedule=history)`` replays it bitwise without
failures (members outside a step's slots close, the others re-form without them).

**ZeRO-1/2** (``Config(zero=1|2)``). Rank ``r`` alone holds the master values and optimizer
state of chunk ``r`` of every bucket, and that state (momentum: a sum over every step) cannot be
recomputed. So rank ``r`` also keeps a replica of rank ``r + 1``'s shard
(:class:`ddp.zero.replica.ShardReplica`): a shard survives any single death. A step is

1. forward and backward (the reduce-scatter: rank ``r`` gets its chunk's averaged gradient);
2. the *shift*: rank ``r`` sends its pieces' gradients to ``r - 1`` and receives ``r + 1``'s (one
   ``Ψ/n``-byte message each way: an ``all_to_all_single`` whose other splits are empty, so it
   runs on the group's own transport), while it makes
3. an undo copy of the own shard, the replica and the buffers; then the update of the replica
   and of the own shard (local: no communication can fail here);
4. the all-gather of the updated chunks: **the commit**. A step is committed on a member when its
   all-gather returned there.

*The commit rule.* An all-gather that returned on any member carried every member's updated
chunk, so every member (the dead one too) had applied its update before: then every live member
has either committed the step or applied it (*pending*). If no live member's all-gather
returned, nobody committed it. Healing all-gathers ``(step, pending, holds)`` and decides:
pending members keep their update when a member is one step ahead (roll forward), and restore
their undo copy otherwise (roll back). Either way every live copy of every shard then stands at
the same committed step: its owner's, and its replica holder's (a replacement holds nothing until
it healed). A non-holder receives its own shard from its replica holder and its replica from
its owner (object broadcasts, bits unchanged); the all-gather of every owner's chunk then rebuilds
the full parameters on every member, and the buffers come from the lowest holder. A shard whose
two holders both died (or were replacements not yet healed) is lost: :class:`StateLostError`.
Rolling forward alone would need a vote after the shift (a member votes once it has its
gradients, so a vote that returned anywhere lets every live member roll forward): one more
synchronisation per step instead of the copies; without it, a member that lost the
reduce-scatter has no gradient to step with.

*Why it stays bitwise.* The replica steps with the owner's gradient bits, from the same state
bits, with the same element-wise arithmetic on pieces of the same lengths, so it equals the
owner's shard after every step (every run checks it at the end: SHA-256 of each replica against
its owner's shard, part of ``identical``); undo copies and transfers are bits. So every shard
is its failure-free state at the committed step, and the redo is the failure-free step.

*Cost when nothing fails* (``n`` members, ``Ψ`` parameter bytes): the shift, ``Ψ/n`` bytes per
member on top of the step's ``2(n-1)/n · Ψ``; the replica's update (element-wise, over ``Ψ/n``);
the undo copy (a ``memcpy`` of the own shard and the replica: parameters and state); memory for a
second shard and the undo copy (measured: docs/DESIGN.md §5, ``python -m ddp.bench_elastic``). Our
ZeRO-1 reduce-scatters too, so it needs the shift as much as ZeRO-2.

*Shrinking.* The shards carried between generations are tagged with the slots they were cut
for; when a generation has other slots, healing sends every member each shard of a split that
the live members hold whole and cuts them again (:func:`ddp.zero.replica.reshard`: bits moved,
none computed), so the replay of the membership schedule stays bitwise equal.

**Limits.** DDP and ZeRO-1/2 (ZeRO-3 would need replicas of the parameter chunks too); a shrunk
world does not grow back; a member's own state outside the model and
optimizer must be a function of the step or carried in the healed state (as the sampler
position and RNG are here). Buffers
(BatchNorm's running statistics): a lost attempt's updates are rolled back, and healing copies
the most advanced member's. DDP broadcasts rank 0's at each forward, so they are the failure-free
ones unless slot 0 lost a step that another member completed: then they come from that member
and differ (parameters and optimizer state never do).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

import collectives
from collectives import faults
from collectives.launch import configure_logging, is_stopped, set_parent_death_signal, start_process

from data import DistributedSampler

from .distributed import DistributedDataParallel
from .zero import ZeroDataParallel, ZeroRedundancyOptimizer
from .zero.replica import Shard, ShardReplica, piece_gradients, reshard

log = logging.getLogger(__name__)


class Job(Protocol):
    """What a fault-tolerant run trains: picklable (it travels to every member), and a pure
    function of the step and slot (module docstring)."""

    steps: int

    def model(self) -> nn.Module:
        """The model, the same on every member (a replacement's is overwritten by healing)."""

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s inputs and targets at step ``step``."""


class EpochJob(Job, Protocol):
    """A job whose steps walk epochs of a data set through our :class:`data.DistributedSampler`:
    what shrink mode needs (``Config.shrink``), since a step's rows then depend on how many
    members shared the epoch so far, not on the step alone."""

    epochs: int
    batch_size: int

    def rows(self) -> int:
        """The rows of one epoch (the data set's length)."""

    def batch_at(self, epoch: int, start: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank`` of ``world_size``'s next batch: the first ``batch_size`` of its indices
        after ``sampler.set_epoch(epoch, start=start)``."""


@dataclasses.dataclass(frozen=True)
class SyntheticJob:
    """A small MLP with dropout on random features (the RNG matters): the tests' job. As an
    :class:`EpochJob` (shrink mode) it trains ``epochs`` epochs over ``size`` fixed random rows."""

    steps: int = 100
    batch_size: int = 16
    features: int = 32
    hidden: int = 64
    seed: int = 0
    epochs: int = 1
    size: int = 500

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(self.features, self.hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(self.hidden, 4))

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._draw(step, world_size * self.batch_size)
        rows = slice(slot * self.batch_size, (slot + 1) * self.batch_size)
        return x[rows], y[rows]

    def _draw(self, key: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        x = torch.randn(n, self.features, generator=g)
        return x, (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4

    def rows(self) -> int:
        return self.size

    def batch_at(self, epoch: int, start: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._draw(-1, self.size)  # the data set (no step draws key -1)
        sampler = DistributedSampler(range(self.size), num_replicas=world_size, rank=rank, seed=self.seed)
        sampler.set_epoch(epoch, start=start)
        rows = sampler.indices()[: self.batch_size]
        return x[rows], y[rows]


@dataclasses.dataclass(frozen=True)
class Config:
    """One fault-tolerant run (every member uses the same)."""

    job: Job = SyntheticJob()
    world_size: int = 2
    lr: float = 0.05
    bucket_mb: float = 0.01
    seed: int = 0  # of the per-step RNG (dropout)
    backend: str = "shm"
    heartbeat: float = 2.0
    timeout: float = 60.0
    respawn_wait: float = 60.0  # seconds survivors wait for a replacement
    spares: int = 0  # warm spares kept ready to take a lost slot
    max_respawns: int | None = None  # replacements (spares or new processes) over the run; None: no limit
    # processes in a row of one slot (or spares in a row) that may die before their first committed
    # step (a spare: before it is ready); one more fails the run: something kills them as they start
    start_failures: int = 3
    shrink: bool = False  # no replacement within respawn_wait: go on with fewer members (an EpochJob)
    schedule: tuple[tuple[int, tuple[int, ...]], ...] = ()  # shrink: (step, slots) changes to apply, no failures
    report_progress: bool = False  # publish each committed step (for chaos at given steps)
    zero: int = 0  # 0: our bucketed DDP; 1, 2: ZeRO-1/2 with a replica of each optimizer shard

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2):
            raise ValueError(
                f"ddp.elastic.Config: zero={self.zero!r}: the fault-tolerant loop runs DDP (0) or ZeRO-1/2 (1, 2); ZeRO-3 "
                "shards the parameters too, which would need a replica of every parameter chunk: use zero=2"
            )
        if self.zero and self.world_size < 2:
            raise ValueError("ddp.elastic.Config: ZeRO keeps each shard's replica on another member: world_size >= 2")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ValueError(f"ddp.elastic.Config: spares must be an int >= 0, got {self.spares!r}")
        if isinstance(self.start_failures, bool) or not isinstance(self.start_failures, int) or self.start_failures < 1:
            raise ValueError(f"ddp.elastic.Config: start_failures must be an int >= 1, got {self.start_failures!r}")
        if self.max_respawns is not None and (not isinstance(self.max_respawns, int) or self.max_respawns < 0):
            raise ValueError(f"ddp.elastic.Config: max_respawns must be None or an int >= 0, got {self.max_respawns!r}")
        if (self.shrink or self.schedule) and not all(hasattr(self.job, a) for a in ("epochs", "rows", "batch_at")):
            raise ValueError(f"ddp.elastic.Config: shrink mode needs an EpochJob (epochs, rows, batch_at), not "
                             f"{type(self.job).__name__}")
        if self.schedule and not self.shrink:
            raise ValueError("ddp.elastic.Config: a membership schedule replays a shrink run: set shrink=True too")


class StateLostError(RuntimeError):
    """No live member holds the training state any more: the run cannot go on where it was."""


def heal(group: collectives.Group, model: nn.Module, opt: torch.optim.Optimizer, step: int,
         extra: dict[str, Any] | None = None) -> int:
    """Make every member's state that of the most advanced member; returns the common step.
    ``extra``: more picklable state (shrink mode's data cursor), updated in place likewise."""
    steps = torch.zeros(group.size(), dtype=torch.int64)
    collectives.all_gather_into_tensor(steps, torch.tensor([step]), group=group)
    ahead = int(steps.max())
    if ahead < 0:
        raise StateLostError(
            "ddp.elastic: every member of this generation is a replacement: the members that held the training "
            "state all died before one of them could heal the others (one in-memory copy per member; restart "
            "from a checkpoint)"
        )
    if step < 0:
        faults.reached("heal")  # a replacement that dies while it heals (tests: collectives.faults)
    src = group.ranks[int((steps == ahead).nonzero()[0])]
    state = [{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "extra": extra}]
    collectives.broadcast_object_list(state, src=src, group=group)
    if group.rank() != src:
        model.load_state_dict(state[0]["model"])
        opt.load_state_dict(state[0]["optimizer"])
        if extra is not None:
            extra.update(state[0]["extra"])
    return ahead


class _Trainer:
    """How a member trains one step, heals and reports: our DDP (:class:`ReplicatedTrainer`) or
    ZeRO-1/2 with shard replicas (:class:`ShardedTrainer`). Both roll back the buffers of an attempt
    that failed before its update (its forward changed BatchNorm's running statistics)."""

    def __init__(self, cfg: Config, model: nn.Module) -> None:
        self.cfg, self.model = cfg, model
        self.before: list[torch.Tensor] | None = None  # buffers before the attempt in flight
        self._buffers: list[torch.Tensor] | None = None  # the model's, listed once per generation
        self._saved: list[torch.Tensor] = []  # where they are copied, reused from step to step

    @torch.no_grad()
    def snapshot_buffers(self) -> list[torch.Tensor]:
        """The buffers' values before this attempt, in tensors reused every step (a copy into
        them costs half a fresh clone); valid until the next snapshot. The buffers are listed at
        a generation's first step and kept until :meth:`close` (listing them costs more than
        copying them): a module updates its buffers in place, as BatchNorm does."""
        if self._buffers is None:
            self._buffers = list(self.model.buffers())
            self._saved = [torch.empty_like(b) for b in self._buffers]
        for saved, b in zip(self._saved, self._buffers):
            saved.copy_(b)
        self.before = self._saved
        return self.before

    def close(self) -> None:
        """End of a generation: the next one lists the buffers again."""
        self._buffers = None

    @torch.no_grad()
    def restore_buffers(self, saved: list[torch.Tensor]) -> None:
        for b, old in zip(self.model.buffers(), saved):
            b.copy_(old)

    def undo_attempt(self) -> None:
        """An attempt that failed before its update leaves no trace: its redo updates the buffers once."""
        if self.before is not None:
            self.restore_buffers(self.before)
            self.before = None

    def parameters_identical(self, group: collectives.Group) -> bool:
        """Whether every member of ``group`` holds the same parameters, bit for bit (collective)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        every = [torch.empty_like(flat) for _ in range(group.size())]
        collectives.all_gather(every, flat, group=group)
        return all(torch.equal(every[0], f) for f in every)


class ReplicatedTrainer(_Trainer):
    """Our bucketed DDP: every member holds the whole state; healing copies the most advanced
    member's (:func:`heal`)."""

    def __init__(self, cfg: Config, model: nn.Module) -> None:
        super().__init__(cfg, model)
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        self.ddp: DistributedDataParallel | None = None

    def heal(self, group: collectives.Group, step: int, extra: dict[str, Any] | None = None,
             slots: tuple[int, ...] | None = None) -> int:
        """:func:`heal` (every member holds the whole state, whatever the slots)."""
        return heal(group, self.model, self.opt, step, extra)

    def step(self, group: collectives.Group, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if self.ddp is None:
            self.ddp = DistributedDataParallel(self.model, group=group, bucket_cap_mb=self.cfg.bucket_mb, init_sync=False)
        self.opt.zero_grad(set_to_none=True)
        self.snapshot_buffers()  # the attempt's forward updates them
        nn.functional.cross_entropy(self.ddp(x), y).backward()
        self.before = None
        faults.reached("step")  # a test's kill point: the gradients all-reduced, not applied yet
        self.opt.step()

    def abandon(self) -> None:
        self.undo_attempt()
        self.close()

    def close(self) -> None:
        super().close()
        if self.ddp is not None:
            self.ddp.remove_hooks()
            self.ddp = None

    def final(self, group: collectives.Group, first: bool) -> dict[str, Any]:
        return {"identical": self.parameters_identical(group), "state": self.model.state_dict() if first else None,
                "optimizer": self.opt.state_dict() if first else None}


class ShardedTrainer(_Trainer):
    """ZeRO-1/2 on the group, and a replica of the next rank's optimizer shard (module docstring:
    *ZeRO-1/2*): a member's state is its own shard, the replica, and ``pending``, the undo copy
    of a step whose update it applied but whose all-gather did not return."""

    def __init__(self, cfg: Config, model: nn.Module, replacement: bool) -> None:
        super().__init__(cfg, model)
        self.holds = not replacement  # its shard and replica are the training state's (not yet: a replacement)
        self.pending: dict[str, Any] | None = None
        self.carry: dict[str, Any] | None = None  # own shard and replica between generations
        self.zdp: ZeroDataParallel | None = None
        self.replacement = replacement
        self.undone = self.kept = 0  # steps in flight rolled back / kept at a heal

    def _build(self, group: collectives.Group, slots: tuple[int, ...], carry: dict[str, Any] | None) -> None:
        """ZeRO on this generation's group (split over ``slots``), the own shard and the replica
        loaded from ``carry`` if given (all or nothing: a failure leaves the carried state as it was)."""
        zdp = ZeroDataParallel(self.model, stage=self.cfg.zero, group=group, bucket_cap_mb=self.cfg.bucket_mb, init_sync=False)
        try:
            zopt = ZeroRedundancyOptimizer(zdp.parameters(), torch.optim.SGD, lr=self.cfg.lr, momentum=0.9)
        except BaseException:
            zdp.remove_hooks()
            raise
        own, replica = Shard.own(zdp, zopt), ShardReplica(zdp, zopt, (group.rank() + 1) % group.size())
        if carry is not None:
            own.load(carry["own"])
            replica.load(carry["replica"])
        self.zdp, self.zopt, self.own, self.replica, self.layout = zdp, zopt, own, replica, slots
        self.carry = None
        self.scratch: dict[str, Any] | None = None  # the step's message and undo tensors, reused

    def heal(self, group: collectives.Group, step: int, extra: dict[str, Any] | None = None,
             slots: tuple[int, ...] | None = None) -> int:
        """Agree on the committed step, roll the step in flight forward or back, give every
        non-holder its shard and replica from the live copies (or, when the members' shards were
        cut for another membership, cut them again for this one), then republish the
        parameters. ``slots``: the members' slots, by rank (default: rank ``k`` has slot ``k``);
        ``extra``: shrink mode's data cursor and history, taken from a member at the committed step."""
        n, me = group.size(), group.rank()
        slots = tuple(range(n)) if slots is None else slots
        # the split of the shards carried; None: a holder that never built them holds the initial
        # state, which is the same under every split
        layout = self.carry["layout"] if self.carry is not None else None
        info: list[Any] = [None] * n
        collectives.all_gather_object(info, (step, self.pending is not None, self.holds, layout), group=group)
        steps, pending, holds, layouts = (list(column) for column in zip(*info))
        if not self.holds:
            faults.reached("heal")  # a replacement that dies while it heals (tests: collectives.faults)
        if not any(holds):
            raise StateLostError("ddp.elastic: every member of this generation is a replacement: no live member holds "
                                 "the optimizer shards (restart from a checkpoint)")
        committed = max(steps[k] for k in range(n) if holds[k])
        odd = [k for k in range(n) if holds[k] and steps[k] != committed and not (steps[k] == committed - 1 and pending[k])]
        if odd:  # a member behind without its update: a live member cannot have committed past it
            raise RuntimeError(f"ddp.elastic: inconsistent members after a failure (step, pending, holds by rank: {info})")
        if self.pending is not None:
            if step == committed:  # nobody's all-gather of this step returned: undo it
                assert self.carry is not None  # abandon() carried the shards the update changed
                self.carry = {**self.carry, "own": self.pending["own"], "replica": self.pending["replica"]}
                self.restore_buffers(self.pending["buffers"])
                self.undone += 1
                log.info("step %d: its update rolled back (no member committed it)", step)
            else:  # some member's returned: every member had applied its update, ours is the committed one
                self.kept += 1
                log.info("step %d: its update kept (a member committed it)", step)
            self.pending = None
        if all(layouts[k] in (None, slots) for k in range(n) if holds[k]):
            self._fill(group, slots, holds)
        else:  # the world shrank: cut every shard again
            self._reshard(group, slots, holds, layouts)
        self.zdp.publish()  # every chunk from its owner: the full parameters of the committed step
        src = min(k for k in range(n) if holds[k] and steps[k] == committed)  # buffers (BatchNorm's): as DDP's heal
        state = [{"buffers": [b.detach().clone() for b in self.model.buffers()], "extra": extra} if me == src else None]
        collectives.broadcast_object_list(state, src=group.ranks[src], group=group)
        self.restore_buffers(state[0]["buffers"])
        if extra is not None:
            extra.update(state[0]["extra"])
        self.holds = True
        return committed

    def _fill(self, group: collectives.Group, slots: tuple[int, ...], holds: list[bool]) -> None:
        """Same split as the shards carried: rank ``k``'s shard lives on rank ``k`` (its owner) and
        ``k - 1`` (its replica); a replacement gets both of its copies from their other holders."""
        n, me = group.size(), group.rank()
        lost = [k for k in range(n) if not holds[k] and not holds[k - 1]]
        if lost:
            raise StateLostError(
                f"ddp.elastic: the optimizer shards of ranks {lost} are lost: their owner and the rank holding their "
                "replica both died (or were replacements that had not healed yet); restart from a checkpoint"
            )
        self._build(group, slots, self.carry)
        for k in range(n):
            holder = (k - 1) % n
            for to, src, shard in ((k, holder, "replica"), (holder, k, "own")):
                if not holds[to]:
                    obj = [getattr(self, shard).state() if me == src else None]
                    collectives.broadcast_object_list(obj, src=group.ranks[src], group=group)
                    if me == to:
                        (self.own if shard == "replica" else self.replica).load(obj[0])

    def _reshard(self, group: collectives.Group, slots: tuple[int, ...], holds: list[bool], layouts: list[Any]) -> None:
        """The shards carried were cut for another membership (shrink mode): take a split whose
        every shard a live member holds (as owner or replica), send every member each of its
        shards, and cut them for this generation's split (:func:`ddp.zero.replica.reshard`). A
        heal that failed half way can leave members carrying different splits of the same
        state; any complete one will do."""
        n, me = group.size(), group.rank()

        def sources(split: tuple[int, ...]) -> list[int | None]:
            """The rank holding each shard of ``split``: its owner, else the rank before it (the replica)."""
            at = {split.index(slots[r]): r for r in range(n) if holds[r] and layouts[r] == split}  # position -> rank
            return [at.get(k, at.get((k - 1) % len(split))) for k in range(len(split))]

        splits = sorted({layouts[r] for r in range(n) if holds[r] and layouts[r] is not None}, key=lambda split: (-len(split), split))
        complete = [split for split in splits if None not in sources(split)]
        if not complete:
            raise StateLostError(
                f"ddp.elastic: no split of the optimizer shards is held whole by the live members (splits over slots "
                f"{splits}; each shard lives on its owner and the member before it): restart from a checkpoint"
            )
        split = complete[0]
        states = []
        for k, src in enumerate(sources(split)):
            obj = [self.carry["own" if split.index(slots[me]) == k else "replica"] if me == src else None]
            collectives.broadcast_object_list(obj, src=group.ranks[src], group=group)
            states.append(obj[0])
        self._build(group, slots, None)
        own, replica = reshard(self.zdp, self.zopt, states, [me, (me + 1) % n])
        self.own.load(own)
        self.replica.load(replica)
        log.info("the optimizer shards of slots %s cut again for slots %s", split, slots)

    def step(self, group: collectives.Group, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        assert self.zdp is not None
        self.zopt.zero_grad(set_to_none=True)
        buffers = self.snapshot_buffers()
        nn.functional.cross_entropy(self.zdp(x), y).backward()  # reduce-scatters the gradients
        if self.scratch is None:  # kept from step to step: no fresh pages every step
            self.scratch = {"grads": torch.empty(sum(t.numel() for t in self.own.tensors)),
                            "incoming": torch.empty(self.replica.numel()), "undo": None}
        grads, incoming = piece_gradients(self.zopt, self.scratch["grads"]), self.scratch["incoming"]
        n, me = group.size(), group.rank()
        send, receive = [0] * n, [0] * n  # the gradient chunk to the replica holder, on the group's own
        send[(me - 1) % n], receive[(me + 1) % n] = grads.numel(), incoming.numel()  # transport (shm: no TCP)
        shift = collectives.all_to_all_single(incoming, grads, receive, send, group=group, async_op=True)
        undo = self.scratch["undo"] or {"own": None, "replica": None}  # made while it flies
        undo = {"own": self.own.state(undo["own"]), "replica": self.replica.state(undo["replica"]), "buffers": buffers}
        shift.wait()
        self.pending, self.before = undo, None
        self.replica.step(incoming)
        faults.reached("step")  # a test's kill point: the replica updated, the own shard not yet
        self.zopt.step()  # the own shard's update, then the all-gather of the parameters: the commit
        self.scratch["undo"], self.pending = self.pending, None

    def abandon(self) -> None:
        self.undo_attempt()  # failed before its update: as for DDP
        if self.zdp is not None and self.holds:
            self.carry = {"layout": self.layout, "own": self.own.state(), "replica": self.replica.state()}
        self.close()

    def close(self) -> None:
        super().close()
        if self.zdp is not None:
            self.zdp.remove_hooks()
            self.zdp = None

    def final(self, group: collectives.Group, first: bool) -> dict[str, Any]:
        """Identical parameters everywhere and every replica equal to its owner's shard (digests);
        rank 0 (``first``) gets the full model and optimizer state (collective)."""
        assert self.zdp is not None
        same = self.parameters_identical(group)
        digests: list[Any] = [None] * group.size()
        collectives.all_gather_object(digests, (_digest(self.own.state()), _digest(self.replica.state())), group=group)
        n = group.size()
        identical = same and all(digests[k][1] == digests[(k + 1) % n][0] for k in range(n))
        state = self.zdp.full_state_dict()
        self.zopt.consolidate_state_dict(group.ranks[0])
        return {"identical": identical, "state": state if first else None,
                "optimizer": self.zopt.state_dict() if first else None, "undone": self.undone, "kept": self.kept}


def _digest(state: dict[str, Any]) -> str:
    """SHA-256 of a shard's state (:meth:`ddp.zero.replica.Shard.state`), bits of every tensor."""
    h = hashlib.sha256()
    for t in state["chunks"]:
        h.update(t.numpy().tobytes())
    for entry in state["optimizer"]:
        for k in sorted(entry):
            v = entry[k]
            h.update(k.encode() + (v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode()))
    return h.hexdigest()


@dataclasses.dataclass
class Prepared:
    """What a member builds before it needs its slot: a warm spare builds it ahead of time."""

    store: dist.TCPStore
    model: nn.Module
    trainer: ReplicatedTrainer | ShardedTrainer


def prepare(cfg: Config, port: int, replacement: bool, warm_up: bool = False) -> Prepared:
    """Connect to the store and build the model and its trainer. ``warm_up`` (a spare): also load
    a batch and run a forward and backward pass once, so the first step after taking a slot finds
    the data loaded and autograd's kernels ready (healing overwrites the buffers it touched)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=cfg.timeout * 2))
    model = cfg.job.model()
    trainer = ShardedTrainer(cfg, model, replacement) if cfg.zero else ReplicatedTrainer(cfg, model)
    if warm_up:
        x, y = cfg.job.batch(0, 0, cfg.world_size)
        nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return Prepared(store, model, trainer)


def member(cfg: Config, port: int, slot: int, replacement: bool, ready: Prepared | None = None,
           on_commit: Callable[[], None] | None = None) -> dict[str, Any]:
    """One member's life: join, train (re-forming and healing after failures), report. ``ready``:
    what :func:`prepare` built (a warm spare's), else built here; ``on_commit``: called once,
    after this member's first committed step."""
    ready_made = ready is not None
    ready = ready or prepare(cfg, port, replacement)
    gc.freeze()  # what exists now lives as long as the process: re-forming's gc.collect() skips it
    store, trainer = ready.store, ready.trainer
    if cfg.spares and not replacement:  # the run starts once its spares are ready
        store.wait([_GO])
    joining = time.monotonic()
    eg = collectives.ElasticGroup(store, slot, cfg.world_size, backend=cfg.backend, timeout=cfg.timeout,
                                  heartbeat=cfg.heartbeat)
    log.info("joined generation %d in %.3fs", eg.generation, time.monotonic() - joining)
    step, failed = (-1 if replacement else 0), 0
    extra: dict[str, Any] | None = {"cursor": (0, 0), "history": []} if cfg.shrink else None
    schedule = dict(cfg.schedule)
    stale = True  # every generation starts by healing: replacements may join the first one too
    seconds: list[tuple[float, float]] = []  # wall and CPU time of each committed step (ddp.bench_elastic)
    failed_at: float | None = None  # when the first failure since the last committed step was seen
    try:
        while True:
            try:
                if stale:
                    healing = time.monotonic()
                    step = trainer.heal(eg.group, step, extra, tuple(m.slot for m in eg.members))
                    stale = False
                    log.info("generation %d: healed to step %d in %.3fs", eg.generation, step, time.monotonic() - healing)
                    if extra is not None:
                        _record(extra, step, eg)
                if (extra["cursor"][0] >= cfg.job.epochs) if extra is not None else (step >= cfg.job.steps):
                    break
                if schedule.get(step, kept := tuple(m.slot for m in eg.members)) != kept:
                    if slot not in schedule[step]:
                        log.info("step %d: leaving, as the schedule says", step)
                        return {"slot": slot, "uid": eg.me.uid, "left_at": step, "identical": True}
                    trainer.abandon()  # nothing in flight: it keeps its state (ZeRO: its shards) for the next generation
                    eg.reform(allow_shrink=True, wait=0)  # without the members the schedule drops
                    stale = True
                    continue
                begun = time.perf_counter(), time.process_time()
                if extra is None:
                    x, y = cfg.job.batch(step, slot, cfg.world_size)
                else:  # shrink mode: the epoch's rows not consumed yet, shared by this generation's members
                    x, y = cfg.job.batch_at(*extra["cursor"], eg.rank(), eg.size())
                torch.default_generator.manual_seed(cfg.seed * 1_000_003 + slot * 10_007 + step)  # CPU: 1/6 of manual_seed's cost
                trainer.step(eg.group, x, y, step)
                step += 1
                seconds.append((time.perf_counter() - begun[0], time.process_time() - begun[1]))
                if failed_at is not None:  # the recovery time, as this member saw it
                    log.info("recovered: step %d committed %.2fs after the failure", step, time.monotonic() - failed_at)
                    failed_at = None
                if on_commit is not None:
                    on_commit()
                    on_commit = None
                if extra is not None:
                    extra["cursor"] = _advance(extra["cursor"], cfg.job.batch_size * eg.size(), cfg.job.rows())
                if cfg.report_progress:
                    store.set(f"ringddp/ddp-elastic/progress/{slot}", f"{step}:{eg.generation}")
            except collectives.CollectiveError as exc:
                log.warning("step %d failed (%s); re-forming", step, str(exc).splitlines()[0][:160])
                stale, failed_at = True, failed_at or time.monotonic()
            else:
                continue
            # out of the except block, whose traceback held the old generation's group: re-forming
            # closes it, and its connections close with it (peers waiting on them fail now)
            trainer.abandon()
            started = time.monotonic()
            failed += 1
            eg.reform(allow_shrink=cfg.shrink, wait=cfg.respawn_wait)
            log.info("generation %d formed in %.2fs", eg.generation, time.monotonic() - started)
        return {"slot": slot, "uid": eg.me.uid, "generation": eg.generation, "steps": step, "failed_steps": failed,
                "step_seconds": seconds, "spare": ready_made, "history": extra["history"] if extra is not None else None,
                **trainer.final(eg.group, eg.rank() == 0)}  # rank 0: slot 0, unless shrink mode dropped it
    finally:
        trainer.close()
        eg.close()


_GO = "ringddp/ddp-elastic/go"  # set by the launcher when the first spares are ready


def _record(extra: dict[str, Any], step: int, eg: collectives.ElasticGroup) -> None:
    """Shrink mode: note the generation's slots from ``step`` on in the membership history (a
    generation that committed nothing is overwritten by the next one)."""
    slots = tuple(m.slot for m in eg.members)
    history = [(s, kept) for s, kept in extra["history"] if s < step]
    extra["history"] = history if history and history[-1][1] == slots else history + [(step, slots)]


def _advance(cursor: tuple[int, int], taken: int, rows: int) -> tuple[int, int]:
    """The data cursor ``(epoch, rows consumed)`` after a step took ``taken`` rows (the epoch's
    last step takes the rest, padded: the next epoch begins)."""
    epoch, start = cursor
    return (epoch + 1, 0) if start + taken >= rows else (epoch, start + taken)


def _child(cfg: Config, port: int, slot: int | None, replacement: bool, conn) -> None:
    """A member's process; ``slot=None``: a warm spare, which prepares, says ``ready`` and waits
    for the launcher to send it a slot."""
    set_parent_death_signal()
    if not mp.parent_process().is_alive():  # the launcher died while this process was importing
        os._exit(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if not os.environ.get("OMP_NUM_THREADS"):  # share the cores: idle OpenMP threads spin, and slow the others' steps
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    send = lambda *report: conn.send_bytes(pickle.dumps(report))  # noqa: E731 - by value, not torch's fd sharing
    ready = None
    try:
        if slot is None:
            ready = prepare(cfg, port, replacement=True, warm_up=True)
            send("ready", None)
            slot = pickle.loads(conn.recv_bytes())
        configure_logging(slot)
        os.environ["RANK"] = str(slot)  # a fault point's rank (collectives.faults) is the slot
        send("ok", member(cfg, port, slot, replacement, ready, on_commit=lambda: send("joined", None)))
    except collectives.FencedError as exc:
        send("fenced", str(exc))
        os._exit(3)
    except StateLostError as exc:
        send("lost", str(exc))
        os._exit(4)
    except BaseException as exc:  # noqa: BLE001 - the launcher reports it
        send("error", f"{type(exc).__name__}: {exc}")
        os._exit(1)


@dataclasses.dataclass
class Outcome:
    """What :func:`run` saw: each slot's final report, the failures and replacements."""

    reports: dict[int, dict[str, Any]]
    events: list[str]
    recoveries: int
    recovery_seconds: list[float]  # per chaos signal: until a newer generation committed a step


def progress(store: dist.Store, world_size: int) -> tuple[int, int]:
    """The most advanced member's committed steps, and the newest generation that committed one
    (with ``Config.report_progress``)."""
    keys = [f"ringddp/ddp-elastic/progress/{slot}" for slot in range(world_size)]
    seen = [tuple(int(v) for v in store.get(k).decode().split(":")) for k in keys if store.check([k])]
    return max((s for s, _ in seen), default=0), max((g for _, g in seen), default=-1)


def run(cfg: Config, chaos: list[tuple[int, int, int]] = (), join_timeout: float = 600.0) -> Outcome:
    """Launch ``cfg.world_size`` members on 127.0.0.1 (and ``cfg.spares`` warm spares), replace
    every one that dies (or stays stopped for the heartbeat bound), and return when every slot
    has reported or, in shrink mode, was given up. ``chaos``: ``(step, slot, signal)``: once a
    member has committed ``step`` steps, send ``signal`` to the slot's process of that moment,
    from here (outside the member), wherever it is in its step (needs ``cfg.report_progress``).
    Signals of one step are sent together; those of a later step wait until the group recovered
    from the earlier ones (a starved launcher would otherwise send them all at once) and the
    spares are ready again.

    A lost slot goes to the oldest spare (a ready one first), else to a new process; after
    ``cfg.max_respawns`` replacements it stays empty: the survivors shrink (``cfg.shrink``) or
    the run fails. A spare that took a slot is itself replaced by a new spare once it committed
    a step (or 10 s later), so that the new one's imports do not slow the recovery down."""
    if chaos and not cfg.report_progress:
        raise ValueError("ddp.elastic.run: chaos at given steps needs Config(report_progress=True)")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.timeout * 2))
    procs: dict[int, tuple[mp.Process, Any]] = {}
    spares: list[tuple[mp.Process, Any]] = []  # oldest first
    warm: set[int] = set()  # pids of spares that said they are ready
    owed: list[float] = []  # when to start a spare at the latest (one per spare that took a slot)
    vacant: set[int] = set()  # slots given up (shrink mode)
    events: list[str] = []
    committed: set[int] = set()  # pids of members that committed a step
    took: set[int] = set()  # pids of spares that took a slot
    early: dict[int | None, int] = {}  # slot (None: the spares) -> its processes in a row that died before committing

    def died_early(slot: int | None, p: mp.Process) -> None:
        """A process of ``slot`` died before its first committed step (a spare: before it was
        ready): fail the run once ``cfg.start_failures`` did so in a row, rather than start the
        next one to die the same way, without end."""
        early[slot] = early.get(slot, 0) + 1
        if early[slot] >= cfg.start_failures:
            who = "spares" if slot is None else f"processes of slot {slot}"
            raise collectives.LaunchError(
                f"ddp.elastic: {early[slot]} {who} in a row died before committing a step (the last: pid {p.pid}, "
                f"exit {p.exitcode}): something kills them as they start (see their log above); events: {events}")

    def spawn(slot: int | None, replacement: bool) -> tuple[mp.Process, Any]:
        parent, child = mp.Pipe()
        p = start_process(_child, (cfg, store.port, slot, replacement, child),
                          "ringddp-spare" if slot is None else f"ringddp-member{slot}")
        child.close()
        return p, parent

    def start(slot: int, replacement: bool) -> None:
        nonlocal recoveries
        if replacement and cfg.max_respawns is not None and recoveries >= cfg.max_respawns:
            if not cfg.shrink:
                raise collectives.LaunchError(f"slot {slot} lost after {recoveries} replacements (max_respawns): "
                                              f"allow more, or shrink; events: {events}")
            vacant.add(slot)
            events.append(f"{time.monotonic() - t0:.2f}s: slot {slot}: no replacement ({recoveries} made): "
                          f"the others go on without it")
            log.warning(events[-1])
            return
        recoveries += replacement
        if replacement and spares:
            spares.sort(key=lambda s: s[0].pid not in warm)  # stable: the oldest ready spare first
            p, conn = procs[slot] = spares.pop(0)
            conn.send_bytes(pickle.dumps(slot))
            took.add(p.pid)
            if cfg.max_respawns is None or recoveries < cfg.max_respawns:  # else no spare could be used
                owed.append(time.monotonic() + 10.0)
            events.append(f"{time.monotonic() - t0:.2f}s: slot {slot}: pid {p.pid} "
                          f"({'warm' if p.pid in warm else 'unready'} spare) takes it")
            log.info("slot %d: pid %d (%s spare)", slot, p.pid, "warm" if p.pid in warm else "unready")
            return
        procs[slot] = spawn(slot, replacement)
        log.info("slot %d: pid %d%s", slot, procs[slot][0].pid, " (replacement)" if replacement else "")
        if replacement:
            events.append(f"{time.monotonic() - t0:.2f}s: slot {slot}: new process pid {procs[slot][0].pid} takes it")

    def add_spare() -> None:
        spares.append(spawn(None, True))
        log.info("spare: pid %d", spares[-1][0].pid)

    t0, deadline = time.monotonic(), time.monotonic() + join_timeout
    recoveries, started = 0, False
    for slot in range(cfg.world_size):
        start(slot, False)
    for _ in range(cfg.spares):
        add_spare()
    pending = sorted(chaos)
    reports: dict[int, dict[str, Any]] = {}
    stopped: dict[int, float] = {}  # pid -> when the launcher first saw it stopped
    waiting: list[tuple[float, int]] = []  # (when a signal was sent, the newest generation then)
    recovery: list[float] = []
    try:
        while len(reports) + len(vacant) < cfg.world_size:
            if time.monotonic() > deadline:
                raise collectives.LaunchError(f"ddp.elastic: not done after {join_timeout:g}s; events: {events}")
            done, generation = progress(store, cfg.world_size) if cfg.report_progress else (0, -1)
            for i, (sent, before) in enumerate(waiting):  # recovered: a step committed by a newer generation
                if generation > before:
                    recovery.append(time.monotonic() - sent)
                    del waiting[i]
                    break
            if not started and (all(p.pid in warm for p, _ in spares) or time.monotonic() - t0 > cfg.timeout):
                store.set(_GO, "1")
                started = True
            while owed and owed[0] <= time.monotonic():
                owed.pop(0)
                add_spare()
            fired = None  # signals of one step go together; a later step's wait for the recovery
            spares_ready = not owed and all(p.pid in warm for p, _ in spares)
            while pending and done >= pending[0][0] and (not waiting and spares_ready or pending[0][0] == fired):
                at, slot, sig = pending.pop(0)
                fired = at
                p = procs[slot][0]
                if slot not in reports and slot not in vacant and p.is_alive():
                    os.kill(p.pid, sig)
                    waiting.append((time.monotonic(), generation))
                    events.append(f"{time.monotonic() - t0:.2f}s: sent {signal.Signals(sig).name} to slot {slot} "
                                  f"(pid {p.pid}) after step {at}")
                    log.warning(events[-1])
            live = [(s, p, c) for s, (p, c) in procs.items() if s not in reports and s not in vacant]
            for slot, p, _ in live:  # a stopped child that has not joined yet has no heartbeat to miss
                if not is_stopped(p):
                    stopped.pop(p.pid, None)
                elif time.monotonic() - stopped.setdefault(p.pid, time.monotonic()) > cfg.heartbeat:
                    os.kill(p.pid, signal.SIGKILL)
                    events.append(f"{time.monotonic() - t0:.2f}s: slot {slot} (pid {p.pid}) stopped for "
                                  f"{cfg.heartbeat:g}s: killed")
                    log.warning(events[-1])
            idle = list(spares)
            ready = mp.connection.wait([c for _, _, c in live] + [p.sentinel for _, p, _ in live]
                                       + [c for _, c in idle], 0.05)
            for p, conn in idle:  # a spare says it is ready, or died waiting: another one starts
                if conn in ready:
                    try:
                        status, _ = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):  # the pipe's end closed, or was reset by the dying process
                        status = "died"
                    if status == "ready":
                        warm.add(p.pid)
                        early[None] = 0
                        continue
                    spares.remove((p, conn))
                    p.join(5)
                    events.append(f"{time.monotonic() - t0:.2f}s: spare (pid {p.pid}) died, exit {p.exitcode}")
                    log.warning(events[-1])
                    if p.pid not in warm:
                        died_early(None, p)
                    add_spare()
            for slot, p, conn in live:
                if conn in ready:
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "died", None
                    if status == "ok":
                        reports[slot] = value
                        continue
                    if status == "ready":  # a spare that was given its slot before it was ready
                        continue
                    if status == "joined":  # its first committed step; a spare's successor may start now
                        committed.add(p.pid)
                        early[slot] = 0
                        if p.pid in took and owed:
                            owed.pop(0)
                            add_spare()
                        continue
                    if status == "lost":  # replacing members cannot help: fail the job, loudly
                        raise collectives.LaunchError(f"slot {slot}: {value}; events: {events}")
                elif p.sentinel in ready:
                    status, value = "died", None
                else:
                    continue
                p.join(5)
                events.append(f"{time.monotonic() - t0:.2f}s: slot {slot} (pid {p.pid}) {status}, exit {p.exitcode}"
                              + (f": {value}" if value else ""))
                log.warning(events[-1])
                if p.pid not in committed:
                    died_early(slot, p)
                if reports:  # the others left after the last step: no one is there to heal a replacement from
                    raise collectives.LaunchError(
                        f"slot {slot} was lost after slots {sorted(reports)} finished the run: its final report is "
                        f"gone and no member is left to heal a replacement from; events: {events}")
                start(slot, True)
                if len(vacant) == cfg.world_size:
                    raise collectives.LaunchError(f"ddp.elastic: every slot was lost and none could be replaced "
                                                  f"(max_respawns); no member is left; events: {events}")
    finally:
        for p, _ in list(procs.values()) + spares:
            if p.is_alive():
                p.kill()
            p.join(10)
    return Outcome(reports, events, recoveries, recovery)
