"""Sharded checkpoints: every rank saves what it owns; any world size (or stage) loads them.

::

    ddp.zero.save_checkpoint("ckpt/step-1000", model, optimizer, extra={"step": 1000})
    ...                                             # later, maybe with another number of ranks
    extra = ddp.zero.load_checkpoint("ckpt/step-1000", model, optimizer)

Rank ``r`` of ``n`` writes ``shard-r-of-n.pt``: for every piece it owns (``flat.py``), the master
values and the optimizer state of those elements, keyed by the parameter's *name* and element
range; rank 0 adds what is replicated (buffers, parameters outside the flat units, the state of a
stage-0 optimizer) and the param groups' hyperparameters. Nothing is gathered: saving costs one
file write per rank and a barrier, and no rank ever holds more than its shard.

Loading reads every rank's file (memory-mapped: only the bytes used are read) and fills each of
this rank's pieces from whatever saved ranges overlap it. Names and element ranges do not depend
on the world size, the bucket layout or the stage, so a checkpoint saved by 4 ranks at stage 3
loads into 2 ranks at stage 2; a rank that finds a piece not fully covered raises ``ValueError``
naming it. Full, unsharded state dicts: ``ZeroDataParallel.full_state_dict`` and the optimizer's
``consolidate_state_dict``.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

import collectives

from .model import ZeroDataParallel
from .optimizer import ZeroRedundancyOptimizer

FORMAT = 1
_Ranges = list[tuple[int, int, Any]]  # (start, stop, payload) of one parameter's flattened elements


def sharded_state_dict(
    model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer | None = None, extra: Any = None
) -> dict[str, Any]:
    """What this rank saves (see the module docstring). Not collective."""
    group = model.process_group
    rank, n = collectives.get_rank(group), collectives.get_world_size(group)
    params: dict[str, _Ranges] = {}
    in_units = set()
    for unit in model.units:
        for piece in unit.layout.pieces(unit.rank):
            a, b = piece.offset, piece.offset + piece.numel
            params.setdefault(unit.names[piece.param], []).append((piece.start, piece.stop, unit.master[a:b].clone()))
        in_units.update(id(p) for p in unit.params)
    named = list(model.module.named_parameters())
    if rank == 0:
        for name, p in named:
            if id(p) not in in_units:
                params[name] = [(0, p.numel(), p.detach().reshape(-1).clone())]
    out: dict[str, Any] = {
        "format": FORMAT,
        "world_size": n,
        "rank": rank,
        "stage": model.stage,
        "shapes": {name: list(model.full_shape(p)) for name, p in named},
        "params": params,
        "buffers": {name: b.detach().clone() for name, b in model.module.named_buffers()} if rank == 0 else {},
        "extra": extra if rank == 0 else None,
    }
    if optimizer is not None:
        state: dict[str, _Ranges] = {}
        if rank == 0 or not optimizer.replicated:
            for name, start, stop, t in optimizer.shards():
                saved = optimizer.optim.state.get(t)
                if saved:
                    values = {k: (v.detach().reshape(-1).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in saved.items()}
                    state.setdefault(name, []).append((start, stop, values))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": len(g["params"])} for g in optimizer.param_groups]
        out["optimizer"] = {"param_groups": groups, "state": state}
    return out


@torch.no_grad()
def load_sharded_state_dict(
    model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer | None, shards: list[dict[str, Any]]
) -> Any:
    """Load the files of every saved rank (``shards``) into ``model`` and ``optimizer``; returns the
    ``extra`` saved with them. Collective (stages 1, 2 all-gather the loaded chunks of every unit,
    frozen ones included)."""
    if not shards or any(s.get("format") != FORMAT for s in shards):
        raise ValueError(f"load_checkpoint: expected shards in format {FORMAT}")
    saved_n = shards[0]["world_size"]
    if sorted(s["rank"] for s in shards) != list(range(saved_n)):
        raise ValueError(f"load_checkpoint: the checkpoint was saved by {saved_n} ranks; got the shards of ranks {sorted(s['rank'] for s in shards)}")
    shapes = shards[0]["shapes"]
    mine = {name: list(model.full_shape(p)) for name, p in model.module.named_parameters()}
    if shapes != mine:
        differ = sorted(k for k in set(shapes) | set(mine) if shapes.get(k) != mine.get(k))
        raise ValueError(f"load_checkpoint: the saved parameters differ from the model's (names or shapes): {differ}")
    model.prepare_step()  # stage 3: nothing may stay gathered from the old values
    params = _merge(shards, lambda s: s["params"])
    in_units = set()
    for unit in model.units:
        for piece in unit.layout.pieces(unit.rank):
            a, b = piece.offset, piece.offset + piece.numel
            name = unit.names[piece.param]
            _fill(unit.master[a:b], params.get(name, []), piece.start, piece.stop, name)
        in_units.update(id(p) for p in unit.params)
    for name, p in model.module.named_parameters():
        if id(p) not in in_units:  # through a flat copy: reshape(-1) of a non-contiguous p is a copy too
            flat = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            _fill(flat, params.get(name, []), 0, p.numel(), name)
            p.detach().copy_(flat.view(p.shape))
    buffers = shards[[s["rank"] for s in shards].index(0)]["buffers"]
    for name, b in model.module.named_buffers():
        b.copy_(buffers[name])
    model.publish(frozen=True)  # every unit: a frozen one's full values come from the file too
    if optimizer is not None:
        _load_optimizer(optimizer, shards)
    return shards[[s["rank"] for s in shards].index(0)]["extra"]


def _load_optimizer(optimizer: ZeroRedundancyOptimizer, shards: list[dict[str, Any]]) -> None:
    saved = [s.get("optimizer") for s in shards]
    if any(s is None for s in saved):
        raise ValueError("load_checkpoint: the checkpoint has no optimizer state")
    groups = saved[0]["param_groups"]
    if [g["params"] for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("load_checkpoint: the saved optimizer has other param groups than this one")
    for outer, group in zip(optimizer.param_groups, groups):
        outer.update({k: v for k, v in group.items() if k != "params"})
    state = _merge(shards, lambda s: s["optimizer"]["state"])
    optimizer.optim.state.clear()
    for name, start, stop, t in optimizer.shards():
        ranges = [(a, b, values) for a, b, values in state.get(name, []) if a < stop and b > start]
        if not ranges:
            continue
        loaded: dict[str, Any] = {}
        for key, value in ranges[0][2].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                target = torch.empty(stop - start, dtype=t.dtype, device=t.device)
                _fill(target, [(a, b, values[key]) for a, b, values in ranges], start, stop, f"{name} ({key})")
                loaded[key] = target
            else:
                loaded[key] = value.clone() if isinstance(value, torch.Tensor) else value
        optimizer.optim.state[t] = loaded


def _merge(shards: list[dict[str, Any]], part) -> dict[str, _Ranges]:  # type: ignore[no-untyped-def]
    out: dict[str, _Ranges] = {}
    for s in shards:
        for name, ranges in part(s).items():
            out.setdefault(name, []).extend(ranges)
    return out


def _fill(target: torch.Tensor, ranges: _Ranges, start: int, stop: int, what: str) -> None:
    """Copy the saved ranges overlapping ``[start, stop)`` into ``target`` (1-D, ``stop - start``)."""
    covered = 0
    for a, b, values in ranges:
        lo, hi = max(start, a), min(stop, b)
        if lo < hi:
            target[lo - start : hi - start].copy_(values[lo - a : hi - a])
            covered += hi - lo
    if covered != stop - start:
        raise ValueError(f"load_checkpoint: elements {start}:{stop} of {what} are covered {covered} times out of {stop - start}")


def _path(directory: str | os.PathLike, rank: int, n: int) -> str:
    return os.path.join(directory, f"shard-{rank:05d}-of-{n:05d}.pt")


def save_checkpoint(
    directory: str | os.PathLike,
    model: ZeroDataParallel,
    optimizer: ZeroRedundancyOptimizer | None = None,
    extra: Any = None,
) -> None:
    """Every rank writes its shard into ``directory`` (collective: returns once all have written).
    ``extra`` (rank 0's) is saved too: a step count, a sampler state, ..."""
    group = model.process_group
    os.makedirs(directory, exist_ok=True)
    torch.save(sharded_state_dict(model, optimizer, extra), _path(directory, collectives.get_rank(group), collectives.get_world_size(group)))
    collectives.barrier(group=group)


def load_checkpoint(
    directory: str | os.PathLike, model: ZeroDataParallel, optimizer: ZeroRedundancyOptimizer | None = None
) -> Any:
    """Load a :func:`save_checkpoint` directory at any world size; returns the saved ``extra``."""
    files = sorted(glob.glob(os.path.join(directory, "shard-*-of-*.pt")))
    counts = {int(m.group(1)) for m in (re.search(r"-of-(\d+)\.pt$", f) for f in files) if m}
    if len(counts) != 1:
        raise ValueError(f"load_checkpoint: {directory} holds no checkpoint, or shards of several ({sorted(counts)} ranks)")
    shards = [torch.load(f, map_location="cpu", mmap=True, weights_only=True) for f in files]
    return load_sharded_state_dict(model, optimizer, shards)


__all__ = ["load_checkpoint", "load_sharded_state_dict", "save_checkpoint", "sharded_state_dict"]
