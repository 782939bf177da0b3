"""Jobs whose ranks fail on purpose, and reading what each survivor saw.

``collectives.launch`` re-raises the first failure and lists every failed rank with the last line
of its traceback, so a survivor tells its story in its exception text: it raises
``RuntimeError(survivor_line(...))`` and :func:`survivors` reads those lines back, from a
``LaunchError``'s text or from a fault script's stderr. A script defines ``survivor_line`` by
including :data:`SURVIVOR_SOURCE`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import collectives
from tests import leaks


def survivor_line(rank: int, exc: "collectives.CollectiveError", seconds: float, again: Callable[[], object],
                  label: str = "") -> str:
    """What a survivor saw, on one line: the error, how long after the fault, and the error of
    ``again()``, one more call on the failed group (which must say the group is unusable)."""
    try:
        again()
        after = "no error"
    except collectives.CollectiveError as second:
        after = str(second).splitlines()[0][:300]
    text = str(exc).splitlines()[0][:300]
    tag = f" ({label})" if label else ""
    return (f"survivor {rank}{tag} failed after {seconds:.2f}s: {type(exc).__name__} op={exc.op} "
            f"peer={exc.peer}: {text} || next call: {after} ||")


#: Python source that defines ``survivor_line`` in a fault script (which imports collectives).
SURVIVOR_SOURCE = "\nfrom typing import Callable\n\n" + inspect.getsource(survivor_line) + "\n"

_LINE = re.compile(
    r"survivor (\d+)(?: \((\w[\w ]*)\))? failed after ([\d.]+)s: (\w+) op=(\w+) peer=(-?\d+|None): (.*?) "
    r"\|\| next call: (.*?) \|\|"
)


@dataclasses.dataclass(frozen=True)
class Survivor:
    rank: int
    label: str
    seconds: float
    kind: str
    op: str
    peer: int | None
    message: str
    next_call: str


def survivors(text: str) -> dict[tuple[int, str], Survivor]:
    """The survivors' reports in ``text``, by (rank, label)."""
    found = {}
    for rank, label, seconds, kind, op, peer, message, after in _LINE.findall(text):
        s = Survivor(int(rank), label, float(seconds), kind, op, None if peer == "None" else int(peer), message, after)
        found[(s.rank, s.label)] = s
    return found


def failure_text(exc: BaseException) -> str:
    """What ``launch`` said about a failed job: the exception re-raised (the first rank's to fail:
    a survivor's ``RuntimeError`` or, when the death arrived first, a ``LaunchError``) with its
    notes, which list every failed rank."""
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


def run_script(tmp_path: Path, text: str, *args: str, timeout: float = 120, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Run ``text`` as a script in a session of its own; whatever happens, its process group
    (the launcher and its ranks) is killed before this returns."""
    script = tmp_path / "job.py"
    script.write_text(text)
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_all_gone(pids: list[int], seconds: float = 5.0) -> None:
    """Every process in ``pids`` has exited (waiting up to ``seconds``)."""
    deadline = time.monotonic() + seconds
    while [p for p in pids if leaks.alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if leaks.alive(p)], f"rank processes outlived the launcher: {pids}"


def pids_in(directory: Path) -> list[int]:
    return [int(p.name) for p in directory.iterdir()]
