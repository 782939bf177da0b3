"""ElasticGroup: heartbeats find a stopped member, the survivors fence it and re-form the group,
a replacement takes a dead member's slot, and a fenced member that wakes up cannot take part.

Real processes (spawned here, not by ``collectives.launch``, which ends the job when a rank dies)
and a store hosted by this test process, as a launcher would. Every member runs steps of
``all_reduce`` of ``slot + 1`` times the step and checks the exact sum over the generation's slots.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.elastic import ElasticGroup, FencedError
from collectives.launch import set_parent_death_signal, start_process

BOUND = 4.0  # heartbeat bound (s): one a loaded machine keeps (a starved healthy member is not "silent")
TIMEOUT = 60.0  # the collective timeout: detection must come from the heartbeat, far sooner


def _steps(eg: ElasticGroup, store, first: int, last: int, log: list) -> None:
    """Run steps first..last-1, re-forming after a failure; log (step, generation, size, ok)."""
    step = first
    while step < last:
        if store.check([f"stop/{eg.me.slot}/{step}"]) and eg.me.uid == int(store.get(f"stop/{eg.me.slot}/{step}")):
            store.set(f"stopped/{eg.me.uid}", repr(time.time()))
            os.kill(os.getpid(), int(store.get(f"signal/{eg.me.uid}")))
        t = torch.full((5,), float((eg.me.slot + 1) * (step + 1)))
        try:
            collectives.all_reduce(t, group=eg.group)
        except collectives.CollectiveError as exc:
            log.append(("failed", step, time.time(), type(exc).__name__, str(exc)[:200]))
            eg.reform(allow_shrink=store.check(["shrink"]), wait=float(store.get("wait")))
            continue
        want = sum(m.slot + 1 for m in eg.members) * (step + 1)
        log.append((step, eg.generation, eg.size(), t.tolist() == [float(want)] * 5))
        store.set(f"done/{eg.me.slot}/{step}/{eg.me.uid}", "1")
        step += 1


def member(port: int, slot: int, world: int, backend: str, first: int, last: int, kill: bool, conn) -> None:
    set_parent_death_signal()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    log: list = []
    try:
        eg = ElasticGroup(store, slot, world, backend=backend, timeout=float(store.get("timeout")), heartbeat=BOUND,
                          kill_silent=kill)
        conn.send(("joined", eg.me.uid))
        try:
            _steps(eg, store, first, last, log)
        finally:
            eg.close()
        conn.send(("ok", log))
    except FencedError as exc:
        conn.send(("fenced", log + [str(exc)]))
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        conn.send(("error", log + [f"{type(exc).__name__}: {exc}"]))


class Job:
    """This test's launcher: the store, the members, their pipes."""

    def __init__(self, backend: str, world: int, steps: int, *, shrink: bool, wait: float, kill: bool = True,
                 timeout: float = TIMEOUT):
        self.store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=120))
        self.store.set("wait", str(wait))
        self.store.set("timeout", str(timeout))
        if shrink:
            self.store.set("shrink", "1")
        self.backend, self.world, self.steps, self.kill = backend, world, steps, kill
        self.procs: list[tuple[mp.Process, object]] = []
        for slot in range(world):
            self.start(slot, first=0)
        self.uids = [self.read(i, "joined") for i in range(world)]

    def start(self, slot: int, first: int) -> int:
        parent, child = mp.Pipe(duplex=False)
        p = start_process(member, (self.store.port, slot, self.world, self.backend, first, self.steps, self.kill, child),
                          f"elastic-{slot}")
        child.close()
        self.procs.append((p, parent))
        return len(self.procs) - 1

    def read(self, i: int, expect: str | None = None, timeout: float = 150.0):
        proc, conn = self.procs[i]
        if not conn.poll(timeout):
            raise AssertionError(f"member {i} (pid {proc.pid}) said nothing in {timeout}s")
        status, value = conn.recv()
        if expect is not None:
            assert status == expect, (status, value)
            return value
        return status, value

    def stop_at(self, index: int, step: int, sig: int) -> None:
        uid = self.uids[index]
        self.store.set(f"signal/{uid}", str(int(sig)))
        self.store.set(f"stop/{index}/{step}", str(uid))

    def close(self) -> None:
        for p, _ in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)


def _failed_at(log: list) -> list[tuple]:
    return [e for e in log if e[0] == "failed"]


