"""Single-copy reads over shm (``process_vm_readv``): results, fallback, faults, mismatches.

Broadcast, scatter, gather, all-gather and all-to-all read a peer's tensor straight out of its
memory when one reader takes at least ``shm_algorithms.CMA_BYTES[op]`` bytes from one owner.
Each case runs just below and above that size, on non-contiguous views, and is compared
bitwise with torch's own collective on a gloo group.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives import shm_algorithms
from collectives.testing import WorkerPool
from tests.collectives.faults import SURVIVOR_SOURCE, assert_all_gone, pids_in, run_script, survivors
from tests.collectives.test_shm import _values
from tests.leaks import PrivateTmpfs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory and /proc")


def _column(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a non-contiguous view (a column of a two-column matrix)."""
    return torch.stack([torch.zeros_like(t), t], dim=1)[:, 1]


def _sizes(op: str, dtype: torch.dtype) -> tuple[int, ...]:
    """Elements per transfer: empty, tiny, just below and above the op's single-copy threshold."""
    edge = shm_algorithms.CMA_BYTES[op] // dtype.itemsize
    return 0, 1, edge - 1, edge + 3


def single_copy_collectives(rank: int, world_size: int) -> tuple[bool, list[str]]:
    """Every single-copy op vs torch's on gloo; whether single-copy reads are on, and the failures."""
    n, failures = world_size, []
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float32, torch.int8):
        for i, numel in enumerate(_sizes("broadcast", dtype)):
            root = (i + 1) % n
            ours, ref = _column(_values(numel, dtype, rank)), _values(numel, dtype, rank)
            collectives.broadcast(ours, src=root)
            dist.broadcast(ref, src=root, group=gloo)
            if not torch.equal(ours, ref):
                failures.append(f"broadcast {numel} {dtype}")
        for i, numel in enumerate(_sizes("scatter", dtype)):
            root = (i + 2) % n
            pieces = [_values(numel, dtype, rank, q) for q in range(n)]
            ours, ref = _column(torch.zeros(numel, dtype=dtype)), torch.zeros(numel, dtype=dtype)
            collectives.scatter(ours, [_column(p) for p in pieces] if rank == root else None, src=root)
            dist.scatter(ref, pieces if rank == root else None, src=root, group=gloo)
            if not torch.equal(ours, ref):
                failures.append(f"scatter {numel} {dtype}")
        for i, numel in enumerate(_sizes("gather", dtype)):
            root = (i + 1) % n
            inp = _values(numel, dtype, rank)
            outs = [_column(torch.zeros(numel, dtype=dtype)) for _ in range(n)] if rank == root else None
            refs = [torch.zeros(numel, dtype=dtype) for _ in range(n)] if rank == root else None
            collectives.gather(_column(inp), outs, dst=root)
            dist.gather(inp, refs, dst=root, group=gloo)
            if outs is not None and not all(torch.equal(o, r) for o, r in zip(outs, refs)):
                failures.append(f"gather {numel} {dtype}")
        for numel in _sizes("all_gather", dtype):
            inp = _values(numel, dtype, rank)
            outs = [_column(torch.zeros(numel, dtype=dtype)) for _ in range(n)]
            refs = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
            collectives.all_gather(outs, _column(inp))
            dist.all_gather(refs, inp, group=gloo)
            whole = torch.zeros(n * numel, dtype=dtype)
            whole[rank * numel : (rank + 1) * numel] = inp
            collectives.all_gather_into_tensor(whole, whole[rank * numel : (rank + 1) * numel])  # in place
            if not all(torch.equal(o, r) for o, r in zip(outs, refs)) or not torch.equal(whole, torch.cat(refs)):
                failures.append(f"all_gather {numel} {dtype}")
        edge = shm_algorithms.CMA_BYTES["all_to_all"] // dtype.itemsize

        def size(q: int, j: int) -> int:  # elements rank q sends to rank j: some pairs below the edge, some above
            return (0, 7, edge - 1, edge + 5)[(q + 2 * j) % 4]

        ins = [_values(size(rank, j), dtype, rank, j) for j in range(n)]
        outs = [_column(torch.zeros(size(j, rank), dtype=dtype)) for j in range(n)]
        collectives.all_to_all(outs, [_column(t) for t in ins])
        ref = torch.zeros(sum(size(j, rank) for j in range(n)), dtype=dtype)
        dist.all_to_all_single(ref, torch.cat(ins), [size(j, rank) for j in range(n)], [size(rank, j) for j in range(n)],
                               group=gloo)  # fmt: skip
        if not torch.equal(torch.cat(outs), ref):
            failures.append(f"all_to_all {dtype}")
    transport = collectives.get_group().engine(torch.device("cpu"), "test").transport
    return transport.cma, failures


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size,cma", [(2, "1"), (3, "1"), (4, "1"), (2, "0")])
def test_single_copy_collectives_match_torch(monkeypatch, world_size, cma):
    """``RINGDDP_SHM_CMA=0``: the same calls copy through the regions, with the same results."""
    monkeypatch.setenv("RINGDDP_SHM_CMA", cma)
    with WorkerPool(world_size, backend="shm", timeout=20.0, job_timeout=150.0) as pool:
        for rank, (on, failures) in enumerate(pool.run(single_copy_collectives)):
            assert on == (cma == "1") and not failures, (rank, on, failures)


