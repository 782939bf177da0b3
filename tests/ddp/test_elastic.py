"""ddp.elastic: members killed (SIGKILL) and stopped (SIGSTOP) from outside mid-training are
replaced, the lost steps redone, and the final parameters and optimizer state are bitwise those
of the same run without failures."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import collectives
from ddp import elastic


def _same(a: dict, b: dict) -> bool:
    """Parameters and optimizer state bitwise equal (BatchNorm's running statistics may differ
    when slot 0 lost a step another member completed: ddp/elastic.py's docstring)."""
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"] if "running_" not in k) and all(
        torch.equal(a["optimizer"]["state"][i]["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
        for i in a["optimizer"]["state"]
    )


def test_chaos_needs_progress_reports():
    with pytest.raises(ValueError, match="report_progress"):
        elastic.run(elastic.Config(), [(1, 0, signal.SIGKILL)])


@pytest.mark.timeout(400)
def test_main_job_survives_members_killed_and_stopped_from_outside(tmp_path):
    """``python -m ddp.train --fault-tolerant``: the job logs each member's pid; one is killed
    (SIGKILL) and then the other stopped (SIGSTOP) from here, by pid, while it trains; the first
    replacement also dies while it heals (a fault point: after the step all-gather, before the
    state arrives), so the next one heals; the job exits 0, says how many members it replaced
    (and the survivors how long each recovery took), and its parameters and optimizer state are bitwise those of the run without failures."""
    ref_path, path = tmp_path / "ref.pt", tmp_path / "ft.pt"
    args = [sys.executable, "-m", "ddp.train", "--fault-tolerant", "-n", "2", "--epochs", "3", "--heartbeat", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ref = subprocess.run(args + ["--save-state", str(ref_path)], capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0 and "0 members replaced" in ref.stderr, ref.stderr[-3000:]
    log_path, flag = tmp_path / "ft.log", tmp_path / "died-healing"
    with open(log_path, "w") as log:
        job = subprocess.Popen(args + ["--save-state", str(path)], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(env, RINGDDP_KILL_AT=f"heal:1:0:{flag}"), start_new_session=True)
        try:
            pids = _wait_for(log_path, r"generation 0 of elastic", lambda text: [int(p) for p in re.findall(r"slot \d: pid (\d+)", text)])
            os.kill(pids[1], signal.SIGKILL)
            # the second failure after a replacement healed: before, slot 0 holds the only copy of the state
            later = _wait_for(log_path, r"\[rank 1\] INFO ddp.elastic: generation [1-9]\d*: healed",
                              lambda text: [int(p) for p in re.findall(r"slot \d: pid (\d+)", text)])
            os.kill(later[0], signal.SIGSTOP)
            assert job.wait(timeout=300) == 0, log_path.read_text()[-4000:]
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    text = log_path.read_text()
    assert flag.exists() and "fault point: killing this process in heal" in text, text[-3000:]
    assert re.search(r"parameters identical on every rank; [3-9] members replaced", text), text[-3000:]
    assert re.search(r"recovered: step \d+ committed [\d.]+s after the failure", text), text[-3000:]
    a, b = torch.load(ref_path), torch.load(path)
    assert _same(a, b)


def _wait_for(path, pattern: str, parse, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if re.search(pattern, text):
            return parse(text)
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {timeout}s:\n{path.read_text()[-3000:]}")


@pytest.mark.timeout(400)
def test_losing_every_holder_of_the_state_fails_loudly():
    """Both members of 2 killed at the same step: their replacements hold no state. The run must
    not quietly start over from the initial model: it fails, naming what was lost. (300 steps: the
    kills land mid-run even when the launcher is starved.)"""
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=300), world_size=2, heartbeat=5.0, report_progress=True)
    with pytest.raises(collectives.LaunchError, match="every member of this generation is a replacement"):
        elastic.run(cfg, [(3, 0, signal.SIGKILL), (3, 1, signal.SIGKILL)], join_timeout=350)


@pytest.mark.timeout(400)
def test_four_members_on_p2p_lose_one_in_each_phase_and_end_bitwise_equal(tmp_path, monkeypatch):
    """Our DDP, 4 members on ``p2p`` (gloo's TCP): slot 1 dies inside an all-reduce (its 20th
    collective: a bucket's, launched from backward), slot 2 inside its optimizer step (its
    gradients all-reduced, not applied: the others commit that step without it), slot 3 is
    killed from here after step 10 and its first replacement dies while it heals, and slot 0 is
    stopped (SIGSTOP) from here after step 50, wherever it is, and found by heartbeat. Every
    loss is healed from a live member and the step redone: the final parameters and optimizer
    state are bitwise those of the same run without failures."""
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=80), world_size=4, backend="p2p", heartbeat=2.0,
                         report_progress=True)
    ref = elastic.run(cfg, join_timeout=300)
    flags = [tmp_path / name for name in ("collective", "step", "heal")]
    monkeypatch.setenv("RINGDDP_KILL_AT", f"collective:20:1:{flags[0]},step:35:2:{flags[1]},heal:1:3:{flags[2]}")
    out = elastic.run(cfg, [(10, 3, signal.SIGKILL), (50, 0, signal.SIGSTOP)], join_timeout=300)
    assert all(f.exists() for f in flags) and out.recoveries >= 5, out.events
    assert any("sent SIGSTOP to slot 0" in e for e in out.events), out.events
    for outcome in (ref, out):
        assert all(r["identical"] and r["steps"] == 80 for r in outcome.reports.values()), outcome.reports
    assert _params_equal(ref.reports[0], out.reports[0])


@dataclasses.dataclass(frozen=True)
class _SlotOneDiesAtOnce(elastic.SyntheticJob):
    """Every process that trains slot 1 exits at its first batch (a member that cannot start)."""

    def batch(self, step: int, slot: int, world_size: int):
        if slot == 1:
            os._exit(7)
        return super().batch(step, slot, world_size)


@pytest.mark.timeout(300)
def test_a_slot_whose_processes_die_as_they_start_fails_the_run_after_three():
    """A replacement that dies before its first committed step, like the member it replaced, is
    not replaced without end: the third process in a row fails the run, naming the slot."""
    cfg = elastic.Config(job=_SlotOneDiesAtOnce(steps=50), world_size=2, heartbeat=5.0)
    t0 = time.monotonic()
    with pytest.raises(collectives.LaunchError, match=r"3 processes of slot 1 in a row died before committing a step .*exit 7"):
        elastic.run(cfg, join_timeout=250)
    assert time.monotonic() - t0 < 200  # not the join timeout


def _params_equal(a: dict, b: dict) -> bool:
    """Parameters and optimizer state of two reports of :func:`ddp.elastic.run` bitwise equal."""
    return _same({"model": a["state"], "optimizer": a["optimizer"]}, {"model": b["state"], "optimizer": b["optimizer"]})


@pytest.mark.timeout(300)
def test_warm_spare_takes_a_slot_then_the_rest_shrink_and_replay_bitwise_from_their_schedule():
    """Three members, one warm spare, at most one replacement, shrink mode. Slot 1 is killed: the
    spare (which built its model and connected beforehand) takes the slot. Slot 2 is killed: no
    replacement is left, so slots 0 and 1 go on as a world of 2, sharing the rest of the epoch.
    Every row is trained on once in the epoch (the only repeats are the sampler's padding of the
    last step), and a run without failures that applies the same membership schedule (slot 2
    leaves at the same step) ends bitwise equal: the spare's healing left no trace either."""
    job = elastic.SyntheticJob(epochs=1, size=2000, batch_size=8)  # 84 steps: the kills after 4 and 10 land mid-run
    cfg = elastic.Config(job=job, world_size=3, heartbeat=5.0, spares=1, max_respawns=1, shrink=True,
                         respawn_wait=0.5, report_progress=True)
    out = elastic.run(cfg, [(4, 1, signal.SIGKILL), (10, 2, signal.SIGKILL)])
    assert sorted(out.reports) == [0, 1] and out.recoveries == 1, out.events
    assert out.reports[1]["spare"] and not out.reports[0]["spare"], out.events  # the spare took slot 1
    history = out.reports[0]["history"]
    assert len(history) == 2 and history[0] == (0, (0, 1, 2)) and history[1][1] == (0, 1), history
    _assert_each_row_once(job, history, out.reports[0]["steps"])
    ref = elastic.run(elastic.Config(job=job, world_size=3, heartbeat=5.0, shrink=True, schedule=tuple(history)))
    assert ref.reports[2]["left_at"] == history[1][0] and ref.reports[0]["history"] == history
    assert _params_equal(ref.reports[0], out.reports[0])


@pytest.mark.timeout(400)
def test_zero_shrinks_to_one_member_cutting_the_shards_again_and_replays_bitwise():
    """ZeRO-2 at 3 members, no replacements, shrink mode: slot 1 and then slot 2 are killed. Each
    time the survivors cut the optimizer shards again for the smaller world, slot 1's shard from
    slot 0's replica, then slot 2's from slot 0's replica of it (ddp.zero.replica.reshard), and
    go on; the last member trains alone. No row of the epoch is lost or repeated, a run without
    failures that applies the same membership schedule ends bitwise equal, and our DDP on that
    schedule ends within float32 rounding (a shard cut wrong would not)."""
    job = elastic.SyntheticJob(epochs=1, size=1200, batch_size=8)  # 50 steps at 3, ...: the kills land mid-run
    cfg = elastic.Config(job=job, world_size=3, zero=2, heartbeat=5.0, max_respawns=0, shrink=True, respawn_wait=0.5,
                         report_progress=True)
    out = elastic.run(cfg, [(4, 1, signal.SIGKILL), (12, 2, signal.SIGKILL)], join_timeout=300)
    assert sorted(out.reports) == [0] and out.recoveries == 0 and out.reports[0]["identical"], out.events
    history = out.reports[0]["history"]
    assert [slots for _, slots in history] == [(0, 1, 2), (0, 2), (0,)], history
    _assert_each_row_once(job, history, out.reports[0]["steps"])
    ref = elastic.run(dataclasses.replace(cfg, report_progress=False, schedule=tuple(history)), join_timeout=300)
    assert ref.reports[0]["history"] == history and all(r["identical"] for r in ref.reports.values())
    assert _same(*({"model": o.reports[0]["state"], "optimizer": o.reports[0]["optimizer"]} for o in (ref, out)))
    # and the shards were cut right: DDP on the same schedule (sums in another order: not bitwise)
    plain = elastic.run(dataclasses.replace(cfg, zero=0, report_progress=False, schedule=tuple(history)), join_timeout=300)
    for k, v in plain.reports[0]["state"].items():
        torch.testing.assert_close(out.reports[0]["state"][k], v, rtol=1e-4, atol=1e-5)  # a wrong cut: ~0.5 off


def _assert_each_row_once(job: elastic.SyntheticJob, history: list, steps: int) -> None:
    """Walk the epoch as the membership ``history`` says: the run took ``steps`` steps, and every
    row was trained on once (the only repeats are the sampler's padding of the last step)."""
    from data import DistributedSampler

    seen, start, step, rows = [], 0, 0, job.rows()
    while start < rows:
        slots = [k for s, k in history if s <= step][-1]
        for rank in range(len(slots)):
            sampler = DistributedSampler(range(rows), num_replicas=len(slots), rank=rank, seed=0)
            sampler.set_epoch(0, start=start)
            seen += sampler.indices()[: job.batch_size].tolist()
        start, step = start + job.batch_size * len(slots), step + 1
    assert steps == step
    assert sorted(set(seen)) == list(range(rows)) and len(seen) - rows < len(history[-1][1])


def test_zero_3_and_world_size_1_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="ZeRO-3 .*use zero=2"):
        elastic.Config(zero=3)
    with pytest.raises(ValueError, match="world_size >= 2"):
        elastic.Config(zero=1, world_size=1)
    from ddp import train

    with pytest.raises(SystemExit):
        train.parse_args(["--fault-tolerant", "--zero", "3"])


