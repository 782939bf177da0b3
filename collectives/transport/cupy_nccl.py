"""Transport over NCCL point-to-point calls (``ncclSend`` / ``ncclRecv``) through CuPy.

This is the wire of the ``nccl-cupy`` backend: our algorithms (``ring.py``, ``tree.py``,
``direct.py``) moving torch CUDA tensors GPU to GPU. torch's own NCCL collectives are never used;
torch's process group only carries the NCCL unique id at start-up (through its store).

**Not yet run on a real GPU** (it was written on a machine without one); see ``docs/nccl.md`` for
what is verified (the call protocol, with a fake NCCL) and what is not.

Installation
    ``pip install ringddp[cuda]`` (CuPy for CUDA 12, ``cupy-cuda12x``); for CUDA 13 install
    ``cupy-cuda13x`` instead. CuPy 13 and 14 are supported. CuPy is imported lazily, inside
    :meth:`CupyNcclTransport.create`, so this module imports fine without it.

Zero copy
    A send or receive of a CUDA tensor hands NCCL ``tensor.data_ptr()``, ``tensor.numel()``
    (a count of *elements*) and the NCCL datatype of the tensor (:func:`nccl_message`); nothing
    is copied. The only exception is a *host* tensor, which NCCL cannot address: it is staged
    through a device buffer of the same size (the engine's barrier passes a 2-byte CPU token).

Datatypes
    float16, bfloat16, float32, float64, int8, uint8, int32 and int64 map to the NCCL type of the
    same name. ``bool`` is sent as ``uint8`` (same pointer, one byte per element): a point-to-point
    message is only bytes, NCCL never looks at the values. For the same reason bfloat16 falls back
    to ``NCCL_FLOAT16`` (same width) on a CuPy that lacks ``NCCL_BFLOAT16``. Any other dtype
    raises ``TypeError``.

Streams
    Every post is issued on the *current torch CUDA stream* of the transport's device
    (``torch.cuda.current_stream(device).cuda_stream``) of the calling thread, so NCCL reads a
    buffer only after the kernels queued before it on that stream, and the algorithms' reductions
    (torch ops on the same thread, hence the same stream) run after the receives they consume.

Grouping
    :meth:`~CupyNcclTransport.post` issues all of its sends and receives between
    ``nccl.groupStart()`` and ``nccl.groupEnd()``: NCCL progresses the operations of one group
    together, and only those. Two ungrouped blocking operations that need each other (rank 0 sends
    to 1 while 1 sends to 0, each receive queued after its send) deadlock, so an algorithm must put
    the send and the receive of one ring step in one ``post`` (or only ever wait along acyclic
    chains: a tree, a pipeline). ``isend`` / ``irecv`` are a group of one operation.

Ordering without tags
    NCCL has no tags: the k-th send from rank A to rank B is matched with the k-th receive posted
    by B from A, in the order the operations were *issued* on each side. The order is the same on
    both sides because (1) every collective of a group runs through the group's FIFO executor, one
    at a time and in program order on every rank (``collectives/work.py``), so a communicator is
    only ever driven by one thread at a time; (2) inside a collective the algorithm posts its
    messages in a deterministic order, identical on all ranks; (3) the operations of one post are
    issued in that order (receives first, then sends, each list in the caller's order) inside one
    NCCL group, on one stream. That is exactly the contract of ``transport/base.py``: messages
    between a pair are matched in posting order, never by tag.

Waiting: host-blocking, with a deadline
    A post records a CUDA event after its group; :meth:`Request.wait` polls ``event.query()``
    (sleeping 50 µs to 1 ms between polls, and checking ``comm.check_async_error()``) until it
    completes or ``transport.timeout`` seconds pass. Past the deadline it calls ``comm.abort()``
    (which makes NCCL's kernels on this rank give up instead of spinning forever), marks the
    transport unusable, and raises :class:`~collectives.errors.CollectiveTimeoutError` naming the
    collective (``transport.op``) and the peer. The peer is not told; its own waits reach their
    own deadline and abort in turn, so no rank hangs forever.

    Why not a stream-ordered ``wait()`` that returns at once? (a) The transport contract asks every
    wait to have a deadline and to name the peer that did not answer; a stream-ordered wait cannot
    time out, and a hang would surface only at some later synchronisation, far from its cause,
    or never. (b) When ``wait()`` returns the operation is complete on the GPU, so when a
    collective returns all its NCCL work is finished: the next collective may run on another
    thread (the group's communication thread for ``async_op=True``) with another current stream,
    and NCCL kernels of one communicator still never overlap on two streams. (c) A barrier really
    blocks the host. The price is one host round trip per wait (tens of microseconds), which
    removes GPU-side pipelining across waits; a stream-ordered mode is the natural optimisation
    once the ring algorithms post each step as one group (see ``docs/nccl.md``).

Start-up and failure
    :meth:`CupyNcclTransport.create` makes the NCCL unique id on group rank 0
    (``nccl.get_unique_id()``), shares it through torch's default store under a prefix unique to
    the process group and to this communicator (a point-to-point message over the group's own
    process group if no default store can be had), and calls ``NcclCommunicator(world_size, uid,
    rank)`` under ``cupy.cuda.Device(device.index)``. ``ncclCommInitRank`` itself blocks until all
    ranks have joined and has no deadline. :meth:`close` destroys the communicator (or aborts it
    if the transport failed or its work does not finish within the timeout).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..errors import CollectiveError, CollectiveTimeoutError, timed_out
from .base import Message, Peer, Request, Transport, wait_for_keys

log = logging.getLogger(__name__)

#: Shown whenever CuPy or its NCCL module cannot be used.
INSTALL_HINT = (
    "the nccl-cupy backend needs CuPy with NCCL: pip install ringddp[cuda] "
    "(CuPy for CUDA 12, cupy-cuda12x; for CUDA 13: pip install cupy-cuda13x)"
)
_NCCL_LIB_HINT = (
    "CuPy is installed but cannot load the NCCL library; install it with "
    "`python -m cupyx.tools.install_library --library nccl --cuda 12.x` (or 13.x), or put a "
    "libnccl.so.2 on the library path"
)

#: ``ncclUniqueId`` is 128 bytes (``NCCL_UNIQUE_ID_BYTES``) in every NCCL 2.x.
UNIQUE_ID_BYTES = 128

#: torch dtype -> names of the NCCL datatype constants to try, in order.
_NCCL_DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("NCCL_FLOAT16",),
    # Send/recv only moves bytes: a 2-byte type of another name carries bf16 unchanged.
    torch.bfloat16: ("NCCL_BFLOAT16", "NCCL_FLOAT16"),
    torch.float32: ("NCCL_FLOAT32",),
    torch.float64: ("NCCL_FLOAT64",),
    torch.int8: ("NCCL_INT8",),
    torch.uint8: ("NCCL_UINT8",),
    torch.int32: ("NCCL_INT32",),
    torch.int64: ("NCCL_INT64",),
    torch.bool: ("NCCL_UINT8",),  # one byte per element: sent as its uint8 bytes
}
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(_NCCL_DTYPE_NAMES)


# ---------------------------------------------------------------------------- lazy CuPy import


def import_cupy_nccl() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, or ``ImportError`` / ``RuntimeError`` with the install hint."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"CuPy is not installed: {INSTALL_HINT}") from exc
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(f"CuPy has no usable NCCL module (cupy.cuda.nccl): {INSTALL_HINT}") from exc
    if nccl is None:  # import blocked (sys.modules entry set to None)
        raise ImportError(f"CuPy has no usable NCCL module (cupy.cuda.nccl): {INSTALL_HINT}")
    if not getattr(nccl, "available", True):
        raise RuntimeError(f"{_NCCL_LIB_HINT}. ({INSTALL_HINT})")
    for name in ("NcclCommunicator", "get_unique_id", "groupStart", "groupEnd"):
        if not hasattr(nccl, name):
            raise RuntimeError(f"cupy.cuda.nccl lacks {name}; this CuPy is too old or incomplete: {INSTALL_HINT}")
    version = _nccl_version(nccl)
    if version is not None and 0 < version < 2700:
        raise RuntimeError(f"NCCL {version} has no send/recv; NCCL >= 2.7 is needed ({_NCCL_LIB_HINT})")
    return cupy, nccl


def _nccl_version(nccl: Any) -> int | None:
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - an old CuPy or a fake; the calls themselves will tell
        return None


# ---------------------------------------------------------------------------- pure helpers


def nccl_dtype(dtype: torch.dtype, nccl: Any) -> int:
    """The NCCL datatype constant (from module ``nccl``) that carries tensors of ``dtype``."""
    names = _NCCL_DTYPE_NAMES.get(dtype)
    if names is None:
        raise TypeError(
            f"the nccl-cupy transport cannot send dtype {dtype}; supported: "
            f"{sorted(str(d) for d in SUPPORTED_DTYPES)}"
        )
    for name in names:
        value = getattr(nccl, name, None)
        if value is not None:
            return int(value)
    raise TypeError(f"dtype {dtype}: this CuPy's nccl module defines none of {names}")


def nccl_message(tensor: torch.Tensor, nccl: Any) -> tuple[int, int, int]:
    """``(pointer, count, datatype)`` for an NCCL send/recv of the whole of ``tensor``.

    ``count`` is in elements of ``datatype``. A pure function of the tensor (works on CPU tensors,
    which is how it is tested without a GPU); the caller checks the device.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    datatype = nccl_dtype(tensor.dtype, nccl)
    if not tensor.is_contiguous():
        raise ValueError("NCCL sends and receives contiguous buffers only; got a non-contiguous tensor")
    return tensor.data_ptr(), tensor.numel(), datatype


