"""Whole-job checkpoints: periodic, atomic on disk, resumed by themselves, bitwise the same result.

A job that loses every process (torchrun restarting all workers after one died, a preempted
allocation) continues from the newest checkpoint in its directory::

    ckpt = Checkpointer("ckpt", keep=3)
    found = ckpt.prepare(fingerprint(model, optimizer, batch_size=32))  # collective; None: start fresh
    if found is not None:
        extras = ckpt.load(found, model, optimizer)     # every saved rank's extra; RNG restored
    ...
    ckpt.save(step, model, optimizer, extra={...})      # after an optimizer step, on every rank
    ckpt.close()                                        # waits for the last background write

**On disk** (``D`` = the directory; ``n`` = ranks that saved)::

    D/step-00000050/MANIFEST.json             format, step, world size, kind, fingerprint, and
                                              every file's bytes and sha256
    D/step-00000050/rank-00000-of-00002.pt    per rank: RNG states, the caller's extra, and the
    D/step-00000050/rank-00001-of-00002.pt    model/optimizer state (below)

``kind`` is how the model and optimizer are held: ``replicated`` (our DDP, naive DDP: rank 0's
file holds ``state_dict()`` of the module and the optimizer, every rank's its RNG and extra),
``sharded`` (ZeRO-1/2/3: every rank's file holds :func:`ddp.zero.sharded_state_dict`, loadable at
any world size and stage) or ``dcp`` (torch's DDP: ``torch.distributed.checkpoint`` writes the
model and optimizer into ``D/step-N/`` with its own files; ours add RNG, extra and rank 0's
buffers: DCP writes one copy of a tensor every rank holds, from whichever rank it picks, and
torch's DDP leaves each rank its own BatchNorm statistics until the next forward broadcasts rank
0's, so the copy DCP kept may be another rank's).

**Atomic.** Everything is written into ``D/.partial-step-N/``: each rank writes its file, fsyncs
it and then (write + rename) ``done-r.json`` with the file's size and sha256; rank 0 waits for
every rank's ``done``, writes ``MANIFEST.json`` the same way, and renames the directory to
``D/step-N`` (one ``rename``: a reader sees all of it or nothing). Then it removes all but the
newest ``keep`` checkpoints (each renamed away first, then deleted). A kill at any moment leaves
either a complete ``step-N`` or a ``.partial-`` directory, which is ignored and removed at the next
start. On start rank 0 checks the newest ``step-N``: its manifest, every file's size and sha256; a
corrupt or truncated one is skipped with a warning naming the file, and the next older one used.

**Background.** :meth:`Checkpointer.save` copies synchronously only what the next forward
changes (buffers), the RNG states and the caller's extra; for our DDP the parameters and the
optimizer state are copied by a writer thread, which a pre-hook on ``optimizer.step()`` waits for
(nothing else changes them: the copy overlaps the next forward and backward), into staging
tensors reused from the last save. The thread then lowers its CPU priority (nice 19) and
serialises, hashes and writes while training continues; the next ``save`` (or ``close``) first
waits for it. ZeRO's shards are copied synchronously (``sharded_state_dict``: 1/N of the state);
``dcp`` saves are synchronous (``torch.distributed.checkpoint`` runs collectives on torch's
default group, which the training loop uses too).

**Bad input** fails at :meth:`Checkpointer.prepare`, on every rank, before anything on disk is
touched: a directory that cannot be written, a checkpoint of another format version, kind,
model (parameter names/shapes), optimizer (class, hyperparameters) or training settings raises
:class:`CheckpointError` naming ``MANIFEST.json`` and what differs.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from typing import Any

import torch
import torch.nn as nn

import collectives
from collectives import faults

from .zero import ZeroDataParallel, ZeroRedundancyOptimizer
from .zero.checkpoint import load_sharded_state_dict, sharded_state_dict

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "MANIFEST.json"
_STEP = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint this job cannot use; the message names the file."""


def kind_of(model: nn.Module) -> str:
    """``sharded`` (ZeRO), ``dcp`` (torch's DDP) or ``replicated`` (ours, naive, a plain module)."""
    if isinstance(model, ZeroDataParallel):
        return "sharded"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "dcp"
    return "replicated"


