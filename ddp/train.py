"""The main job: data-parallel training of a small classifier on scikit-learn's handwritten digits.

Everything distributed in it is ringddp's own: processes started by :func:`collectives.launch`
(or ``torchrun`` / SLURM variables), gradients averaged by :class:`ddp.DistributedDataParallel`
(or the naive :func:`ddp.all_reduce_gradients`), data split by :class:`data.DistributedSampler`
(or shipped from rank 0 by :class:`data.ScatterDataset`). The data set (1,797 8x8 images) ships
inside scikit-learn, so nothing is downloaded::

    python -m ddp.train                              # 2 local CPU processes, bucketed DDP
    python -m ddp.train --world-size 4 --data scatter --accum 2 --trace trace.json --plot loss.png
    python -m ddp.train --zero 3                     # ZeRO-3: parameters, gradients and state sharded
    python -m ddp.train --torch-ddp                  # torch's own DDP, on backend "ringddp" (our collectives)
    torchrun --nproc_per_node=2 -m ddp.train         # ranks from torchrun's environment
    torchrun --nproc-per-node 2 --max-restarts 3 -m ddp.train --checkpoint-dir ckpt   # survives restarts

``--zero 1|2|3`` trains the same model with :class:`ddp.ZeroDataParallel` and
:class:`ddp.ZeroRedundancyOptimizer` instead (``--zero 0``, the default, is the DDP above). Every
run logs what each rank holds for parameters, gradients and optimizer state (tensor accounting,
:func:`ddp.zero.memory_report`). At the end every rank compares its parameters with rank 0's
(bitwise; at stage 3 inside ``summon_full_params``) and the job fails if any differ.

``--checkpoint-dir D`` checkpoints the whole training state every ``--checkpoint-every`` optimizer
steps and at the end (:mod:`ddp.checkpoint`), and a job started on a directory holding one resumes
from the newest valid checkpoint, mid-epoch included: with the same world size the result is
bitwise the one of an uninterrupted run. ``--save-state OUT.pt`` writes rank 0's final model and
optimizer state dicts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import collectives
from collectives import ReduceOp, faults, torch_backend, trace
from collectives.backends import backend_argument, describe_backends, device_type_of, resolve_backend, select_backend
from collectives.transport.shm import ShmTransport
from data import DistributedSampler, ScatterDataset

from . import elastic
from .checkpoint import Checkpointer, CheckpointError, Found, fingerprint, kind_of
from .distributed import DistributedDataParallel
from .naive import all_reduce_gradients
from .sync import broadcast_module, broadcast_tensors
from .zero import ZeroDataParallel, ZeroRedundancyOptimizer, memory_report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("ddp.train")


@dataclasses.dataclass
class Config:
    world_size: int = 2
    backend: str = "auto"
    epochs: int = 10
    batch_size: int = 32  # per rank, per micro-batch
    lr: float = 0.05
    hidden: int = 256
    bucket_mb: float = 0.05
    naive: bool = False
    torch_ddp: bool = False
    zero: int = 0
    accum: int = 1
    data: str = "sampler"
    seed: int = 0
    timeout: float = 60.0
    trace: str | None = None
    plot: str | None = None
    verbose: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50  # optimizer steps
    keep: int = 3
    resume: bool = True
    save_state: str | None = None
    fault_tolerant: bool = False
    heartbeat: float = 2.0
    spares: int = 0
    shrink: bool = False
    max_respawns: int | None = None
    respawn_wait: float = 60.0


@functools.lru_cache(maxsize=4)
def load_digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set as float features in [0, 1] and int64 labels, split 80/20 by ``seed``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int) -> nn.Module:
    """An MLP with BatchNorm (so DDP's buffer broadcast is exercised): 64 -> hidden -> hidden -> 10."""
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


@dataclasses.dataclass(frozen=True)
class DigitsJob:
    """The main job as a :class:`ddp.elastic.Job` (``--fault-tolerant``): the same model, and step
    ``s``'s batch of slot ``k`` is the one the plain job's sampler gives rank ``k`` there (epoch
    ``s // steps_per_epoch``, shuffled by the seed), so it depends on nothing but the step."""

    epochs: int
    world_size: int
    batch_size: int
    hidden: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        rows = len(load_digits_split(self.seed)[0])
        return -(-rows // self.world_size // self.batch_size)  # ceil of the sampler's per-rank share

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return make_model(self.hidden)

    def batch(self, step: int, slot: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step % self.steps_per_epoch) * self.batch_size * world_size
        return self.batch_at(step // self.steps_per_epoch, start, slot, world_size)

    def rows(self) -> int:
        return len(load_digits_split(self.seed)[0])

    def batch_at(self, epoch: int, start: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shrink mode's batch (:class:`ddp.elastic.EpochJob`): the sampler shares the epoch's
        rows from ``start`` on among ``world_size`` ranks; this rank's first ``batch_size``."""
        x, y = load_digits_split(self.seed)[:2]
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size, rank=rank, shuffle=True, seed=self.seed)
        sampler.set_epoch(epoch, start=start)
        rows = sampler.indices()[: self.batch_size]
        return x[rows], y[rows]


class _Data:
    """This rank's share of the training rows, epoch by epoch, from any position in the epoch."""

    def __init__(self, cfg: Config, rank: int, world_size: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch_size, self.world_size = cfg.batch_size, world_size
        if cfg.data == "scatter":  # only rank 0's copy is used; the others receive their shard
            self.shard: ScatterDataset | None = ScatterDataset((x, y) if rank == 0 else None, src=0, shuffle=True, seed=cfg.seed)
        else:
            self.shard = None
            self.full = TensorDataset(x, y)
            self.sampler = DistributedSampler(self.full, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)

    def epoch(self, epoch: int, consumed: int = 0) -> DataLoader:
        """The loader of ``epoch`` without its first ``consumed`` rows (all ranks' together)."""
        if self.shard is None:
            self.sampler.set_epoch(epoch, start=consumed)
            return DataLoader(self.full, batch_size=self.batch_size, sampler=self.sampler)
        self.shard.set_epoch(epoch)  # shard r holds rows order[r::N]: a consumed prefix is consumed / N of each
        rows = range(consumed // self.world_size, len(self.shard))
        return DataLoader(torch.utils.data.Subset(self.shard, rows), batch_size=self.batch_size, shuffle=False)


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train(was_training)
    return correct / max(len(y), 1)


def _identical_parameters(model: nn.Module) -> bool:
    """True on every rank iff every rank's parameters and buffers equal rank 0's bitwise.

    Checked with torch.distributed's own broadcast and all-reduce on its default process group,
    not ours: a bug in our collectives must not be able to vouch for itself.
    """
    flat = torch.cat([t.detach().reshape(-1).double() for t in list(model.parameters()) + list(model.buffers())])
    if tdist.get_backend() != "nccl":  # gloo moves CPU tensors
        flat = flat.cpu()
    reference = flat.clone()
    tdist.broadcast(reference, src=0)
    same = torch.tensor([1 if torch.equal(flat, reference) else 0], dtype=torch.int32, device=flat.device)
    tdist.all_reduce(same, tdist.ReduceOp.MIN)
    return bool(same.item())


def _gather_json(obj: Any, device: torch.device) -> list[Any] | None:
    """Gather a JSON-able object from every rank to rank 0 (as bytes, through our ``gather``)."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(collectives.get_world_size())]
    collectives.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    root = collectives.get_rank() == 0
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes] if root else None
    collectives.gather(padded, out, dst=0)
    if not root:
        return None
    assert out is not None
    return [json.loads(bytes(o[: int(s.item())].cpu().tolist()).decode()) for o, s in zip(out, sizes)]


def train(rank: int, world_size: int, cfg: Config) -> dict[str, Any] | None:
    """One rank's training loop; rank 0 returns the summary."""
    # Share the cores: OpenMP threads spinning in several processes at once slow every step down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if cfg.verbose:
        logging.getLogger("collectives").setLevel(logging.DEBUG)
        logging.getLogger("ddp").setLevel(logging.DEBUG)
    x_train, y_train, x_test, y_test = load_digits_split(cfg.seed)
    device = torch.device("cpu")
    if device_type_of(cfg.backend) == "cuda":  # one GPU per rank, data stays on the host until each batch
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    x_test, y_test = x_test.to(device), y_test.to(device)
    torch.manual_seed(cfg.seed + 1000 * rank)  # different initial weights: DDP's broadcast fixes them
    model: nn.Module = make_model(cfg.hidden).to(device)
    faults.mark_backward(model[0])  # a test's kill point (collectives.faults); nothing unless armed
    if cfg.naive:
        broadcast_module(model)
    elif cfg.torch_ddp:  # torch's own DDP; its collectives reach ours through torch.distributed
        group = tdist.new_group(backend="ringddp", pg_options=torch_backend.Options(backend=cfg.backend))
        model = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=cfg.bucket_mb)
    elif cfg.zero:
        model = ZeroDataParallel(model, stage=cfg.zero, bucket_cap_mb=cfg.bucket_mb)
    else:
        model = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb)
    if rank == 0 and not (cfg.naive or cfg.torch_ddp):  # torch's DDP keeps its layout to itself
        what = "units" if cfg.zero == 3 else "buckets"
        log.info("%s layout (%d %s, launched in this order):\n%s", what[:-1], len(model.buckets), what, model.describe_buckets())
    if cfg.zero:
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=cfg.lr, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    data = _Data(cfg, rank, world_size, x_train, y_train)
    at = _Position()
    epochs: list[dict[str, float]] = []
    epoch_loss = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's sum of losses, batches
    checkpointer = None
    if cfg.checkpoint_dir:
        checkpointer = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep, timeout=cfg.timeout)
        found = checkpointer.prepare(fingerprint(model, optimizer, **_resume_settings(cfg)), resume=cfg.resume)
        if found is not None:
            at, epochs, epoch_loss = _resume(checkpointer, found, model, optimizer, cfg, rank, world_size, device)
    memory = None
    tracer_cm = trace.tracing(rank) if cfg.trace else contextlib.nullcontext()
    started = time.perf_counter()
    with tracer_cm as tracer:
        for epoch in range(at.epoch, cfg.epochs):
            loader = data.epoch(epoch, at.consumed)
            first, skipped = at.batch, at.consumed  # batches and rows of this epoch done before (a resumed epoch)
            # Every rank must take the same number of steps (a scatter shard may be one row shorter).
            count = torch.tensor([len(loader)], dtype=torch.int64, device=device)
            collectives.all_reduce(count, ReduceOp.MIN)
            total = int(count.item())
            bar = _progress(rank, first + total, f"epoch {epoch + 1}/{cfg.epochs}", first)
            for i, (xb, yb) in enumerate(loader):
                if i >= total:
                    break
                batch, last = first + i, i + 1 == total
                xb, yb = xb.to(device), yb.to(device)
                sync = (batch + 1) % cfg.accum == 0 or last
                with trace.span("step", "train", epoch=epoch, batch=batch, sync=sync):
                    skip = not sync and not cfg.naive
                    if cfg.naive:  # what DDP's broadcast_buffers does: BatchNorm statistics follow rank 0
                        broadcast_tensors(list(model.buffers()))
                    with model.no_sync() if skip else contextlib.nullcontext():  # type: ignore[operator]
                        out = model(xb)
                        loss = F.cross_entropy(out, yb)
                        with trace.span("backward", "train"):
                            (loss / cfg.accum).backward()
                    if sync:
                        if cfg.naive:
                            all_reduce_gradients(model)
                        with trace.span("optimizer step", "train"):
                            faults.reached("step")
                            optimizer.step()
                            memory = memory_report(model, optimizer)  # gradients and state are all there now
                            optimizer.zero_grad()
                epoch_loss += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=device)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss.item():.4f}")
                    bar.update()
                if not sync:
                    continue
                at = _Position(epoch, batch + 1, skipped + (i + 1) * cfg.batch_size * world_size, at.step + 1)
                if checkpointer is not None and at.step % cfg.checkpoint_every == 0 and not last:
                    _checkpoint(checkpointer, model, optimizer, at, epochs, epoch_loss)
            if bar is not None:
                bar.close()
            collectives.all_reduce(epoch_loss)  # mean training loss over every rank's batches
            mean_loss = float(epoch_loss[0] / epoch_loss[1])
            epoch_loss.zero_()
            if cfg.naive:
                broadcast_tensors(list(model.buffers()))
            accuracy = _accuracy(model, x_test, y_test)
            epochs.append({"epoch": epoch + 1, "loss": mean_loss, "test_accuracy": accuracy})
            if rank == 0:
                log.info("epoch %2d/%d  train loss %.4f  test accuracy %5.1f%%", epoch + 1, cfg.epochs, mean_loss, 100 * accuracy)
            at = _Position(epoch + 1, 0, 0, at.step)
            if checkpointer is not None and (epoch + 1 == cfg.epochs or at.step % cfg.checkpoint_every == 0):
                _checkpoint(checkpointer, model, optimizer, at, epochs, epoch_loss)
    if checkpointer is not None:
        checkpointer.close()
    elapsed = time.perf_counter() - started
    if memory is None:  # resumed after the last step: nothing stepped in this process
        memory = memory_report(model, optimizer)
    if cfg.save_state:
        save_state(cfg.save_state, model, optimizer)

    with model.summon_full_params() if cfg.zero == 3 else contextlib.nullcontext():  # type: ignore[operator]
        identical = _identical_parameters(model)
    backend = backend_in_use(device)
    memory_per_rank = _gather_json(dataclasses.asdict(memory), device)
    events = _gather_json(tracer.export(), device) if tracer is not None else None
    if not identical:
        raise RuntimeError(f"rank {rank}: parameters differ between ranks after training")
    if rank != 0:
        return None
    summary = {
        "world_size": world_size,
        "backend": backend,
        "run": describe_run(cfg, world_size, backend),
        "mode": mode_name(cfg),
        "data": cfg.data,
        "epochs": epochs,
        "final_test_accuracy": epochs[-1]["test_accuracy"] if epochs else 0.0,
        "seconds": elapsed,
        "identical_parameters": identical,
        "memory_per_rank": memory_per_rank,
    }
    if cfg.trace and events is not None:
        trace.write_chrome_trace(cfg.trace, events)
        log.info("wrote Chrome trace %s (open in https://ui.perfetto.dev or chrome://tracing)", cfg.trace)
    if cfg.plot:
        curve_figure(epochs, plot_title(cfg, world_size, backend)).savefig(cfg.plot, dpi=100)
        log.info("wrote loss curve %s", cfg.plot)
    return summary


