"""``ScatterDataset``: one rank holds the data, every rank ends up holding only its shard.

The "scatter" approach of the design notes. The source rank (``src``, default 0) passes the
tensors; the others pass nothing. The rows are permuted with the same ``(seed, epoch)``
permutation as :class:`data.DistributedSampler` and handed out with one
:func:`collectives.scatter` per field, so a non-source rank holds ``~1/N`` of the data instead of
all of it::

    source rank (holds all n rows)          rank 0      rank 1      rank 2
    order = randperm(n, seed + epoch)       order[0]    order[1]    order[2]
                                            order[3]    order[4]    order[5]
                                            ...         ...         ...

Shard ``r`` is ``rows[order[r::N]]``: with ``drop_last=True`` exactly the indices of
``DistributedSampler(drop_last=True)`` on rank ``r``; without it, those of
``DistributedSampler(drop_last=False)`` minus the wrapped-around padding (shard lengths then
differ by at most one instead of repeating rows).

The wire protocol uses only tensors (no pickle). Every round starts with an **agreement round**:
each rank fills one row of a small int64 table and ``all_gather`` s it::

    column:  status  phase  src  seed  epoch  shuffle  drop_last  kind  n_fields  n_rows  meta_len  keys_len
    rank 0:  0/1/2   1|2    0    ...   ...    0/1      0/1        <- header, source rank only ->
    rank 1:  0/1/2   1|2    0    ...   ...    0/1      0/1        0     0         0       0         0

``status`` is the verdict of the rank's *local* checks (0 ok, 1 ``ValueError``, 2 ``TypeError``,
3 anything unexpected, raised as ``RuntimeError``): the
source rank validates its data, the other ranks check that they passed none. Because every rank
sees the whole table before any data moves, a bad input anywhere makes **every** rank raise the
same exception — the lowest failing rank broadcasts its message as utf-8 bytes — instead of some
ranks waiting forever for a scatter that never comes. The same table catches ranks that disagree
on ``src``, ``seed``, ``shuffle``, ``drop_last`` or the epoch.

After a clean agreement the source's header describes the data; the per-field metadata goes out
with :func:`collectives.broadcast` as one int64 tensor::

    for each field:  key_bytes  dtype_code  ndim  shape[0] ... shape[ndim-1]

followed (dicts only) by the utf-8 bytes of the keys in a uint8 tensor. Then one
:func:`collectives.scatter` per field moves the rows.

Costs (``S`` = bytes of the data set, ``N`` ranks):

* memory: the source keeps its tensors (``S``) plus its shard (``S/N``), and needs one
  temporary copy of the largest field while scattering it; other ranks hold ``S/N``.
* construction and each :meth:`ScatterDataset.set_epoch` with a new epoch: the source sends
  ``(N-1)/N · S`` bytes, which takes about ``(N-1)(α + S β / N)`` (see ``collectives/direct.py``).

``set_epoch`` and construction are collectives: call them on every rank, in the same order.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence, Union

import torch
from torch.utils.data import Dataset

import collectives
from collectives import Group, get_group

from .sampler import global_order

log = logging.getLogger(__name__)

#: What the source rank passes: one tensor, a tuple/list of tensors, or a dict of tensors,
#: all with the same first (row) dimension.
TensorData = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor]]

#: dtype <-> wire code. Codes are part of the protocol: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int32: 7,
    torch.int64: 8,
    torch.bool: 9,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

# structure kinds
_TENSOR, _TUPLE, _LIST, _DICT = 1, 2, 3, 4
# status codes -> the exception every rank raises
_OK, _VALUE_ERROR, _TYPE_ERROR, _RUNTIME_ERROR = 0, 1, 2, 3
_ERRORS: dict[int, type[Exception]] = {_VALUE_ERROR: ValueError, _TYPE_ERROR: TypeError, _RUNTIME_ERROR: RuntimeError}
# phases of the agreement round
_CONSTRUCT, _SET_EPOCH = 1, 2
# columns of the agreement table
_COLUMNS = ("status", "phase", "src", "seed", "epoch", "shuffle", "drop_last",
            "kind", "n_fields", "n_rows", "meta_len", "keys_len")  # fmt: skip
_COL = {name: i for i, name in enumerate(_COLUMNS)}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _Rejected(Exception):
    """A local check failed; carries the exception type every rank will raise."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: object) -> bool:
    """Can ``value`` go into an int64 cell of the agreement table?"""
    return _is_int(value) and _INT64_MIN <= value <= _INT64_MAX