def _module(model: nn.Module) -> nn.Module:
    """The wrapped module of a DDP/ZeRO wrapper (its ``module``), else ``model`` itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer, **settings: Any) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: format, kind, parameter names and shapes,
    optimizer class and hyperparameters, and ``settings`` (JSON values: batch size, seed, ...)."""
    inner = _module(model)
    shapes = {name: list(model.full_shape(p)) if isinstance(model, ZeroDataParallel) else list(p.shape)
              for name, p in inner.named_parameters()}
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    groups = [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in optimizer.param_groups]
    return {
        "format": FORMAT,
        "kind": kind_of(model),
        "parameters": shapes,
        "optimizer": {"class": type(local).__name__, "param_groups": groups},
        "settings": settings,
    }


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words (empty: compatible)."""
    if saved.get("format") != mine["format"]:  # the rest of an unknown format means nothing
        return [f"checkpoint format {saved.get('format')} (this version reads format {mine['format']})"]
    out = []
    if saved.get("kind") != mine["kind"]:
        out.append(f"kind: saved {saved.get('kind')}, this job {mine['kind']}")
    a, b = saved.get("parameters", {}), mine["parameters"]
    names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if names:
        shown = ", ".join(f"{k} saved {a.get(k, 'absent')} here {b.get(k, 'absent')}" for k in names[:4])
        out.append(f"model parameters: {shown}" + (f" (and {len(names) - 4} more)" if len(names) > 4 else ""))
    if saved.get("optimizer") != mine["optimizer"]:
        out.append(f"optimizer: saved {saved.get('optimizer')}, this job {mine['optimizer']}")
    for key in sorted(set(saved.get("settings", {})) | set(mine["settings"])):
        if saved.get("settings", {}).get(key) != mine["settings"].get(key):
            out.append(f"{key}: saved {saved.get('settings', {}).get(key)!r}, this job {mine['settings'].get(key)!r}")
    return out


# ---------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """Every RNG that can affect training, of this process: torch (CPU, CUDA), Python, NumPy."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _plain(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return out
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _plain(value: Any) -> Any:
    """Tuples to lists (loadable with ``weights_only``)."""
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _stage(value: Any, staging: list[torch.Tensor]) -> Any:
    """A copy of nested dicts/lists with every tensor copied into the tensor of ``staging`` (the
    copies of the last save) at the same place, where shape and dtype match (no fresh pages to
    fault in: the copy runs at memory speed), else into a new one, which ``staging`` keeps."""
    at = 0

    def copy(v: Any) -> Any:
        nonlocal at
        if isinstance(v, torch.Tensor):
            old = staging[at] if at < len(staging) else None
            if old is not None and old.shape == v.shape and old.dtype == v.dtype and old.device == v.device:
                new = old.copy_(v.detach())
            else:
                new = v.detach().clone()
                staging[at:at + 1] = [new]
            at += 1
            return new
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(copy(x) for x in v)
        return copy_module.copy(v)

    out = copy(value)
    del staging[at:]
    return out


def _merge_states(payload: dict[str, Any], deferred: dict[str, Any]) -> dict[str, Any]:
    """The payload with the deferred parts in (the parameters joined to the buffers: the order of
    a state dict's keys does not matter to ``load_state_dict``)."""
    out = dict(payload)
    if "model" in deferred:
        out["model"] = {**deferred["model"], **payload.get("model", {})}
    if "optimizer" in deferred:
        out["optimizer"] = deferred["optimizer"]
    return out


def _lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: a thread's nice value is its own),
    so a background write takes the CPU time training leaves idle rather than training's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


# ---------------------------------------------------------------------------- files