def _uid_to_bytes(uid: Any) -> tuple[bytes, str]:
    """Serialise a CuPy NCCL unique id: ``(128 raw bytes, form)``; ``form`` lets it be rebuilt.

    CuPy 13 returns a tuple of 128 ``char`` values: signed (-128..127) where C ``char`` is signed
    (x86-64), unsigned (0..255) where it is not (aarch64). Other CuPy versions may return bytes,
    a bytearray or a NumPy array; all are accepted.
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        data, form = bytes(uid), "bytearray" if isinstance(uid, bytearray) else "bytes"
    elif isinstance(uid, (tuple, list)):
        values = [int(v) for v in uid]
        if any(not -128 <= v <= 255 for v in values):
            raise ValueError("NCCL unique id: values must be bytes (-128..255)")
        # Signed unless a value only an unsigned char can hold appears. When every value is in
        # 0..127 both readings are the same bytes, so the guess cannot go wrong.
        signed = not any(v > 127 for v in values)
        data = bytes(v & 0xFF for v in values)
        form = f"{'tuple' if isinstance(uid, tuple) else 'list'}-{'signed' if signed else 'unsigned'}"
    elif hasattr(uid, "dtype") and hasattr(uid, "tobytes") and hasattr(uid, "tolist"):  # numpy.ndarray
        import numpy as np

        arr = np.asarray(uid)
        if arr.dtype.itemsize == 1:
            data = arr.tobytes()
        else:
            data = bytes(int(v) & 0xFF for v in arr.reshape(-1).tolist())
        form = f"ndarray-{arr.dtype.str}"
    else:
        raise TypeError(
            f"NCCL unique id of unexpected type {type(uid).__name__}; expected a tuple of ints, bytes "
            "or an array (cupy.cuda.nccl.get_unique_id() of CuPy 13/14)"
        )
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(data)} bytes, expected {UNIQUE_ID_BYTES}")
    return data, form


def _uid_from_bytes(data: bytes, form: str) -> Any:
    """Rebuild a unique id in the ``form`` reported by :func:`_uid_to_bytes`."""
    data = bytes(data)
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(data)} bytes, expected {UNIQUE_ID_BYTES}")
    if form == "bytes":
        return data
    if form == "bytearray":
        return bytearray(data)
    if form.startswith(("tuple-", "list-")):
        kind, sign = form.split("-", 1)
        values = [b - 256 if sign == "signed" and b > 127 else b for b in data]
        return tuple(values) if kind == "tuple" else values
    if form.startswith("ndarray-"):
        import numpy as np

        dtype = np.dtype(form[len("ndarray-") :])
        if dtype.itemsize == 1:
            return np.frombuffer(data, dtype=dtype).copy()
        signed = dtype.kind == "i"
        return np.array([b - 256 if signed and b > 127 else b for b in data], dtype=dtype)
    raise ValueError(f"unknown NCCL unique id form {form!r}")


# ---------------------------------------------------------------------------- unique id exchange

_UID_KEY = "uid"
_UID_P2P_TAG = 0x4E43  # "NC": keeps the exchange apart from algorithm traffic on a shared gloo group
_UID_P2P_BYTES = 256
_counter_lock = threading.Lock()
_communicators_made: collections.Counter[str] = collections.Counter()


def _group_name(process_group: Any) -> str:
    """A name of ``process_group`` that is the same on all of its ranks."""
    from torch.distributed import distributed_c10d as c10d

    for get in (c10d._get_process_group_name, lambda pg: pg.group_name):
        try:
            name = get(process_group)
        except Exception:  # noqa: BLE001 - private API; fall through to the next way
            continue
        if name and str(name) != "None":
            return str(name)
    try:
        return "ranks-" + "-".join(str(r) for r in c10d.get_process_group_ranks(process_group))
    except Exception:  # noqa: BLE001 - not a registered group (tests); creation order still tells apart
        return "unnamed"


def _default_store() -> Any | None:
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialised, or the private API moved
        return None


def _encode_uid(uid: Any) -> bytes:
    data, form = _uid_to_bytes(uid)
    return form.encode() + b"|" + data


def _decode_uid(payload: bytes) -> Any:
    form, sep, data = bytes(payload).partition(b"|")
    if not sep:
        raise ValueError("malformed NCCL unique id message")
    return _uid_from_bytes(data, form.decode())


def share_unique_id(
    process_group: Any, rank: int, world_size: int, timeout: float, make_uid: Callable[[], Any]
) -> Any:
    """Make the NCCL unique id on group rank 0 (``make_uid()``) and give it to every rank.

    Every member must call this, for the same process group, in the same order (each call is a
    new communicator and gets its own store prefix). The other ranks receive the id rebuilt in
    the form rank 0's CuPy produced it. torch's collectives are not used.
    """
    name = _group_name(process_group)
    with _counter_lock:
        serial = _communicators_made[name]
        _communicators_made[name] += 1
    if world_size == 1:
        return make_uid()
    base = _default_store()
    if base is not None:
        import torch.distributed as dist

        store = dist.PrefixStore(f"ringddp/nccl-cupy/{name}/{serial}/", base)
        return _share_via_store(store, rank, world_size, timeout, make_uid)
    return _share_via_p2p(process_group, rank, world_size, timeout, make_uid)


def _share_via_store(store: Any, rank: int, world_size: int, timeout: float, make_uid: Callable[[], Any]) -> Any:
    if rank == 0:
        uid = make_uid()
        store.set(_UID_KEY, _encode_uid(uid))
        return uid
    if not wait_for_keys(store, [_UID_KEY], time.monotonic() + timeout):  # the client is shared: poll
        raise CollectiveTimeoutError(
            f"nccl-cupy init: no NCCL unique id from rank 0: {timed_out(timeout)} (this is rank {rank} "
            f"of {world_size})",
            op="nccl-cupy init",
            peer=0,
        )
    payload = store.get(_UID_KEY)
    # The last reader removes the key (best effort; a left-over key is harmless: prefixes are unique).
    try:
        if store.add("read", 1) == world_size - 1:
            store.delete_key(_UID_KEY)
    except Exception:  # noqa: BLE001
        pass
    return _decode_uid(payload)


def _share_via_p2p(
    process_group: Any, rank: int, world_size: int, timeout: float, make_uid: Callable[[], Any]
) -> Any:
    wait = datetime.timedelta(seconds=timeout)
    buf = torch.zeros(_UID_P2P_BYTES, dtype=torch.uint8)
    if rank == 0:
        uid = make_uid()
        payload = _encode_uid(uid)
        buf[:2] = torch.tensor([len(payload) >> 8, len(payload) & 0xFF], dtype=torch.uint8)
        buf[2 : 2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for peer in range(1, world_size):
            try:
                process_group.send([buf], peer, _UID_P2P_TAG).wait(wait)
            except RuntimeError as exc:
                raise CollectiveError(
                    f"nccl-cupy init: sending the NCCL unique id to rank {peer} failed (this is rank 0 "
                    f"of {world_size}): {exc}",
                    op="nccl-cupy init",
                    peer=peer,
                ) from exc
        return uid
    try:
        process_group.recv([buf], 0, _UID_P2P_TAG).wait(wait)
    except RuntimeError as exc:
        raise CollectiveError(
            f"nccl-cupy init: receiving the NCCL unique id from rank 0 failed (this is rank {rank} "
            f"of {world_size}, waited up to {timeout:g}s): {exc}",
            op="nccl-cupy init",
            peer=0,
        ) from exc
    size = (int(buf[0]) << 8) | int(buf[1])
    return _decode_uid(bytes(buf[2 : 2 + size].tolist()))


def _make_communicator(nccl: Any, world_size: int, uid: Any, rank: int) -> Any:
    """``NcclCommunicator(world_size, uid, rank)``, retrying other unique id forms on ``TypeError``.

    CuPy 13's constructor insists on a tuple; should another CuPy take (or return) another form,
    the same 128 bytes are offered as a tuple and as bytes before giving up.
    """
    try:
        return nccl.NcclCommunicator(world_size, uid, rank)
    except TypeError as first:
        data, form = _uid_to_bytes(uid)
        for other in ("tuple-signed", "tuple-unsigned", "bytes"):
            if other == form:
                continue
            try:
                return nccl.NcclCommunicator(world_size, _uid_from_bytes(data, other), rank)
            except (TypeError, OverflowError):
                continue
        raise TypeError(f"NcclCommunicator rejected the unique id in every known form: {first}") from first


# ---------------------------------------------------------------------------- CUDA runtime seam


class TorchCudaRuntime:
    """What the transport needs from the CUDA runtime, taken from torch.

    A seam for tests: the fake-NCCL tests substitute an object with the same three methods.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self) -> Any:
        """The stream to issue on; has ``.cuda_stream`` (the handle) and ``.record_event()``."""
        return torch.cuda.current_stream(self.device)

    def device_guard(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device)

    def staging(self, like: torch.Tensor) -> torch.Tensor:
        """A device buffer shaped like host tensor ``like``."""
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)


