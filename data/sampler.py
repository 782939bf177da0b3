"""``DistributedSampler``: every rank holds the whole data set and reads only its share of indices.

This is the standard recipe of data-parallel training (the "DistributedSampler" approach of the
design notes): nothing is communicated, each rank computes *the same* permutation from
``(seed, epoch)`` and keeps every ``num_replicas``-th index starting at its rank::

    n = 10, num_replicas = 4, shuffle=False, drop_last=False

    global order     0 1 2 3 4 5 6 7 8 9 | 0 1      <- padded by wrapping around to 12 = 3 x 4
    rank 0           0       4       8            -> [0, 4, 8]
    rank 1             1       5       9          -> [1, 5, 9]
    rank 2               2       6       0        -> [2, 6, 0]   (0 is padding)
    rank 3                 3       7       1      -> [3, 7, 1]   (1 is padding)

With ``drop_last=True`` the tail that does not fill a whole round is dropped instead (``n = 10``
gives 2 indices per rank and rows 8, 9 are unused this epoch). With ``shuffle=True`` the global
order is ``torch.randperm(n)`` drawn from a ``torch.Generator`` seeded with ``seed + epoch``, so
calling :meth:`DistributedSampler.set_epoch` at the start of each epoch gives every epoch a new
order that all ranks agree on without exchanging a byte.

The indices are exactly those of :class:`torch.utils.data.distributed.DistributedSampler` for
every combination of arguments (the test suite checks this property with hypothesis); the only
differences are that the rank and world size default to our collectives' group rather than
``torch.distributed``'s, and that bad arguments raise ``ValueError``/``TypeError`` up front.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sized

import torch
from torch.utils.data import Sampler

import collectives

log = logging.getLogger(__name__)


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DistributedSampler: {what} must be an int, got {type(value).__name__} {value!r}")
    return value


def shard_sizes(length: int, num_replicas: int, drop_last: bool) -> tuple[int, int]:
    """``(num_samples, total_size)``: indices per rank, and indices over all ranks after padding/dropping.

    Without ``drop_last`` every rank gets ``ceil(length / num_replicas)`` indices (the last round is
    padded); with it, ``floor(length / num_replicas)`` (the incomplete last round is dropped).
    """
    per_rank = length // num_replicas if drop_last else -(-length // num_replicas)
    return per_rank, per_rank * num_replicas


def global_order(length: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of all ``length`` rows (int64), identical on every rank.

    ``torch.randperm(length)`` from a generator seeded with ``seed + epoch`` when shuffling,
    ``0 .. length-1`` otherwise. :class:`~data.scatter.ScatterDataset` uses the same order, so
    both approaches visit the same rows in the same epoch.
    """
    if not shuffle:
        return torch.arange(length, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator)


class DistributedSampler(Sampler[int]):
    """Yield this rank's indices of ``dataset`` for the current epoch.

    Args:
        dataset: anything with ``len()``; its length is read once, here.
        num_replicas: number of ranks sharing the data; default: the size of the collectives'
            default group (``collectives.get_world_size()``), or of ``group``.
        rank: this rank, ``0 <= rank < num_replicas``; default ``collectives.get_rank()``.
        shuffle: draw a new permutation each epoch (see :meth:`set_epoch`); else keep 0..n-1.
        seed: base seed of the permutation; must be the same on every rank.
        drop_last: drop the incomplete last round instead of padding it with rows from the
            beginning (padding repeats a few rows in an epoch; dropping skips a few).
        group: keyword-only; the collectives group to read the defaults from.

    Typical loop::

        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)      # otherwise every epoch repeats epoch 0's order
            for batch in loader: ...
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        group=None,
    ) -> None:
        try:
            length = len(dataset)
        except TypeError as exc:
            raise TypeError(f"DistributedSampler: dataset must have a length (len()), got {type(dataset).__name__}") from exc
        if num_replicas is None or rank is None:
            if collectives.is_non_member(group):
                raise ValueError(
                    "DistributedSampler: this rank is not a member of the group it was given (new_group "
                    "returned a non-member handle here); build the sampler on the group's ranks only"
                )
            if not collectives.is_initialized() and group is None:
                raise RuntimeError(
                    "DistributedSampler: num_replicas/rank were not given and the collectives are not "
                    "initialised; call collectives.init_process_group() (or use collectives.launch) "
                    "first, or pass num_replicas= and rank= explicitly"
                )
            if num_replicas is None:
                num_replicas = collectives.get_world_size(group)
            if rank is None:
                rank = collectives.get_rank(group)
        num_replicas = _check_int(num_replicas, "num_replicas")
        rank = _check_int(rank, "rank")
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank must be in [0, {num_replicas - 1}], got {rank}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = _check_int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.start = 0
        self.length = length
        self.num_samples, self.total_size = shard_sizes(length, num_replicas, self.drop_last)
        if length and self.num_samples == 0:
            log.debug(
                "DistributedSampler: %d rows, %d replicas and drop_last=True: every rank gets 0 indices",
                length, num_replicas,
            )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Use ``epoch`` for the next iteration's permutation (call it on every rank, same values).

        ``start``: positions of the epoch's global order already consumed, by all ranks together
        (a job resuming mid-epoch: batches done x batch size x the world size *then*). The ranks
        share the rest, ``order[start:]``, as they would a whole epoch: rank ``r`` of ``N`` takes
        positions ``start + r, start + r + N, ...``, padded (or dropped) at the end the same way.
        At the world size of the interrupted run that is exactly the rest of each rank's epoch; at
        another one the epoch still visits every row once (plus padding), none twice.
        """
        epoch, start = _check_int(epoch, "epoch"), _check_int(start, "start")
        if not 0 <= start <= self.length:
            raise ValueError(f"DistributedSampler.set_epoch: start must be in [0, {self.length}], got {start}")
        self.epoch, self.start = epoch, start
        self.num_samples, self.total_size = shard_sizes(self.length - start, self.num_replicas, self.drop_last)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch as an int64 tensor (what ``iter`` yields)."""
        order = global_order(self.length, self.shuffle, self.seed, self.epoch)
        # Position p of the padded/truncated global order holds order[p % n]: with drop_last,
        # total_size <= n so the modulo never wraps; without it, positions n.. wrap around to the
        # start (as many times as needed when total_size > 2n, e.g. 3 rows over 8 ranks).
        positions = self.start + torch.arange(self.num_samples, dtype=torch.int64) * self.num_replicas + self.rank
        if self.length == 0:
            return positions  # empty
        return order[positions % self.length]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples
