"""Tests of the CuPy NCCL transport (``collectives/transport/cupy_nccl.py``).

Two kinds:

* **Fake-NCCL tests** (run everywhere, no GPU, no CuPy): a fake ``cupy`` / ``cupy.cuda.nccl`` is
  put into ``sys.modules`` or a fake communicator is handed to the transport, and the call
  protocol is checked: one ``groupStart``/``groupEnd`` per post, the stream handle, pointer /
  count / datatype per torch dtype, errors, timeouts, the unique id exchange over a real gloo group.
* **Real-GPU tests** (skipped without CUDA and CuPy): every collective through
  ``collectives.launch(..., backend="nccl-cupy")`` on CUDA tensors, compared with torch on the
  same device; world size 1, and 2 when two GPUs are visible.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import random
import sys
import types

import pytest
import torch

from collectives.errors import CollectiveError, CollectiveTimeoutError
from collectives.transport import cupy_nccl
from collectives.transport.base import wait_all
from collectives.transport.cupy_nccl import (
    INSTALL_HINT,
    CupyNcclTransport,
    _uid_from_bytes,
    _uid_to_bytes,
    nccl_dtype,
    nccl_message,
)

# NCCL's own ncclDataType_t values.
NCCL_CONSTANTS = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
}
EXPECTED_NCCL_TYPE = {
    torch.float16: 6,
    torch.bfloat16: 9,
    torch.float32: 7,
    torch.float64: 8,
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.bool: 1,  # sent as its uint8 bytes
}
STREAM_HANDLE = 0x5EED


# ---------------------------------------------------------------------------- fakes


class FakeNcclError(RuntimeError):
    pass


class FakeCommunicator:
    """Records every call into the shared log of its fake ``nccl`` module."""

    #: unique id types the constructor accepts (CuPy 13 takes tuples only)
    accepts: tuple[type, ...] = (tuple, bytes, list, bytearray)

    def __init__(self, ndev, uid, rank, log=None):
        if not isinstance(uid, self.accepts):
            raise TypeError(f"commId must be one of {self.accepts}, got {type(uid).__name__}")
        self.log = log if log is not None else []
        self.ndev, self.uid, self.rank = ndev, uid, rank
        self.async_error: Exception | None = None
        self.fail_send: Exception | None = None
        self.aborted = self.destroyed = 0
        self.async_checks = 0
        self.log.append(("init", ndev, rank))

    def send(self, ptr, count, datatype, peer, stream):
        self.log.append(("send", ptr, count, datatype, peer, stream))
        if self.fail_send is not None:
            raise self.fail_send

    def recv(self, ptr, count, datatype, peer, stream):
        self.log.append(("recv", ptr, count, datatype, peer, stream))

    def check_async_error(self):
        self.async_checks += 1
        if self.async_error is not None:
            raise self.async_error

    def abort(self):
        self.aborted += 1
        self.log.append(("abort",))

    def destroy(self):
        self.destroyed += 1
        self.log.append(("destroy",))


class FakeEvent:
    """Completes after ``ready_after`` queries (never if None)."""

    def __init__(self, ready_after: int | None = 0):
        self.ready_after = ready_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries > self.ready_after


class FakeStream:
    def __init__(self, runtime: "FakeRuntime"):
        self.cuda_stream = STREAM_HANDLE
        self._runtime = runtime

    def record_event(self):
        event = FakeEvent(self._runtime.ready_after)
        self._runtime.events.append(event)
        self._runtime.log.append(("record_event",))
        return event


class FakeRuntime:
    """Stands in for :class:`cupy_nccl.TorchCudaRuntime`; staging buffers are CPU tensors."""

    def __init__(self, log: list, ready_after: int | None = 0):
        self.log = log
        self.ready_after = ready_after
        self.events: list[FakeEvent] = []
        self.staged: list[torch.Tensor] = []

    def current_stream(self):
        return FakeStream(self)

    @contextlib.contextmanager
    def device_guard(self):
        self.log.append(("device_guard",))
        yield

    def staging(self, like):
        buf = torch.zeros_like(like)
        self.staged.append(buf)
        return buf


def fake_nccl_module(log: list, *, bf16: bool = True, available: bool = True, uid_factory=None, comm_cls=None):
    nccl = types.ModuleType("cupy.cuda.nccl")
    for name, value in NCCL_CONSTANTS.items():
        if name != "NCCL_BFLOAT16" or bf16:
            setattr(nccl, name, value)
    nccl.available = available
    nccl.NcclError = FakeNcclError
    nccl.groupStart = lambda: log.append(("groupStart",))
    nccl.groupEnd = lambda: log.append(("groupEnd",))
    nccl.get_version = lambda: 22304
    nccl.get_unique_id = uid_factory or (lambda: tuple(random.randint(-128, 127) for _ in range(128)))
    cls = comm_cls or FakeCommunicator
    nccl.NcclCommunicator = lambda ndev, uid, rank: cls(ndev, uid, rank, log)
    return nccl


class FakeDevice:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def __enter__(self):
        self.log.append(("device_enter", self.index))
        return self

    def __exit__(self, *exc):
        self.log.append(("device_exit", self.index))
        return False


def fake_cupy(log: list, **kwargs):
    nccl = fake_nccl_module(log, **kwargs)
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cuda.Device = functools.partial(FakeDevice, log)
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    return cupy


def install_fake_cupy(monkeypatch, cupy) -> None:
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cupy.cuda.nccl)


class FakeProcessGroup:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def make_transport(
    world_size: int = 2,
    rank: int = 0,
    timeout: float = 5.0,
    ready_after: int | None = 0,
    device: torch.device = torch.device("cpu"),
    **nccl_kwargs,
):
    """A transport over a fake communicator. With ``device=cpu`` CPU tensors count as "on the
    communicator's device", so the zero-copy path runs on CPU tensors; with ``cuda:0`` they are
    host tensors and take the staging path."""
    log: list = []
    nccl = fake_nccl_module(log, **nccl_kwargs)
    comm = FakeCommunicator(world_size, tuple(range(128)), rank, log)
    log.clear()
    runtime = FakeRuntime(log, ready_after)
    transport = CupyNcclTransport(comm, nccl, rank, world_size, timeout, device, runtime=runtime)
    return transport, comm, log, runtime


def nccl_calls(log):
    return [entry for entry in log if entry[0] in ("groupStart", "groupEnd", "send", "recv")]


# ---------------------------------------------------------------------------- import / install hint


def test_module_imports_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # "import cupy" now raises ImportError
    module = importlib.reload(cupy_nccl)
    assert issubclass(module.CupyNcclTransport, module.Transport)
    src = open(module.__file__).read()
    top_level = [line for line in src.splitlines() if line.startswith(("import cupy", "from cupy"))]
    assert top_level == []


def test_missing_cupy_raises_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError) as info:
        CupyNcclTransport.create(FakeProcessGroup(1), 0, 5.0, torch.device("cuda", 0))
    assert "pip install ringddp[cuda]" in str(info.value)
    assert "cupy-cuda13x" in str(info.value)
    assert INSTALL_HINT in str(info.value)


def test_missing_nccl_module_raises_install_hint(monkeypatch):
    cupy = fake_cupy([])
    del cupy.cuda.nccl
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)
    with pytest.raises(ImportError, match=r"pip install ringddp\[cuda\]"):
        CupyNcclTransport.create(FakeProcessGroup(1), 0, 5.0, torch.device("cuda", 0))


def test_nccl_library_unavailable_raises_hint(monkeypatch):
    install_fake_cupy(monkeypatch, fake_cupy([], available=False))
    with pytest.raises(RuntimeError) as info:
        CupyNcclTransport.create(FakeProcessGroup(1), 0, 5.0, torch.device("cuda", 0))
    assert "NCCL" in str(info.value) and "pip install ringddp[cuda]" in str(info.value)


# ---------------------------------------------------------------------------- dtype / pointer mapping


@pytest.mark.parametrize("dtype", sorted(EXPECTED_NCCL_TYPE, key=str), ids=str)
def test_message_maps_pointer_count_and_dtype(dtype):
    nccl = fake_nccl_module([])
    base = torch.zeros(64, dtype=dtype)
    view = base[5:37]  # a view with a storage offset: the pointer must include it
    pointer, count, datatype = nccl_message(view, nccl)
    assert pointer == view.data_ptr() == base.data_ptr() + 5 * base.element_size()
    assert count == 32  # elements, not bytes
    assert datatype == EXPECTED_NCCL_TYPE[dtype] == nccl_dtype(dtype, nccl)


def test_bool_is_sent_as_uint8_bytes():
    nccl = fake_nccl_module([])
    t = torch.tensor([True, False, True])
    assert nccl_message(t, nccl) == (t.data_ptr(), 3, NCCL_CONSTANTS["NCCL_UINT8"])


def test_bfloat16_falls_back_to_a_two_byte_type_on_old_cupy():
    nccl = fake_nccl_module([], bf16=False)
    assert nccl_dtype(torch.bfloat16, nccl) == NCCL_CONSTANTS["NCCL_FLOAT16"]


@pytest.mark.parametrize("dtype", [torch.int16, torch.complex64, torch.float8_e4m3fn, torch.uint16], ids=str)
def test_unsupported_dtype_raises_type_error(dtype):
    nccl = fake_nccl_module([])
    with pytest.raises(TypeError, match=str(dtype)):
        nccl_message(torch.zeros(4, dtype=dtype), nccl)


def test_unsupported_dtype_issues_nothing():
    transport, _, log, _ = make_transport()
    with pytest.raises(TypeError):
        transport.isend(torch.zeros(4, dtype=torch.int16), 1)
    assert log == []


def test_non_contiguous_tensor_is_rejected():
    nccl = fake_nccl_module([])
    with pytest.raises(ValueError, match="contiguous"):
        nccl_message(torch.zeros(4, 4).t(), nccl)


# ---------------------------------------------------------------------------- unique id adapter


def _random_id(seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(128))


def test_uid_cupy13_signed_tuple_roundtrip():
    raw = _random_id(1)
    uid = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy 13 on x86-64: signed char
    data, form = _uid_to_bytes(uid)
    assert data == raw and form == "tuple-signed"
    assert _uid_from_bytes(data, form) == uid


def test_uid_cupy13_unsigned_tuple_roundtrip():
    raw = _random_id(2)
    uid = tuple(raw)  # CuPy 13 where char is unsigned (aarch64)
    data, form = _uid_to_bytes(uid)
    assert data == raw and form == "tuple-unsigned"
    assert _uid_from_bytes(data, form) == uid


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_uid_bytes_forms_roundtrip(kind):
    raw = _random_id(3)
    uid = {"bytes": raw, "bytearray": bytearray(raw), "memoryview": memoryview(raw)}[kind]
    data, form = _uid_to_bytes(uid)
    assert data == raw
    rebuilt = _uid_from_bytes(data, form)
    assert bytes(rebuilt) == raw and isinstance(rebuilt, (bytes, bytearray))


@pytest.mark.parametrize("np_dtype", ["int8", "uint8", "int64"])
def test_uid_ndarray_roundtrip(np_dtype):
    np = pytest.importorskip("numpy")
    raw = _random_id(4)
    values = [b - 256 if np_dtype != "uint8" and b > 127 else b for b in raw]
    uid = np.array(values, dtype=np_dtype)
    data, form = _uid_to_bytes(uid)
    assert data == raw
    rebuilt = _uid_from_bytes(data, form)
    assert rebuilt.dtype == uid.dtype and (rebuilt == uid).all()


def test_uid_adapter_rejects_bad_input():
    with pytest.raises(ValueError, match="128"):
        _uid_to_bytes(tuple(range(100)))
    with pytest.raises(ValueError, match="128"):
        _uid_from_bytes(b"\x00" * 12, "bytes")
    with pytest.raises(TypeError, match="unexpected type"):
        _uid_to_bytes(12345)
    with pytest.raises(ValueError):
        _uid_to_bytes(tuple([300] * 128))
    with pytest.raises(ValueError, match="form"):
        _uid_from_bytes(_random_id(), "mystery")


def test_uid_payload_encoding_roundtrip():
    uid = tuple(b - 256 if b > 127 else b for b in _random_id(5))
    assert cupy_nccl._decode_uid(cupy_nccl._encode_uid(uid)) == uid


def test_communicator_retries_other_uid_forms():
    class BytesOnly(FakeCommunicator):
        accepts = (bytes,)

    log: list = []
    nccl = fake_nccl_module(log, comm_cls=BytesOnly)
    uid = tuple(b - 256 if b > 127 else b for b in _random_id(6))
    comm = cupy_nccl._make_communicator(nccl, 2, uid, 1)
    assert comm.uid == _random_id(6) and comm.rank == 1

    class NothingWorks(FakeCommunicator):
        accepts = (float,)

    with pytest.raises(TypeError, match="every known form"):
        cupy_nccl._make_communicator(fake_nccl_module([], comm_cls=NothingWorks), 2, uid, 1)


# ---------------------------------------------------------------------------- create()


def test_create_world1_builds_communicator_under_device(monkeypatch):
    log: list = []
    uid = tuple(b - 256 if b > 127 else b for b in _random_id(7))
    install_fake_cupy(monkeypatch, fake_cupy(log, uid_factory=lambda: uid))
    t = CupyNcclTransport.create(FakeProcessGroup(1), 0, 7.0, torch.device("cuda", 3))
    assert isinstance(t, CupyNcclTransport)
    assert (t.rank, t.world_size, t.timeout, t.device) == (0, 1, 7.0, torch.device("cuda", 3))
    assert log == [("device_enter", 3), ("init", 1, 0), ("device_exit", 3)]
    assert t.comm.uid == uid


def test_create_names_one_rank_per_gpu_when_nccl_refuses(monkeypatch):
    class Refused(FakeCommunicator):
        def __init__(self, *args):
            raise FakeNcclError("NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN for details)")

    install_fake_cupy(monkeypatch, fake_cupy([], comm_cls=Refused))
    with pytest.raises(RuntimeError, match="one rank per GPU") as info:
        CupyNcclTransport.create(FakeProcessGroup(1), 0, 5.0, torch.device("cuda", 0))
    assert isinstance(info.value.__cause__, FakeNcclError)


def test_create_rejects_cpu_device(monkeypatch):
    install_fake_cupy(monkeypatch, fake_cupy([]))
    with pytest.raises(ValueError, match="CUDA"):
        CupyNcclTransport.create(FakeProcessGroup(1), 0, 5.0, torch.device("cpu"))


def _uid_exchange_job(rank: int, world_size: int):
    """Runs on each rank of a 2-process gloo job: create() with a fake CuPy, three times."""
    import collectives.group as group_mod

    log: list = []
    made: list[tuple] = []

    def make_uid():
        uid = tuple(random.Random(1000 + len(made)).randint(-128, 127) for _ in range(128))
        made.append(uid)
        return uid

    cupy = fake_cupy(log, uid_factory=make_uid)
    sys.modules.update({"cupy": cupy, "cupy.cuda": cupy.cuda, "cupy.cuda.nccl": cupy.cuda.nccl})
    pg = group_mod.get_default_group().process_group
    seen = []
    for _ in range(2):  # two communicators on one group: distinct store prefixes
        t = CupyNcclTransport.create(pg, rank, 30.0, torch.device("cuda", 0))
        seen.append(t.comm.uid)
    real_store = cupy_nccl._default_store
    cupy_nccl._default_store = lambda: None  # the point-to-point fallback
    try:
        t = CupyNcclTransport.create(pg, rank, 30.0, torch.device("cuda", 0))
        seen.append(t.comm.uid)
    finally:
        cupy_nccl._default_store = real_store
    return {"made": made, "seen": seen, "init": [e for e in log if e[0] == "init"]}


def test_unique_id_is_shared_over_the_process_group():
    import collectives

    results = collectives.launch(_uid_exchange_job, 2, backend="p2p", timeout=60, join_timeout=240)
    root, other = results
    assert len(root["made"]) == 3 and other["made"] == []  # only group rank 0 makes ids
    assert root["seen"] == root["made"]
    assert other["seen"] == root["made"]  # same ids, same (signed tuple) form, all three times
    assert len(set(root["made"])) == 3
    assert root["init"] == [("init", 2, 0)] * 3 and other["init"] == [("init", 2, 1)] * 3


# ---------------------------------------------------------------------------- call protocol


def test_post_wraps_all_ops_in_one_group_on_the_current_stream():
    transport, _, log, _ = make_transport(world_size=3, rank=1)
    a, b = torch.arange(8, dtype=torch.float32), torch.zeros(4, dtype=torch.int64)
    c = torch.zeros(8, dtype=torch.float32)
    requests = transport.post(sends=[(a, 2), (b, 0)], recvs=[(c, 0)])
    assert nccl_calls(log) == [
        ("groupStart",),
        ("recv", c.data_ptr(), 8, 7, 0, STREAM_HANDLE),  # receives first
        ("send", a.data_ptr(), 8, 7, 2, STREAM_HANDLE),
        ("send", b.data_ptr(), 4, 4, 0, STREAM_HANDLE),
        ("groupEnd",),
    ]
    # the event is recorded after the group, under the device guard
    assert log.index(("device_guard",)) < log.index(("groupStart",))
    assert log.index(("record_event",)) > log.index(("groupEnd",))
    assert [r.peer for r in requests] == [0, 2, 0]
    wait_all(requests)
    assert all(r.is_completed() for r in requests)


def test_isend_and_irecv_are_groups_of_one():
    transport, _, log, _ = make_transport()
    x = torch.ones(3, dtype=torch.float16)
    transport.isend(x, 1).wait()
    transport.irecv(x, 1).wait()
    transport.send(x, 1)
    transport.recv(x, 1)
    calls = nccl_calls(log)
    assert calls == [
        ("groupStart",), ("send", x.data_ptr(), 3, 6, 1, STREAM_HANDLE), ("groupEnd",),
        ("groupStart",), ("recv", x.data_ptr(), 3, 6, 1, STREAM_HANDLE), ("groupEnd",),
    ] * 2


@pytest.mark.parametrize("dtype", sorted(EXPECTED_NCCL_TYPE, key=str), ids=str)
def test_post_passes_nccl_dtype_for_every_torch_dtype(dtype):
    transport, _, log, _ = make_transport()
    x = torch.zeros(5, dtype=dtype)
    transport.isend(x, 1).wait()
    assert ("send", x.data_ptr(), 5, EXPECTED_NCCL_TYPE[dtype], 1, STREAM_HANDLE) in log


def test_empty_post_issues_nothing():
    transport, _, log, _ = make_transport()
    assert transport.post() == []
    assert log == []


def test_bad_peer_is_rejected_before_any_group_opens():
    transport, _, log, _ = make_transport(world_size=2)
    with pytest.raises(ValueError, match="peer 2"):
        transport.post(sends=[(torch.zeros(2), 0), (torch.zeros(2), 2)])
    with pytest.raises(ValueError):
        transport.isend(torch.zeros(2), -1)
    assert log == []


def test_tensor_on_another_device_is_rejected():
    transport, _, log, _ = make_transport(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="cuda:0"):
        transport.isend(torch.zeros(2, device="meta"), 1)
    assert log == []


def test_host_tensors_are_staged_through_a_device_buffer():
    transport, _, log, runtime = make_transport(device=torch.device("cuda", 0))
    token = torch.tensor([7, 9], dtype=torch.uint8)
    transport.isend(token[0:1], 1).wait()
    staged_send = runtime.staged[0]
    assert staged_send.tolist() == [7]
    assert ("send", staged_send.data_ptr(), 1, 1, 1, STREAM_HANDLE) in log
    request = transport.irecv(token[1:2], 1)
    staged_recv = runtime.staged[1]
    assert ("recv", staged_recv.data_ptr(), 1, 1, 1, STREAM_HANDLE) in log
    staged_recv.fill_(42)  # what NCCL would have written
    request.wait()
    assert token.tolist() == [7, 42]


def test_wait_polls_the_event_until_it_completes():
    transport, comm, _, runtime = make_transport(ready_after=3)
    request = transport.isend(torch.zeros(4), 1)
    assert not request.is_completed()
    request.wait()
    assert request.is_completed()
    assert runtime.events[0].queries >= 4
    assert comm.async_checks >= 1


def test_requests_of_one_group_share_completion():
    transport, _, _, runtime = make_transport(ready_after=1)
    requests = transport.post(sends=[(torch.zeros(2), 1)], recvs=[(torch.zeros(2), 1)])
    assert len(runtime.events) == 1
    wait_all(requests)


# ---------------------------------------------------------------------------- failures


def test_timeout_names_op_and_peer_and_aborts():
    transport, comm, _, _ = make_transport(world_size=4, rank=2, timeout=0.05, ready_after=None)
    with transport.operation("all_reduce"):
        request = transport.irecv(torch.zeros(4), 3)
        with pytest.raises(CollectiveTimeoutError) as info:
            request.wait()
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, CollectiveError)
    assert err.op == "all_reduce" and err.peer == 3
    assert "all_reduce" in str(err) and "rank 3" in str(err) and " Timed out " in str(err)
    assert comm.aborted == 1
    assert transport.broken is not None
    # unusable afterwards: nothing more is issued, waits fail at once
    with pytest.raises(CollectiveError, match="unusable"):
        transport.isend(torch.zeros(1), 1)
    with pytest.raises(CollectiveError, match="unusable"):
        request.wait()


def test_timeout_in_a_group_mentions_the_other_peers():
    transport, _, _, _ = make_transport(world_size=4, rank=0, timeout=0.02, ready_after=None)
    with transport.operation("all_to_all"):
        requests = transport.post(sends=[(torch.zeros(1), 1), (torch.zeros(1), 2)], recvs=[(torch.zeros(1), 3)])
        with pytest.raises(CollectiveTimeoutError) as info:
            requests[0].wait()
    assert info.value.peer == 3 and "ranks [1, 2]" in str(info.value)


def test_async_nccl_error_raises_collective_error_and_aborts():
    transport, comm, _, _ = make_transport(timeout=5.0, ready_after=None)
    comm.async_error = FakeNcclError("NCCL_ERROR_REMOTE_ERROR: remote process exited")
    with transport.operation("broadcast"):
        request = transport.isend(torch.zeros(2), 1)
        with pytest.raises(CollectiveError) as info:
            request.wait()
    assert not isinstance(info.value, CollectiveTimeoutError)
    assert info.value.op == "broadcast" and info.value.peer == 1
    assert "remote process exited" in str(info.value)
    assert comm.aborted == 1


def test_failing_nccl_call_still_closes_the_group():
    transport, comm, log, _ = make_transport()
    comm.fail_send = FakeNcclError("NCCL_ERROR_INVALID_ARGUMENT")
    with transport.operation("scatter"):
        with pytest.raises(CollectiveError) as info:
            transport.post(sends=[(torch.zeros(2), 1)], recvs=[(torch.zeros(2), 1)])
    assert info.value.op == "scatter" and info.value.peer == 1
    calls = nccl_calls(log)
    assert calls[0] == ("groupStart",) and calls[-1] == ("groupEnd",)
    assert comm.aborted == 1 and transport.broken is not None


# ---------------------------------------------------------------------------- close


def test_close_destroys_the_communicator_once():
    transport, comm, _, _ = make_transport()
    transport.close()
    transport.close()
    assert comm.destroyed == 1 and comm.aborted == 0
    with pytest.raises(CollectiveError, match="closed"):
        transport.isend(torch.zeros(1), 1)


def test_close_after_failure_aborts_instead_of_destroying():
    transport, comm, _, _ = make_transport(timeout=0.01, ready_after=None)
    with pytest.raises(CollectiveTimeoutError):
        transport.isend(torch.zeros(1), 1).wait()
    transport.close()
    assert comm.destroyed == 0 and comm.aborted >= 1


def test_close_aborts_when_pending_work_never_finishes():
    transport, comm, _, _ = make_transport(timeout=0.02, ready_after=None)
    transport.close()
    assert comm.destroyed == 0 and comm.aborted == 1


# ---------------------------------------------------------------------------- simulated NCCL semantics
#
# A small in-process model of what NCCL promises for point-to-point, to run the real algorithms
# (ring.py, tree.py, direct.py) through this transport without a GPU, one thread per rank:
#
# * each rank has ONE stream: its groups run one after another, in issue order;
# * the k-th send from A to B is matched with the k-th receive posted by B from A (no tags);
# * a matched pair moves its bytes only while BOTH groups are running (heads of their streams):
#   NCCL's send/recv is blocking on the GPU, with no buffering to rely on;
# * a group completes when all of its operations have; the event recorded after it then fires.
#
# Bytes are moved with ctypes.memmove from the pointers the transport passed, so a wrong pointer,
# count or datatype shows up as a wrong result.

import ctypes
import threading

from collectives.engine import AlgorithmEngine
from collectives.tuning import Tuning
from collectives.ops import ReduceOp

_NCCL_ITEMSIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}


class _SimGroup:
    def __init__(self, ops):
        self.ops = ops
        self.done = False


class _SimEvent:
    def __init__(self, world: "SimNcclWorld", group: "_SimGroup | None"):
        self.world, self.group = world, group

    def query(self) -> bool:
        if self.group is None:
            return True
        self.world.progress()
        return self.group.done


class SimNcclWorld:
    def __init__(self, world_size: int):
        self.n = world_size
        self.lock = threading.RLock()
        self.streams = [[] for _ in range(world_size)]  # groups not yet complete, in order
        self.last_group: list[_SimGroup | None] = [None] * world_size
        self.counters: dict[tuple, int] = {}
        self.pending: dict[tuple, dict] = {}  # (kind, src, dst, seq) -> op
        self.local = threading.local()
        self.module = self._module()

    def _module(self):
        nccl = fake_nccl_module([])
        nccl.groupStart = self.group_start
        nccl.groupEnd = self.group_end
        return nccl

    def group_start(self):
        self.local.ops = []

    def group_end(self):
        ops, self.local.ops = self.local.ops, None
        if not ops:
            return
        rank = ops[0]["rank"]
        with self.lock:
            group = _SimGroup(ops)
            for op in ops:
                op["group"] = group
                src, dst = (rank, op["peer"]) if op["kind"] == "send" else (op["peer"], rank)
                key = (op["kind"], src, dst)
                seq = self.counters.get(key, 0)
                self.counters[key] = seq + 1
                self.pending[(op["kind"], src, dst, seq)] = op
                op["key"] = (src, dst, seq)
            self.streams[rank].append(group)
            self.last_group[rank] = group
        self.progress()

    def issue(self, rank, kind, ptr, count, datatype, peer, stream):
        assert getattr(self.local, "ops", None) is not None, "NCCL call outside groupStart/groupEnd"
        self.local.ops.append(
            {"rank": rank, "kind": kind, "ptr": ptr, "nbytes": count * _NCCL_ITEMSIZE[datatype], "peer": peer, "done": False}
        )

    def progress(self):
        with self.lock:
            moved = True
            while moved:
                moved = False
                heads = {id(s[0]) for s in self.streams if s}
                for stream in self.streams:
                    if not stream:
                        continue
                    for op in stream[0].ops:
                        if op["done"] or op["kind"] != "send":
                            continue
                        match = self.pending.get(("recv", *op["key"]))
                        if match is None or id(match["group"]) not in heads:
                            continue
                        assert match["nbytes"] == op["nbytes"], "send/recv size mismatch"
                        ctypes.memmove(match["ptr"], op["ptr"], op["nbytes"])
                        op["done"] = match["done"] = True
                        del self.pending[("send", *op["key"])], self.pending[("recv", *op["key"])]
                        moved = True
                for stream in self.streams:
                    while stream and all(op["done"] for op in stream[0].ops):
                        stream.pop(0).done = True
                        moved = True

    def transport(self, rank: int, timeout: float) -> CupyNcclTransport:
        world = self

        class Comm:
            def send(self, ptr, count, datatype, peer, stream):
                world.issue(rank, "send", ptr, count, datatype, peer, stream)

            def recv(self, ptr, count, datatype, peer, stream):
                world.issue(rank, "recv", ptr, count, datatype, peer, stream)

            def abort(self):
                pass

            def destroy(self):
                pass

        class Stream:
            cuda_stream = STREAM_HANDLE

            def record_event(self):
                with world.lock:
                    group = world.last_group[rank]
                return _SimEvent(world, group)

        class Runtime:
            def current_stream(self):
                return Stream()

            def device_guard(self):
                return contextlib.nullcontext()

            def staging(self, like):
                return torch.empty_like(like)

        return CupyNcclTransport(Comm(), world.module, rank, world.n, timeout, torch.device("cpu"), runtime=Runtime())


def run_on_simulated_nccl(world_size: int, job, timeout: float, depth: int = 4):
    """Run ``job(engine, rank)`` on ``world_size`` threads over one simulated NCCL world."""
    world = SimNcclWorld(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank):
        transport = world.transport(rank, timeout)
        # 64-byte segments: several per chunk, to exercise the pipelining and slot reuse
        engine = AlgorithmEngine(transport, Tuning(segment_bytes=64, depth=depth), torch.device("cpu"))
        try:
            with transport.operation("sim"):
                results[rank] = job(engine, rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4 + 30)
    return results, errors


def _sim_input(rank: int, numel: int = 50) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float32) % 7) + rank + 1


def _sim_all_reduce(algorithm):
    def job(engine, rank):
        buf = _sim_input(rank)
        engine.all_reduce(buf, ReduceOp.SUM, algorithm)
        return buf
    return job, lambda n, r: sum(_sim_input(i) for i in range(n))


def _sim_broadcast(algorithm):
    def job(engine, rank):
        buf = _sim_input(rank)
        engine.broadcast(buf, 1 % engine.transport.world_size, algorithm)
        return buf
    return job, lambda n, r: _sim_input(1 % n)


def _sim_reduce(algorithm):
    def job(engine, rank):
        buf = _sim_input(rank)
        engine.reduce(buf, 0, ReduceOp.SUM, algorithm)
        return buf if rank == 0 else None
    return job, lambda n, r: sum(_sim_input(i) for i in range(n)) if r == 0 else None


def _sim_all_gather():
    def job(engine, rank):
        n = engine.transport.world_size
        out = torch.zeros(50 * n)
        engine.all_gather(list(out.split(50)), _sim_input(rank))
        return out
    return job, lambda n, r: torch.cat([_sim_input(i) for i in range(n)])


def _sim_reduce_scatter():
    def job(engine, rank):
        n = engine.transport.world_size
        out = torch.zeros(20)
        engine.reduce_scatter(out, list(_sim_input(rank, 20 * n).split(20)), ReduceOp.SUM)
        return out
    return job, lambda n, r: sum(_sim_input(i, 20 * n) for i in range(n))[20 * r : 20 * (r + 1)]


def _sim_scatter():
    def job(engine, rank):
        n = engine.transport.world_size
        out = torch.zeros(50)
        engine.scatter(out, [_sim_input(10 + i) for i in range(n)] if rank == 0 else None, 0)
        return out
    return job, lambda n, r: _sim_input(10 + r)


def _sim_gather():
    def job(engine, rank):
        n = engine.transport.world_size
        outs = [torch.zeros(50) for _ in range(n)] if rank == 0 else None
        engine.gather(_sim_input(rank), outs, 0)
        return torch.cat(outs) if rank == 0 else None
    return job, lambda n, r: torch.cat([_sim_input(i) for i in range(n)]) if r == 0 else None


def _sim_all_to_all():
    def job(engine, rank):
        n = engine.transport.world_size
        outs = [torch.zeros(50) for _ in range(n)]
        engine.all_to_all(outs, [_sim_input(10 * rank + j) for j in range(n)])
        return torch.cat(outs)
    return job, lambda n, r: torch.cat([_sim_input(10 * j + r) for j in range(n)])


def _sim_barrier():
    def job(engine, rank):
        engine.barrier()
        return "ok"
    return job, lambda n, r: "ok"


#: every algorithm the engine runs; each must complete under NCCL's rules and give torch's answer.
SIM_CASES = {
    "all_reduce recursive_doubling": _sim_all_reduce("recursive_doubling"),
    "all_reduce ring": _sim_all_reduce("ring"),
    "broadcast binomial": _sim_broadcast("binomial"),
    "broadcast chain": _sim_broadcast("chain"),
    "reduce binomial": _sim_reduce("binomial"),
    "reduce ring": _sim_reduce("ring"),
    "all_gather (ring)": _sim_all_gather(),
    "reduce_scatter (ring)": _sim_reduce_scatter(),
    "scatter": _sim_scatter(),
    "gather": _sim_gather(),
    "all_to_all": _sim_all_to_all(),
    "barrier": _sim_barrier(),
}


def _check_sim(name, world_size, timeout, depth):
    job, expected = SIM_CASES[name]
    results, errors = run_on_simulated_nccl(world_size, job, timeout, depth)
    for rank in range(world_size):
        if errors[rank] is not None:
            raise errors[rank]
        want = expected(world_size, rank)
        if want is None or isinstance(want, str):
            assert results[rank] == want
        else:
            assert torch.equal(results[rank], want), f"{name}: rank {rank} got {results[rank]} want {want}"


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(SIM_CASES))
def test_simulated_nccl_algorithms_are_deadlock_free(name, world_size, depth):
    """Each step's send+recv in one post, or waits only along acyclic chains: no deadlock on NCCL.

    A deadlock would surface as CollectiveTimeoutError from the transport's deadline.
    """
    _check_sim(name, world_size, timeout=20.0, depth=depth)


def test_simulated_nccl_detects_a_cyclic_wait():
    """The model itself: rank 0 and 1 each send first, in separate groups: a deadlock."""

    def job(engine, rank):
        t = engine.transport
        peer = 1 - rank
        send = t.isend(torch.ones(4), peer)
        recv = t.irecv(torch.zeros(4), peer)
        wait_all([recv, send])

    _, errors = run_on_simulated_nccl(2, job, timeout=0.3)
    assert all(isinstance(e, CollectiveTimeoutError) for e in errors)

    def grouped(engine, rank):
        out = torch.zeros(4)
        wait_all(engine.transport.post(sends=[(torch.full((4,), float(rank)), 1 - rank)], recvs=[(out, 1 - rank)]))
        return out

    results, errors = run_on_simulated_nccl(2, grouped, timeout=5.0)
    assert errors == [None, None]
    assert results[0].tolist() == [1.0] * 4 and results[1].tolist() == [0.0] * 4


# ---------------------------------------------------------------------------- real GPU (skipped here)


def _require_gpu(min_gpus: int = 1):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible (torch.cuda.is_available() is False): real NCCL tests skipped")
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install ringddp[cuda])")
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("CuPy cannot load NCCL")
    if torch.cuda.device_count() < min_gpus:
        pytest.skip(f"needs {min_gpus} GPUs, {torch.cuda.device_count()} visible")


GPU_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
]


def _rank_input(rank: int, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Small exact values, so sums in any order are the same bits in every float dtype."""
    base = torch.arange(numel, device=device) % 5
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return (base + rank + 1).to(dtype)