# ---------------------------------------------------------------------------- requests


class CupyNcclRequest(Request):
    """One send or receive of a posted NCCL group; completes when the group's event does."""

    __slots__ = ("_transport", "_event", "_kind", "_peer", "_op", "_group_peers", "_done", "_finish", "_keep")

    def __init__(
        self,
        transport: "CupyNcclTransport",
        event: Any,
        kind: str,
        peer: Peer,
        op: str,
        group_peers: tuple[int, ...],
        finish: Callable[[], None] | None = None,
        keep: Any = None,
    ):
        self._transport = transport
        self._event = event
        self._kind = kind
        self._peer = peer
        self._op = op
        self._group_peers = group_peers
        self._done = False
        self._finish = finish  # host copy-out of a staged receive
        self._keep = keep  # the buffers NCCL uses, kept alive until completion

    @property
    def peer(self) -> Peer:
        return self._peer

    def describe(self) -> str:
        direction = "to" if self._kind == "send" else "from"
        text = f"{self._kind} {direction} rank {self._peer}"
        others = sorted(set(self._group_peers) - {self._peer})
        if others:
            text += f" (grouped with traffic to/from ranks {others})"
        return text

    def wait(self) -> None:
        if self._done:
            return
        self._transport._wait(self)
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._transport.broken is not None:
            return True  # wait() returns at once (by raising)
        return bool(self._event.query())


