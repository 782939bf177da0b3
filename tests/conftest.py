"""Shared fixtures: persistent rank pools (one per world size), started on first use; started
processes stopped after each test; and the session's end check for what tests left behind.

The pools run the backend under test — ``p2p`` unless ``pytest --collectives-backend NAME`` says
otherwise — never ``$RINGDDP_BACKEND``: with ``RINGDDP_BACKEND=torch`` in the environment the
property tests would otherwise compare torch's collectives with themselves.

At the end of the session (after every fixture's finalizer ran) the run fails if a process this
session started is still alive (they all inherit ``RINGDDP_TEST_SESSION``), if this process still
maps or holds a file of /dev/shm, or if a private tmpfs or a network namespace of this session is
still there (see ``tests/leaks.py``). What is found is listed, then killed or removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

import pytest

from collectives.testing import WorkerPool
from collectives.testing.plugin import check_collective  # noqa: F401  (the kit's fixture, on these pools)
from tests import leaks

_pools: dict[int, WorkerPool] = {}
_namespaces_before: set[str] = set()
_left: list[str] = []


def pytest_configure(config):
    global _namespaces_before
    os.environ[leaks.SESSION_VARIABLE] = uuid.uuid4().hex[:12]
    _namespaces_before = leaks.namespaces() if os.geteuid() == 0 else set()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if anything of this session outlived its tests."""
    processes = leaks.session_processes()
    for pid, cmd in sorted(processes.items()):
        _left.append(f"process {pid} still running: {cmd[:200]}")
    for line in leaks.segment_mappings() + [f"fd {fd}" for fd in leaks.segment_fds()]:
        _left.append(f"this process still maps or holds a file of /dev/shm: {line}")
    mounts = leaks.session_mounts()
    _left.extend(f"tmpfs still mounted at {m}" for m in mounts)
    spaces = leaks.session_namespaces(_namespaces_before, {os.getpid(), *processes}) if os.geteuid() == 0 else []
    _left.extend(f"network namespace left: {ns}" for ns in spaces)
    leaks.kill_all(processes)
    for m in mounts:
        subprocess.run(["umount", "-l", m], capture_output=True)
        os.rmdir(m)
    for ns in spaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if _left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _left:
        terminalreporter.section("left behind by this test session (the run fails)", red=True)
        for line in _left:
            terminalreporter.line(line, red=True)


@pytest.fixture
def processes():
    """``processes(argv, **popen_kwargs)`` starts a ``subprocess.Popen`` in a session of its own;
    after the test, pass or fail, its whole process group is killed and reaped."""
    started: list[subprocess.Popen] = []

    def start(argv, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def pytest_addoption(parser):
    parser.addoption("--collectives-backend", default="p2p", help="backend the rank pools test (default p2p)")


@pytest.fixture(scope="session")
def pools(request):
    """``pools(n)`` -> a WorkerPool of ``n`` ranks, shared by the whole test session."""
    backend = request.config.getoption("--collectives-backend")

    def get(world_size: int) -> WorkerPool:
        if world_size not in _pools:
            _pools[world_size] = WorkerPool(world_size, backend=backend, timeout=20.0, job_timeout=90.0)
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture(scope="session")
def collective_pools(pools):
    """The kit plugin's pools are the suite's pools."""
    return pools
