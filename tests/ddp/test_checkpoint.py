"""Whole-job checkpoints (``ddp.checkpoint``) as the main job uses them: real processes, torchrun
restarting killed workers, and a comparison with the uninterrupted run down to the last bit."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ddp.test_train import run_train

EPOCHS = "2"  # 23 steps an epoch at 2 ranks; with --checkpoint-every 7: steps 7, 14, 21, 28, 35, 42 and the end, 46


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run's final state: our DDP without checkpoints. At 2 ranks every mode
    (ours, ZeRO-1/2/3, torch's DDP) ends in this state bit for bit: the same sums of two
    gradients, averaged the same way, stepped elementwise by the same SGD."""
    path = tmp_path_factory.mktemp("reference") / "ref.pt"
    out = run_train("--epochs", EPOCHS, "--save-state", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    return load(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A checkpoint directory of the 2-rank DDP run (steps 35, 42 and 46 kept)."""
    d = tmp_path_factory.mktemp("trained") / "ckpt"
    out = run_train("--epochs", EPOCHS, "--checkpoint-dir", str(d), "--checkpoint-every", "7")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in d.iterdir()) == ["step-00000035", "step-00000042", "step-00000046"]
    return d


def copy_of(checkpoints: Path, tmp_path: Path, *steps: int) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoints, d)
    for p in d.iterdir():
        if steps and int(p.name.split("-")[1]) not in steps:
            shutil.rmtree(p)
    return d


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_worker_restarted_by_torchrun_ends_bitwise_equal(tmp_path, mode, reference):
    """SIGKILL one worker at a seeded random moment after the first checkpoint (in backward, a
    collective, the optimizer step, a checkpoint write...): torchrun restarts both, they resume from
    the newest complete checkpoint, and the final model and optimizer state equal those of the
    uninterrupted run bit for bit."""
    log, state = torchrun_with_kill(tmp_path, list(MODES).index(mode), *MODES[mode])
    assert "resuming from" in log, log[-3000:]
    assert equal(load(state), reference)


@pytest.mark.timeout(300)
def test_corrupt_newest_checkpoints_fall_back_to_an_older_one(tmp_path, checkpoints, reference):
    """The newest checkpoint truncated, the next one with a flipped byte: the job says so for
    each, resumes from the third (mid-epoch: 12 batches into epoch 2) and ends as the
    uninterrupted run; the bad ones are replaced by good ones."""
    d = copy_of(checkpoints, tmp_path)
    newest = d / "step-00000046" / "rank-00000-of-00002.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    second = d / "step-00000042" / "rank-00001-of-00002.pt"
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x40
    second.write_bytes(bytes(data))
    state = tmp_path / "state.pt"
    out = run_train("--epochs", EPOCHS, "--checkpoint-dir", str(d), "--checkpoint-every", "7", "--save-state", str(state))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{newest}: 1000 bytes, the manifest says" in out.stderr
    assert f"{second}: sha256 differs from the manifest's (corrupted)" in out.stderr
    assert out.stderr.count("falling back to the previous one") == 2
    assert "resuming from " + str(d / "step-00000035") in out.stderr
    assert "resumed at step 35: epoch 2, 12 batches into it" in out.stderr
    assert equal(load(state), reference)
    from ddp.checkpoint import verify

    assert [verify(str(d / f"step-000000{s}"))["step"] for s in (35, 42, 46)] == [35, 42, 46]


def snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


@pytest.mark.timeout(300)
def test_bad_input_fails_at_start_naming_the_file_and_touches_nothing(tmp_path, checkpoints):
    """Another model, another checkpoint format, --no-resume on a directory holding checkpoints,
    a directory that is a file: exit 1 at start, the message names the file and what differs, and
    every file on disk is as it was."""
    d = copy_of(checkpoints, tmp_path, 35, 46)
    manifest = d / "step-00000035" / "MANIFEST.json"
    old = json.loads(manifest.read_text())
    old["format"] = old["fingerprint"]["format"] = 99
    manifest.write_text(json.dumps(old))
    before = snapshot(d)
    cases = [
        (["--hidden", "32"], f"{d / 'step-00000046' / 'MANIFEST.json'}: this job cannot resume it: model parameters: "
                             "0.bias saved [256] here [32], 0.weight saved [256, 64] here [32, 64]"),
        (["--no-resume"], f"checkpoint directory {d}: holds checkpoints (newest step-00000046) and resuming was refused"),
        (["--zero", "1", "--lr", "0.1"], "kind: saved replicated, this job sharded; optimizer: saved"),
    ]
    for args, message in cases:
        out = run_train("-n", "1", "--epochs", EPOCHS, "--checkpoint-dir", str(d), *args)
        assert out.returncode == 1 and message in out.stderr, (args, out.stderr[-3000:])
        assert snapshot(d) == before, args
    shutil.rmtree(d / "step-00000046")
    out = run_train("-n", "1", "--epochs", EPOCHS, "--checkpoint-dir", str(d))
    assert out.returncode == 1 and f"{manifest}: this job cannot resume it: checkpoint format 99 (this version reads format 1)" in out.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = run_train("-n", "1", "--epochs", EPOCHS, "--checkpoint-dir", str(blocker))
    assert out.returncode == 1 and f"checkpoint directory {blocker}: exists and is not a directory" in out.stderr
    assert blocker.read_text() == "not a directory"


@pytest.mark.timeout(300)
def test_resume_at_another_world_size(tmp_path, checkpoints):
    """Saved by 2 ranks 12 batches into epoch 2, resumed by 1: the one rank takes the epoch's
    remaining rows (what is left of it, not a whole epoch). ZeRO-2 re-partitions its shards; our
    DDP loads the replicated state: both end in the same state bit for bit (the sharded and the
    replicated path agree), and differ from the 2-rank run's (the global batch halved)."""
    zero = tmp_path / "zero"
    out = run_train("--epochs", EPOCHS, "--zero", "2", "--checkpoint-dir", str(zero), "--checkpoint-every", "7")
    assert out.returncode == 0, out.stderr[-3000:]
    states = []
    for d, args in ((copy_of(checkpoints, tmp_path / "ddp", 35), []), (zero, ["--zero", "2"])):
        for p in d.iterdir():
            if p.name != "step-00000035":
                shutil.rmtree(p)
        state = d.parent / "state.pt"
        out = run_train("-n", "1", "--epochs", EPOCHS, "--checkpoint-dir", str(d), "--save-state", str(state), *args)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "resuming from " + str(d / "step-00000035") + " (step 35, saved by 2 ranks)" in out.stderr
        # 1437 rows, 35 - 23 = 12 batches of 2 x 32 done: 669 left, 21 batches of 32 at one rank
        assert "resumed at step 35: epoch 2, 12 batches into it" in out.stderr
        states.append(load(state))
        assert json.loads((d / "step-00000056" / "MANIFEST.json").read_text())["world_size"] == 1
    assert equal(states[0], states[1])
