"""What whole-job checkpoints cost (:mod:`ddp.checkpoint`): the stall of a step, the overhead, the
restart time under torchrun.

    python -m ddp.bench_checkpoint                      # stall and overhead: ddp.bench's model, 2 ranks
    python -m ddp.bench_checkpoint --restarts 10        # also: kill to resumed training, under torchrun
    python -m ddp.bench_checkpoint --json ckpt.json

**Stall.** Every rank trains ``ddp.bench``'s MLP (``--layers`` x ``--width``, SGD with momentum)
under our DDP and times its steps: ``--steps`` without a checkpoint (the median is the step
time), then ``--saves`` checkpoints written synchronously (``Checkpointer(background=False)``:
copy, serialise, write, fsync, rank 0's manifest and rename; timed from the call to its return),
then as many in the background, each followed by steps until its write is done. A background
checkpoint holds training up by the ``save`` call (the copy of the state) plus whatever the steps
during its write lose to it (their time above the median step); both are reported, per
checkpoint, as medians. The disk's speed: the checkpoint's bytes written with one ``write`` and
``fsync`` on their own. **Overhead** at ``--checkpoint-every S``: the stall over ``S`` steps.

**Restart.** ``--restarts N`` runs the main job (``ddp.train``) under ``torchrun --max-restarts N``
with checkpoints, and SIGKILLs a worker N times, each time once the job has resumed and written a
new checkpoint; the time from the kill to the log line of the resumed job (``resumed at step``:
the state is loaded and the next step starts) is reported, median and range.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import collectives

from .bench import make_model
from .checkpoint import Checkpointer, fingerprint
from .distributed import DistributedDataParallel

log = logging.getLogger("ddp.bench_checkpoint")


def _bench_rank(rank: int, world_size: int, a: argparse.Namespace, directory: str) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(a.seed)
    model = DistributedDataParallel(make_model(a.width, a.layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(a.batch, a.width), torch.randint(0, a.width, (a.batch,))

    def step() -> float:
        t = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t

    for _ in range(3):
        step()
    base = statistics.median(step() for _ in range(a.steps))
    out: dict[str, Any] = {"step_s": base, "sync_s": [], "call_s": [], "held_s": [], "cpu_s": [], "write_s": [], "write_steps": []}
    sync = Checkpointer(os.path.join(directory, "sync"), keep=1, background=False, timeout=300)
    sync.prepare(fingerprint(model, optimizer), resume=False)
    for i in range(a.saves):
        collectives.barrier()
        t = time.perf_counter()
        sync.save(i + 1, model, optimizer)
        out["sync_s"].append(time.perf_counter() - t)
    background = Checkpointer(os.path.join(directory, "background"), keep=1, timeout=300)
    background.prepare(fingerprint(model, optimizer), resume=False)
    for i in range(a.saves):
        collectives.barrier()
        held = background.held_s
        t = time.perf_counter()
        background.save(i + 1, model, optimizer)
        out["call_s"].append(time.perf_counter() - t)
        steps = 0
        while True:  # every rank steps until every rank's write is done (one flag, all-reduced)
            step()
            steps += 1
            busy = torch.tensor([background.writing()], dtype=torch.int32)
            collectives.all_reduce(busy)
            if not busy.item():
                break
        background.wait()
        out["held_s"].append(background.held_s - held)  # the next optimizer step waiting for the copy
        out["write_s"].append(time.perf_counter() - t)
        out["cpu_s"].append(background.write_cpu_s)
        out["write_steps"].append(steps)
    if rank == 0:
        files = [os.path.join(sync.path(a.saves), f) for f in os.listdir(sync.path(a.saves))]
        out["bytes"] = sum(os.path.getsize(f) for f in files)
        out["disk_mb_s"] = _disk_speed(directory, out["bytes"])
    return out


def _disk_speed(directory: str, nbytes: int) -> float:
    data = os.urandom(min(nbytes, 1 << 20)) * max(1, nbytes >> 20)
    path = os.path.join(directory, "speed.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t
    os.unlink(path)
    return len(data) / seconds / 1e6


def bench_stall(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=a.dir) as d:
        per_rank = collectives.launch(_bench_rank, a.world_size, a, d, timeout=300)
    r0 = per_rank[0]
    step = max(r["step_s"] for r in per_rank)
    sync = statistics.median(max(r["sync_s"][i] for r in per_rank) for i in range(a.saves))
    later = range(1, a.saves)  # the first background save allocates its staging copies; later ones reuse them

    def median(key: str, saves: range = range(a.saves)) -> float:
        return statistics.median(max(r[key][i] for r in per_rank) for i in saves)

    stall = statistics.median(max(r["call_s"][i] + r["held_s"][i] for r in per_rank) for i in later)
    call, cpu = median("call_s", later), median("cpu_s", later)
    return {
        "world_size": a.world_size, "model": f"{a.layers} x {a.width} MLP", "bytes": r0["bytes"], "disk_mb_s": r0["disk_mb_s"],
        "step_ms": 1e3 * step, "sync_write_ms": 1e3 * sync, "save_call_ms": 1e3 * call, "stall_ms": 1e3 * stall, "stall_over_sync": stall / sync, "write_cpu_ms": 1e3 * cpu,
        "write_wall_ms": 1e3 * median("write_s", later), "steps_during_write": median("write_steps", later),
        "every": a.every, "overhead": stall / (a.every * step), "overhead_with_write_cpu": (stall + cpu) / (a.every * step),
    }


def bench_restart(a: argparse.Namespace) -> dict[str, Any]:
    """Kill a worker ``a.restarts`` times under torchrun; seconds from each kill to ``resumed at``."""
    with tempfile.TemporaryDirectory(prefix="ckpt-restart-", dir=a.dir) as d:
        logfile = Path(d) / "job.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.world_size),
               "--max-restarts", str(a.restarts), "-m", "ddp.train", "--epochs", "1000", "--checkpoint-dir",
               os.path.join(d, "ckpt"), "--checkpoint-every", "5", "--keep", "2"]
        times: list[float] = []
        with open(logfile, "w") as out:
            job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                for _ in range(a.restarts):
                    _wait_for(logfile, len(times), job)
                    t = time.monotonic()
                    victim = _worker(job.pid)
                    os.kill(victim, signal.SIGKILL)
                    _wait_for(logfile, len(times) + 1, job, resumed=True)
                    times.append(time.monotonic() - t)
                    log.info("restart %d: %.2f s from the kill to resumed training", len(times), times[-1])
            finally:
                job.terminate()  # torchrun stops its workers (each in a session of its own) before it exits
                try:
                    job.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    for task in os.listdir(f"/proc/{job.pid}/task"):
                        for child in Path(f"/proc/{job.pid}/task/{task}/children").read_text().split():
                            os.kill(int(child), signal.SIGKILL)
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
    return {"restarts": len(times), "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _wait_for(logfile: Path, count: int, job: subprocess.Popen, resumed: bool = False) -> None:
    """Until the log shows ``count`` resumes (and, unless ``resumed``, a checkpoint written after)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise RuntimeError(f"the job exited ({job.returncode}):\n{logfile.read_text()[-3000:]}")
        text = logfile.read_text()
        seen = len(re.findall(r"\[rank 0\] INFO ddp.train: resumed at step", text))
        if seen >= count and (resumed or _checkpoints_after(text, count)):
            return
        time.sleep(0.002)
    raise TimeoutError(f"no resume {count} in the log:\n{logfile.read_text()[-3000:]}")


