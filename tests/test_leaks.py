"""The leak checks of tests/leaks.py can fail: each sees a leak made on purpose, and not after it is gone."""

from __future__ import annotations

import mmap
import os
import sys
import time

import pytest

from tests import leaks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and O_TMPFILE")


def _unnamed_segment(directory: str, size: int = 1 << 20) -> tuple[int, mmap.mmap]:
    """What the shm transport makes: an unnamed, reserved file, mapped shared."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, size)
    return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)


def test_an_unnamed_segment_is_seen_by_its_fd_and_mapping_until_released():
    before_maps, before_fds = leaks.segment_mappings(), leaks.segment_fds()
    fd, mapping = _unnamed_segment("/dev/shm")
    try:
        assert len(leaks.segment_mappings()) == len(before_maps) + 1
        assert len(leaks.segment_fds()) > len(before_fds)  # (Python's mmap keeps a duplicate fd)
        assert not [name for name in os.listdir("/dev/shm") if str(os.fstat(fd).st_ino) in name]  # no listing shows it
    finally:
        os.close(fd)
        mapping.close()
    assert leaks.segment_mappings() == before_maps and leaks.segment_fds() == before_fds


def test_a_private_tmpfs_counts_the_bytes_a_segment_holds():
    with leaks.PrivateTmpfs("8m") as fs:
        assert fs.used() == 0
        fd, mapping = _unnamed_segment(fs.path, 1 << 20)
        assert fs.used() >= 1 << 20 and leaks.files_in(fs.path) == []  # held, yet nothing listed
        assert leaks.segment_mappings("self", fs.path) and leaks.segment_fds("self", fs.path)
        os.close(fd)
        assert fs.used() >= 1 << 20  # the mapping still holds it
        mapping.close()
        assert fs.wait_until_empty(1.0) == 0
    assert fs.path not in leaks.session_mounts() and not os.path.exists(fs.path)


def test_a_process_of_the_session_is_seen_wherever_it_runs(processes):
    child = processes([sys.executable, "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 10
    while child.pid not in leaks.session_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.pid in leaks.session_processes()
    leaks.kill_all([child.pid])
    child.wait()
    assert child.pid not in leaks.session_processes()