def _steps_ok(log: list) -> list[tuple]:
    return [e for e in log if isinstance(e, tuple) and isinstance(e[0], int)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["shm"])  # p2p: the replacement test below and the host test
def test_stopped_member_is_found_by_heartbeat_fenced_killed_and_the_rest_go_on(backend):
    """Slot 2 of 3 stops itself (SIGSTOP) before step 3's all-reduce: the survivors, blocked in it,
    raise within the heartbeat bound (not the 60 s timeout), kill it, shrink to 2 and finish
    every step with exact sums; slot 2's process ends killed by SIGKILL."""
    job = Job(backend, 3, 6, shrink=True, wait=8.0)
    try:
        job.stop_at(2, 3, signal.SIGSTOP)
        logs = [job.read(i, "ok") for i in (0, 1)]
        job.procs[2][0].join(30)
        assert job.procs[2][0].exitcode == -signal.SIGKILL, job.procs[2][0].exitcode
        stopped = float(job.store.get(f"stopped/{job.uids[2]}"))
        for log in logs:
            (failure,) = _failed_at(log)
            assert failure[1] == 3, failure
            assert failure[2] - stopped < BOUND + 8, f"found after {failure[2] - stopped:.1f}s"
            steps = _steps_ok(log)
            assert [s[0] for s in steps] == list(range(6)) and all(s[3] for s in steps), steps
            assert [(s[1], s[2]) for s in steps] == [(0, 3)] * 3 + [(1, 2)] * 3, steps
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["p2p"])  # shm: tests/ddp/test_elastic.py
def test_killed_member_is_replaced_and_the_full_world_goes_on(backend):
    """Slot 1 of 3 is killed (SIGKILL) before step 2; a replacement started by the launcher takes
    slot 1 in generation 1, and every step's sum is over all three slots again."""
    job = Job(backend, 3, 5, shrink=False, wait=90.0)
    try:
        job.stop_at(1, 2, signal.SIGKILL)
        job.procs[1][0].join(60)
        assert job.procs[1][0].exitcode == -signal.SIGKILL
        new = job.start(1, first=2)
        assert job.read(new, "joined") > max(job.uids)
        logs = [job.read(i, "ok") for i in (0, 2, new)]
        for log in logs[:2]:
            (failure,) = _failed_at(log)
            assert failure[1] == 2, failure
        for log in logs:
            steps = [s for s in _steps_ok(log) if s[0] >= 2]
            assert [s[0] for s in steps] == [2, 3, 4] and all(s[3] for s in steps), steps
            assert {(s[1], s[2]) for s in steps} == {(1, 3)}, steps
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["shm"])  # the fence is the store's, whatever the backend
def test_fenced_member_that_wakes_up_cannot_take_part(backend):
    """With nobody killed (``kill_silent=False``, as for a member on another host), slot 2 stops
    before step 1; the heartbeat fences it and marks the group broken, which ends the survivors'
    shared-memory wait in flight within the bound (not at the 60 s deadline), and they shrink and
    run on. Once they are done, slot 2 is resumed: it may still finish the old generation's step
    from the memory it kept mapped (the survivors abandoned that step), but it ends with
    FencedError without a step in any later generation, and the survivors' sums were exact
    throughout."""
    job = Job(backend, 3, 4, shrink=True, wait=8.0, kill=False)
    try:
        job.stop_at(2, 1, signal.SIGSTOP)
        logs = [job.read(i, "ok") for i in (0, 1)]
        stopped = float(job.store.get(f"stopped/{job.uids[2]}"))
        for log in logs:
            (failure,) = _failed_at(log)
            assert failure[2] - stopped < BOUND + 8 and "abandoned" in failure[4], (failure, stopped)
        os.kill(job.procs[2][0].pid, signal.SIGCONT)
        status, log = job.read(2)
        assert status == "fenced", (status, log)
        assert {s[1] for s in _steps_ok(log)} == {0} and "fenced" in log[-1], log
        for log in logs:
            steps = _steps_ok(log)
            assert all(s[3] for s in steps) and [(s[1], s[2]) for s in steps][-1] == (1, 2), steps
    finally:
        job.close()


def test_bad_arguments_raise_before_anything_is_made():
    store = dist.HashStore()
    with pytest.raises(TypeError, match="TCPStore"):
        ElasticGroup(store, 0, 2)
    tcp = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for kwargs, match in [({"slot": 2, "world_size": 2}, "slot"), ({"slot": 0, "world_size": 0}, "world_size"),
                          ({"slot": 0, "world_size": 2, "heartbeat": 0}, "heartbeat")]:
        with pytest.raises(ValueError, match=match):
            ElasticGroup(tcp, **kwargs)


