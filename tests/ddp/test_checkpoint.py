"""Whole-job checkpoints (``ddp.checkpoint``) as the main job uses them: real processes, torchrun
restarting killed workers, and a comparison with the uninterrupted run down to the last bit."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import collectives
from collectives import faults
from collectives.testing import hosts
from tests.ddp.test_train import run_train, run_train_here

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


def train_argv(tmp_path: Path, *args: str) -> list[str]:
    """``ddp.train`` checkpointing every 4 steps into ``tmp_path/ckpt``, final state to ``tmp_path/state.pt``."""
    return ["-m", "ddp.train", "--epochs", EPOCHS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
            "--keep", "2", "--save-state", str(tmp_path / "state.pt"), *args]


def kill_and_finish(agents: list[subprocess.Popen], logs: list[Path], ckpt: Path, kill: str, victim_agent: int = 0) -> str:
    """Wait for the torchrun ``agents`` to exit 0 (each logging to its file in ``logs``); returns
    their output. ``kill`` is ``"random:<seed>"``: once the first checkpoint exists, SIGKILL a
    worker of agent ``victim_agent`` from outside after a moment drawn from the seed (its rank
    too, if the agent has several); otherwise a fault point (``collectives.faults``) the job was
    started with. Every agent and its workers are killed on the way out."""
    def tails() -> str:
        return "\n".join(f.read_text()[-4000:] for f in logs)

    try:
        if kill.startswith("random:"):
            rng = random.Random(int(kill.split(":")[1]))
            deadline = time.monotonic() + 120
            while not any(p.name.startswith("step-") for p in ckpt.glob("step-*")):
                assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, tails()
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            alive = workers(agents[victim_agent].pid)
            assert alive, f"the workers had already exited:\n{tails()}"
            os.kill(alive[sorted(alive)[rng.randrange(len(alive))]], signal.SIGKILL)
        for a in agents:
            assert a.wait(timeout=240) == 0, tails()
    finally:
        for a in agents:
            if a.poll() is None:  # its workers run in sessions of their own: kill them first
                for pid in workers(a.pid).values():
                    os.kill(pid, signal.SIGKILL)
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    return "\n".join(f.read_text() for f in logs)


def torchrun_with_kill(tmp_path: Path, kill: str, *args: str) -> Path:
    """Run the job under torchrun (2 workers, 3 restarts), kill workers (``kill``: see
    :func:`kill_and_finish`, or fault points ``<phase>:<n>:<rank>``, comma-separated, each firing
    once), let it finish, check that it resumed. Returns the ``--save-state`` file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           *train_argv(tmp_path, *args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    points = [] if kill.startswith("random:") else kill.split(",")
    flags = [tmp_path / f"killed-{i}" for i in range(len(points))]
    if points:
        env[faults.ENV] = ",".join(f"{point}:{flag}" for point, flag in zip(points, flags))
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        text = kill_and_finish([job], [log], tmp_path / "ckpt", kill)
    assert "resuming from" in text, text[-3000:]
    for point, flag in zip(points, flags):
        assert flag.exists() and flag.read_text().split() == point.split(":")[:2], f"{point} did not fire:\n{text[-3000:]}"
    return tmp_path / "state.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run of our DDP, checkpointing every 7 steps (steps 35, 42 and 46
    kept in ``ckpt``), its final state in ``state.pt``."""
    d = tmp_path_factory.mktemp("trained")
    out = run_train_here("--epochs", EPOCHS, "--checkpoint-dir", str(d / "ckpt"), "--checkpoint-every", "7",
                    "--save-state", str(d / "state.pt"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (d / "ckpt").iterdir()) == ["step-00000035", "step-00000042", "step-00000046"]
    return d


@pytest.fixture(scope="module")
def reference(trained) -> dict:
    """The uninterrupted run's final state. At 2 ranks every mode (ours, ZeRO-1/2/3, torch's DDP)
    ends in this state bit for bit: the same sums of two gradients, averaged the same way, stepped
    elementwise by the same SGD; checkpoints (here every 7 steps, every 4 in the kill tests) change
    nothing of it."""
    return load(trained / "state.pt")


@pytest.fixture(scope="module")
def checkpoints(trained) -> Path:
    return trained / "ckpt"


def copy_of(checkpoints: Path, tmp_path: Path, *steps: int) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoints, d)
    for p in d.iterdir():
        if steps and int(p.name.split("-")[1]) not in steps:
            shutil.rmtree(p)
    return d


# (mode, its flags, where workers kill themselves): fault points inside a phase, the n-th time a
# rank reaches it (optimizer step; backward, then a collective after the restart; its file of a
# checkpoint written). ZeRO-1 is left out: it checkpoints and restores exactly as ZeRO-2 (the
# same sharded optimizer). Our DDP is the two-host test's, killed from outside at a seeded random
# moment. (One job killed twice costs a restart; a job of its own costs a torchrun start too.)
KILLS = [
    ("zero2", ["--zero", "2"], "step:10:0"),
    ("zero3", ["--zero", "3"], "backward:10:1,collective:60:0"),
    ("torch-ddp", ["--torch-ddp"], "checkpoint:2:0"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,kill", [k[1:] for k in KILLS], ids=[f"{m}-{'-'.join(p.split(':')[0] for p in k.split(','))}" for m, _, k in KILLS])
def test_killed_worker_restarted_by_torchrun_ends_bitwise_equal(tmp_path, args, kill, reference):
    """A worker SIGKILLs itself inside a chosen phase (in a collective, at the optimizer step,
    inside backward with the later layers' collectives running, with its checkpoint file written
    but the checkpoint not published): torchrun restarts both, they resume from the newest
    complete checkpoint, and the final model and optimizer state equal those of the uninterrupted
    run bit for bit."""
    state = torchrun_with_kill(tmp_path, kill, *args)
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
    out = run_train_here("--epochs", EPOCHS, "--checkpoint-dir", str(d), "--checkpoint-every", "7", "--save-state", str(state))
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


def start_each(rank: int, world_size: int, argvs: list[list[str]]) -> list[str | None]:
    """The main job's start (``ddp.train.train``) for each of ``argvs`` in this one process: the
    ``CheckpointError`` each raised (None: it trained, which bad input must not)."""
    from ddp.checkpoint import CheckpointError
    from ddp.train import parse_args, train

    errors: list[str | None] = []
    for argv in argvs:
        try:
            train(rank, world_size, parse_args(argv))
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(300)
def test_bad_input_fails_at_start_naming_the_file_and_touches_nothing(tmp_path, checkpoints):
    """Another model, optimizer and kind, another checkpoint format, --no-resume on a directory
    holding checkpoints, a directory that is a file: the start fails, the message names the file
    and what differs, and every file on disk is as it was. The first through the command line
    (exit 1, the message on stderr), the others as the same start inside one process."""
    d = copy_of(checkpoints, tmp_path / "a", 35, 46)
    old = copy_of(checkpoints, tmp_path / "b", 35)
    manifest = old / "step-00000035" / "MANIFEST.json"
    saved = json.loads(manifest.read_text())
    saved["format"] = saved["fingerprint"]["format"] = 99
    manifest.write_text(json.dumps(saved))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    before = snapshot(tmp_path)
    out = run_train("-n", "1", "--epochs", EPOCHS, "--checkpoint-dir", str(d), "--hidden", "32", "--zero", "1", "--lr", "0.1")
    assert out.returncode == 1, out.stderr[-3000:]
    for part in (f"{d / 'step-00000046' / 'MANIFEST.json'}: this job cannot resume it: kind: saved replicated, this "
                 "job sharded; model parameters: 0.bias saved [256] here [32], 0.weight saved [256, 64] here [32, 64]",
                 "optimizer: saved {'class': 'SGD', 'param_groups': [{'lr': 0.05,",
                 "this job {'class': 'SGD', 'param_groups': [{'lr': 0.1,"):
        assert part in out.stderr, (part, out.stderr[-3000:])
    cases = {
        f"checkpoint directory {d}: holds checkpoints (newest step-00000046) and resuming was refused": ["--no-resume"],
        f"{manifest}: this job cannot resume it: checkpoint format 99 (this version reads format 1)": ["--checkpoint-dir", str(old)],
        f"checkpoint directory {blocker}: exists and is not a directory": ["--checkpoint-dir", str(blocker)],
    }
    argvs = [["--epochs", EPOCHS, "--checkpoint-dir", str(d), *args] for args in cases.values()]
    errors = collectives.launch(start_each, 1, argvs, timeout=60, join_timeout=200)[0]
    for message, error in zip(cases, errors):
        assert error is not None and message in error, (message, error)
    assert snapshot(tmp_path) == before


@pytest.mark.timeout(420)
def test_resume_at_another_world_size(tmp_path):
    """Saved by 4 ranks 3 batches into the epoch, resumed by 2: the two ranks share the epoch's
    remaining rows (1437 - 3 x 4 x 64 = 669: 6 batches each, not a whole epoch). A ZeRO-2
    checkpoint is resumed by ZeRO-3, every shard re-partitioned (4 -> 2, the parameters sharded
    too); the reference makes the same change of world size with our DDP (the replicated state).
    Both end in the same state bit for bit: at 4 ranks as at 2, DDP and every ZeRO stage step
    identically, so only a wrong re-partition can tell them apart."""
    states = []
    for name, saved_by, resumed_by in (("ddp", [], []), ("zero", ["--zero", "2"], ["--zero", "3"])):
        d, state = tmp_path / name / "ckpt", tmp_path / name / "state.pt"
        common = ["--epochs", "1", "--batch-size", "64", "--checkpoint-dir", str(d)]
        out = run_train_here("-n", "4", *common, "--checkpoint-every", "3", *saved_by)
        assert out.returncode == 0, out.stderr[-3000:]
        shutil.rmtree(d / "step-00000006")  # the end of the epoch
        out = run_train_here("-n", "2", *common, "--save-state", str(state), *resumed_by)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "resuming from " + str(d / "step-00000003") + " (step 3, saved by 4 ranks)" in out.stderr, out.stderr[-3000:]
        assert "resumed at step 3: epoch 1, 3 batches into it" in out.stderr
        assert json.loads((d / "step-00000009" / "MANIFEST.json").read_text())["world_size"] == 2
        states.append(load(state))
    assert equal(states[0], states[1])


@pytest.mark.hosts
@pytest.mark.timeout(300)
def test_two_hosts_torchrun_nnodes_2_worker_killed_on_one_host(tmp_path, reference):
    """``torchrun --nnodes 2`` (c10d rendezvous), one agent and one worker on each of two emulated
    hosts (network namespaces). SIGKILL the worker on host 1: its agent counts a restart, host 0's
    restarts its worker for the membership change without counting one; the new workers agree on
    a round of their own (``collectives.group``), resume from the checkpoint, and end bitwise
    equal to the uninterrupted run."""
    reason = hosts.unavailable()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(hosts.HostNet(hosts=2))
        agents, logs = [], []
        for host in range(2):
            env = net.rank_env(0, 1, {"OMP_NUM_THREADS": "1"})
            for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                env.pop(key)  # torchrun sets these
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.address(0)}:29400",
                    "--rdzv-id", "checkpoint-test", "--rdzv-conf", f"is_host={int(host == 0)}",
                    "--local-addr", net.address(host), *train_argv(tmp_path)]
            logs.append(tmp_path / f"host{host}.log")
            out = stack.enter_context(open(logs[-1], "w"))
            agents.append(net.popen(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        text = kill_and_finish(agents, logs, tmp_path / "ckpt", "random:1", victim_agent=1)
    assert "resuming from" in text, text[-3000:]
    starts = [re.findall(r"rank \d of 2: start (\d+) of this torchrun job's workers", log.read_text()) for log in logs]
    assert starts[0] and starts[0][-1:] == starts[1][-1:], (starts, text[-3000:])  # the last workers of both hosts: one start
    assert equal(load(tmp_path / "state.pt"), reference)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.tag not in left, left
