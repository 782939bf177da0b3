"""The shared-memory transport: every collective against torch's, faults, segments, limits.

The ranks' default group runs over ``shm`` (``WorkerPool(n, backend="shm")``), so the property
cases exercise both the transport's messages (algorithms written against send/recv) and
the shared-region algorithms (``auto`` all-reduce, broadcast, all-gather, reduce-scatter,
scatter, gather, all-to-all).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import collectives
from collectives.testing import WorkerPool, assert_matches_reference, cases
from collectives.transport.shm import ShmConfig, ShmUnavailableError
from tests import leaks
from tests.collectives.faults import SURVIVOR_SOURCE, assert_all_gone, pids_in, run_script, survivors
from tests.leaks import PrivateTmpfs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory and /proc")


def transport_name(rank: int, world_size: int) -> str:
    return transport_name_of(collectives.get_group())


def shm_settings(rank: int, world_size: int) -> tuple[str, int, int, int]:
    """The transport of the default group and, once set up (one collective), the sizes it runs with."""
    collectives.all_reduce(torch.ones(1))
    transport = collectives.get_group().engine(torch.device("cpu"), "test").transport
    cfg = transport.config
    return type(transport).__name__, cfg.slot_bytes, cfg.slots, cfg.region_bytes


@pytest.fixture(scope="module")
def _shm_pool_cache():
    pools: dict[tuple, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def shm_pools(_shm_pool_cache):
    """``shm_pools(n, slot_bytes=..., ...)``: a pool over shm whose ranks run with
    ``RINGDDP_SHM_<NAME>=value`` for each ``name=value`` (set at every start of the pool, so also
    after a failed job restarts it). Checked when handed out and again after the test."""
    used: list[tuple[WorkerPool, tuple]] = []

    def get(world_size: int, **env: int) -> WorkerPool:
        key = (world_size, tuple(sorted(env.items())))
        if key not in _shm_pool_cache:
            variables = {f"RINGDDP_SHM_{k.upper()}": str(v) for k, v in env.items()}
            _shm_pool_cache[key] = WorkerPool(world_size, backend="shm", timeout=20.0, job_timeout=120.0, env=variables)
        pool = _shm_pool_cache[key]
        defaults = ShmConfig()
        want = ("ShmTransport", *(env.get(k, getattr(defaults, k)) for k in ("slot_bytes", "slots", "region_bytes")))
        assert pool.run(shm_settings) == [want] * world_size
        used.append((pool, want))
        return pool

    yield get
    for pool, want in used:  # the settings held to the end, restarts included
        assert pool.run(shm_settings) == [want] * pool.world_size


def rank_environment(rank: int, world_size: int) -> str | None:
    return os.environ.get("RINGDDP_SHM_REGION_BYTES")


@pytest.mark.timeout(120)
def test_pool_environment_is_set_again_after_a_restart():
    with WorkerPool(2, backend="shm", timeout=20.0, env={"RINGDDP_SHM_REGION_BYTES": 4096}) as pool:
        assert pool.run(rank_environment) == ["4096"] * 2
        pool.close()  # what a failed job does; the next run starts fresh ranks
        assert pool.run(rank_environment) == ["4096"] * 2
        defaults = ShmConfig()
        assert pool.run(shm_settings) == [("ShmTransport", defaults.slot_bytes, defaults.slots, 4096)] * 2


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
    pool = shm_pools(world_size, slot_bytes=128, slots=2, region_bytes=2048)

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
    pool = shm_pools(world_size, slot_bytes=64 << 10, slots=2, region_bytes=1 << 20)
    for rank, result in enumerate(pool.run(big_collectives)):
        assert all(result), (rank, result)


def _values(numel: int, dtype: torch.dtype, *salt: int) -> torch.Tensor:
    """Values that differ by position and by ``salt`` (sender, receiver)."""
    x = (torch.arange(numel) * 7 + sum(s * 31 ** (i + 1) for i, s in enumerate(salt))) % 11
    return (x % 2).to(dtype) if dtype == torch.bool else x.to(dtype)


def _columns(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values as non-contiguous views (columns of one matrix)."""
    grid = torch.stack(pieces, dim=1)
    return [grid[:, q] for q in range(len(pieces))]


SLOTTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.bool)


