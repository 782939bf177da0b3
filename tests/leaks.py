"""What a test run may leave behind, looked for where a leak would actually show.

Segments are unnamed ``O_TMPFILE`` files and the rendezvous sockets are abstract, so a listing of
/dev/shm never shows a leaked segment. A segment stays alive only while some process holds it:
an open fd or a mapping. So these helpers look there:

* :func:`session_processes`: processes started by this test session (they inherit
  :data:`SESSION_VARIABLE` from the pytest process), wherever they were reparented;
* :func:`segment_mappings` / :func:`segment_fds`: a process's mappings and fds of files on a
  given tmpfs (``/dev/shm`` by default), compared by device number, so unnamed files count;
* :class:`PrivateTmpfs`: a tmpfs of the test's own (root only), whose used bytes go back to 0
  exactly when every segment in it is freed: a free-space check no other job on the machine
  disturbs;
* :func:`session_mounts`, :func:`session_namespaces`: mounts and network namespaces this session
  made.

``tests/conftest.py`` runs these at the end of the session and fails the run if anything is left.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from collectives import procfs

#: set by tests/conftest.py in the pytest process; every process the session starts inherits it.
SESSION_VARIABLE = "RINGDDP_TEST_SESSION"
#: prefix of the mount points :class:`PrivateTmpfs` makes (the session id follows it).
TMPFS_PREFIX = "ringddp-tmpfs-"


def session_id() -> str:
    return os.environ.get(SESSION_VARIABLE, "")


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone, a zombie's (empty), or not ours to read
        return b""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def process_state(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``T``, ``Z``...), or None if there is no such process."""
    return procfs.state(pid)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


def session_processes(session: str | None = None) -> dict[int, str]:
    """Live processes (not zombies) that inherited this session's id, except this process,
    multiprocessing's resource tracker and this process's forkserver (which forks the ranks of
    ``collectives.launch`` and ends with this process): pid -> command line."""
    marker = f"{SESSION_VARIABLE}={session or session_id()}".encode()
    if marker.endswith(b"="):
        return {}
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        if marker in _environ(pid).split(b"\0") and alive(pid):
            cmd = _cmdline(pid)
            own_forkserver = "multiprocessing.forkserver" in cmd and procfs.parent(pid) == os.getpid()
            if "resource_tracker" not in cmd and not own_forkserver:
                found[pid] = cmd
    return found


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _device(path: str | os.PathLike) -> int:
    return os.stat(path).st_dev


def segment_mappings(pid: int | str = "self", directory: str | os.PathLike = "/dev/shm") -> list[str]:
    """``pid``'s mappings of files on the file system of ``directory`` (default /dev/shm), named
    or not, POSIX semaphores (``sem.*``, multiprocessing's) excepted: the lines of its maps."""
    dev = _device(directory)
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[3] == want and fields[4] != "0" and "/sem." not in fields[5]:
            out.append(line)
    return out


def segment_fds(pid: int | str = "self", directory: str | os.PathLike = "/dev/shm") -> list[str]:
    """``pid``'s open fds of files on the file system of ``directory``: ``fd -> target`` each."""
    dev = _device(directory)
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(path)
            target = os.readlink(path)
        except OSError:
            continue
        if st.st_dev == dev and not os.path.isdir(path) and "/sem." not in target:
            out.append(f"{fd} -> {target}")
    return out


def mount_table() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            out.append((pre.split()[4].replace("\\040", " "), post.split()[0]))
    return out


def session_mounts(session: str | None = None) -> list[str]:
    """Mount points of :class:`PrivateTmpfs` of this session that are still mounted."""
    tag = f"{TMPFS_PREFIX}{session or session_id()}-"
    return [point for point, _ in mount_table() if os.path.basename(point).startswith(tag)]


def namespaces() -> set[str]:
    """Network namespaces named like :mod:`collectives.testing.hosts`' (``rdh<pid>...``); empty
    where ``ip`` is missing or not allowed."""
    if shutil.which("ip") is None:
        return set()
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.split() and line.startswith("rdh")}


def session_namespaces(before: set[str], ours: set[int]) -> list[str]:
    """Namespaces made since ``before`` whose creator (the pid in the name) is one of ``ours``
    or no longer exists: what this session left."""
    left = []
    for name in sorted(namespaces() - before):
        m = re.match(r"rdh(\d+)", name)
        if m and (int(m.group(1)) in ours or not alive(int(m.group(1)))):
            left.append(name)
    return left


def tmpfs_used(path: str | os.PathLike) -> int:
    """Bytes in use on the file system of ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class PrivateTmpfs:
    """``with PrivateTmpfs("64m") as fs:`` a tmpfs of the test's own at ``fs.path``.

    ``fs.used()`` is the bytes its files hold: 0 exactly when every segment made in it has been
    freed, since nothing else on the machine uses it. Where mounting is not allowed (not root)
    the test is skipped, or with ``skip=False`` ``fs.available`` is False and ``fs.path`` empty
    (the caller uses /dev/shm and checks less). On leaving, it is unmounted (lazily, and
    reported, if something still holds it) and its directory removed; an error raised inside
    the block is never masked by the clean-up.
    """

    def __init__(self, size: str, skip: bool = True):
        self.size, self.skip = size, skip
        self.path = ""
        self.available = False
        self.why_not = ""

    def __enter__(self) -> "PrivateTmpfs":
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return self._unavailable("a private tmpfs needs root and mount")
        path = tempfile.mkdtemp(prefix=f"{TMPFS_PREFIX}{session_id()}-")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            os.rmdir(path)
            return self._unavailable(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.path, self.available = path, True
        return self

    def _unavailable(self, why: str) -> "PrivateTmpfs":
        if self.skip:
            pytest.skip(why)
        self.why_not = why
        return self

    def used(self) -> int:
        return tmpfs_used(self.path)

    def wait_until_empty(self, seconds: float = 5.0) -> int:
        """Bytes still used after waiting up to ``seconds`` for exiting processes to release theirs."""
        deadline = time.monotonic() + seconds
        while (used := self.used()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

    def __exit__(self, kind, value, tb) -> None:
        if not self.available:
            return
        busy = ""
        done = subprocess.run(["umount", self.path], capture_output=True, text=True)
        if done.returncode != 0:
            busy = done.stderr.strip()
            subprocess.run(["umount", "-l", self.path], capture_output=True)
        try:
            os.rmdir(self.path)
        except OSError:
            pass
        if busy and kind is None:
            raise AssertionError(f"{self.path} was still in use at the end of the test (unmounted lazily): {busy}")


def files_in(path: str | os.PathLike) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())
