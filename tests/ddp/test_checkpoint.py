"""Whole-job checkpoints (``ddp.checkpoint``) as the main job uses them: real processes, torchrun
restarting killed workers, and a comparison with the uninterrupted run down to the last bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ddp.test_train import run_train

EPOCHS = "3"


def equal(a, b) -> bool:
    """Nested state dicts equal bitwise (tensors with ``torch.equal``, same dtypes and shapes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def load(path: Path):
    return torch.load(path, weights_only=True)


def workers(pid: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's (``pid``) worker processes now alive."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                env = dict(v.split("=", 1) for v in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in v)
            except OSError:
                continue
            if "RANK" in env:
                out[int(env["RANK"])] = child
    return out


def torchrun_with_kill(tmp_path: Path, seed: int, *args: str) -> tuple[str, Path]:
    """Run the job under torchrun (2 workers, 3 restarts) checkpointing into ``tmp_path/ckpt``; once
    its first checkpoint exists, SIGKILL a worker (rank and moment drawn from ``seed``). Returns
    the output and the ``--save-state`` file."""
    rng = random.Random(seed)
    ckpt, state, log = tmp_path / "ckpt", tmp_path / "state.pt", tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "-m", "ddp.train", "--epochs", EPOCHS, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--keep", "2",
           "--save-state", str(state), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not any(p.name.startswith("step-") for p in ckpt.glob("step-*")):
                assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            rank = rng.randrange(2)
            victim = workers(job.pid).get(rank)
            assert victim is not None, f"rank {rank} had already exited:\n{log.read_text()[-3000:]}"
            os.kill(victim, signal.SIGKILL)
            assert job.wait(timeout=240) == 0, log.read_text()[-5000:]
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return log.read_text(), state


MODES = {"ddp": [], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"], "zero3": ["--zero", "3"], "torch-ddp": ["--torch-ddp"]}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_worker_restarted_by_torchrun_ends_bitwise_equal(tmp_path, mode):
    """SIGKILL one worker at a seeded random moment after the first checkpoint: torchrun restarts
    both, they resume from the newest complete checkpoint, and the final model and optimizer state
    equal those of the uninterrupted run (no torchrun, no checkpoints) bit for bit."""
    ref = tmp_path / "ref.pt"
    out = run_train("--epochs", EPOCHS, "--save-state", str(ref), *MODES[mode])
    assert out.returncode == 0, out.stderr[-3000:]
    log, state = torchrun_with_kill(tmp_path, list(MODES).index(mode), *MODES[mode])
    assert "resuming from" in log, log[-3000:]
    assert equal(load(state), load(ref))