def _progress(rank: int, total: int, desc: str, done: int = 0):
    if rank != 0 or not sys.stderr.isatty():  # the per-epoch log lines say enough in a log file
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, leave=False, file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class _Position:
    """Where training stands after an optimizer step: ``batch`` batches of ``epoch`` done, which
    used its first ``consumed`` rows (all ranks' together), and ``step`` optimizer steps in all."""

    epoch: int = 0
    batch: int = 0
    consumed: int = 0
    step: int = 0


def _resume_settings(cfg: Config) -> dict[str, Any]:
    """What a checkpoint must have been trained with to be resumed (besides model and optimizer)."""
    return {"batch_size": cfg.batch_size, "accum": cfg.accum, "data": cfg.data, "seed": cfg.seed}


def _checkpoint(checkpointer: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer, at: _Position,
                epochs: list[dict[str, float]], epoch_loss: torch.Tensor) -> None:
    with trace.span("checkpoint", "train", step=at.step):
        checkpointer.save(at.step, model, optimizer, extra={
            "position": dataclasses.asdict(at), "epochs": epochs, "epoch_loss": epoch_loss.cpu()})


def _resume(checkpointer: Checkpointer, found: Found, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config,
            rank: int, world_size: int, device: torch.device) -> tuple[_Position, list[dict[str, float]], torch.Tensor]:
    """Load ``found``; the position, epoch history and this rank's partial epoch loss it holds.

    At another world size the position is in rows (the sampler shares the epoch's rest among the
    new ranks) and rank 0 carries the partial epoch's loss of every saved rank."""
    saved_n = int(found.manifest["world_size"])
    if saved_n != world_size and cfg.data == "scatter":
        raise CheckpointError(f"{found.path}: saved by {saved_n} ranks; --data scatter resumes only at that world size "
                              f"(this job has {world_size}); use --data sampler to change it")
    extras = checkpointer.load(found, model, optimizer)
    at = _Position(**extras[0]["position"])
    if saved_n == world_size:
        epoch_loss = extras[rank]["epoch_loss"].clone()
    else:
        epoch_loss = sum(e["epoch_loss"] for e in extras) if rank == 0 else torch.zeros(2, dtype=torch.float64)
    log.info("resumed at step %d: epoch %d, %d batches into it", at.step, at.epoch + 1, at.batch)
    return at, list(extras[0]["epochs"]), epoch_loss.to(device)