def _reduce(tensors, op: str):
    fn = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}[op]
    if tensors[0].dtype == torch.bool:
        fn = torch.logical_or if op in ("sum", "max") else torch.logical_and
    return functools.reduce(fn, tensors)


def _gpu_collectives_job(rank: int, world_size: int):
    """Every collective on CUDA tensors, checked against torch on the same device. Returns failures."""
    import collectives as C
    from collectives.group import get_default_group

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []

    def check(name, got, want):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"rank {rank}: {name}: got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")

    # The transport itself: NCCL send/recv to self (world size 1) or to the neighbours, one group.
    engine = get_default_group().engine(dev, "test")
    transport = engine.transport
    for dtype in GPU_DTYPES:
        for numel in (1, 1000, 1 << 22):
            x = _rank_input(rank, numel, dtype, dev)
            y = torch.zeros_like(x)
            right, left = (rank + 1) % world_size, (rank - 1) % world_size
            wait_all(transport.post(sends=[(x, right)], recvs=[(y, left)]))
            check(f"post {dtype} {numel}", y, _rank_input(left, numel, dtype, dev))

    for dtype in GPU_DTYPES:
        for numel, algorithms in ((100, ("recursive_doubling", "ring", "auto")), (300_000, ("ring", "auto"))):
            inputs = [_rank_input(r, numel, dtype, dev) for r in range(world_size)]
            ops = ["sum", "max", "min"] + (["product"] if world_size <= 2 else [])
            for op in ops:
                for algorithm in algorithms:
                    t = inputs[rank].clone()
                    C.all_reduce(t, op=op, algorithm=algorithm)
                    check(f"all_reduce {op} {algorithm} {dtype} {numel}", t, _reduce(inputs, op))
            if dtype.is_floating_point:
                t = inputs[rank].clone()
                C.all_reduce(t, op="avg")
                want = _reduce(inputs, "sum")
                if world_size > 1:
                    want = want / world_size
                check(f"all_reduce avg {dtype} {numel}", t, want.to(dtype))
            for algorithm in ("chain", "binomial", "auto"):
                for src in range(world_size):
                    t = inputs[rank].clone()
                    C.broadcast(t, src, algorithm=algorithm)
                    check(f"broadcast {algorithm} src={src} {dtype}", t, inputs[src])
            for algorithm in ("ring", "binomial"):
                t = inputs[rank].clone()
                C.reduce(t, 0, op="sum", algorithm=algorithm)
                check(f"reduce {algorithm} {dtype}", t, _reduce(inputs, "sum") if rank == 0 else inputs[rank])
            outs = [torch.empty_like(inputs[0]) for _ in range(world_size)]
            C.all_gather(outs, inputs[rank])
            for r in range(world_size):
                check(f"all_gather [{r}] {dtype}", outs[r], inputs[r])
            flat = torch.empty(numel * world_size, dtype=dtype, device=dev)
            C.all_gather_into_tensor(flat, inputs[rank])
            check(f"all_gather_into_tensor {dtype}", flat, torch.cat(inputs))
            big = [_rank_input(r, numel * world_size, dtype, dev) for r in range(world_size)]
            out = torch.empty(numel, dtype=dtype, device=dev)
            C.reduce_scatter_tensor(out, big[rank])
            check(f"reduce_scatter_tensor {dtype}", out, _reduce(big, "sum")[rank * numel : (rank + 1) * numel])
            out = torch.empty(numel, dtype=dtype, device=dev)
            C.reduce_scatter(out, list(big[rank].chunk(world_size)))
            check(f"reduce_scatter {dtype}", out, _reduce(big, "sum")[rank * numel : (rank + 1) * numel])
            pieces = [_rank_input(100 + i, numel, dtype, dev) for i in range(world_size)]
            out = torch.empty_like(pieces[0])
            C.scatter(out, pieces if rank == 0 else None, src=0)
            check(f"scatter {dtype}", out, pieces[rank])
            gathered = [torch.empty_like(inputs[0]) for _ in range(world_size)] if rank == 0 else None
            C.gather(inputs[rank], gathered, dst=0)
            if rank == 0:
                for r in range(world_size):
                    check(f"gather [{r}] {dtype}", gathered[r], inputs[r])
            sends = [_rank_input(10 * rank + j, numel, dtype, dev) for j in range(world_size)]
            recvs = [torch.empty_like(sends[0]) for _ in range(world_size)]
            C.all_to_all(recvs, sends)
            for j in range(world_size):
                check(f"all_to_all [{j}] {dtype}", recvs[j], _rank_input(10 * j + rank, numel, dtype, dev))
            single_in = torch.cat(sends)
            single_out = torch.empty_like(single_in)
            C.all_to_all_single(single_out, single_in)
            check(f"all_to_all_single {dtype}", single_out, torch.cat([_rank_input(10 * j + rank, numel, dtype, dev) for j in range(world_size)]))
    C.barrier()
    t = _rank_input(rank, 1000, torch.float32, dev)
    work = C.all_reduce(t, async_op=True)
    work.wait()
    check("all_reduce async", t, _reduce([_rank_input(r, 1000, torch.float32, dev) for r in range(world_size)], "sum"))
    torch.cuda.synchronize()
    return failures


