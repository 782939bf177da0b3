"""Training that survives a member's death: the lost member is replaced, the step redone, and the
run ends bitwise where the same run without failures ends (DDP; issue 44's loop, first form).

:func:`run` starts the members on 127.0.0.1 and trains a :class:`Job` with our DDP on an
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

**Limits.** Our bucketed DDP only (ZeRO-1/2 shards would need a replica of each optimizer
shard), no shrink mode and no warm spares yet, and a member's own state outside the model and
optimizer must be a function of the step (as the sampler position and RNG are here). Buffers
(BatchNorm's running statistics): a lost attempt's updates are rolled back, and healing copies
the most advanced member's. DDP broadcasts rank 0's at each forward, so they are the failure-free
ones unless slot 0 lost a step that another member completed: then they come from that member
and differ (parameters and optimizer state never do).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

import collectives
from collectives.launch import configure_logging, is_stopped, set_parent_death_signal

from .distributed import DistributedDataParallel

log = logging.getLogger(__name__)


class Job(Protocol):
    """What a fault-tolerant run trains: picklable (it travels to every member), and a pure
    function of the step and slot (module docstring)."""

    steps: int

    def model(self) -> nn.Module:
        """The model, the same on every member (a replacement's is overwritten by healing)."""

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s inputs and targets at step ``step``."""


@dataclasses.dataclass(frozen=True)
class SyntheticJob:
    """A small MLP with dropout on random features (the RNG matters): the tests' job."""

    steps: int = 100
    batch_size: int = 16
    features: int = 32
    hidden: int = 64
    seed: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(self.features, self.hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(self.hidden, 4))

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(world_size * self.batch_size, self.features, generator=g)
        y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
        rows = slice(slot * self.batch_size, (slot + 1) * self.batch_size)
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
    report_progress: bool = False  # publish each committed step (for chaos at given steps)


class StateLostError(RuntimeError):
    """No live member holds the training state any more: the run cannot go on where it was."""


def heal(group: collectives.Group, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> int:
    """Make every member's state that of the most advanced member; returns the common step."""
    steps = torch.zeros(group.size(), dtype=torch.int64)
    collectives.all_gather_into_tensor(steps, torch.tensor([step]), group=group)
    ahead = int(steps.max())
    if ahead < 0:
        raise StateLostError(
            "ddp.elastic: every member of this generation is a replacement: the members that held the training "
            "state all died before one of them could heal the others (one in-memory copy per member; restart "
            "from a checkpoint)"
        )
    src = group.ranks[int((steps == ahead).nonzero()[0])]
    state = [{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}]
    collectives.broadcast_object_list(state, src=src, group=group)
    if group.rank() != src:
        model.load_state_dict(state[0]["model"])
        opt.load_state_dict(state[0]["optimizer"])
    return ahead


def member(cfg: Config, port: int, slot: int, replacement: bool) -> dict[str, Any]:
    """One member's life: join, train (re-forming and healing after failures), report."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=cfg.timeout * 2))
    eg = collectives.ElasticGroup(store, slot, cfg.world_size, backend=cfg.backend, timeout=cfg.timeout,
                                  heartbeat=cfg.heartbeat)
    model = cfg.job.model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    step, failed = (-1 if replacement else 0), 0
    stale = True  # every generation starts by healing: replacements may join the first one too
    ddp: DistributedDataParallel | None = None
    before: list[torch.Tensor] | None = None  # buffers before the step in flight
    seconds: list[tuple[float, float]] = []  # wall and CPU time of each committed step (ddp.bench_elastic)
    try:
        while True:
            try:
                if stale:
                    step = heal(eg.group, model, opt, step)
                    stale = False
                    log.info("generation %d: healed to step %d", eg.generation, step)
                if step >= cfg.job.steps:
                    break
                if ddp is None:
                    ddp = DistributedDataParallel(model, group=eg.group, bucket_cap_mb=cfg.bucket_mb, init_sync=False)
                begun = time.perf_counter(), time.process_time()
                x, y = cfg.job.batch(step, slot, cfg.world_size)
                torch.manual_seed(cfg.seed * 1_000_003 + slot * 10_007 + step)
                opt.zero_grad(set_to_none=True)
                before = [b.detach().clone() for b in model.buffers()]  # the attempt's forward updates them
                nn.functional.cross_entropy(ddp(x), y).backward()
                before = None
                opt.step()
                step += 1
                seconds.append((time.perf_counter() - begun[0], time.process_time() - begun[1]))
                if cfg.report_progress:
                    store.set(f"ringddp/ddp-elastic/progress/{slot}", f"{step}:{eg.generation}")
            except collectives.CollectiveError as exc:
                log.warning("step %d failed (%s); re-forming", step, str(exc).splitlines()[0][:160])
                if before is not None:  # the lost attempt leaves no trace: its redo updates them once
                    with torch.no_grad():
                        for b, old in zip(model.buffers(), before):
                            b.copy_(old)
                    before = None
                if ddp is not None:
                    ddp.remove_hooks()
                    ddp = None
                started = time.monotonic()
                failed += 1
                eg.reform(wait=cfg.respawn_wait)
                stale = True
                log.info("generation %d formed in %.2fs", eg.generation, time.monotonic() - started)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(eg.size())]
        collectives.all_gather(every, flat, group=eg.group)
        identical = all(torch.equal(every[0], f) for f in every)
        return {"slot": slot, "uid": eg.me.uid, "generation": eg.generation, "identical": identical,
                "steps": step, "failed_steps": failed, "step_seconds": seconds, "state": model.state_dict() if slot == 0 else None,
                "optimizer": opt.state_dict() if slot == 0 else None}
    finally:
        if ddp is not None:
            ddp.remove_hooks()
        eg.close()


def _child(cfg: Config, port: int, slot: int, replacement: bool, conn) -> None:
    set_parent_death_signal()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    configure_logging(slot)
    send = lambda *report: conn.send_bytes(pickle.dumps(report))  # noqa: E731 - by value, not torch's fd sharing
    try:
        send("ok", member(cfg, port, slot, replacement))
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
    """Launch ``cfg.world_size`` members on 127.0.0.1, replace every one that dies (or stays
    stopped for the heartbeat bound), and return when every slot has reported. ``chaos``:
    ``(step, slot, signal)``: once a member has committed ``step`` steps, send ``signal`` to the
    slot's process of that moment, from here (outside the member), wherever it is in its step
    (needs ``cfg.report_progress``). Signals of one step are sent together; those of a later step
    wait until the group recovered from the earlier ones (a starved launcher would otherwise send
    them all at once)."""
    if chaos and not cfg.report_progress:
        raise ValueError("ddp.elastic.run: chaos at given steps needs Config(report_progress=True)")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.timeout * 2))
    ctx = mp.get_context("spawn")
    procs: dict[int, tuple[mp.Process, Any]] = {}
    events: list[str] = []

    def start(slot: int, replacement: bool) -> None:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(cfg, store.port, slot, replacement, child), name=f"ringddp-member{slot}")
        p.start()
        child.close()
        procs[slot] = (p, parent)
        log.info("slot %d: pid %d%s", slot, p.pid, " (replacement)" if replacement else "")

    for slot in range(cfg.world_size):
        start(slot, False)
    t0, deadline = time.monotonic(), time.monotonic() + join_timeout
    pending = sorted(chaos)
    reports: dict[int, dict[str, Any]] = {}
    stopped: dict[int, float] = {}  # pid -> when the launcher first saw it stopped
    recoveries = 0
    waiting: list[tuple[float, int]] = []  # (when a signal was sent, the newest generation then)
    recovery: list[float] = []
    try:
        while len(reports) < cfg.world_size:
            if time.monotonic() > deadline:
                raise collectives.LaunchError(f"ddp.elastic: not done after {join_timeout:g}s; events: {events}")
            done, generation = progress(store, cfg.world_size) if cfg.report_progress else (0, -1)
            for i, (sent, before) in enumerate(waiting):  # recovered: a step committed by a newer generation
                if generation > before:
                    recovery.append(time.monotonic() - sent)
                    del waiting[i]
                    break
            fired = None  # signals of one step go together; a later step's wait for the recovery
            while pending and done >= pending[0][0] and (not waiting or pending[0][0] == fired):
                at, slot, sig = pending.pop(0)
                fired = at
                p = procs[slot][0]
                if slot not in reports and p.is_alive():
                    os.kill(p.pid, sig)
                    waiting.append((time.monotonic(), generation))
                    events.append(f"{time.monotonic() - t0:.2f}s: sent {signal.Signals(sig).name} to slot {slot} "
                                  f"(pid {p.pid}) after step {at}")
                    log.warning(events[-1])
            live = [(s, p, c) for s, (p, c) in procs.items() if s not in reports]
            for slot, p, _ in live:  # a stopped child that has not joined yet has no heartbeat to miss
                if not is_stopped(p):
                    stopped.pop(p.pid, None)
                elif time.monotonic() - stopped.setdefault(p.pid, time.monotonic()) > cfg.heartbeat:
                    os.kill(p.pid, signal.SIGKILL)
                    events.append(f"{time.monotonic() - t0:.2f}s: slot {slot} (pid {p.pid}) stopped for "
                                  f"{cfg.heartbeat:g}s: killed")
                    log.warning(events[-1])
            ready = mp.connection.wait([c for _, _, c in live] + [p.sentinel for _, p, _ in live], 0.05)
            for slot, p, conn in live:
                if conn in ready:
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, value = "died", None
                    if status == "ok":
                        reports[slot] = value
                        continue
                    if status == "lost":  # replacing members cannot help: fail the job, loudly
                        raise collectives.LaunchError(f"slot {slot}: {value}; events: {events}")
                elif p.sentinel in ready:
                    status, value = "died", None
                else:
                    continue
                p.join(5)
                events.append(f"{time.monotonic() - t0:.2f}s: slot {slot} (pid {p.pid}) {status}, exit {p.exitcode}"
                              + (f": {value}" if value else "") + "; starting a replacement")
                log.warning(events[-1])
                recoveries += 1
                start(slot, True)
    finally:
        for p, _ in procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
    return Outcome(reports, events, recoveries, recovery)