def _forbid_process_vm_readv() -> None:
    """Install a seccomp filter in this process (every thread) that fails ``process_vm_readv``
    with EPERM, as a container's seccomp profile may (x86-64 system call numbers)."""
    import ctypes

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    load_nr, jump_if_equal, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS (seccomp_data.nr), BPF_JMP|JEQ|K, BPF_RET|K
    code = (Instruction * 4)(
        Instruction(load_nr, 0, 0, 0),
        Instruction(jump_if_equal, 0, 1, 310),  # __NR_process_vm_readv
        Instruction(ret, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        Instruction(ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    )
    program = Program(4, code)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.syscall(317, 1, 1, ctypes.byref(program)) == 0, ctypes.get_errno()  # seccomp(SET_MODE_FILTER, TSYNC)


def refused_rank(rank: int, world_size: int) -> tuple[bool, bool]:
    """Rank 1 may not read other processes: every rank turns single-copy reads off, results stay right."""
    if rank == 1:
        _forbid_process_vm_readv()
    m = shm_algorithms.CMA_BYTES["broadcast"] // 4 + 3
    x = torch.full((m,), float(rank))
    collectives.broadcast(x, src=0)
    transport = collectives.get_group().engine(torch.device("cpu"), "test").transport
    return transport.cma, bool((x == 0).all())


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter uses x86-64 system call numbers")
def test_single_copy_refused_on_one_rank_is_off_on_every_rank():
    assert collectives.launch(refused_rank, 3, backend="shm", timeout=20.0, join_timeout=90) == [(False, True)] * 3


def single_copy_proven(rank: int, world_size: int) -> dict[str, str]:
    """Set up three groups with single-copy reads on, then forbid rank 1 ``process_vm_readv``:
    what a transfer below the threshold and a broadcast and a scatter above it did on this rank."""
    groups = {name: collectives.new_group(backend="shm", timeout=3.0) for name in ("below", "broadcast", "scatter")}
    collectives.barrier()  # start together: new_group returns at different times on different ranks
    for g in groups.values():
        collectives.barrier(group=g)  # set-up, single-copy probe included, happens here
    seen = {"cma": str(all(g.engine(torch.device("cpu"), "test").transport.cma for g in groups.values()))}
    if rank == 1:
        _forbid_process_vm_readv()
    edge = {op: shm_algorithms.CMA_BYTES[op] // 4 for op in ("broadcast", "scatter")}
    calls = {
        "below": lambda g: collectives.broadcast(torch.full((edge["broadcast"] - 1,), float(rank)), src=0, group=g),
        "broadcast": lambda g: collectives.broadcast(torch.full((edge["broadcast"] + 3,), float(rank)), src=0, group=g),
        "scatter": lambda g: collectives.scatter(
            torch.zeros(edge["scatter"] + 3), [torch.ones(edge["scatter"] + 3)] * world_size if rank == 0 else None,
            src=0, group=g),
    }
    for name, call in calls.items():
        try:
            call(groups[name])
            seen[name] = "ok"
        except collectives.CollectiveError as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
        collectives.barrier()  # the owner gives up on its reader at the 3 s deadline: start the next call together
    return seen


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter uses x86-64 system call numbers")
def test_large_transfers_are_read_with_process_vm_readv():
    """README / DESIGN: large broadcast and scatter transfers copy once, straight from the owner's
    tensor, with ``process_vm_readv``. Proven from outside: once rank 1 may no longer call it, a
    transfer below the threshold still works (through the regions) and those above it fail on
    rank 1, naming the system call."""
    reader = collectives.launch(single_copy_proven, 2, backend="shm", timeout=20.0, join_timeout=90)[1]
    assert reader["cma"] == "True" and reader["below"] == "ok", reader
    for name in ("broadcast", "scatter"):
        assert reader[name].startswith("CollectiveError") and "process_vm_readv" in reader[name], (name, reader[name])


KILL_SCRIPT = """
import os, signal, sys, threading, time
import torch
import collectives
from collectives.shm_algorithms import CMA_BYTES
""" + SURVIVOR_SOURCE + """

def job(rank, world_size, piddir):
    open(os.path.join(piddir, str(os.getpid())), "w").close()
    n, m = world_size, max(CMA_BYTES.values()) // 4  # single-copy reads in every op
    t, out = torch.ones(m), torch.empty(m)
    pieces = [torch.ones(m) for _ in range(n)] if rank == 1 else None
    collectives.broadcast(t, src=0)
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(100_000):
            collectives.broadcast(t, src=0)  # rank 0 waits for rank 1 to read
            collectives.scatter(out, pieces, src=1)  # the others read from rank 1
    except collectives.CollectiveError as exc:
        raise RuntimeError(survivor_line(rank, exc, time.monotonic() - start, lambda: collectives.barrier()))
    return "finished"

if __name__ == "__main__":
    collectives.launch(job, 3, sys.argv[1], backend="shm", timeout=10.0, join_timeout=60)
"""


@pytest.mark.timeout(120)
def test_rank_killed_while_peers_read_or_wait(tmp_path):
    """DESIGN, single-copy reads: an owner waiting for its readers and readers of a dead owner
    (ESRCH) raise CollectiveError naming the op (10 s deadline: every survivor within 5 s); no
    process and no segment outlives the job."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    with PrivateTmpfs("64m", skip=False) as fs:
        env = {"RINGDDP_SHM_DIR": fs.path} if fs.available else {}
        out = run_script(tmp_path, KILL_SCRIPT, str(piddir), timeout=100, env=env)
        assert out.returncode != 0
        found = {rank: s for (rank, _), s in survivors(out.stderr).items()}
        assert sorted(found) == [0, 2], out.stderr[-3000:]
        for s in found.values():
            assert s.seconds < 5.0 and s.kind == "CollectiveError" and s.op in ("broadcast", "scatter"), found
            assert "unusable" in s.next_call, found
        assert any(s.peer == 1 for s in found.values()), found
        pids = pids_in(piddir)
        assert len(pids) == 3
        assert_all_gone(pids)
        if fs.available:
            assert fs.wait_until_empty() == 0


def stalled_reader(rank: int, world_size: int) -> tuple[str, int | None, bool]:
    """Rank 1 stops (SIGSTOP) before a broadcast whose root then gives up on it at the deadline
    and continues it after that. What each rank saw: (outcome, peer named, detail)."""
    m = shm_algorithms.CMA_BYTES["broadcast"] // 4 + 1
    x = torch.full((m,), float(rank))
    collectives.broadcast(x, src=0)  # sets the transport up
    pids: list[int] = [0] * world_size
    collectives.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        threading.Timer(STALL_TIMEOUT + 0.8, os.kill, (pids[1], signal.SIGCONT)).start()
    x.fill_(float(rank))
    try:
        collectives.broadcast(x, src=0)
    except collectives.CollectiveError as exc:
        return type(exc).__name__, exc.peer, "stopped waiting" in str(exc)
    return "ok", None, bool((x == 0).all())


STALL_TIMEOUT = 2.0


@pytest.mark.timeout(120)
def test_reader_late_for_a_root_that_gave_up_raises_instead_of_reading():
    """The root withdraws its tensor when its wait for rank 1 times out; rank 1, continued
    later, finds the withdrawal and raises naming the root instead of reading."""
    results = collectives.launch(stalled_reader, 2, backend="shm", timeout=STALL_TIMEOUT, join_timeout=90)
    assert results == [("CollectiveTimeoutError", 1, False), ("CollectiveError", 0, True)], results


def mismatched_single_copy_calls(rank: int, world_size: int) -> dict[str, tuple[str, str | None, bool]]:
    """Rank 1 passes one element more than the others (all above the threshold), each op on a
    fresh group: what every rank saw (the error, its op, whether it came fast)."""
    n = world_size
    m = max(shm_algorithms.CMA_BYTES.values()) // 4 + 1 + (rank == 1)
    calls = {
        "broadcast": lambda g: collectives.broadcast(torch.ones(m), src=0, group=g),
        "scatter": lambda g: collectives.scatter(torch.zeros(m), [torch.ones(m)] * n if rank == 0 else None, src=0,
                                                 group=g),
        "gather": lambda g: collectives.gather(torch.ones(m), [torch.zeros(m) for _ in range(n)] if rank == 0 else None,
                                               dst=0, group=g),
        "all_gather": lambda g: collectives.all_gather([torch.zeros(m) for _ in range(n)], torch.ones(m), group=g),
        "all_to_all": lambda g: collectives.all_to_all([torch.zeros(m) for _ in range(n)], [torch.ones(m)] * n,
                                                       group=g),
    }
    import logging

    logging.getLogger("collectives.group").setLevel(logging.CRITICAL)
    seen = {}
    for name, call in calls.items():
        g = collectives.new_group(backend="shm", timeout=20.0)
        collectives.barrier()  # start together: new_group returns at different times on different ranks
        start = time.monotonic()
        try:
            call(g)
            seen[name] = ("no error", None, False)
        except collectives.CollectiveError as exc:
            fast = not isinstance(exc, collectives.CollectiveTimeoutError) and time.monotonic() - start < 5.0
            seen[name] = ("error", exc.op, fast)
        g.close()
    return seen


@pytest.mark.timeout(120)
def test_mismatched_sizes_raise_on_every_rank_in_the_call():
    """Owners raise too, in the call: they wait for their readers, who abandon it."""
    results = collectives.launch(mismatched_single_copy_calls, 3, backend="shm", timeout=20.0, join_timeout=90)
    for rank, seen in enumerate(results):
        for name, (kind, op, fast) in seen.items():
            assert kind == "error" and op == name and fast, (rank, name, kind, op, fast)
