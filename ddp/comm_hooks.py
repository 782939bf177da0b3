"""Comm hooks: how DDP reduces a bucket, replaceable, with torch's interface.

::

    model = ddp.DistributedDataParallel(net)
    model.register_comm_hook(None, ddp.comm_hooks.fp16_compress_hook)   # state: the group, or None

A hook is ``hook(state, bucket) -> torch.futures.Future``. ``bucket`` is a
:class:`~ddp.reducer.GradBucket` (``buffer()``: the flat gradients of the bucket, ``index()``,
``parameters()``, ``gradients()``, ``is_last()``, ``set_buffer()``); the future's value is the
reduced flat tensor, which DDP copies into the bucket (nothing to copy when it *is*
``bucket.buffer()``) and then into ``param.grad``. A hook written for torch DDP runs unchanged
when it calls ``collectives`` instead of ``torch.distributed``: ``Work.get_future()`` gives
torch's future (value ``[tensor]``).

When a hook runs
----------------
* On the thread running the backward pass, once per bucket and synchronised pass: when the
  bucket's last gradient arrived *and* every earlier bucket was launched (bucket order, the same on
  every rank), or, for buckets that ``find_unused_parameters`` completes, in the end-of-backward
  callback. Never inside ``no_sync()``.
* ``loss.backward()`` returns after every hook's future completed and the results were written to
  ``.grad``. An error in a future is raised there (a failed collective fails its future; torch
  reports it as a ``RuntimeError`` that names the original error).

The rule our collectives add
----------------------------
Our collectives are point-to-point messages matched by the *order* in which ranks start them.
A hook starts its collectives in the hook call (``async_op=True``, one after the other; they run
in that order on the group's communication thread), and may start more in a ``.then`` callback
attached right away, as torch's PowerSGD does: a callback runs when its collective completes,
on the communication thread, and a collective it starts runs at once, right after that one, at
the same point of every rank's sequence (it may wait for it, too). Attach such callbacks before
issuing any other collective, so that the callback's collectives follow their parent on every
rank whether it had already finished or not.

Exactness
---------
The replicas stay identical only if every rank ends with bitwise identical gradients. Each
collective here returns bitwise identical results on every rank, and local arithmetic on those
results is deterministic, so any hook that only post-processes collective results keeps them so;
local arithmetic *before* the collective (casting, dividing one's own gradient) is free to differ
per rank. Compression changes the numbers, not this property: fp16/bf16 gradients are rounded
(``2^-11`` / ``2^-8`` relative per value, plus one rounding per addition inside the all-reduce),
but identically everywhere.
"""

from __future__ import annotations

import torch

import collectives
from collectives import Group, ReduceOp

from .reducer import GradBucket

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "reduce_scatter_hook"]


def _first(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


def allreduce_hook(process_group: Group | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with one AVG all-reduce: bit for bit what DDP does without a hook.

    The starting point for your own hooks. (torch's ``allreduce_hook`` divides by the world size
    *before* a SUM all-reduce; AVG divides once after it, which is what our DDP does by default.)
    """
    work = collectives.all_reduce(bucket.buffer(), ReduceOp.AVG, group=process_group, async_op=True)
    return work.get_future().then(_first)


def _compress_hook(dtype: torch.dtype, process_group: Group | None, bucket: GradBucket) -> torch.futures.Future:
    """Cast to ``dtype`` and divide by the world size there, SUM all-reduce, cast back in place."""
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(collectives.get_world_size(process_group))  # divide first: no fp16 overflow

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # into the bucket: no second full-precision buffer
        return buffer

    work = collectives.all_reduce(compressed, ReduceOp.SUM, group=process_group, async_op=True)
    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: Group | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in float16: half the bytes of float32 on the wire.

    Same semantics as torch's ``default_hooks.fp16_compress_hook``: ``buffer.to(float16)``, divided
    by the world size in float16 (before the sum, so the sum cannot overflow float16's 65504),
    SUM all-reduce in float16, decompressed into the bucket's buffer. Cost: each value rounded to
    11 significant bits, once in the cast and once per addition of the all-reduce; values below
    ``6e-8 · world size`` flush to zero. Identical on every rank.
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Group | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in bfloat16: half the bytes, float32's range, 8 significant bits.

    Same semantics as torch's ``default_hooks.bf16_compress_hook`` (see :func:`fp16_compress_hook`);
    no overflow or underflow concerns, coarser rounding (``2^-8`` relative per operation).
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def reduce_scatter_hook(process_group: Group | None, bucket: GradBucket) -> torch.futures.Future:
    """The all-reduce taken apart: reduce-scatter (AVG), then all-gather, started back to back.

    A ring all-reduce *is* these two halves (``ring.py``). Between them, rank ``r`` holds the
    averaged chunk ``r`` of the bucket and nothing else: that is the seam sharded training uses
    (ZeRO / FSDP update only their own chunk there and all-gather parameters instead of
    gradients). Here the chunks are gathered straight back, so the result is the plain average:
    each chunk is summed and divided once, by its owner, then copied to everyone, so it is bitwise
    identical on every rank. Both collectives are started inside the hook (our order rule; the
    all-gather runs after the reduce-scatter on the communication thread); a bucket whose length
    does not divide by the world size is zero-padded.
    """
    n = collectives.get_world_size(process_group)
    buffer = bucket.buffer()
    chunk = -(-buffer.numel() // n)
    padded = buffer if chunk * n == buffer.numel() else torch.cat([buffer, buffer.new_zeros(chunk * n - buffer.numel())])
    mine = buffer.new_empty(chunk)
    collectives.reduce_scatter_tensor(mine, padded, ReduceOp.AVG, group=process_group, async_op=True)
    gathered = collectives.all_gather_into_tensor(padded, mine, group=process_group, async_op=True)
    return gathered.get_future().then(lambda _: padded[: buffer.numel()])