def save_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int | None = None) -> None:
    """``--save-state``: rank 0 writes ``{"model": ..., "optimizer": ...}``, the unwrapped model's
    full ``state_dict()`` and the optimizer's (ZeRO's consolidated), with ``torch.save`` through a
    temporary file and a rename. Collective for ZeRO; ``rank`` (default: this process's rank in
    the default group) lets the fault-tolerant launcher, which is in no group, write."""
    rank = collectives.get_rank() if rank is None else rank
    if kind_of(model) == "sharded":
        full = model.full_state_dict()  # type: ignore[operator]
        optimizer.consolidate_state_dict(0)  # type: ignore[attr-defined]
        if rank != 0:
            return
        state = {"model": full, "optimizer": optimizer.state_dict()}
    else:
        if rank != 0:
            return
        inner = getattr(model, "module", model)
        state = {"model": inner.state_dict(), "optimizer": optimizer.state_dict()}
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
    log.info("wrote the final model and optimizer state to %s", path)


def mode_name(cfg: Config) -> str:
    """What trained: ``naive DDP``, ``torch's DDP``, ``bucketed DDP`` (ours) or ``ZeRO-<stage>``."""
    if cfg.naive:
        return "naive DDP"
    if cfg.torch_ddp:
        return "torch's DDP"
    return f"ZeRO-{cfg.zero}" if cfg.zero else "bucketed DDP"