def slotted_collectives(rank: int, world_size: int, numels: tuple[int, ...]) -> list[str]:
    """Scatter, gather and all-to-all through the regions' per-peer slots; the failures, named.

    Non-contiguous inputs and outputs, every root, uneven all-to-all with some empty pairs.
    """
    n, failures = world_size, []
    for numel in numels:
        for dtype in SLOTTED_DTYPES:
            root = (numel + SLOTTED_DTYPES.index(dtype)) % n
            case = f"numel {numel} {dtype} root {root}"
            out = torch.zeros(2 * numel, dtype=dtype)[::2]
            pieces = _columns([_values(numel, dtype, root, q) for q in range(n)])
            collectives.scatter(out, pieces if rank == root else None, src=root)
            if not torch.equal(out, _values(numel, dtype, root, rank)):
                failures.append(f"scatter {case}")
            outs = _columns([torch.zeros(numel, dtype=dtype)] * n) if rank == root else None
            collectives.gather(_columns([_values(numel, dtype, rank)] * 2)[1], outs, dst=root)
            if outs is not None and not all(torch.equal(outs[q], _values(numel, dtype, q)) for q in range(n)):
                failures.append(f"gather {case}")

            def size(q: int, j: int) -> int:  # elements rank q sends to rank j
                return 0 if (q + j) % 4 == 3 else numel * (1 + q + 2 * j) // (2 * n) + j

            ins = [_values(size(rank, j), dtype, rank, j) for j in range(n)]
            received = [torch.zeros(size(j, rank), dtype=dtype) for j in range(n)]
            collectives.all_to_all(received, ins)
            if not all(torch.equal(received[j], _values(size(j, rank), dtype, j, rank)) for j in range(n)):
                failures.append(f"all_to_all {case}")
            single = torch.zeros(n * numel, dtype=dtype)
            collectives.all_to_all_single(single, torch.cat([_values(numel, dtype, rank, j) for j in range(n)]))
            if not torch.equal(single, torch.cat([_values(numel, dtype, j, rank) for j in range(n)])):
                failures.append(f"all_to_all_single {case}")
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_scatter_gather_all_to_all_through_region_slots(shm_pools, world_size):
    """1 KiB halves: pieces of a few dozen elements alternate between the halves many times."""
    pool = shm_pools(world_size, slot_bytes=128, slots=2, region_bytes=2048)
    for rank, failures in enumerate(pool.run(slotted_collectives, (0, 1, 5, 63, 64, 65, 1001))):
        assert not failures, (rank, failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_scatter_gather_all_to_all_in_the_smallest_region(shm_pools, world_size):
    """64-byte halves: 16-byte slots at 2 ranks (one float64 per piece), and at 3 ranks no room
    for the all-to-all header plus a slot per peer, so the engine falls back to messages."""
    pool = shm_pools(world_size, slot_bytes=64, slots=1, region_bytes=128)
    for rank, failures in enumerate(pool.run(slotted_collectives, (0, 1, 3, 17))):
        assert not failures, (rank, failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_scatter_gather_all_to_all_larger_than_a_half(shm_pools, world_size):
    pool = shm_pools(world_size, slot_bytes=64 << 10, slots=2, region_bytes=1 << 20)
    for rank, failures in enumerate(pool.run(slotted_collectives, (3 * 2**16 + 5,))):
        assert not failures, (rank, failures)


FAULT_SCRIPT = """
import os, signal, sys, threading, time
import torch
import collectives
""" + SURVIVOR_SOURCE + """
def job(rank, world_size, piddir, sig):
    open(os.path.join(piddir, str(os.getpid())), "w").close()
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
        raise RuntimeError(survivor_line(rank, exc, time.monotonic() - start, lambda: collectives.barrier()))
    return "finished"

if __name__ == "__main__":
    collectives.launch(job, 3, sys.argv[1], sys.argv[2], backend="shm", timeout=float(sys.argv[3]), join_timeout=60)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_rank_killed_or_stopped_mid_collective(tmp_path, sig):
    """DESIGN, shm *Waiting*: the peer sockets reach EOF when a peer dies, even by SIGKILL: the
    waiter raises CollectiveError naming the op and the dead peer; a stopped peer (SIGSTOP) runs
    into the deadline and gives CollectiveTimeoutError naming it. After either the group is
    unusable and says so; no process and no segment outlives the job.

    SIGKILL runs with a 10 s deadline and every survivor must raise within 5 s: an error at the
    deadline (dead peers not detected) fails. SIGSTOP runs with a 4 s deadline."""
    deadline = 10.0 if sig == "SIGKILL" else 4.0
    piddir = tmp_path / "pids"
    piddir.mkdir()
    with PrivateTmpfs("64m", skip=False) as fs:
        env = {"RINGDDP_SHM_DIR": fs.path} if fs.available else {}
        start = time.monotonic()
        out = run_script(tmp_path, FAULT_SCRIPT, str(piddir), sig, str(deadline), env=env)
        elapsed = time.monotonic() - start
        assert out.returncode != 0
        found = {rank: s for (rank, _), s in survivors(out.stderr).items()}
        assert sorted(found) == [0, 2], out.stderr[-3000:]
        for s in found.values():
            assert s.op in ("all_reduce", "broadcast", "barrier"), found
            assert "unusable" in s.next_call, found
            if sig == "SIGKILL":
                assert s.kind == "CollectiveError" and s.seconds < 5.0, found  # the closed socket, not the deadline
            elif s.kind == "CollectiveTimeoutError":
                assert deadline - 0.1 <= s.seconds < deadline + 3.0, found
            else:  # it saw the other survivor exit after that one's timeout
                assert s.kind == "CollectiveError" and s.peer != 1 and s.seconds >= deadline - 0.1, found
        # someone names rank 1: dead (EOF on its socket) or stopped (the deadline)
        named = [s.kind for s in found.values() if s.peer == 1]
        assert named == (["CollectiveError"] * len(named) if sig == "SIGKILL" else named) and named, found
        if sig == "SIGSTOP":
            assert "CollectiveTimeoutError" in named, found
        assert elapsed < 90, elapsed
        pids = pids_in(piddir)
        assert len(pids) == 3
        assert_all_gone(pids)
        if fs.available:  # every segment freed: the private tmpfs is empty again
            assert fs.wait_until_empty() == 0 and leaks.files_in(fs.path) == []


TWO_JOBS_SCRIPT = """
import sys
import torch
import collectives

def job(rank, world_size, salt):
    ok = True
    for i in range(30):
        x = torch.full((300_000,), float(rank + salt + i))
        collectives.all_reduce(x)
        ok &= bool((x == sum(q + salt + i for q in range(world_size))).all())
    return ok

if __name__ == "__main__":
    print(collectives.launch(job, 2, int(sys.argv[1]), backend="shm", timeout=20.0, join_timeout=90))
"""


@pytest.mark.timeout(180)
def test_two_jobs_at_once(tmp_path, processes):
    """DESIGN, shm *Segments*: a random job id keeps two jobs apart; afterwards no segment is left."""
    script = tmp_path / "two.py"
    script.write_text(TWO_JOBS_SCRIPT)
    with PrivateTmpfs("64m", skip=False) as fs:
        env = dict(os.environ, OMP_NUM_THREADS="1", **({"RINGDDP_SHM_DIR": fs.path} if fs.available else {}))
        procs = [
            processes([sys.executable, str(script), str(salt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True, env=env)
            for salt in (0, 1000)
        ]  # fmt: skip
        outs = [p.communicate(timeout=150) for p in procs]
        for p, (stdout, stderr) in zip(procs, outs):
            assert p.returncode == 0, stderr[-3000:]
            assert stdout.strip().endswith("[True, True]"), stdout
        if fs.available:
            assert fs.wait_until_empty() == 0 and leaks.files_in(fs.path) == []


def too_small(rank: int, world_size: int) -> tuple[str, str]:
    """Explicit shm: the error. Then a group under ``auto``: a logged fallback to p2p that works."""
    try:
        collectives.all_reduce(torch.ones(10))
        error = "no error"
    except ShmUnavailableError as exc:
        error = str(exc)
    g = collectives.new_group(backend="auto")
    x = torch.ones(10)
    collectives.all_reduce(x, group=g)
    assert x[0] == world_size
    transport = g.engine(torch.device("cpu"), "test").transport
    return error, type(transport._p2p).__name__, transport.shared_regions()


def transport_name_of(group) -> str:
    return type(group.engine(torch.device("cpu"), "test").transport).__name__


@pytest.mark.timeout(180)
def test_shm_directory_too_small(monkeypatch):
    """A 1 MiB tmpfs cannot hold a 10 MiB segment: a clear error on every rank, never SIGBUS."""
    with PrivateTmpfs("1m") as fs:
        monkeypatch.setenv("RINGDDP_SHM_DIR", fs.path)
        results = collectives.launch(too_small, 2, backend="shm", timeout=20.0, join_timeout=90)
        needed = ShmConfig().segment_bytes(2)
        for error, fallback, regions in results:
            assert f"needs {needed} bytes" in error and "--shm-size" in error and "p2p" in error, error
            assert fallback == "TorchP2PTransport" and regions is None
        assert fs.wait_until_empty() == 0 and leaks.files_in(fs.path) == []  # failed reservations freed


def auto_choice(rank: int, world_size: int) -> str:
    return transport_name_of(collectives.get_group())


def segments_held_until_destroyed(rank: int, world_size: int, directory: str) -> tuple[int, list[str], list[str]]:
    """Segments of every kind (the world's, a subgroup's, symmetric memory) in use, then the
    process group destroyed: how many mappings of ``directory``'s file system this rank held in
    use, and which mappings and fds it still holds afterwards."""
    sym = collectives.symmetric_empty(1 << 16)
    sym.fill_(1)
    collectives.all_reduce(sym)
    sub = collectives.new_group(backend="shm")
    collectives.all_reduce(torch.ones(1 << 20), group=sub)
    collectives.broadcast(torch.ones(10), src=0)
    in_use = len(leaks.segment_mappings("self", directory))
    del sym, sub
    collectives.destroy_process_group()
    gc.collect()
    return in_use, leaks.segment_mappings("self", directory), leaks.segment_fds("self", directory)


@pytest.mark.timeout(120)
def test_segments_are_released_when_the_group_is_destroyed(monkeypatch):
    """DESIGN, shm *Segments*: the transport's segments and symmetric memory stay mapped until the
    transport closes; destroying the process group releases every mapping and fd (a leak would
    keep the unnamed file, and its memory, alive for the life of the process)."""
    with PrivateTmpfs("64m", skip=False) as fs:
        directory = fs.path if fs.available else "/dev/shm"
        monkeypatch.setenv("RINGDDP_SHM_DIR", directory)
        for in_use, maps, fds in collectives.launch(segments_held_until_destroyed, 2, directory, backend="shm",
                                                    timeout=20.0, join_timeout=90):
            assert in_use >= 2 * 3, in_use  # the check sees segments: every rank's, of three kinds
            assert maps == [] and fds == [], (maps, fds)
        if fs.available:
            assert fs.wait_until_empty() == 0


def random_sums(rank: int, world_size: int, numels: tuple[int, ...]) -> list[torch.Tensor]:
    out = []
    for numel in numels:
        x = _wide_floats(rank, numel)
        collectives.all_reduce(x)
        out.append(x)
    return out


def _wide_floats(rank: int, numel: int) -> torch.Tensor:
    """Random float32 of magnitudes 1e-6 .. 1e6: a sum's bits depend on the order of its terms."""
    g = torch.Generator().manual_seed(4321 + rank)
    scale = 10.0 ** torch.randint(-6, 7, (numel,), generator=g)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(torch.float32)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [3, 4])
def test_float_sums_are_bitwise_identical_and_in_rank_order(shm_pools, world_size):
    """README: all_reduce is bitwise identical on every rank, also for floating-point sums; DESIGN
    (shm_algorithms): each element is combined in rank order 0, 1, ..., n-1 (one-shot and
    two-shot alike). The expectation is that fold, computed here with plain torch additions."""
    numels = (1000, 100_003, 600_001)  # one-shot; one-shot near its limit; two-shot in pieces
    results = shm_pools(world_size).run(random_sums, numels)
    for i, numel in enumerate(numels):
        expected = _wide_floats(0, numel)
        for q in range(1, world_size):
            expected = expected + _wide_floats(q, numel)
        for rank in range(world_size):
            got = results[rank][i]
            assert torch.equal(got.view(torch.int32), results[0][i].view(torch.int32)), (numel, rank, "differs from rank 0")
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (numel, rank, "not the rank-order fold")


@pytest.mark.timeout(180)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_ranks_left_on_one_cpu_move_apart_without_pinning():
    """Both ranks put on one CPU: the higher rank's waits move it off its peer's CPU (rank 0 never
    moves), acting on fresh words only, and every affinity mask is left as it was. Where the ranks
    end up is the scheduler's (with every CPU busy it has nowhere to put them apart), so only what
    is ours is asserted here; ``python -m collectives.bench --placement ROUNDS`` reports where
    they ended. Rounds run until rank 1 has moved: one on an idle machine; beside eight CPU hogs
    (load 9-13) rank 1 moved in 6-10 of 10 rounds."""
    from collectives.bench import placement_rank
    from collectives.transport.shm.waiting import CPU_FRESH

    rounds: list[tuple[dict, dict]] = []
    with WorkerPool(2, backend="shm", timeout=20.0) as pool:
        while len(rounds) < 20 and not any(rank1["moves"] for _, rank1 in rounds):
            rounds += zip(*pool.run(placement_rank, 1))
    assert all(r["mask_kept"] for pair in rounds for r in pair), f"an affinity mask was left changed: {rounds}"
    assert not any(rank0["moves"] for rank0, _ in rounds), f"rank 0 moved: only the higher rank moves: {rounds}"
    assert any(rank1["moves"] for _, rank1 in rounds), f"rank 1 never moved off rank 0's CPU in {len(rounds)} rounds"
    assert all(r["oldest_word_s"] <= CPU_FRESH for pair in rounds for r in pair), f"a move on a stale word: {rounds}"


def cpu_after_a_stale_word(rank: int, world_size: int, rounds: int) -> tuple[float, bool]:
    """Each round: run calls with rank 0 on CPU b and rank 1 on CPU a (so rank 0's published CPU
    is b), swap them (masks given back at once), let the words age, then one all-reduce that
    rank 1 enters first. Returns the age (s) of the oldest peer's word a move of this rank acted
    on, and whether its mask is the one it had."""
    mask = os.sched_getaffinity(0)
    a, b = sorted(mask)[:2]
    t = torch.ones(1024)
    collectives.all_reduce(t)  # set up with the whole mask: a core per rank, so the waits spread
    for _ in range(rounds):
        os.sched_setaffinity(0, {b if rank == 0 else a})
        for _ in range(20):
            if rank == 1:  # rank 0 comes first, waits, and publishes b
                time.sleep(0.0002)
            collectives.all_reduce(t)
        os.sched_setaffinity(0, {a if rank == 0 else b})  # the kernel moves us now, and leaves us there
        os.sched_setaffinity(0, mask)
        time.sleep(0.02)  # the words age past CPU_FRESH; no wait publishes meanwhile
        if rank == 0:  # rank 1 waits first and reads rank 0's old word: "b", its own CPU
            end = time.perf_counter() + 0.0003
            while time.perf_counter() < end:
                pass
        collectives.all_reduce(t)
        collectives.barrier()
    transport = collectives.get_group().engine(torch.device("cpu"), "test").transport
    return transport.moves.oldest_word, os.sched_getaffinity(0) == mask


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_stale_cpu_word_does_not_move_a_rank_onto_its_peer():
    """A peer's CPU is trusted only while fresh: rank 0's word says the CPU rank 1 now runs on,
    but rank 0 has moved since; moving rank 1 "away" would put it on rank 0's CPU (what the
    bench saw after gloo's calls: ranks together for whole samples, 87 µs a call). Asserted on
    the words the moves acted on, not on where the ranks ended: a busy scheduler puts the ranks
    together on its own (beside eight CPU hogs, rank 1 ended on rank 0's CPU in 4 of 6 rounds)."""
    from collectives.transport.shm.waiting import CPU_FRESH

    with WorkerPool(2, backend="shm", timeout=20.0) as pool:
        per_rank = pool.run(cpu_after_a_stale_word, 6)
    assert all(kept for _, kept in per_rank), "an affinity mask was left changed"
    assert all(oldest <= CPU_FRESH for oldest, _ in per_rank), f"a rank moved on a word {per_rank} s old"


def test_auto_picks_shm_on_one_host(monkeypatch):
    monkeypatch.delenv("RINGDDP_BACKEND", raising=False)
    assert collectives.launch(auto_choice, 2, timeout=20.0, join_timeout=90) == ["ShmTransport"] * 2


def test_config_is_checked():
    with pytest.raises(ValueError, match="slots"):
        ShmConfig(slots=9).validate()
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmConfig(slot_bytes=100).validate()


def test_config_reads_sizes_as_people_type_them(monkeypatch):
    monkeypatch.setenv("RINGDDP_SHM_REGION_BYTES", "64M")
    monkeypatch.setenv("RINGDDP_SHM_SLOT_BYTES", "256K")
    monkeypatch.setenv("RINGDDP_SHM_SLOTS", "2")
    monkeypatch.setenv("RINGDDP_SHM_SPIN_US", "20")
    config = ShmConfig.from_env()
    assert (config.region_bytes, config.slot_bytes, config.slots, config.spin_seconds) == (64 << 20, 256 << 10, 2, 20e-6)
    for name, bad in (("RINGDDP_SHM_REGION_BYTES", "64Q"), ("RINGDDP_SHM_SLOTS", "four"), ("RINGDDP_SHM_SPIN_US", "fast")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}': expected"):
            ShmConfig.from_env()
        monkeypatch.delenv(name)


def mismatched_sizes(rank: int, world_size: int, numel: int) -> tuple[str, str | None, bool]:
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(numel + 7 * rank))
    except collectives.CollectiveError as exc:
        # the rank that finds the mismatch tells its peers: nobody waits for the deadline
        fast = not isinstance(exc, collectives.CollectiveTimeoutError) and time.monotonic() - start < 5.0
        return "error", exc.op, fast
    return "no error", None, False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("numel", [100, 3 << 20])  # one-shot and two-shot
