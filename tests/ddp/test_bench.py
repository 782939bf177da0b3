"""Smoke test of ``python -m ddp.bench``: a tiny model, two ranks, a few steps, JSON and table out."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from ddp import bench


@pytest.mark.timeout(120)
def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "ddp_bench.json"
    png = tmp_path / "ddp_bench.png"
    argv = [
        "--world-size", "2", "--width", "64", "--layers", "2", "--batch", "8",
        "--bucket-mb", "25,0", "--warmup", "1", "--rounds", "2", "--steps", "2",
        "--timeout", "60", "--quiet", "--json", str(out), "--plot", str(png),
    ]  # fmt: skip
    assert bench.main(argv) == 0

    summary = json.loads(out.read_text())
    rows = {r["name"]: r for r in summary["rows"]}
    assert set(rows) == {"torch DDP", "torch DDP ringddp", "torch DDP ringddp adopt", "torch FSDP2", "torch FSDP2 ringddp",
                         "ours 25 MB", "ours 0 MB", "local (no comm)"}
    assert summary["params"] == 2 * (64 * 64 + 64)
    assert summary["allocator"] == summary["config"]["allocator"] == "steady"
    for row in rows.values():
        assert row["steps"] == 4  # 2 timed rounds x 2 steps
        for key in ("step_ms", "forward_ms", "backward_ms", "optim_ms", "speed_vs_torch"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert row["step_min_ms"] <= row["step_ms"] <= row["step_max_ms"]
    for name in ("torch DDP", "torch DDP ringddp", "torch DDP ringddp adopt", "torch FSDP2", "torch FSDP2 ringddp",
                 "ours 25 MB", "ours 0 MB"):
        assert rows[name]["in_sync"], name
    assert rows["torch DDP"]["speed_vs_torch"] == pytest.approx(1.0)
    assert rows["torch FSDP2"]["speed_vs_torch"] == pytest.approx(1.0)  # the FSDP2 rows compare with each other
    assert rows["torch FSDP2 ringddp"]["speed_vs_torch"] == pytest.approx(
        rows["torch FSDP2"]["step_ms"] / rows["torch FSDP2 ringddp"]["step_ms"])
    # torch's DDP over ringddp hands our collectives every gradient once (measured by tracing)
    assert rows["torch DDP ringddp"]["comm_mib"] == pytest.approx(rows["torch DDP"]["comm_mib"])
    for name in ("gloo", "ringddp", "gloo C++", "ringddp C++", "ours"):
        for case in bench.ASYNC_CASES:
            assert 0 < summary["async_return_us"][name][f"{case}_us"] < 1e6, (name, case)
    passes, per_step = summary["passes_ms"], summary["step_passes_ms"]
    assert set(passes) == {f"{k}_ms" for k in bench.GRADIENT_PASSES} and all(0 < v < 1e4 for v in passes.values())
    assert per_step == pytest.approx(bench.step_passes_ms(passes, 2))
    assert 0 < per_step["ours"] < per_step["torch DDP ringddp"] and per_step["torch DDP ringddp adopt"] < per_step["torch DDP ringddp"]
    assert rows["torch DDP"]["comm_vs_torch"] in (None, pytest.approx(1.0))  # None: torch no slower than local
    assert rows["local (no comm)"]["comm_ms"] is None
    for name in ("torch DDP", "ours 25 MB"):
        assert rows[name]["comm_ms"] == pytest.approx(rows[name]["step_ms"] - rows["local (no comm)"]["step_ms"])
    # Our rows carry the reducer's statistics: 25 MB holds the whole model, 0 MB one bucket per tensor.
    assert rows["ours 25 MB"]["buckets"] == 1
    assert rows["ours 0 MB"]["buckets"] == 4
    for name in ("ours 25 MB", "ours 0 MB"):
        r = rows[name]
        assert r["wait_ms"] >= 0
        assert 0 <= r["launched_during_backward"] <= r["buckets"]
    assert rows["torch DDP"]["wait_ms"] is None and rows["local (no comm)"]["wait_ms"] is None
    assert png.stat().st_size > 0

    table = capsys.readouterr().out
    for name in rows:
        assert name in table
    assert "vs torch" in table and "steady allocator" in table
    assert bench.format_passes(summary) in table


def test_step_passes_count_what_each_row_moves():
    passes = {"copy_ms": 2.0, "scale_ms": 3.0, "add_ms": 4.0}
    # 2 ranks: ours copies the fresh gradients in, adds and copies half, divides half; torch's
    # reducer scales in and copies out all of it, and the two-shot copies half in, adds half,
    # copies it back and half out; adopted, its buckets are read in place (add and copy half).
    assert bench.step_passes_ms(passes, 2) == {
        "ours": 2 + 0.5 * (4 + 2) + 3 / 2, "torch DDP ringddp": 3 + 2 + 0.5 * (4 + 4) + 2 / 2,
        "torch DDP ringddp adopt": 3 + 2 + 0.5 * (4 + 2),
    }  # fmt: skip
    assert bench.step_passes_ms(passes, 4)["ours"] == pytest.approx(2 + 0.75 * 6 + 0.75)


@pytest.mark.timeout(120)
def test_bench_grad_view_stays_in_sync(tmp_path):
    out = tmp_path / "view.json"
    argv = [
        "--world-size", "2", "--width", "32", "--layers", "2", "--batch", "4", "--grad-view",
        "--warmup", "0", "--rounds", "1", "--steps", "2", "--timeout", "60", "--quiet", "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["config"]["grad_view"] is True
    assert all(r["in_sync"] for r in summary["rows"] if r["kind"] != "local")


def test_bucket_list_parsing():
    assert bench._parse_mb_list("25,5,inf") == (25.0, 5.0, math.inf)
    with pytest.raises(Exception):
        bench._parse_mb_list("25,-1")


@pytest.mark.timeout(120)
def test_bench_comm_hooks_halve_the_bytes(tmp_path):
    out = tmp_path / "hooks.json"
    argv = [
        "--world-size", "2", "--width", "64", "--layers", "2", "--batch", "8", "--comm-hook", "none,fp16,bf16",
        "--torch-stacks", "ddp-ringddp,ddp-ringddp-adopt",
        "--warmup", "0", "--rounds", "1", "--steps", "1", "--timeout", "60", "--quiet", "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    grad_mib = 2 * (64 * 64 + 64) * 4 / 2**20
    # ours measured (traced step), torch computed: one float32 all-reduce of every gradient, or half
    for name in ("ours 25 MB", "torch DDP", "torch DDP ringddp", "torch DDP ringddp adopt"):
        assert rows[name]["comm_mib"] == pytest.approx(grad_mib)
        assert rows[name]["in_sync"], name
    for hook in ("fp16", "bf16"):
        for name in (f"ours 25 MB {hook}", f"torch DDP {hook}", f"torch DDP ringddp {hook}", f"torch DDP ringddp adopt {hook}"):
            assert rows[name]["comm_mib"] == pytest.approx(grad_mib / 2), name
            assert rows[name]["in_sync"], name
        assert rows[f"torch DDP {hook}"]["speed_vs_torch"] == pytest.approx(1.0)


def test_comm_hook_list_parsing():
    assert bench._parse_hooks("none,fp16,fp16") == ("none", "fp16")
    with pytest.raises(Exception):
        bench._parse_hooks("none,zip")
    assert bench._parse_stacks("none") == () and bench._parse_stacks("fsdp2") == ("fsdp2",)
    with pytest.raises(Exception):
        bench._parse_stacks("ddp,zero")


@pytest.mark.timeout(180)
def test_bench_zero_rows_traffic_and_memory(tmp_path, capsys):
    out = tmp_path / "zero.json"
    argv = [
        "--world-size", "2", "--width", "64", "--layers", "2", "--batch", "8", "--zero", "1,2,3", "--optimizer", "adam",
        "--warmup", "0", "--rounds", "1", "--steps", "1", "--timeout", "60", "--quiet", "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) >= {"ours ZeRO-1", "ours ZeRO-2", "ours ZeRO-3", "torch ZeRO-1", "torch FSDP2 ZeRO-2", "torch FSDP2"}
    mib = 2 * (64 * 64 + 64) * 4 / 2**20  # parameter bytes
    sent = {name: rows[name]["sent_mib"] / mib for name in rows if rows[name]["sent_mib"] is not None}
    # the seed's table on a ring of 2: DDP, ZeRO-1 and ZeRO-2 send 2(n-1)/n = 1 x the parameters, ZeRO-3 1.5 x
    for name in ("ours 25 MB", "ours ZeRO-1", "ours ZeRO-2", "torch DDP", "torch FSDP2 ZeRO-2"):
        assert sent[name] == pytest.approx(1.0, rel=1e-3), name
    for name in ("ours ZeRO-3", "torch FSDP2", "torch ZeRO-1"):  # torch's ZeRO-1 broadcasts on top of DDP
        assert sent[name] == pytest.approx(1.5, rel=1e-3), name
    memory = {name: rows[name]["memory_mib"] for name in rows}
    for stage in (1, 2, 3):  # Adam's two moments: half of DDP's at 2 ranks (+ step counters)
        assert memory[f"ours ZeRO-{stage}"]["optimizer"] <= memory["ours 25 MB"]["optimizer"] / 2 * 1.05
    assert memory["ours ZeRO-2"]["grads"] == pytest.approx(mib / 2) and memory["ours ZeRO-3"]["params"] == pytest.approx(mib / 2)
    assert all(r["in_sync"] for r in rows.values() if r["kind"] != "local")
    assert rows["ours ZeRO-3"]["vs_ddp"] > 0 and rows["torch FSDP2"]["speed_vs_torch"] == pytest.approx(1.0)
    assert "sent MB" in capsys.readouterr().out


_ALLOCATE_TWICE = """
import resource, sys, torch
from ddp.bench import keep_freed_memory
if sys.argv[1] == "steady":
    assert keep_freed_memory()
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(16 << 20)  # 64 MiB, every page written
    del t
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("allocator", ["steady", "default"])
def test_steady_allocator_maps_a_freed_tensor_once(allocator):
    """--allocator steady: 64 MiB allocated and freed again and again stops costing page faults
    once the heap holds it (glibc places it in two alternating spots, so after two or three
    rounds); glibc as it comes maps it and faults it in anew every time. In a process of its own."""
    done = subprocess.run([sys.executable, "-c", _ALLOCATE_TWICE, allocator], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    faults = [int(line) for line in done.stdout.split()]
    pages = (64 << 20) // 4096
    assert faults[0] >= pages // 2
    if allocator == "steady":
        assert max(faults[3:]) < pages // 64, faults
    else:
        assert min(faults) >= pages // 2, faults