def _checkpoints_after(text: str, count: int) -> bool:
    marker = [m.end() for m in re.finditer(r"\[rank 0\] INFO ddp.train: resumed at step", text)]
    rest = text[marker[count - 1]:] if count else text
    return "epoch " in rest  # an epoch logged since: training runs (and checkpoints every 5 steps)


def _worker(pid: int) -> int:
    for task in os.listdir(f"/proc/{pid}/task"):
        children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        if children:
            return int(children[-1])
    raise RuntimeError("torchrun has no worker")


def format_summary(summary: dict[str, Any]) -> str:
    """The measurements as lines of text (what the bench prints; ``scripts/benchmarks.py`` renders
    its stored JSON with this too)."""
    lines = []
    if "stall" in summary:
        s = summary["stall"]
        lines += [
            f"checkpoint of {s['model']} at {s['world_size']} ranks: {s['bytes'] / 2**20:.1f} MiB "
            f"(disk: {s['disk_mb_s']:.0f} MB/s with fsync)",
            f"  step {s['step_ms']:.1f} ms; synchronous checkpoint {s['sync_write_ms']:.1f} ms",
            f"  background: the step is held {s['stall_ms']:.1f} ms (save() {s['save_call_ms']:.1f} ms, the next optimizer "
            f"step's wait for the copy the rest): {100 * s['stall_over_sync']:.1f} % of the synchronous write; the write "
            f"then takes {s['write_wall_ms']:.0f} ms ({s['steps_during_write']:g} steps) and {s['write_cpu_ms']:.0f} ms "
            f"of CPU, at nice 19 after the copy",
            f"  overhead at --checkpoint-every {s['every']}: {100 * s['overhead']:.2f} % of the step "
            f"({100 * s['overhead_with_write_cpu']:.2f} % counting all the write's CPU as lost)",
        ]
    if "restart" in summary:
        r = summary["restart"]
        lines.append(f"restart under torchrun, kill to resumed training: median {r['median_s']:.2f} s of {r['restarts']} "
                     f"({r['min_s']:.2f} .. {r['max_s']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringddp-bench-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps without a checkpoint (default 10)")
    p.add_argument("--saves", type=int, default=5, help="checkpoints of each kind (default 5; 0: no stall measurement)")
    p.add_argument("--every", type=int, default=50, help="the --checkpoint-every the overhead is for (default 50)")
    p.add_argument("--restarts", type=int, default=0, help="kills under torchrun to time (default 0: none)")
    p.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary: dict[str, Any] = {}
    if a.saves:
        summary["stall"] = bench_stall(a)
    if a.restarts:
        summary["restart"] = bench_restart(a)
    log.info("%s", format_summary(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
