"""Feeding data-parallel ranks: two ways to give every rank a different part of the data.

* :class:`DistributedSampler` — every rank holds the **whole** data set and iterates over its
  share of the indices (torch's recipe, same indices as ``torch.utils.data.DistributedSampler``).
  No communication; memory ``S`` per rank; reshuffling is free (``set_epoch``).
* :class:`ScatterDataset` — only the source rank holds the data; each rank receives its shard
  through :func:`collectives.scatter`. Memory ``S/N`` on the other ranks; construction and every
  reshuffle move ``(N-1)/N · S`` bytes from the source.

Both use the same global order (``randperm`` seeded with ``seed + epoch``) and the same
"every N-th row" sharding, so they visit the same rows on the same rank. ``docs/data.md``
compares them with measured numbers (``python -m data.compare``).
"""

from .sampler import DistributedSampler, global_order, shard_sizes
from .scatter import DTYPE_CODES, ScatterDataset, TensorData

__all__ = ["DTYPE_CODES", "DistributedSampler", "ScatterDataset", "TensorData", "global_order", "shard_sizes"]
