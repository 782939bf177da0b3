"""Argument checks on tensors, run by every public collective before anything is queued.

Three families, all raised on the calling rank before any traffic:

* **What a tensor is.** Only dense (strided) tensors of a supported dtype on a real device carry
  a collective: sparse (COO, CSR, CSC, BSR, BSC), nested, quantized, mkldnn and meta tensors get
  a ``TypeError`` that names the layout, instead of a torch-internal message from deep inside a
  copy.
* **What a view would cost.** A non-contiguous tensor travels as a contiguous copy (written back
  for outputs). A view whose copy is far larger than the memory it views (``expand`` of a small
  tensor to ``2**40`` elements) would allocate terabytes before failing; such views raise a
  ``ValueError`` that says how many bytes the copy would need (:data:`COPY_LIMIT_BYTES`,
  :data:`COPY_LIMIT_FACTOR`).
* **Aliasing.** A tensor a collective *writes* must not have elements sharing memory (an
  ``expand``-ed output), and two written tensors (the list of an ``all_gather``) must not overlap:
  each element receives different data, so no answer could be right — ``ValueError``. An *input*
  that overlaps an output (``all_to_all_single(t, t)``) is legal and gets the exact answer: the
  overlapping input is *staged* (copied) on the communication thread just before the collective
  runs, which costs one copy of that input and only in that case. The in-place forms torch
  documents (``all_gather_into_tensor`` whose input is this rank's chunk of the output,
  ``reduce_scatter_tensor`` whose output is this rank's chunk of the input) are recognised and run
  without a copy.

Overlap is decided on storage and byte ranges; where two ranges intersect and one tensor is not
contiguous, the element offsets are compared exactly (up to :data:`EXACT_OVERLAP_ELEMS` elements;
beyond that the tensors are treated as overlapping, which for inputs only costs a copy).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .ops import SUPPORTED_DTYPES, check_dtype

#: A non-contiguous view is refused when its contiguous copy exceeds both this many bytes ...
COPY_LIMIT_BYTES = 1 << 30
#: ... and this multiple of the bytes of storage it views.
COPY_LIMIT_FACTOR = 16
#: Largest tensors whose element offsets are compared exactly when their byte ranges intersect.
EXACT_OVERLAP_ELEMS = 1 << 22

Named = Sequence[tuple[str, torch.Tensor]]


def _layout_name(t: torch.Tensor) -> str | None:
    """A name for a layout collectives cannot carry, or None for a dense strided tensor."""
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.").removeprefix("_")  # sparse_csr, mkldnn, ...
    if t.is_quantized:
        return f"quantized ({t.dtype})"
    if t.is_meta:
        return "meta (no data)"
    return None


def tensor(t: object, op_name: str, what: str = "tensor") -> torch.Tensor:
    """Check that ``t`` is a dense tensor collectives can carry; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op_name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout is not torch.strided or t.is_quantized or t.is_meta:  # _layout_name's cases
        raise TypeError(
            f"{op_name}: {what} is a {_layout_name(t)} tensor; collectives carry dense (strided) tensors only: "
            "pass .to_dense() (or the tensor's values), or a real-device tensor"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        check_dtype(t.dtype, op_name)
    if not t.is_contiguous():
        _check_copy(t, op_name, what)
    return t


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) of the memory ``t`` views."""
    start = t.storage_offset()  # torch strides are never negative
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    esize = t.element_size()
    return t.untyped_storage().data_ptr(), start * esize, (start + extent + 1) * esize


def _check_copy(t: torch.Tensor, op_name: str, what: str) -> None:
    copy = t.numel() * t.element_size()
    if copy <= COPY_LIMIT_BYTES or t.numel() == 0:
        return
    _, lo, hi = _span(t)
    if copy > COPY_LIMIT_FACTOR * (hi - lo):
        raise ValueError(
            f"{op_name}: {what} is a non-contiguous view ({t.numel()} elements, shape "
            f"{tuple(t.shape)}, strides {t.stride()}) over {hi - lo} bytes of storage; sending it "
            f"needs a contiguous copy of {copy} bytes ({copy / 2**30:.1f} GiB). Pass a smaller "
            "tensor, or call .contiguous() yourself if you really mean it"
        )


def _self_overlaps(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (an expand()-ed or as_strided view).

    Sorted by stride, each dimension's stride must step past everything the smaller ones reach.
    """
    reach = 0
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """Byte offsets (into the storage) of every element of ``t``."""
    off = torch.tensor([t.storage_offset()], dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = (off[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return off * t.element_size()


def _shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """For two tensors whose byte ranges in one storage intersect: do they share an element?"""
    if a.is_contiguous() and b.is_contiguous():
        return True
    if a.element_size() != b.element_size() or max(a.numel(), b.numel()) > EXACT_OVERLAP_ELEMS:
        return True
    return bool(torch.isin(_offsets(a), _offsets(b)).any())


def _overlapping_pairs(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of tensors that share memory.

    A sweep over byte ranges sorted by start: only ranges that intersect are compared, so the
    usual case (distinct buffers, or consecutive chunks of one) costs ``O(n log n)``, not ``O(n²)``.
    """
    spans = sorted((*_span(t), i) for i, t in enumerate(tensors) if t.numel())
    pairs, active = [], []  # active: (storage, end, index) of ranges that may reach later starts
    for storage, lo, hi, j in spans:
        active = [a for a in active if a[0] == storage and a[1] > lo]
        pairs += [(min(i, j), max(i, j)) for _, _, i in active if _shares_elements(tensors[i], tensors[j])]
        active.append((storage, hi, j))
    return pairs


def aliasing(op_name: str, writes: Named, reads: Named = ()) -> list[bool]:
    """Check the tensors a collective writes; say which of the ones it reads must be staged.

    Raises ``ValueError`` when a written tensor has self-overlapping elements or two written
    tensors overlap. Returns, for each of ``reads``, whether it overlaps a written tensor (and
    must be copied before the collective runs, see :func:`staged`).
    """
    for what, t in writes:
        if t.numel() > 1 and not t.is_contiguous() and _self_overlaps(t):  # contiguous: never
            raise ValueError(
                f"{op_name}: {what} has elements that share memory (shape {tuple(t.shape)}, strides "
                f"{t.stride()}, e.g. an expand()-ed view); the collective writes it, so every element "
                "needs its own memory: pass a .clone() or a fresh tensor"
            )
    w = len(writes)
    stage = [False] * len(reads)
    if w + len(reads) < 2:  # one tensor (all_reduce, broadcast): nothing to overlap with
        return stage
    for i, j in _overlapping_pairs([t for _, t in writes] + [t for _, t in reads]):
        if j < w:  # two outputs
            raise ValueError(
                f"{op_name}: {writes[i][0]} and {writes[j][0]} overlap in memory (the same tensor twice, "
                "or views of one buffer that share elements); each receives different data, so pass "
                "distinct tensors"
            )
        if i < w:  # an input overlapping an output
            stage[j - w] = True
    return stage


def is_chunk(big: torch.Tensor, small: torch.Tensor, index: int) -> bool:
    """True when contiguous ``small`` is exactly chunk ``index`` of contiguous ``big`` (torch's in-place forms)."""
    if not (big.is_contiguous() and small.is_contiguous()) or small.numel() == 0:
        return False
    pb, lob, _ = _span(big)
    ps, los, _ = _span(small)
    return pb == ps and los == lob + index * small.numel() * small.element_size()


def staged(reads: Sequence[torch.Tensor], flags: Sequence[bool]) -> list[torch.Tensor]:
    """``reads`` with the flagged ones replaced by contiguous copies (call on the communication thread)."""
    return [t.clone(memory_format=torch.contiguous_format) if flag else t for t, flag in zip(reads, flags)]
