"""The shared-memory transport: every collective against torch's, faults, segments, limits.

The ranks' default group runs over ``shm`` (installed by :func:`use_shm` in each rank), so the
property cases exercise both the transport's messages (algorithms written against send/recv) and
the shared-region algorithms (``auto`` all-reduce, broadcast, all-gather, reduce-scatter).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings

import collectives
from collectives.engine import AlgorithmEngine
from collectives.group import get_default_group
from collectives.testing import WorkerPool, assert_matches_reference, cases
from collectives.transport.shm import ShmConfig, ShmTransport, ShmUnavailableError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory and /proc")


def use_shm(rank: int, world_size: int, config: ShmConfig | None = None) -> str:
    """Rank-side job: run the default group's CPU collectives over a new shm transport."""
    from torch.distributed.distributed_c10d import _get_default_store

    g = get_default_group()
    store = dist.PrefixStore("test-shm", _get_default_store())
    transport = ShmTransport(g.rank, g.size, g.timeout, store, config)
    old = g._engines.get("p2p:cpu")
    g._engines["p2p:cpu"] = AlgorithmEngine(transport, g.workspace, g.tuning)
    if old is not None:
        old.close()
    return type(g.engine(torch.device("cpu"), "test").transport).__name__


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def shm_pools():
    pools: dict[tuple, WorkerPool] = {}

    def get(world_size: int, config: ShmConfig | None = None) -> WorkerPool:
        key = (world_size, config)
        if key not in pools:
            pool = WorkerPool(world_size, timeout=20.0, job_timeout=120.0)
            assert pool.run(use_shm, config) == ["ShmTransport"] * world_size
            pools[key] = pool
        return pools[key]

    yield get
    for pool in pools.values():
        pool.close()


EXAMPLES = {1: 15, 2: 60, 3: 40, 4: 40, 5: 30}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_collective_matches_torch_over_shm(shm_pools, world_size):
    pool = shm_pools(world_size)

    @settings(max_examples=EXAMPLES[world_size], deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(world_size))
    def check(case):
        assert_matches_reference(pool, case)

    check()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_region_and_fifo_smaller_than_the_tensors(shm_pools, world_size):
    """Pieces of 1 KiB and 128-byte slots: every large-ish case streams through many of them."""
    pool = shm_pools(world_size, ShmConfig(slot_bytes=128, slots=2, region_bytes=2048))

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(world_size))
    def check(case):
        assert_matches_reference(pool, case)

    check()


def big_collectives(rank: int, world_size: int) -> list[bool]:
    """Sizes far above a region (pieces) and a FIFO (chunks), odd sizes, every op family."""
    n = world_size
    results = []
    for numel in (0, 1, n - 1, 3 * 2**20 + 7):
        x = (torch.arange(numel) % 7 + rank).to(torch.float32)
        expected = sum((torch.arange(numel) % 7 + q).to(torch.float32) for q in range(n))
        collectives.all_reduce(x)
        results.append(torch.equal(x, expected))
        y = torch.full((numel,), float(rank))
        collectives.broadcast(y, src=n - 1)
        results.append(torch.equal(y, torch.full((numel,), float(n - 1))))
        z = (torch.arange(numel) % 5 + rank).to(torch.float32)
        collectives.all_reduce(z, algorithm="ring")  # messages through the FIFO
        results.append(torch.equal(z, sum((torch.arange(numel) % 5 + q).to(torch.float32) for q in range(n))))
        out = torch.empty(n * numel)
        collectives.all_gather_into_tensor(out, torch.full((numel,), float(rank)))
        results.append(torch.equal(out, torch.arange(n).repeat_interleave(numel).float()))
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensors_larger_than_region_and_fifo(shm_pools, world_size):
    pool = shm_pools(world_size, ShmConfig(slot_bytes=64 << 10, slots=2, region_bytes=1 << 20))
    for rank, result in enumerate(pool.run(big_collectives)):
        assert all(result), (rank, result)


