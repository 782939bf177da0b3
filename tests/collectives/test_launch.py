"""The launcher: results, re-raised exceptions, rank deaths, no orphans, torchrun, rendezvous."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest

import collectives
from collectives import LaunchError


def launched_children():
    """Processes started by launch() that are still alive (the test pools' ranks don't count)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("ringddp-rank")]


def identity(rank, world_size, extra):
    return rank, world_size, extra, collectives.get_rank(), collectives.get_world_size()


def raises_on_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom on rank one")
    return rank


def hangs(rank, world_size):
    time.sleep(60)


@pytest.mark.timeout(120)
def test_results_by_rank_and_reraised_exceptions():
    assert collectives.launch(identity, 3, "x", join_timeout=60) == [(r, 3, "x", r, 3) for r in range(3)]
    with pytest.raises(KeyError) as info:
        collectives.launch(raises_on_one, 2, join_timeout=60)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1" in notes and "boom on rank one" in notes and "raises_on_one" in notes
    assert launched_children() == []


@pytest.mark.timeout(120)
def test_join_timeout_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="join timeout"):
        collectives.launch(hangs, 2, join_timeout=8)
    assert time.monotonic() - start < 30
    assert launched_children() == []


@pytest.mark.timeout(120)
def test_rank_that_never_joins_gives_a_rendezvous_timeout(tmp_path):
    script = textwrap.dedent(
        """
        import socket, sys, collectives
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        try:
            collectives.init_process_group(init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, timeout=3)
        except Exception as exc:
            print(type(exc).__name__, exc)
            sys.exit(0)
        sys.exit("joined alone?")
        """
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rendezvous" in out.stdout and "1 of 2" in out.stdout, out.stdout
    assert time.monotonic() - start < 30


TORCHRUN_SCRIPT = """
import sys
import collectives, torch

def job(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    collectives.all_reduce(t)
    return float(t)

if __name__ == "__main__":
    results = collectives.launch(job, 2)
    mine = [r for r in results if r is not None]
    # one write per line, so the two ranks' lines cannot interleave
    sys.stdout.write(f"RESULT {len(mine)} {mine[0]}\\n")
    sys.stdout.flush()
"""


@pytest.mark.timeout(180)
def test_runs_unchanged_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("RESULT 1 3.0") == 2, out.stdout