def test_mismatched_calls_raise_instead_of_a_silent_answer(numel):
    results = collectives.launch(mismatched_sizes, 2, numel, backend="shm", timeout=20.0, join_timeout=60)
    assert results == [("error", "all_reduce", True)] * 2, results


def mismatched_slotted_calls(rank: int, world_size: int) -> dict[str, tuple[str, str | None, bool]]:
    """Calls that disagree between ranks, each on a fresh group: what every rank saw.

    A rank that reads a peer's region raises in the call; a rank that only wrote (the root of a
    scatter, the others in a gather) raises at its next wait on the group (a barrier here).
    """
    n = world_size

    def all_to_all(sends: list[int], recvs: list[int]) -> None:
        collectives.all_to_all([torch.zeros(k) for k in recvs], [torch.ones(k) for k in sends], group=g)

    calls = {
        "scatter 8 vs 9 elements": lambda: collectives.scatter(
            torch.zeros(8 + (rank == 1)), [torch.ones(8)] * n if rank == 0 else None, src=0, group=g
        ),
        "broadcast 8 vs 9 elements": lambda: collectives.broadcast(torch.ones(8 + (rank == 1)), src=0, group=g),
        # ranks 0 and 1 both think they are the root, so no rank reads the other: the wire check's
        # header exchange (on by default) catches it, the regions' signatures alone could not
        "broadcast roots 0 vs 1": lambda: collectives.broadcast(torch.ones(8), src=min(rank, 1), group=g),
        "scatter roots 0 vs 1": lambda: collectives.scatter(
            torch.zeros(8), [torch.ones(8)] * n if rank < 2 else None, src=min(rank, 1), group=g
        ),
        "gather 8 vs 9 elements": lambda: collectives.gather(
            torch.ones(8 + (rank == 1)), [torch.zeros(8) for _ in range(n)] if rank == 0 else None, dst=0, group=g
        ),
        # several pieces, and a different number of them on each rank
        "scatter 2^16 vs 2^21 elements": lambda: collectives.scatter(
            torch.zeros(1 << (16 + 5 * (rank == 1))), [torch.ones(1 << 16)] * n if rank == 0 else None, src=0, group=g
        ),
        "gather 2^16 vs 2^21 elements": lambda: collectives.gather(
            torch.ones(1 << (16 + 5 * (rank == 1))), [torch.zeros(1 << 16) for _ in range(n)] if rank == 0 else None,
            dst=0, group=g,
        ),
        # rank 0 sends 5 elements to rank 1, which expects 4; rank 2 (if any) agrees with both
        "all_to_all sizes": lambda: all_to_all([1, 5, 2][:n] if rank == 0 else [5, 1, 2][:n] if rank == 1 else [2] * n,
                                               [1, 5, 2][:n] if rank == 0 else [4, 1, 2][:n] if rank == 1 else [2] * n),
        "all_to_all vs gather": lambda: all_to_all([8] * n, [8] * n) if rank == 0 else collectives.gather(
            torch.ones(8), None, dst=0, group=g
        ),
    }
    import logging

    logging.getLogger("collectives.group").setLevel(logging.CRITICAL)  # one "unusable" line per case
    seen = {}
    for name, call in calls.items():
        g = collectives.new_group(backend="shm", timeout=20.0)
        collectives.barrier()  # start together: new_group returns at different times on different ranks
        start = time.monotonic()
        kind, error = "error", None
        try:
            call()
            kind = "error at the next wait"
            collectives.barrier(group=g)
        except collectives.CollectiveError as exc:
            error = exc
        if error is None:
            seen[name] = ("no error", None, False)
        else:
            fast = not isinstance(error, collectives.CollectiveTimeoutError) and time.monotonic() - start < 5.0
            seen[name] = (kind, error.op, fast)
        g.close()
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_one_to_many_calls_raise_on_every_rank(world_size):
    """No rank completes a mismatched call and the next one: each raises CollectiveError, fast."""
    results = collectives.launch(mismatched_slotted_calls, world_size, backend="shm", timeout=20.0, join_timeout=120)
    for rank, seen in enumerate(results):
        for name, (kind, op, fast) in seen.items():
            assert kind != "no error" and fast, (rank, name, kind, op)
    # the ranks that read a peer's region raise in the call itself: rank 1 of a scatter or
    # broadcast from 0, the root of a gather, and in an all-to-all every rank
    for name in results[0]:
        if "roots" in name:
            readers = []
        elif name.startswith(("scatter", "broadcast")):
            readers = [1]
        elif name.startswith("gather") or name.endswith("vs gather"):
            readers = [0]
        else:
            readers = range(world_size)
        assert all(results[q][name][0] == "error" for q in readers), (name, [r[name] for r in results])