@pytest.mark.timeout(400)
def test_zero_heals_killed_members_shards_from_their_replicas(tmp_path, monkeypatch):
    """ZeRO-2 at 3 members on shm: slot 1 kills itself inside its optimizer update of step 3,
    after the others applied theirs (nobody commits that step: they roll it back), its first
    replacement dies while it heals (a fault point: after the members' states were gathered,
    before any shard moved), and slot 2 is killed by SIGKILL from here after step 8, wherever it
    is. Each replacement that lives gets its optimizer
    shard from its left neighbour's replica and its replica duty from its right neighbour, the
    step is redone, and the final parameters and optimizer state are bitwise those of ZeRO-1
    without failures (ZeRO-1 and 2 compute the same numbers: one launch less than a reference
    of each). Every member also checked that each replica equals its owner's shard (``identical``)."""
    # 60 steps: the kill after step 8 must land while slot 2 still trains (a step takes ~10 ms, the
    # launcher polls every 50 ms; with 12 steps slot 2 had finished when the signal came)
    cfg = elastic.Config(job=elastic.SyntheticJob(steps=60), world_size=3, zero=1, heartbeat=5.0, report_progress=True)
    ref = elastic.run(cfg, join_timeout=300)
    flag, crashed = tmp_path / "died-healing", tmp_path / "died-updating"
    # the members inherit it; a member's fault-point rank is its slot
    monkeypatch.setenv("RINGDDP_KILL_AT", f"step:4:1:{crashed},heal:1:1:{flag}")
    out = elastic.run(dataclasses.replace(cfg, zero=2), [(8, 2, signal.SIGKILL)], join_timeout=300)
    assert out.recoveries >= 3 and flag.exists() and crashed.exists(), out.events
    assert sum(r["undone"] for r in out.reports.values()) >= 1, out.reports
    for outcome in (ref, out):
        assert all(r["identical"] and r["steps"] == 60 for r in outcome.reports.values()), outcome.reports
    a, b = ({"model": o.reports[0]["state"], "optimizer": o.reports[0]["optimizer"]} for o in (ref, out))
    assert all("running_" not in k for k in a["model"]) and _same(a, b)
