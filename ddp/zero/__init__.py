"""ZeRO: data parallelism that shards the optimizer state, the gradients and the parameters.

* :class:`ZeroDataParallel` (``model.py``): the model wrapper, ``stage=0`` (DDP) to ``3``;
* :class:`ZeroRedundancyOptimizer` (``optimizer.py``): the sharded optimizer, torch's signature;
* :func:`save_checkpoint` / :func:`load_checkpoint` (``checkpoint.py``): one file per rank,
  loadable at another world size or stage;
* :func:`memory_report` (``memory.py``): bytes of parameters, gradients and optimizer state per
  rank, by tensor accounting;
* ``replica.py``: a copy of another rank's optimizer shard kept current step by step (stages 1
  and 2), what lets ``ddp.elastic`` survive a rank's death.

How the shards are laid out: ``flat.py``; the parameter storage: ``units.py``; the
reduce-scattered gradient buckets: ``buckets.py``. The stage ladder, its costs and its limits:
``docs/zero.md``.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .memory import MemoryReport, memory_report
from .model import MixedPrecision, ZeroDataParallel
from .optimizer import ZeroRedundancyOptimizer, register_elementwise_optimizer

__all__ = [
    "MemoryReport",
    "MixedPrecision",
    "ZeroDataParallel",
    "ZeroRedundancyOptimizer",
    "load_checkpoint",
    "memory_report",
    "register_elementwise_optimizer",
    "save_checkpoint",
]