def mismatched_calls(rank: int, world_size: int, case: str) -> tuple[str, str]:
    """Calls that move the same bytes but mean different things: an error on every rank, never an answer."""
    try:
        if case == "dtype over messages":  # float32 and int32 of one size: equal bytes, ring messages
            t = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.int32)
            collectives.all_reduce(t, algorithm="ring")
        elif case == "dtype over regions":
            collectives.all_reduce(torch.ones(8, dtype=torch.float32 if rank == 0 else torch.int32))
        else:  # "regions against messages": nobody moves data, both wait
            collectives.all_reduce(torch.ones(8), algorithm="auto" if rank == 0 else "ring")
    except collectives.CollectiveError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["dtype over messages", "dtype over regions", "regions against messages"])
def test_wire_check_names_both_calls_without_a_message_of_its_own(case):
    results = collectives.launch(mismatched_calls, 2, case, backend="shm", timeout=20.0, join_timeout=60)
    for kind, message in results:
        assert kind == "CollectiveError", results  # not the 20 s timeout
        assert "called a different collective" in message and "as collective #1" in message, message
    differ = "algorithm" if case == "regions against messages" else "dtype"
    assert any(f"differ in {differ}" in message for _, message in results), results


def planned_plain_calls(rank: int, world_size: int) -> dict:
    """Plain calls whose shape ran before (the planned path where the kernel is loaded): the
    results, what their bad arguments raise, and a mismatch between two planned shapes."""
    from collectives.group import get_default_group
    from collectives.transport.shm import native

    # in grad mode, AVG's division is not recorded by autograd (a leaf parameter, a non-leaf)
    leaf, nonleaf = torch.nn.Parameter(torch.full((5,), rank + 1.0)), torch.ones(4, requires_grad=True) * (rank + 1)
    f, i = torch.ones(8), torch.full((8,), 1 << 24, dtype=torch.int32)  # i's bits summed as floats differ
    for t in (leaf, nonleaf, f, i) * 2:  # the first call of a shape plans it, the second runs planned
        collectives.all_reduce(t, collectives.ReduceOp.AVG if t.requires_grad else collectives.ReduceOp.SUM)
    out: dict = {"sums": (f.tolist(), i.tolist()), "refused": [], "error": None}
    out["avg"] = (leaf.tolist(), nonleaf.tolist(), leaf.is_leaf, type(nonleaf.grad_fn).__name__)
    out["planned"] = sum(start is not None for _, start in get_default_group().plans.values())
    out["loaded"] = native.library() is not None
    for bad in (lambda: collectives.all_reduce(i, collectives.ReduceOp.AVG),  # a planned dtype, another op
                lambda: collectives.all_reduce(f, async_op=1),
                lambda: collectives.all_reduce(torch.ones(2, 4).to_sparse_csr()),
                lambda: collectives.all_reduce(torch.ones(8, device="meta"))):
        try:
            bad()
            out["refused"].append("no error")
        except (TypeError, ValueError) as exc:  # before any traffic: the peer is not in a call
            out["refused"].append(type(exc).__name__)
    try:
        collectives.all_reduce(f if rank == 0 else i)  # both shapes planned; they differ in dtype only
    except collectives.CollectiveError as exc:
        out["error"] = (type(exc).__name__, exc.op, exc.peer, str(exc))
    return out


