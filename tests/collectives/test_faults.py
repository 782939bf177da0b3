"""Faults with real processes: a rank killed mid-collective, and mismatched calls in debug mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import collectives
from collectives import CollectiveError, LaunchError

KILL_SCRIPT = """
import os, signal, sys, threading, time
import torch
import collectives

def job(rank, world_size, piddir):
    open(os.path.join(piddir, str(os.getpid())), "w").close()
    t = torch.ones(1 << 22)  # 16 MB: each all-reduce takes a while
    collectives.all_reduce(t)
    if rank == 2:  # die in the middle of the next all-reduces
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(10_000):
            collectives.all_reduce(t)
    except collectives.CollectiveError as exc:
        raise RuntimeError(f"survivor {rank} failed after {time.monotonic() - start:.1f}s: op={exc.op} peer={exc.peer}: {exc}")
    return "finished"

if __name__ == "__main__":
    collectives.launch(job, 4, sys.argv[1], timeout=10.0, join_timeout=120)
"""


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_rank_killed_mid_all_reduce(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), str(piddir)], capture_output=True, text=True, timeout=150,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    elapsed = time.monotonic() - start
    err = out.stderr
    assert out.returncode != 0
    # the launcher names the dead rank and how it died
    assert "rank 2 died without reporting (killed by signal 9)" in err, err[-3000:]
    # every survivor failed within the 10 s timeout with an error naming the op and a peer. Most
    # see the closed connection at once (~0.3 s); gloo sometimes leaves a receive from the dead
    # rank pending until the deadline, so "within the timeout" is the guarantee.
    found = dict(re.findall(r"survivor (\d) failed after ([\d.]+)s: op=all_reduce peer=\d", err))
    assert sorted(found) == ["0", "1", "3"], err[-3000:]
    assert all(float(seconds) < 12 for seconds in found.values()), found
    assert elapsed < 60, elapsed
    # no orphans: every rank process is gone
    pids = [int(p.name) for p in piddir.iterdir()]
    assert len(pids) == 4
    time.sleep(0.5)
    assert not [p for p in pids if process_alive(p)], "rank processes outlived the launcher"


def mismatched(rank, world_size, kind):
    try:
        if kind == "numel":
            collectives.all_reduce(torch.ones(10 + rank))
        elif kind == "op":
            collectives.all_reduce(torch.ones(10), op=collectives.ReduceOp.MAX if rank else collectives.ReduceOp.SUM)
        elif kind == "collective":
            if rank == 0:
                collectives.broadcast(torch.ones(10), src=0)
            else:
                collectives.all_reduce(torch.ones(10))
        elif kind == "dtype":
            collectives.all_reduce(torch.ones(10, dtype=torch.float64 if rank else torch.float32))
    except ValueError as exc:
        after = torch.ones(3)
        collectives.all_reduce(after)  # the group still works: the check ran before any payload
        return str(exc), after.tolist()
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["numel", "op", "collective", "dtype"])
def test_debug_mode_reports_mismatched_calls(monkeypatch, kind):
    monkeypatch.setenv("RINGDDP_DEBUG", "DETAIL")
    results = collectives.launch(mismatched, 3, kind, timeout=20.0, join_timeout=90)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} raised nothing"
        message, after = result
        assert "ranks disagree on" in message and "RINGDDP_DEBUG" in message, message
        assert kind in message, message
        assert after == [3.0, 3.0, 3.0]


def silent_mismatch(rank, world_size):
    try:
        collectives.all_reduce(torch.ones(5000 + rank * 7))  # sizes differ, no debug mode
    except CollectiveError as exc:
        return "error", exc.op, str(exc)
    return "no error", None, ""


@pytest.mark.timeout(120)
def test_default_level_turns_a_size_mismatch_into_a_collective_error(monkeypatch):
    """At the default level (RINGDDP_DEBUG=CHECK) the wire check finds the mismatch before any
    payload is trusted: a CollectiveError on both ranks, no process killed."""
    monkeypatch.delenv("RINGDDP_DEBUG", raising=False)
    start = time.monotonic()
    # p2p's wire check (gloo tags + header exchange); shm's own check is in test_shm.py
    results = collectives.launch(silent_mismatch, 2, backend="p2p", timeout=10.0, join_timeout=60)
    for kind, op, message in results:
        assert (kind, op) == ("error", "all_reduce"), message
        assert "differ in numel" in message and "numel=5000" in message and "numel=5007" in message, message
    assert time.monotonic() - start < 30  # found at once, not at a deadline


@pytest.mark.timeout(120)
def test_with_checks_off_a_mismatch_times_out_instead_of_killing_a_rank(monkeypatch):
    """With RINGDDP_DEBUG=OFF there is no header exchange, but payload messages are still tagged
    with what they are: the mismatched messages never pair (gloo would abort the receiver of a
    longer message than it posted), so both ranks wait and raise CollectiveTimeoutError."""
    monkeypatch.setenv("RINGDDP_DEBUG", "OFF")
    results = collectives.launch(silent_mismatch, 2, backend="p2p", timeout=5.0, join_timeout=60)
    for kind, op, message in results:
        assert (kind, op) == ("error", "all_reduce") and "timed out" in message, message