def _gpu_timeout_job(rank: int, world_size: int):
    """Rank 1 waits for a message rank 0 never sends: it must time out naming rank 0."""
    from collectives.group import get_default_group

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    transport = get_default_group().engine(dev, "test").transport
    if rank == 0:
        transport.isend(torch.ones(1, device=dev), 1).wait()  # pairs the connection up first
        return "idle"
    transport.irecv(torch.zeros(1, device=dev), 0).wait()
    with transport.operation("all_reduce"):
        try:
            transport.irecv(torch.zeros(1, device=dev), 0).wait()
        except CollectiveTimeoutError as exc:
            return (exc.op, exc.peer, transport.broken is not None)
    return "no timeout"


def test_gpu_every_collective_world_size_1():
    _require_gpu(1)
    import collectives

    (failures,) = collectives.launch(_gpu_collectives_job, 1, backend="nccl-cupy", timeout=60, join_timeout=900)
    assert failures == []


def test_gpu_every_collective_world_size_2():
    _require_gpu(2)
    import collectives

    results = collectives.launch(_gpu_collectives_job, 2, backend="nccl-cupy", timeout=60, join_timeout=1800)
    assert [f for fs in results for f in fs] == []


def test_gpu_timeout_names_the_silent_peer():
    _require_gpu(2)
    import collectives

    results = collectives.launch(_gpu_timeout_job, 2, backend="nccl-cupy", timeout=3, join_timeout=120)
    assert results == ["idle", ("all_reduce", 0, True)]


def test_gpu_environment_variable_selects_the_backend(monkeypatch):
    _require_gpu(1)
    import collectives
    from collectives.backends import resolve_backend

    monkeypatch.setenv("RINGDDP_BACKEND", "nccl-cupy")
    assert resolve_backend(None) == "nccl-cupy"
    (failures,) = collectives.launch(_gpu_collectives_job, 1, timeout=60, join_timeout=900)
    assert failures == []