def host_member(out_dir: str, steps: int, cut_after: int, timeout: float) -> None:
    """One member of a job over network-namespace hosts (started by ``HostNet.popen`` with
    torchrun's environment; the store's server runs on host 0): slot = RANK. Runs ``steps`` exact
    all-reduces on backend ``auto``, re-forming (shrinking) after a failure, and writes its log;
    from step ``cut_after`` on it waits until the test has cut host 1 off."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    log: list = []
    try:
        eg = ElasticGroup(store, rank, world, backend="auto", timeout=timeout, heartbeat=BOUND)
        step = 0
        while step < steps:
            if step == cut_after:
                open(os.path.join(out_dir, f"at-cut{rank}"), "w").close()
                while not os.path.exists(os.path.join(out_dir, "cut")):
                    time.sleep(0.02)
            t = torch.full((1000,), float((rank + 1) * (step + 1)))
            try:
                collectives.all_reduce(t, group=eg.group)
            except collectives.CollectiveError as exc:
                log.append(("failed", step, time.time(), type(exc).__name__))
                eg.reform(allow_shrink=True, wait=3.0)
                continue
            want = sum(m.slot + 1 for m in eg.members) * (step + 1)
            log.append((step, eg.generation, eg.size(), bool((t == want).all())))
            step += 1
        eg.close()
        outcome = ("ok", log)
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        outcome = ("error", log + [f"{type(exc).__name__}: {str(exc)[:300]}"])
    with open(os.path.join(out_dir, f"log{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)


@pytest.mark.timeout(240)
def test_a_host_cut_off_mid_run_leaves_the_other_host_going(tmp_path):
    """2 network-namespace hosts x 2 members on backend ``auto`` (shared memory inside a host, the
    network between them); host 1's link is cut after step 3. Its members cannot be killed from
    host 0: they are fenced by the heartbeats, the survivors' call in flight ends at its deadline
    (nothing ends a wait on a peer that cannot be killed), they re-form without host 1 and finish
    every step with exact sums over their own slots. Host 1's members end with FencedError (their
    heartbeats no longer reach the store), not a hang in a store request."""
    from collectives.testing.hosts import HostNet, unavailable

    if (reason := unavailable()) is not None:
        pytest.skip(reason)
    timeout, steps, cut_after = 10.0, 8, 3
    code = ("import sys; from tests.collectives.test_elastic import host_member; "
            "host_member(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server = ("import sys, time, torch.distributed as d; s = d.TCPStore(sys.argv[1], int(sys.argv[2]), 1, True, "
              "wait_for_workers=False); time.sleep(600)")
    with HostNet(hosts=2) as net:
        net.popen(0, [sys.executable, "-c", server, net.address(0), str(net.rank_env(0, 2)["MASTER_PORT"])])
        procs = [net.popen(rank // 2, [sys.executable, "-c", code, str(tmp_path), str(steps), str(cut_after), str(timeout)],
                           env=net.rank_env(rank, 2, {"PYTHONPATH": root}), cwd=root)
                 for rank in range(4)]
        deadline = time.monotonic() + 150
        while len(list(tmp_path.glob("at-cut*"))) < 4:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "members did not reach the cut"
            time.sleep(0.05)
        net.set_link(1, up=False)
        cut = time.time()
        (tmp_path / "cut").touch()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    logs = {rank: pickle.loads((tmp_path / f"log{rank}.pkl").read_bytes()) for rank in range(4)}
    for rank in (0, 1):
        status, log = logs[rank]
        assert status == "ok", (rank, log)
        (failure,) = _failed_at(log)
        assert failure[1] == cut_after and failure[2] - cut < 2 * timeout + 10, (rank, failure, cut)
        done = _steps_ok(log)
        assert [s[0] for s in done] == list(range(steps)) and all(s[3] for s in done), (rank, done)
        assert [s[2] for s in done] == [4] * cut_after + [2] * (steps - cut_after), (rank, done)
    for rank in (2, 3):
        status, log = logs[rank]
        assert status == "error" and "FencedError" in log[-1] and "cut off" in log[-1], (rank, log)
        assert not any(s[0] >= cut_after for s in _steps_ok(log)), (rank, log)