# ---------------------------------------------------------------------------- transport


class CupyNcclTransport(Transport):
    """Point-to-point over one NCCL communicator (CuPy's ``NcclCommunicator``), CUDA tensors.

    Build it with :meth:`create` (all ranks of the group at once). The constructor takes an
    existing communicator, which is how the tests drive it with a fake one.

    Args:
        comm: a ``cupy.cuda.nccl.NcclCommunicator`` of ``world_size`` ranks, this one ``rank``.
        nccl: the ``cupy.cuda.nccl`` module (``groupStart``/``groupEnd`` and dtype constants).
        rank, world_size: this rank and the size of the group (NCCL ranks = group ranks).
        timeout: seconds any wait may block before the communicator is aborted.
        device: the CUDA device of the communicator; tensors must live there (or on the host).
        runtime: the CUDA runtime seam (default :class:`TorchCudaRuntime` for ``device``).
    """

    #: sleep between polls of a pending operation grows from the first to the second (seconds).
    poll_interval = (50e-6, 1e-3)

    def __init__(
        self,
        comm: Any,
        nccl: Any,
        rank: int,
        world_size: int,
        timeout: float,
        device: torch.device,
        runtime: Any | None = None,
    ):
        super().__init__(rank, world_size, timeout)
        self.comm = comm
        self.nccl = nccl
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.runtime = runtime if runtime is not None else TorchCudaRuntime(self.device)
        self.broken: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, process_group: Any, rank: int, timeout: float, device: torch.device) -> "CupyNcclTransport":
        """Create the communicator of ``process_group`` on ``device``; every member must call this.

        Rank 0 of the group makes the NCCL unique id; it reaches the others through torch's
        store (see :func:`share_unique_id`). Raises ``ImportError``/``RuntimeError`` with the
        install hint when CuPy or NCCL is missing.
        """
        cupy, nccl = import_cupy_nccl()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the nccl-cupy transport runs on CUDA devices, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        world_size = process_group.size()
        uid = share_unique_id(process_group, rank, world_size, timeout, nccl.get_unique_id)
        with cupy.cuda.Device(device.index):
            try:
                comm = _make_communicator(nccl, world_size, uid, rank)
            except nccl.NcclError as exc:
                if "INVALID_USAGE" not in str(exc):
                    raise
                # Seen on an H100 with two ranks on its one GPU: NCCL's bare message names no cause.
                raise RuntimeError(
                    f"NCCL refused rank {rank}'s communicator on {device} ({exc}); NCCL allows one rank per "
                    f"GPU, and {torch.cuda.device_count()} are visible "
                    f"here for a group of {world_size}: give each rank of a host its own device "
                    "(CUDA_VISIBLE_DEVICES, or fewer ranks per host)"
                ) from exc
        log.debug("rank %d/%d: NCCL communicator ready on %s", rank, world_size, device)
        return cls(comm, nccl, rank, world_size, timeout, device)

    # ------------------------------------------------------------------ posting

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.post(sends=[(tensor, peer)])[0]

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        return self.post(recvs=[(tensor, peer)])[0]

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[Request]:
        """Issue all ``recvs`` then all ``sends`` in one NCCL group on the current stream.

        Returns their requests, receives first. Arguments are checked before anything is issued,
        so a bad one never leaves an NCCL group open.
        """
        self._check_usable()
        if not sends and not recvs:
            return []
        op = self.op
        # (kind, peer, pointer, count, datatype, host tensor to copy back, buffer NCCL uses)
        plan: list[tuple[str, int, int, int, int, torch.Tensor | None, torch.Tensor]] = []
        for kind, messages in (("recv", recvs), ("send", sends)):
            for tensor, peer in messages:
                self._check_peer(peer, op)
                host = None
                if self._needs_staging(tensor, op):
                    # NCCL cannot address host memory: go through a device buffer.
                    nccl_message(tensor, self.nccl)  # dtype/contiguity checks first
                    host, tensor = tensor, self.runtime.staging(tensor)
                    if kind == "send":
                        tensor.copy_(host)
                plan.append((kind, peer, *nccl_message(tensor, self.nccl), host, tensor))

        stream = self.runtime.current_stream()
        handle = int(stream.cuda_stream)
        current = plan[0]
        try:
            with self.runtime.device_guard():
                self.nccl.groupStart()
                try:
                    for current in plan:
                        kind, peer, pointer, count, datatype = current[:5]
                        if kind == "recv":
                            self.comm.recv(pointer, count, datatype, peer, handle)
                        else:
                            self.comm.send(pointer, count, datatype, peer, handle)
                finally:
                    self.nccl.groupEnd()  # always close the group, even after a failed call
                event = stream.record_event()
        except Exception as exc:  # noqa: BLE001 - NcclError, CUDA errors
            kind, peer = current[0], current[1]
            direction = "to" if kind == "send" else "from"
            message = (
                f"{op}: posting a {kind} {direction} rank {peer} failed (this is rank {self.rank} "
                f"of {self.world_size}): {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"
            )
            self._abort(message)
            raise CollectiveError(message, op=op, peer=peer) from exc

        peers = tuple(p[1] for p in plan)
        requests: list[Request] = []
        for kind, peer, _, _, _, host, device_buffer in plan:
            finish = None
            if kind == "recv" and host is not None:
                finish = _copy_back(host, device_buffer)
            requests.append(CupyNcclRequest(self, event, kind, peer, op, peers, finish, device_buffer))
        return requests

    # ------------------------------------------------------------------ waiting

    def _wait(self, request: CupyNcclRequest) -> None:
        if self.broken is not None:
            raise CollectiveError(
                f"{request._op}: {request.describe()} cannot complete: the NCCL transport is unusable "
                f"after an earlier failure: {self.broken}",
                op=request._op,
                peer=request._peer,
            )
        event = request._event
        if not event.query():
            deadline = time.monotonic() + self.timeout
            delay, longest = self.poll_interval
            while not event.query():
                self._check_async_error(request)
                if time.monotonic() >= deadline:
                    self._timed_out(request)
                time.sleep(delay)
                delay = min(delay * 2, longest)
        self._check_async_error(request)

    def _check_async_error(self, request: CupyNcclRequest) -> None:
        check = getattr(self.comm, "check_async_error", None)
        if check is None:
            return
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - NcclError
            message = (
                f"{request._op}: {request.describe()} failed: NCCL reported an asynchronous error "
                f"(this is rank {self.rank} of {self.world_size}): {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"
            )
            self._abort(message)
            raise CollectiveError(message, op=request._op, peer=request._peer) from exc

    def _timed_out(self, request: CupyNcclRequest) -> None:
        message = (
            f"{request._op}: {request.describe()}: {timed_out(self.timeout)} (this is rank "
            f"{self.rank} of {self.world_size}); the NCCL communicator was aborted and the transport "
            "is unusable"
        )
        self._abort(message)
        raise CollectiveTimeoutError(message, op=request._op, peer=request._peer)

    def _abort(self, reason: str) -> None:
        """Abort the communicator (NCCL kernels stop waiting) and refuse all further traffic."""
        if self.broken is None:
            self.broken = reason
        comm = self.comm
        if comm is None:
            return
        try:
            comm.abort()
        except Exception as exc:  # noqa: BLE001 - keep the original error; log this one
            log.warning("rank %d: ncclCommAbort failed: %s", self.rank, exc)

    # ------------------------------------------------------------------ checks

    def _check_usable(self) -> None:
        if self._closed:
            raise CollectiveError(f"{self.op}: the NCCL transport is closed", op=self.op)
        if self.broken is not None:
            raise CollectiveError(
                f"{self.op}: the NCCL transport is unusable after an earlier failure: {self.broken}", op=self.op
            )

    def _check_peer(self, peer: object, op: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"{op}: peer {peer!r} is not a rank of this group of {self.world_size}")

    def _needs_staging(self, tensor: object, op: str) -> bool:
        """False for a tensor on the communicator's device, True for a host tensor, else raise."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device == self.device:
            return False
        if tensor.device.type == "cpu":
            return True
        raise ValueError(
            f"{op}: the NCCL communicator of this group lives on {self.device}; got a tensor on {tensor.device}"
        )

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Destroy the communicator (abort it if it failed or its work does not finish in time)."""
        if self._closed:
            return
        self._closed = True
        comm, self.comm = self.comm, None
        if comm is None:
            return
        try:
            if self.broken is None and self._drain():
                comm.destroy()
            else:
                comm.abort()
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            log.warning("rank %d: closing the NCCL communicator failed: %s", self.rank, exc)

    def _drain(self) -> bool:
        """Wait (up to the timeout) for work queued on the current stream; False if it hangs."""
        try:
            with self.runtime.device_guard():
                event = self.runtime.current_stream().record_event()
            deadline = time.monotonic() + self.timeout
            while not event.query():
                if time.monotonic() >= deadline:
                    log.warning("rank %d: NCCL work still pending at close; aborting the communicator", self.rank)
                    return False
                time.sleep(self.poll_interval[1])
        except Exception as exc:  # noqa: BLE001 - e.g. the CUDA context is already gone at exit
            log.debug("rank %d: could not drain the stream before close: %s", self.rank, exc)
        return True


def _copy_back(host: torch.Tensor, staged: torch.Tensor) -> Callable[[], None]:
    def finish() -> None:
        host.copy_(staged)

    return finish