FAULT_SCRIPT = """
import os, signal, sys, threading, time
import torch
import collectives
sys.path.insert(0, {tests!r})
from test_shm import use_shm

def job(rank, world_size, piddir, sig):
    open(os.path.join(piddir, str(os.getpid())), "w").close()
    use_shm(rank, world_size)
    t = torch.ones(1 << 22)
    collectives.all_reduce(t)
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), getattr(signal, sig))).start()
    start = time.monotonic()
    try:
        for _ in range(100_000):
            collectives.all_reduce(t)
            collectives.broadcast(t, src=0)
            collectives.all_reduce(t[:100], algorithm="ring")
    except collectives.CollectiveError as exc:
        raise RuntimeError(f"survivor {{rank}} failed after {{time.monotonic() - start:.1f}}s: "
                           f"{{type(exc).__name__}} op={{exc.op}} peer={{exc.peer}}: {{exc}}")
    return "finished"

if __name__ == "__main__":
    collectives.launch(job, 3, sys.argv[1], sys.argv[2], timeout=4.0, join_timeout=60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run_script(tmp_path, text: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_rank_killed_or_stopped_mid_collective(tmp_path, sig):
    before = _shm_files()
    piddir = tmp_path / "pids"
    piddir.mkdir()
    start = time.monotonic()
    out = _run_script(tmp_path, FAULT_SCRIPT.format(tests=os.path.dirname(__file__)), str(piddir), sig)
    elapsed = time.monotonic() - start
    err = out.stderr
    assert out.returncode != 0
    found = sorted(set(re.findall(r"survivor (\d) failed after ([\d.]+)s: (\w+) op=(\w+) peer=(\d)", err)))
    assert [f[0] for f in found] == ["0", "2"], err[-3000:]
    for rank, seconds, kind, op, peer in found:
        assert float(seconds) < 4.0 + 3.0, found  # within the 4 s timeout (plus scheduling slack)
        assert op in ("all_reduce", "broadcast"), found
        if sig == "SIGKILL":
            assert kind == "CollectiveError", found
        else:
            assert kind == "CollectiveTimeoutError" and peer == "1", found
    if sig == "SIGKILL":
        assert any(peer == "1" for *_, peer in found), found  # someone names the dead rank
    assert elapsed < 90, elapsed
    pids = [int(p.name) for p in piddir.iterdir()]
    assert len(pids) == 3
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "rank processes outlived the launcher"
    assert _shm_files() <= before, "segments left in /dev/shm"


TWO_JOBS_SCRIPT = """
import sys
import torch
import collectives
sys.path.insert(0, {tests!r})
from test_shm import use_shm

def job(rank, world_size, salt):
    use_shm(rank, world_size)
    ok = True
    for i in range(30):
        x = torch.full((300_000,), float(rank + salt + i))
        collectives.all_reduce(x)
        ok &= bool((x == sum(q + salt + i for q in range(world_size))).all())
    return ok

if __name__ == "__main__":
    print(collectives.launch(job, 2, int(sys.argv[1]), timeout=20.0, join_timeout=90))
"""


@pytest.mark.timeout(180)
def test_two_jobs_at_once(tmp_path):
    before = _shm_files()
    script = tmp_path / "two.py"
    script.write_text(TWO_JOBS_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(salt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
        for salt in (0, 1000)
    ]  # fmt: skip
    outs = [p.communicate(timeout=150) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
        assert stdout.strip().endswith("[True, True]"), stdout
    assert _shm_files() <= before


def too_small(rank: int, world_size: int, directory: str) -> str:
    try:
        use_shm(rank, world_size, ShmConfig(directory=directory))
    except ShmUnavailableError as exc:
        x = torch.ones(10)
        collectives.all_reduce(x)  # the group still works over p2p
        return str(exc) if x[0] == world_size else "wrong"
    return "no error"


@pytest.mark.timeout(180)
def test_shm_directory_too_small():
    """A 1 MiB tmpfs cannot hold a 10 MiB segment: a clear error on every rank, never SIGBUS."""
    mountpoint = tempfile.mkdtemp(prefix="ringddp-tiny-shm-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mountpoint], capture_output=True)
    if mounted.returncode != 0:
        os.rmdir(mountpoint)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        results = collectives.launch(too_small, 2, mountpoint, timeout=20.0, join_timeout=90)
        needed = ShmConfig().segment_bytes(2)
        for text in results:
            assert f"needs {needed} bytes" in text and "--shm-size" in text and "p2p" in text, text
        assert os.listdir(mountpoint) == []
    finally:
        subprocess.run(["umount", mountpoint], check=True)
        os.rmdir(mountpoint)


def test_config_is_checked():
    with pytest.raises(ValueError, match="slots"):
        ShmConfig(slots=9).validate()
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmConfig(slot_bytes=100).validate()