def backend_in_use(device: torch.device) -> str:
    """The backend that ran the default group's collectives on ``device`` tensors: the one asked
    for, or what ``auto`` picked (``shm`` on one host), and ``p2p`` where ``shm`` found no shared
    memory and fell back to it."""
    group = collectives.get_group()
    transport = getattr(group.engine(device), "transport", None)
    if isinstance(transport, ShmTransport) and transport.fell_back:
        return "p2p"
    return select_backend(group.backend, device.type, group).name


def describe_run(cfg: Config, world_size: int, backend: str) -> str:
    """The run in words, for the last log line and the plot: ranks (``world_size``: under torchrun
    not ``cfg``'s), what trained, data mode, and ``backend``, the one that ran
    (:func:`backend_in_use`), with the ``--backend`` asked for where it differs (``auto``)."""
    asked = "" if resolve_backend(cfg.backend) == backend else f" ({cfg.backend})"
    ranks = f"{world_size} rank{'' if world_size == 1 else 's'}"
    return f"{ranks}, {mode_name(cfg)}, {cfg.data} data, {backend} backend{asked}"


def plot_title(cfg: Config, world_size: int, backend: str) -> str:
    """The plot's title: :func:`describe_run`, then how gradients travel (bucket cap; stage 3
    communicates per module unit, naive DDP once after backward) and the accumulation."""
    if cfg.naive:
        how = "gradients all-reduced after backward"
    elif cfg.zero == 3:
        how = "one unit per module"
    else:
        how = f"{cfg.bucket_mb:g} MB buckets"
    if cfg.accum > 1:
        how += f", {cfg.accum} micro-batches per step"
    return f"digits: {describe_run(cfg, world_size, backend)}\n{how}"