class _Hashing:
    """A binary file that hashes what is written through it (``torch.save`` streams into it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.bytes += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save`` into ``path`` (temporary name, fsync, rename); its bytes and sha256."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        out = _Hashing(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, rename."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rank_file(rank: int, n: int) -> str:
    return f"rank-{rank:05d}-of-{n:05d}.pt"


@dataclasses.dataclass
class Found:
    """A complete, verified checkpoint: its directory and manifest."""

    path: str
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def verify(path: str) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path`` after checking every file's size and sha256;
    raises :class:`CheckpointError` naming the first file that is missing, short or altered."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable ({exc})") from exc
    for name, meta in manifest.get("files", {}).items():
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
        except OSError as exc:
            raise CheckpointError(f"{file}: missing ({exc.strerror})") from exc
        if size != meta["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {meta['bytes']} (truncated?)")
        if _sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest's (corrupted)")
    return manifest


class Checkpointer:
    """Periodic whole-job checkpoints in ``directory`` (see the module docstring).

    Args:
        directory: where ``step-N`` directories live; created if missing.
        keep: how many complete checkpoints to keep (the newest).
        background: write our own formats in a thread after a synchronous copy.
        timeout: seconds rank 0 waits for the other ranks' files before giving a checkpoint up.
        group: the collectives group of the job (default: the world).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, background: bool = True,
                 timeout: float = 60.0, group: Any = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.background = background
        self.timeout = timeout
        self.group = group
        self.rank = collectives.get_rank(group)
        self.world_size = collectives.get_world_size(group)
        self._fingerprint: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: list[torch.Tensor] = []  # the copies of the last save, reused by the next
        self._deferred_staging: list[torch.Tensor] = []
        self._copied = threading.Event()
        self._copied.set()
        self._guarded: torch.optim.Optimizer | None = None
        self._hook: Any = None
        self.write_cpu_s = 0.0  #: CPU seconds the last background write took (copy, serialise, hash, write)
        self.held_s = 0.0  #: seconds optimizer steps waited, in all, for the writer thread's copy

    # ------------------------------------------------------------------ start

    def steps(self) -> list[int]:
        """Steps of the ``step-N`` directories present (complete or not), oldest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)

    def path(self, step: int) -> str:
        """Where checkpoint ``step`` lives (complete or not)."""
        return os.path.join(self.directory, f"step-{step:08d}")

    def _scan(self, mine: dict[str, Any], resume: bool) -> Found | None:
        """Rank 0's start: check the directory and pick the newest valid checkpoint (raises
        :class:`CheckpointError`); only then remove leftovers of interrupted saves."""
        d = self.directory
        if os.path.exists(d) and not os.path.isdir(d):
            raise CheckpointError(f"checkpoint directory {d}: exists and is not a directory")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {d}: cannot be created ({exc.strerror})") from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {d}: not writable by this user")
        steps = self.steps()
        if steps and not resume:
            raise CheckpointError(
                f"checkpoint directory {d}: holds checkpoints (newest {os.path.basename(self.path(steps[-1]))}) and "
                "resuming was refused (--no-resume); they are left alone: choose an empty directory or remove them")
        found = None
        for step in reversed(steps):
            path = self.path(step)
            try:
                manifest = verify(path)
            except CheckpointError as exc:
                log.warning("checkpoint %s is not usable, falling back to the previous one: %s", path, exc)
                continue
            wrong = differences(manifest.get("fingerprint", manifest), mine)
            if wrong:
                raise CheckpointError(f"{os.path.join(path, MANIFEST)}: this job cannot resume it: " + "; ".join(wrong))
            found = Found(path, manifest)
            break
        for name in os.listdir(d):  # what a killed save or prune left behind
            if name.startswith((".partial-", ".removing-")):
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)
        return found

    def prepare(self, mine: dict[str, Any], resume: bool = True) -> Found | None:
        """Collective: check the directory and find the newest valid checkpoint (rank 0 reads, all
        ranks get its answer). Raises :class:`CheckpointError` on every rank for bad input."""
        self._fingerprint = mine
        answer: list[Any] = [None]
        if self.rank == 0:
            try:
                found = self._scan(mine, resume)
                answer = [("ok", None if found is None else dataclasses.asdict(found))]
            except CheckpointError as exc:
                answer = [("error", str(exc))]
        collectives.broadcast_object_list(answer, src=0, group=self.group)
        status, value = answer[0]
        if status == "error":
            raise CheckpointError(value)
        if value is None:
            return None
        found = Found(**value)
        log.info("resuming from %s (step %d, saved by %d ranks)", found.path, found.step, found.manifest["world_size"])
        return found

    # ------------------------------------------------------------------ save

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None) -> None:
        """Checkpoint the state after optimizer step ``step``; call it on every rank. Collective only
        for ``dcp``; otherwise each rank copies its part and writes it (in the background), and
        rank 0 publishes the checkpoint once every rank's file is on disk."""
        self.wait()
        if self._fingerprint is None:
            raise RuntimeError("Checkpointer.save: call prepare() first (it checks the directory)")
        kind = kind_of(model)
        partial = os.path.join(self.directory, f".partial-step-{step:08d}")
        os.makedirs(partial, exist_ok=True)
        payload: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "rng": rng_state(), "extra": extra}
        deferred: dict[str, Any] = {}  # copied by the writer thread before the next optimizer step
        if kind == "sharded":
            payload["sharded"] = sharded_state_dict(model, optimizer)  # clones
        elif kind == "replicated" and self.rank == 0:
            inner = _module(model)
            params = {id(p) for p in inner.parameters()}
            state = inner.state_dict(keep_vars=True)
            payload["model"] = {k: v for k, v in state.items() if id(v) not in params}  # buffers: forward changes them
            deferred["model"] = {k: v for k, v in state.items() if id(v) in params}
            deferred["optimizer"] = optimizer.state_dict()
        if kind == "dcp" and self.rank == 0:  # the buffers every rank gets at the next forward (see the module docstring)
            payload["buffers"] = dict(_module(model).named_buffers())
        payload = _stage(payload, self._staging)
        if deferred and self.background:
            self._guard(optimizer)
            self._copied.clear()
        elif deferred:
            payload = _merge_states(payload, _stage(deferred, self._deferred_staging))
            deferred = {}
        if kind == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial)
        if self.background and kind != "dcp":
            self._thread = threading.Thread(target=self._write_in_background, args=(step, partial, payload, deferred), daemon=True,
                                            name=f"checkpoint step {step}")
            self._thread.start()
        else:
            self._write(step, partial, payload)

    def _guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait until the writer thread has copied what it changes."""
        if self._guarded is not optimizer:
            if self._hook is not None:
                self._hook.remove()
            self._hook = optimizer.register_step_pre_hook(lambda *_: self._wait_copied())
            self._guarded = optimizer

    def _wait_copied(self) -> None:
        if not self._copied.is_set():
            started = time.perf_counter()
            self._copied.wait()
            self.held_s += time.perf_counter() - started

    def _write_in_background(self, step: int, partial: str, payload: dict[str, Any], deferred: dict[str, Any]) -> None:
        started = time.thread_time()
        try:
            if deferred:
                payload = _merge_states(payload, _stage(deferred, self._deferred_staging))
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = exc
            return
        finally:
            self._copied.set()
        _lower_priority()  # the copy is done: the rest may wait for idle CPU
        self._write(step, partial, payload)
        self.write_cpu_s = time.thread_time() - started

    def _write(self, step: int, partial: str, payload: dict[str, Any]) -> None:
        try:
            name = _rank_file(self.rank, self.world_size)
            done = {name: _save_hashed(payload, os.path.join(partial, name))}
            faults.reached("checkpoint")  # a test's kill point: this rank's file written, the checkpoint not complete
            _write_atomic(os.path.join(partial, f"done-{self.rank}.json"), json.dumps(done).encode())
            if self.rank == 0:
                self._finish(step, partial)
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = exc

    def _finish(self, step: int, partial: str) -> None:
        """Rank 0: wait for every rank's file, write the manifest, publish by rename, prune."""
        deadline = time.monotonic() + self.timeout
        markers = [os.path.join(partial, f"done-{r}.json") for r in range(self.world_size)]
        while not all(os.path.exists(m) for m in markers):
            if time.monotonic() > deadline:
                missing = [r for r, m in enumerate(markers) if not os.path.exists(m)]
                raise TimeoutError(f"checkpoint step {step}: ranks {missing} did not write {partial} within {self.timeout:g}s")
            time.sleep(0.005)
        files: dict[str, Any] = {}
        for m in markers:
            with open(m, encoding="utf-8") as f:
                files.update(json.load(f))
        for name in sorted(os.listdir(partial)):  # torch.distributed.checkpoint's own files
            if name not in files and not name.startswith("done-") and not name.endswith(".tmp"):
                path = os.path.join(partial, name)
                files[name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
        manifest = {"format": FORMAT, "step": step, "world_size": self.world_size, "kind": self._fingerprint["kind"],
                    "fingerprint": self._fingerprint, "files": files, "written": time.time()}
        _write_atomic(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1).encode())
        final = self.path(step)
        if os.path.exists(final):  # a corrupt one skipped at start: replaced by this one
            self._remove(final)
        os.rename(partial, final)
        _fsync_dir(self.directory)
        for old in self.steps()[: -self.keep]:
            self._remove(self.path(old))
        log.debug("checkpoint %s written (%d files)", final, len(files))

    def _remove(self, path: str) -> None:
        gone = os.path.join(self.directory, ".removing-" + os.path.basename(path))
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the background write; raise its error here if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint write in {self.directory} failed: {error}") from error

    close = wait

    def writing(self) -> bool:
        """Whether a background write is still running (not collective)."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ load

    def load(self, found: Found, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
        """Load ``found`` into ``model`` and ``optimizer`` (collective), restore this rank's RNG
        states (a rank that did not exist when it was saved keeps its own), and return every saved
        rank's ``extra`` (index = saved rank)."""
        n = int(found.manifest["world_size"])
        files = self.files(found)
        kind = kind_of(model)
        if kind == "sharded":
            load_sharded_state_dict(model, optimizer, [f["sharded"] for f in files])
        elif kind == "replicated":
            _module(model).load_state_dict(files[0]["model"])
            optimizer.load_state_dict(files[0]["optimizer"])
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=found.path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with torch.no_grad():
                for name, b in _module(model).named_buffers():
                    b.copy_(files[0]["buffers"][name])
        if self.rank < n:
            set_rng_state(files[self.rank]["rng"])
        return [f["extra"] for f in files]

    def files(self, found: Found) -> list[dict[str, Any]]:
        """Every saved rank's file of ``found`` (memory-mapped), index = saved rank."""
        n = int(found.manifest["world_size"])
        return [torch.load(os.path.join(found.path, _rank_file(r, n)), map_location="cpu", mmap=True, weights_only=True)
                for r in range(n)]


__all__ = ["CheckpointError", "Checkpointer", "Found", "differences", "fingerprint", "kind_of", "rng_state",
           "set_rng_state", "verify"]