def _check_int64(value: object, what: str, minimum: int = _INT64_MIN) -> None:
    if not _is_int(value):
        raise _Rejected(_TYPE_ERROR, f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not minimum <= value <= _INT64_MAX:
        raise _Rejected(_VALUE_ERROR, f"{what} must be in [{minimum}, 2**63 - 1], got {value}")


def _flatten(data: object) -> tuple[int, list[str], list[torch.Tensor]]:
    """``(kind, keys, fields)`` of the source's data, or :class:`_Rejected` with a clear message."""
    if data is None:
        raise _Rejected(
            _VALUE_ERROR,
            "passed no data (data=None), but the source rank must pass a tensor, a tuple/list of "
            "tensors or a dict of tensors",
        )
    if isinstance(data, torch.Tensor):
        kind, keys, fields = _TENSOR, [""], [data]
    elif isinstance(data, (tuple, list)):
        kind, keys, fields = (_TUPLE if isinstance(data, tuple) else _LIST), [""] * len(data), list(data)
    elif isinstance(data, Mapping):
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise _Rejected(_TYPE_ERROR, f"dict keys must be str, got {bad[0]!r} ({type(bad[0]).__name__})")
        kind, keys, fields = _DICT, list(data.keys()), list(data.values())
    else:
        raise _Rejected(
            _TYPE_ERROR,
            f"data must be a tensor, a tuple/list of tensors or a dict of tensors, got {type(data).__name__}",
        )
    if not fields:
        raise _Rejected(_VALUE_ERROR, f"data has no fields (an empty {type(data).__name__})")
    names = [repr(k) if kind == _DICT else f"#{i}" for i, k in enumerate(keys)]
    for name, f in zip(names, fields):
        if not isinstance(f, torch.Tensor):
            raise _Rejected(_TYPE_ERROR, f"field {name} must be a torch.Tensor, got {type(f).__name__}")
        if f.dtype not in DTYPE_CODES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise _Rejected(_TYPE_ERROR, f"field {name} has dtype {f.dtype}, which cannot be scattered; supported: {supported}")
        if f.device.type != "cpu":
            raise _Rejected(_VALUE_ERROR, f"field {name} is on {f.device}; ScatterDataset moves CPU tensors only")
        if f.is_sparse or f.layout != torch.strided:
            raise _Rejected(_TYPE_ERROR, f"field {name} is not a dense (strided) tensor")
        if f.dim() == 0:
            raise _Rejected(_VALUE_ERROR, f"field {name} is a 0-dim tensor; every field needs a first (row) dimension")
    rows = {name: f.shape[0] for name, f in zip(names, fields)}
    if len(set(rows.values())) > 1:
        listing = ", ".join(f"{name}: {n}" for name, n in rows.items())
        raise _Rejected(_VALUE_ERROR, f"fields have different first dimensions ({listing}); every field needs one entry per row")
    if fields[0].shape[0] == 0:
        raise _Rejected(_VALUE_ERROR, "data has 0 rows")
    return kind, keys, fields


def _encode_meta(keys: list[str], fields: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 metadata (per field: key_bytes, dtype_code, ndim, shape...) and the uint8 key bytes."""
    meta: list[int] = []
    key_bytes = b""
    for key, f in zip(keys, fields):
        encoded = key.encode("utf-8")
        key_bytes += encoded
        meta += [len(encoded), DTYPE_CODES[f.dtype], f.dim(), *f.shape]
    return torch.tensor(meta, dtype=torch.int64), torch.tensor(list(key_bytes), dtype=torch.uint8)


def _decode_meta(meta: torch.Tensor, key_bytes: torch.Tensor, n_fields: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    values, raw = meta.tolist(), bytes(key_bytes.tolist())
    out, pos, kpos = [], 0, 0
    for _ in range(n_fields):
        klen, code, ndim = values[pos : pos + 3]
        shape = tuple(values[pos + 3 : pos + 3 + ndim])
        out.append((raw[kpos : kpos + klen].decode("utf-8"), _CODE_DTYPES[code], shape))
        pos, kpos = pos + 3 + ndim, kpos + klen
    return out


class ScatterDataset(Dataset):
    """This rank's shard of a data set that only the source rank holds.

    Args:
        data: on the source rank, the rows: a tensor, a tuple/list of tensors, or a dict of tensors
            (str keys), all on the CPU with the same first dimension. On every other rank,
            ``None`` — passing data there is an **error** (raised on every rank): it usually means
            every rank loaded the whole data set, in which case :class:`data.DistributedSampler`
            is the cheaper tool, or that ``src`` is wrong.
        src: global rank of the source (default 0).
        group: collectives group (default: the default group).
        shuffle: permute the rows with ``randperm`` seeded by ``seed + epoch`` before sharding;
            otherwise shard ``r`` is rows ``r, r + N, r + 2N, ...``.
        seed: base seed; must be the same on every rank (checked).
        drop_last: drop the last ``n % N`` rows of the (permuted) order so all shards have the
            same length; otherwise shard lengths differ by at most one.
        epoch: the epoch of the initial shards (default 0).

    ``ds[i]`` is row ``i`` of the local shard with the structure of ``data`` (a tensor, a tuple,
    a list or a dict); ``len(ds)`` is the local shard's length. Use it like any map-style dataset::

        ds = ScatterDataset((x, y) if rank == 0 else None, seed=0)
        loader = DataLoader(ds, batch_size=32, shuffle=False)   # rows already shuffled
        for epoch in range(epochs):
            ds.set_epoch(epoch)             # collective: new global permutation, new shards
            for xb, yb in loader: ...

    Attributes:
        indices: int64 tensor of the global row numbers of the local rows.
        bytes_received: payload bytes this rank has received from other ranks (all rounds).
        last_round_bytes_received: the same, for the latest construction / reshuffle only.
        last_round_seconds: wall time of the latest construction / reshuffle on this rank.

    The source rank keeps a reference to its tensors (not a copy) to reshuffle them later; do not
    modify them in place unless the next epoch should see the change.
    """

    def __init__(
        self,
        data: TensorData | None = None,
        *,
        src: int = 0,
        group: Group | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        epoch: int = 0,
    ) -> None:
        started = time.perf_counter()
        g = get_group(group, "ScatterDataset")
        self._group: Group | None = g
        self._ranks = list(g.ranks)
        #: this process's rank within the group
        self.rank: int = g.rank()
        self.src = src
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = epoch
        self.bytes_received = 0
        self._source: list[torch.Tensor] | None = None
        self._fields: list[torch.Tensor] = []

        # --- local checks; the verdict travels in the agreement table instead of being raised here
        status, message = _OK, ""
        header = [0, 0, 0, 0, 0]
        meta = key_bytes = None
        try:
            _check_int64(seed, "seed")
            _check_int64(epoch, "epoch", minimum=0)
            root = g.group_rank(src, "src", "ScatterDataset") if _is_int(src) else None
            if root is None:
                raise _Rejected(_TYPE_ERROR, f"src must be an int rank, got {type(src).__name__} {src!r}")
            if g.rank() == root:
                kind, keys, fields = _flatten(data)
                n = fields[0].shape[0]
                if self.drop_last and n < g.size():
                    raise _Rejected(
                        _VALUE_ERROR,
                        f"data has {n} rows, fewer than the {g.size()} ranks: with drop_last=True every shard would be empty",
                    )
                meta, key_bytes = _encode_meta(keys, fields)
                header = [kind, len(fields), n, meta.numel(), key_bytes.numel()]
                self._source = fields
            elif data is not None:
                raise _Rejected(
                    _VALUE_ERROR,
                    f"passed data, but only the source rank {src} does; "
                    "the other ranks pass None",
                )
        except _Rejected as rejected:
            status, message = rejected.status, rejected.message
        except ValueError as exc:  # e.g. src not in the group
            status, message = _VALUE_ERROR, str(exc).removeprefix("ScatterDataset: ")
        except Exception as exc:  # anything unexpected still must not leave the peers waiting
            status, message = _RUNTIME_ERROR, f"{type(exc).__name__}: {exc}"
        mine = [status, _CONSTRUCT, src if _fits(src) else -1, seed if _fits(seed) else 0,
                epoch if _fits(epoch) else 0, int(self.shuffle), int(self.drop_last), *header]  # fmt: skip
        table = self._agree(mine, status, message)

        # --- the source's header and metadata
        head = table[g.group_rank(src, "src", "ScatterDataset")]
        kind, n_fields, n_rows, meta_len, keys_len = head[_COL["kind"] :]
        if meta is None:
            meta = torch.empty(meta_len, dtype=torch.int64)
            key_bytes = torch.empty(keys_len, dtype=torch.uint8)
        received = 0
        collectives.broadcast(meta, src, group=g)
        if keys_len:
            collectives.broadcast(key_bytes, src, group=g)
        if g.rank() != self._root:
            received += meta.nbytes + key_bytes.nbytes
        self._kind = kind
        self._specs = _decode_meta(meta, key_bytes, n_fields)
        self._keys = [key for key, _, _ in self._specs]
        self.num_rows = n_rows
        self._table_bytes = (g.size() - 1) * len(_COLUMNS) * 8
        received += self._table_bytes
        received += self._scatter()
        self._finish_round(received, started, "built")
        if 0 in self.shard_lengths():
            log.warning(
                "ScatterDataset: %d rows over %d ranks leaves some shards empty (lengths %s)",
                n_rows, g.size(), self.shard_lengths(),
            )

    # ------------------------------------------------------------------ protocol

    @property
    def _root(self) -> int:
        """Group rank of the source."""
        return self._ranks.index(self.src)

    def _agree(self, mine: list[int], status: int, message: str) -> list[list[int]]:
        """All-gather every rank's row; raise the same exception on every rank if anything is off."""
        g = self._group
        row = torch.tensor(mine, dtype=torch.int64)
        table_t = torch.empty(g.size() * len(_COLUMNS), dtype=torch.int64)
        collectives.all_gather_into_tensor(table_t, row, group=g)
        table = table_t.view(g.size(), len(_COLUMNS)).tolist()
        failed = [r for r in range(g.size()) if table[r][_COL["status"]] != _OK]
        if failed:
            first = failed[0]
            length = torch.tensor([len(message.encode("utf-8"))], dtype=torch.int64)
            collectives.broadcast(length, g.ranks[first], group=g)
            text = torch.tensor(list(message.encode("utf-8")), dtype=torch.uint8) if g.rank() == first else None
            if text is None:
                text = torch.empty(int(length.item()), dtype=torch.uint8)
            if text.numel():
                collectives.broadcast(text, g.ranks[first], group=g)
            error = _ERRORS[table[first][_COL["status"]]]
            who = f"rank {g.ranks[first]}" + (" (the source)" if table[first][_COL["src"]] == g.ranks[first] else "")
            others = f" [ranks {[g.ranks[r] for r in failed]} rejected their input]" if len(failed) > 1 else ""
            raise error(f"ScatterDataset: {who}: {bytes(text.tolist()).decode('utf-8')}{others}")
        for name in ("phase", "src", "seed", "epoch", "shuffle", "drop_last"):
            values = [table[r][_COL[name]] for r in range(g.size())]
            if len(set(values)) > 1:
                if name == "phase":
                    what = {_CONSTRUCT: "construct a ScatterDataset", _SET_EPOCH: "call set_epoch"}
                    detail = "; ".join(f"rank {g.ranks[r]} is about to {what.get(v, v)}" for r, v in enumerate(values))
                    raise RuntimeError(f"ScatterDataset: ranks are out of step: {detail}")
                listing = ", ".join(f"rank {g.ranks[r]}: {v}" for r, v in enumerate(values))
                raise ValueError(f"ScatterDataset: ranks disagree on {name} ({listing}); pass the same value on every rank")
        return table

    def _scatter(self) -> int:
        """Shard every field for ``self.epoch`` with one scatter each; returns bytes received here."""
        g, root = self._group, self._root
        n, size = self.num_rows, g.size()
        order = global_order(n, self.shuffle, self.seed, self.epoch) if g.rank() == root else None
        total = (n // size) * size if self.drop_last else n
        per_rank = -(-total // size)  # rows in the longest shard; shorter ones get a padding row
        mine = self.shard_lengths()[g.rank()]
        received = 0
        fields: list[torch.Tensor] = []
        for i, (_, dtype, shape) in enumerate(self._specs):
            out = torch.empty((per_rank, *shape[1:]), dtype=dtype)
            pieces = None
            if g.rank() == root:
                assert self._source is not None and order is not None
                # position p of the sharded order lives on rank p % size, at row p // size.
                positions = torch.arange(per_rank * size).view(per_rank, size).t()
                rows = order[positions.clamp(max=max(total - 1, 0))]  # padding repeats a row; receivers trim it
                with torch.no_grad():
                    picked = self._source[i].index_select(0, rows.reshape(-1))
                pieces = list(picked.reshape(size, *out.shape).unbind(0))
                del picked
            collectives.scatter(out, pieces, src=self.src, group=g)
            del pieces
            if g.rank() != root:
                received += out.nbytes
            fields.append(out[:mine] if mine < per_rank else out)
        self._fields = fields
        return received

    def _finish_round(self, received: int, started: float, what: str) -> None:
        self.bytes_received += received
        self.last_round_bytes_received = received
        self.last_round_seconds = time.perf_counter() - started
        log.debug(
            "ScatterDataset %s for epoch %d: %d of %d rows here (%d bytes), %d bytes received in %.3fs",
            what, self.epoch, len(self), self.num_rows, self.nbytes, received, self.last_round_seconds,
        )

    # ------------------------------------------------------------------ public API

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle globally with ``(seed, epoch)`` and re-scatter (a collective: call on every rank).

        Cheap when nothing changes: with ``shuffle=False`` or the current epoch, only the small
        agreement round runs (which also checks that all ranks passed the same ``epoch``).
        """
        if self._group is None:
            raise RuntimeError("ScatterDataset.set_epoch: this copy was pickled (e.g. into a DataLoader worker) and has no group")
        started = time.perf_counter()
        status, message = _OK, ""
        try:
            _check_int64(epoch, "epoch", minimum=0)
        except _Rejected as rejected:
            status, message = rejected.status, rejected.message
        mine = [status, _SET_EPOCH, self.src, self.seed, epoch if _fits(epoch) else 0,
                int(self.shuffle), int(self.drop_last), 0, 0, 0, 0, 0]  # fmt: skip
        self._agree(mine, status, message)
        if epoch == self.epoch or not self.shuffle:
            self.epoch = epoch
            self._finish_round(self._table_bytes, started, "kept")
            return
        self.epoch = epoch
        received = self._table_bytes + self._scatter()
        self._finish_round(received, started, "reshuffled")

    def shard_lengths(self) -> list[int]:
        """Rows of every rank's shard (group rank order)."""
        size = len(self._ranks)
        total = (self.num_rows // size) * size if self.drop_last else self.num_rows
        return [len(range(r, total, size)) for r in range(size)]

    @property
    def indices(self) -> torch.Tensor:
        """Global row numbers (into the source's data) of the local rows, in local order."""
        size = len(self._ranks)
        total = (self.num_rows // size) * size if self.drop_last else self.num_rows
        order = global_order(self.num_rows, self.shuffle, self.seed, self.epoch)
        return order[self.rank : total : size]

    @property
    def fields(self) -> list[torch.Tensor]:
        """The local shard, one tensor per field (in the order given)."""
        return list(self._fields)

    @property
    def keys(self) -> list[str] | None:
        """Field names for dict data, else ``None``."""
        return list(self._keys) if self._kind == _DICT else None

    @property
    def nbytes(self) -> int:
        """Bytes of memory held by the local shard (tensor storages, including a padding row if any)."""
        return sum(f.untyped_storage().nbytes() for f in self._fields)

    @property
    def source_nbytes(self) -> int:
        """Bytes of the source tensors this rank keeps (non-zero on the source rank only)."""
        return sum(f.untyped_storage().nbytes() for f in self._source) if self._source else 0

    def __len__(self) -> int:
        return self._fields[0].shape[0] if self._fields else 0

    def __getitem__(self, index: Any) -> Any:
        if self._kind == _TENSOR:
            return self._fields[0][index]
        if self._kind == _DICT:
            return {k: f[index] for k, f in zip(self._keys, self._fields)}
        items = [f[index] for f in self._fields]
        return tuple(items) if self._kind == _TUPLE else items

    def __repr__(self) -> str:
        return (
            f"ScatterDataset(rank={self.rank}, rows={len(self)}/{self.num_rows}, fields={len(self._fields)}, "
            f"epoch={self.epoch}, shuffle={self.shuffle}, drop_last={self.drop_last})"
        )

    def __getstate__(self) -> dict:
        """Pickled copies (DataLoader workers under ``spawn``) carry the shard, not the group or source."""
        state = dict(self.__dict__)
        state["_group"] = None
        state["_source"] = None
        return state