def curve_figure(epochs: list[dict[str, float]], title: str) -> Figure:
    """The ``--plot`` figure: train loss (left axis, from 0) and test accuracy (right axis) by
    epoch, ticks on whole epochs, the legend under the axes where it covers neither a curve nor an
    axis label. ``epochs``: the summary's rows (``epoch``, ``loss``, ``test_accuracy``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: nothing global, no GUI backend
    from matplotlib.ticker import MaxNLocator

    xs = [e["epoch"] for e in epochs]
    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)  # lays out and draws without a display
    ax = fig.subplots()
    (loss,) = ax.plot(xs, [e["loss"] for e in epochs], marker="o", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("cross-entropy")
    ax.set_ylim(bottom=0)  # one epoch: the loss at the top, the accuracy (centred) below it
    ax.set_xlim(0.5, len(xs) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    twin = ax.twinx()
    (accuracy,) = twin.plot(xs, [100 * e["test_accuracy"] for e in epochs], color="tab:green", marker="s",
                            label="test accuracy")
    twin.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    fig.legend(handles=[loss, accuracy], loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # the bottom strip holds the legend
    return fig


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="ringddp-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=2, help="local processes to start (default 2)")
    p.add_argument("--backend", default="auto", type=backend_argument, help=f"collectives backend (default auto: shm on one host): {describe_backends()}")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank per micro-batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    p.add_argument("--bucket-mb", type=float, default=0.05, help="DDP bucket size in MiB (small model: small buckets)")
    p.add_argument("--naive", action="store_true", help="average gradients after backward instead of bucketed DDP")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 0 = DDP (default), 1 shards the optimizer state, 2 also the gradients, 3 also the parameters")
    p.add_argument("--torch-ddp", action="store_true",
                   help="train with torch's own DistributedDataParallel on the torch.distributed backend 'ringddp'")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (no_sync in between)")
    p.add_argument("--data", default="sampler", choices=["sampler", "scatter"], help="every rank samples / rank 0 scatters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any communication may block")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace of every rank")
    p.add_argument("--plot", metavar="OUT.png", help="write the loss / accuracy curve")
    p.add_argument("--verbose", "-v", action="store_true", help="log the bucket layout and every collective")
    p.add_argument("--checkpoint-dir", metavar="D", help="checkpoint the training state into D and resume from it")
    p.add_argument("--checkpoint-every", metavar="S", type=int, default=50, help="optimizer steps between checkpoints (default 50)")
    p.add_argument("--keep", metavar="K", type=int, default=3, help="complete checkpoints to keep (default 3)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="refuse to resume: fail if --checkpoint-dir already holds a checkpoint")
    p.add_argument("--save-state", metavar="OUT.pt", help="write rank 0's final model and optimizer state dicts (torch.save)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="survive members killed or stopped from outside: replace them, redo the lost step (bucketed DDP "
                        "or --zero 1|2, one host)")
    p.add_argument("--heartbeat", type=float, default=2.0, help="--fault-tolerant: seconds of silence that make a member dead")
    p.add_argument("--spares", metavar="K", type=int, default=0,
                   help="--fault-tolerant: warm spares kept ready to take a lost member's slot (default 0: start a new process)")
    p.add_argument("--max-respawns", metavar="N", type=int, help="--fault-tolerant: replace at most N lost members over the run")
    p.add_argument("--respawn-wait", metavar="S", type=float, default=60.0,
                   help="--fault-tolerant: seconds the survivors wait for a replacement (default 60)")
    p.add_argument("--shrink", action="store_true",
                   help="--fault-tolerant: when no replacement comes (--max-respawns, --respawn-wait), go on with fewer members")
    a = p.parse_args(argv)
    if not a.fault_tolerant and (a.spares or a.shrink or a.max_respawns is not None):
        p.error("--spares, --shrink and --max-respawns go with --fault-tolerant")
    if a.spares < 0 or (a.max_respawns is not None and a.max_respawns < 0) or not a.respawn_wait >= 0:
        p.error("--spares and --max-respawns must be >= 0, --respawn-wait a number of seconds >= 0")
    if a.fault_tolerant:
        if a.zero == 3:
            p.error("--fault-tolerant runs ZeRO-1/2 (a replica of each optimizer shard on the next rank), not ZeRO-3, "
                    "whose parameter shards would need replicas too: use --zero 2 (or 1, or 0 for DDP)")
        clash = [flag for flag, on in [("--naive", a.naive), ("--torch-ddp", a.torch_ddp),
                                       ("--accum", a.accum != 1), ("--data scatter", a.data == "scatter"),
                                       ("--checkpoint-dir", a.checkpoint_dir), ("--trace", a.trace), ("--plot", a.plot)] if on]
        if clash:
            p.error(f"--fault-tolerant runs bucketed DDP or ZeRO-1/2 with --data sampler and --accum 1; drop {', '.join(clash)}")
        if resolve_backend(a.backend) not in ("auto", "shm", "p2p"):
            p.error(f"--fault-tolerant re-forms groups on the shm and p2p backends (or auto), not {a.backend}")
        if a.world_size < 2 or not a.heartbeat > 0:
            p.error("--fault-tolerant needs --world-size >= 2 and --heartbeat > 0")
        if os.environ.get("TORCHELASTIC_RUN_ID") or "RANK" in os.environ:
            p.error("--fault-tolerant starts and replaces its own members: run it without torchrun")
    if a.checkpoint_every < 1 or a.keep < 1:
        p.error("--checkpoint-every and --keep must be >= 1")
    if a.save_state and not os.path.isdir(os.path.dirname(os.path.abspath(a.save_state))):
        p.error(f"--save-state {a.save_state}: its directory does not exist")
    if a.world_size < 1 or a.epochs < 1 or a.batch_size < 1 or a.accum < 1:
        p.error("--world-size, --epochs, --batch-size and --accum must be >= 1")
    if a.naive and a.zero:
        p.error("--naive and --zero exclude each other (the naive form is stage 0 without buckets)")
    if a.torch_ddp and (a.naive or a.zero or device_type_of(a.backend) != "cpu"):
        p.error("--torch-ddp runs torch's DDP on the CPU backend 'ringddp': not with --naive, --zero or a CUDA --backend")
    if device_type_of(a.backend) == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--backend {a.backend} needs CUDA GPUs (nccl-cupy: pip install 'ringddp[cuda]')")
        if a.data == "scatter":
            p.error(f"--data scatter ships CPU tensors; use --data sampler with --backend {a.backend}")
    return Config(
        world_size=a.world_size, backend=a.backend, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
        hidden=a.hidden, bucket_mb=a.bucket_mb, naive=a.naive, torch_ddp=a.torch_ddp, zero=a.zero, accum=a.accum,
        data=a.data, seed=a.seed,
        timeout=a.timeout, trace=a.trace, plot=a.plot, verbose=a.verbose, checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every, keep=a.keep, resume=a.resume, save_state=a.save_state,
        fault_tolerant=a.fault_tolerant, heartbeat=a.heartbeat, spares=a.spares, shrink=a.shrink,
        max_respawns=a.max_respawns, respawn_wait=a.respawn_wait,
    )  # fmt: skip


def fault_tolerant(cfg: Config) -> int:
    """``--fault-tolerant``: the job on :func:`ddp.elastic.run` (members replaced, steps redone)."""
    job = DigitsJob(cfg.epochs, cfg.world_size, cfg.batch_size, cfg.hidden, cfg.seed)
    ecfg = elastic.Config(job=job, world_size=cfg.world_size, lr=cfg.lr, bucket_mb=cfg.bucket_mb, seed=cfg.seed,
                          backend=resolve_backend(cfg.backend), heartbeat=cfg.heartbeat, timeout=cfg.timeout,
                          spares=cfg.spares, shrink=cfg.shrink, max_respawns=cfg.max_respawns,
                          respawn_wait=cfg.respawn_wait, zero=cfg.zero)
    started = time.monotonic()
    try:
        out = elastic.run(ecfg)
    except collectives.LaunchError as exc:
        log.error("ringddp-train: error: %s", exc)
        return 1
    if not all(r["identical"] for r in out.reports.values()):
        log.error("ringddp-train: the members' parameters differ")
        return 1
    first = next(r for r in out.reports.values() if r["state"] is not None)  # rank 0 of the last generation
    if cfg.save_state:  # ZeRO's optimizer state comes consolidated: a plain SGD's state dict
        model = job.model()
        model.load_state_dict(first["state"])
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        optimizer.load_state_dict(first["optimizer"])
        save_state(cfg.save_state, model, optimizer, rank=0)
    redone = sum(r["failed_steps"] for r in out.reports.values())
    if cfg.shrink:
        log.info("membership (from step: slots): %s", ", ".join(f"{s}: {list(k)}" for s, k in first["history"]))
    log.info("done: fault-tolerant %s, %d ranks: %d steps in %.1fs; parameters identical on every rank; "
             "%d members replaced, %d step attempts redone", mode_name(cfg), len(out.reports), first["steps"], time.monotonic() - started,
             out.recoveries, redone)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if cfg.fault_tolerant:
        return fault_tolerant(cfg)
    try:
        results = collectives.launch(train, cfg.world_size, cfg, backend=cfg.backend, timeout=cfg.timeout, log_level=logging.INFO)
    except CheckpointError as exc:  # bad input, found before anything was written
        log.error("ringddp-train: error: %s", exc)
        return 1
    summary = next((r for r in results if r is not None), None)
    if summary is None:
        return 0  # under torchrun: only rank 0's process reports
    log.info("%s", format_memory(summary["memory_per_rank"], summary["mode"]))
    log.info("%s", done_message(summary))
    return 0


def done_message(summary: dict[str, Any]) -> str:
    """The job's last line, from rank 0's summary (:func:`train`)."""
    epochs = len(summary["epochs"])
    return (f"done: {summary['run']}: trained {epochs} epoch{'' if epochs == 1 else 's'} in {summary['seconds']:.1f}s; "
            f"parameters identical on every rank; final test accuracy {100 * summary['final_test_accuracy']:.1f}%")


def format_memory(per_rank: list[dict[str, Any]], mode: str) -> str:
    """The per-rank memory table the job prints (MiB, by tensor accounting; peaks during a step)."""

    def cell(held: int, peak: int | None) -> str:
        return f"{held / 2**20:.3f}" + (f" (peak {peak / 2**20:.3f})" if peak is not None and peak != held else "")

    rows = [("rank", "parameters", "gradients", "optimizer state")]
    for r, m in enumerate(per_rank):
        rows.append((str(r), cell(m["params"], m["params_peak"]), cell(m["grads"], m["grads_peak"]), cell(m["optimizer"], None)))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines = [f"memory per rank after the last step, {mode} (MiB, tensor accounting):"]
    lines += ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
