"""Data parallelism on top of ``collectives``: the naive form and a bucketed, overlapped DDP.

* :func:`all_reduce_gradients` — after ``loss.backward()``, average every gradient with one
  blocking all-reduce each (the lecture-notes form, for study);
* :class:`DistributedDataParallel` — the real thing: gradients packed into buckets whose
  all-reduces start during the backward pass (see ``ddp/distributed.py`` for how and why);
* :func:`broadcast_module` — make every rank's replica equal to rank 0's (parameters and buffers);
* :mod:`ddp.comm_hooks` — how a bucket is reduced, replaceable (fp16/bf16 compression, ...);
* :class:`ZeroDataParallel` and :class:`ZeroRedundancyOptimizer` (:mod:`ddp.zero`) — the ZeRO
  ladder: shard the optimizer state (stage 1), the gradients (2) and the parameters (3).

Run ``python -m ddp.bench`` to compare with ``torch.nn.parallel.DistributedDataParallel``.
"""

from . import comm_hooks
from .bucket import BucketInfo, assign_buckets, format_bucket_table
from .distributed import DistributedDataParallel
from .reducer import GradBucket, Reducer, ReductionStats
from .naive import all_reduce_gradients
from .sync import broadcast_module, broadcast_tensors
from . import zero
from .zero import MixedPrecision, ZeroDataParallel, ZeroRedundancyOptimizer

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "BucketInfo",
    "DistributedDataParallel",
    "GradBucket",
    "MixedPrecision",
    "Reducer",
    "ReductionStats",
    "all_reduce_gradients",
    "assign_buckets",
    "broadcast_module",
    "broadcast_tensors",
    "comm_hooks",
    "format_bucket_table",
    "zero",
    "ZeroDataParallel",
    "ZeroRedundancyOptimizer",
]