@pytest.mark.timeout(120)
def test_planned_plain_calls_keep_their_checks_and_the_wire_check():
    """DESIGN §3, the plain call's planned path: a call whose key (CPU, dtype, count, op) ran
    before skips to the kernel after the checks the key does not fix; the sums are right, in
    grad mode too (nothing recorded); bad arguments still raise before any traffic; the calls
    are still numbered and compared, so two planned shapes that differ in dtype alone (equal
    bytes, equal count) raise on both ranks naming the op, the peer and both calls."""
    results = collectives.launch(planned_plain_calls, 2, backend="shm", timeout=20.0, join_timeout=90)
    for rank, out in enumerate(results):
        assert out["sums"] == ([4.0] * 8, [4 << 24] * 8), out["sums"]
        assert out["avg"] == ([1.5] * 5, [1.5] * 4, True, "MulBackward0"), out["avg"]
        assert out["planned"] == (4 if out["loaded"] else 0), out
        assert out["refused"] == ["ValueError", "TypeError", "TypeError", "TypeError"], out["refused"]
        kind, op, peer, message = out["error"]
        assert (kind, op, peer) == ("CollectiveError", "all_reduce", 1 - rank), out["error"]
        assert "as collective #9" in message and "differ in dtype" in message, message


@pytest.mark.timeout(180)
def test_bench_shows_shm_and_memcpy_rows(capsys, tmp_path):
    """The shm columns, timed nccl-tests style (``--timing loop``: 50 back-to-back calls at 64 KiB),
    and the persistent all-reduce's (all_reduce only)."""
    from collectives import bench

    path = tmp_path / "rows.json"
    code = bench.main(["--shm", "--ops", "all_reduce,all_gather", "--world-sizes", "2", "--min-bytes", "64K",
                       "--max-bytes", "64K", "--iters", "2", "--timing", "loop", "--persistent", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out  # 0: no wrong element in any column, the persistent one included
    rows = json.loads(path.read_text())
    assert all(r["timing"] == "loop" and r["calls"] == 50 for r in rows), out
    assert "shm us" in out and "sym us" in out and "memcpy us" in out and "persistent us" in out, out
    assert [r["op"] for r in rows if "persistent_us" in r and r["persistent_us"] == r["persistent_us"]] == ["all_reduce"]
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("all_reduce", "all_gather"))}
    assert len(rows) == 2, out
    # all_reduce also ran on symmetric memory (a time), all_gather has no such variant ("-");
    # the #wrong column (5th field after the count) covers every variant, sym included
    sym_cell = lambda line: line.split("|")[6].split()[0]  # noqa: E731
    assert sym_cell(rows["all_reduce"]) != "-" and sym_cell(rows["all_gather"]) == "-", out
    assert all(line.split("|")[1].split()[3] == "0" for line in rows.values()), out
