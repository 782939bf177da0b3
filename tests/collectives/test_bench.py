"""Smoke test of ``python -m collectives.bench``: every op at two tiny sizes, checked, JSON and PNG out."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as tdist

import collectives
from collectives import bench


@pytest.mark.timeout(180)
def test_bench_every_op_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--ops", "all", "--world-sizes", "2", "--dtypes", "float32,float16", "--min-bytes", "4K",
            "--max-bytes", "8K", "--iters", "2", "--segment-bytes", "1K", "--cpu", "--json", str(out), "--plot", str(png)]
    assert bench.main(argv) == 0

    rows = json.loads(out.read_text())
    assert {(r["op"], r["dtype"], r["bytes"]) for r in rows} == {
        (op, dtype, size) for op in bench.OPS for dtype in ("float32", "float16") for size in (4096, 8192)
    }
    for r in rows:
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["backend"] == "p2p"
        for key in ("ours_us", "ours_busbw", "torch_us", "torch_busbw", "vs_torch", "ours_cpu_ms", "torch_cpu_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["op"], key)
        has_wire = r["op"] in ("all_reduce", "reduce_scatter")
        assert math.isfinite(r["wire_busbw"]) == has_wire
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "vs torch" in table and "cpu ms" in table and table.count("all_reduce") == 4


@pytest.mark.timeout(120)
def test_bench_loop_timing_at_world_size_one(tmp_path):
    """busbw is 0 at one rank (factor (n-1)/n): the ratios are still defined (they are time ratios).
    The loop mode times ``8 MiB / size`` calls (at most 50) after untimed warm-up calls."""
    out = tmp_path / "bench.json"
    argv = ["--ops", "all_reduce,all_gather", "--world-sizes", "1", "--min-bytes", "4K", "--max-bytes", "4M",
            "--iters", "2", "--timing", "loop", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert {(r["bytes"], r["calls"], r["warmup"]) for r in rows} == {
        (4 << 10, 50, 5), (64 << 10, 50, 5), (1 << 20, 8, 5), (4 << 20, 2, 2),
        (8 << 10, 50, 5), (16 << 10, 50, 5), (32 << 10, 50, 5), (128 << 10, 50, 5), (256 << 10, 32, 5),
        (512 << 10, 16, 5), (2 << 20, 4, 4)}
    for r in rows:
        assert r["wrong"] == 0 and r["ours_busbw"] == 0 and r["timing"] == "loop"
        assert r["vs_torch"] == pytest.approx(r["torch_us"] / r["ours_us"]), r["op"]


def test_bench_rejects_gpu_mode_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the GPU mode runs instead of being refused")
    with pytest.raises(SystemExit):
        bench.main(["--backend", "nccl-cupy"])
    assert "needs CUDA" in capsys.readouterr().err


def test_bench_rejects_unknown_ops(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--ops", "all_reduce,allreduce"])
    assert "allreduce" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bench_placement_report(capsys):
    """``--placement``: where two shm ranks put on one CPU ended, and the moves; it fails only on
    what is ours (a mask left changed, a move on a stale word), never on where the scheduler put them."""
    assert bench.main(["--placement", "2"]) == 0
    out = capsys.readouterr().out
    assert "ranks apart at the end of" in out and "of 2 rounds" in out, out
    assert "rank 0 0," in out and "affinity masks as they were: yes" in out, out
    with pytest.raises(SystemExit):
        bench.main(["--placement", "0"])
    assert "ROUNDS must be at least 1" in capsys.readouterr().err


def _wrong_counts(rank, world_size):
    """#wrong of every bench op, for our collectives and for ones that write nothing."""
    reference = tdist.new_group(backend="gloo")
    names = ("all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor", "scatter", "gather",
             "all_to_all_single")  # fmt: skip
    counts = {}
    for broken in (False, True):
        saved = {name: getattr(collectives, name) for name in names}
        if broken:
            for name in names:
                setattr(collectives, name, lambda *args, **kwargs: None)
        try:
            counts[broken] = {op: bench._Case(op, torch.float32, 1024, rank, world_size, torch.device("cpu")).wrong(reference)
                              for op in bench.OPS}
        finally:
            for name, fn in saved.items():
                setattr(collectives, name, fn)
    return counts


@pytest.mark.timeout(120)
def test_bench_counts_outputs_never_written_as_wrong(pools):
    counts = pools(2).run(_wrong_counts)
    for op in bench.OPS:
        assert sum(c[False][op] for c in counts) == 0, (op, counts)
        assert sum(c[True][op] for c in counts) > 0, (op, counts)  # torch's result is not mistaken for ours


class _Peer:
    """A stand-in peer library: torch's all_reduce (right), or nothing at all (``broken``)."""

    name = "mpi"
    library = "stand-in"

    def __init__(self, group, broken):
        self.group, self.broken = group, broken

    def supports(self, op, dtype):
        return op == "all_reduce"

    def all_reduce(self, tensor):
        if not self.broken:
            tdist.all_reduce(tensor, group=self.group)


def _peer_wrong_counts(rank, world_size):
    reference = tdist.new_group(backend="gloo")
    case = bench._Case("all_reduce", torch.float32, 1024, rank, world_size, torch.device("cpu"))
    return {broken: case.wrong(reference, peers=[_Peer(reference, broken)]) for broken in (False, True)}


@pytest.mark.timeout(120)
def test_bench_checks_each_peer_result(pools):
    counts = pools(2).run(_peer_wrong_counts)
    assert sum(c[False] for c in counts) == 0 and sum(c[True] for c in counts) > 0, counts


@pytest.mark.timeout(900)  # DeepSpeed JIT-builds its op on first use: minutes on 2 busy cores
def test_bench_peer_columns(tmp_path, capsys):
    """``--peers`` (optional extra): each installed peer's all_reduce timed beside ours and checked;
    MPI's ranks started by mpiexec, DeepSpeed's shm op in the same ranks; ``--persistent``: ours
    planned once, a column beside them."""
    peers = [p for p in bench.PEERS if not bench.peer_libraries.unavailable(p)]
    if not peers:
        pytest.skip("; ".join(bench.peer_libraries.unavailable(p) for p in bench.PEERS))
    out = tmp_path / "bench.json"
    argv = ["--backend", "shm", "--peers", ",".join(peers), "--persistent", "--world-sizes", "2", "--min-bytes", "4K",
            "--max-bytes", "8K", "--timing", "loop", "--iters", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [4096, 8192]
    for r in rows:
        assert r["wrong"] == 0 and sorted(r["peers"]) == sorted(peers + ["persistent"]), r
        assert math.isfinite(r["persistent_us"]), r
        for p in peers:
            assert {"mpi": "MPI", "deepspeed": "DeepSpeed"}[p] in r["peers"][p], r
            assert math.isfinite(r[f"{p}_us"]) and r[f"ours_vs_{p}"] == r[f"{p}_us"] / r["ours_us"]
    printed = capsys.readouterr().out
    assert all(f"{p} us" in printed for p in peers), printed
    if "deepspeed" in peers:  # its segments are unlinked once mapped (DeepSpeed leaves them behind)
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_buffer") and "ringddp" in f]


def test_bench_peer_job_argv_drops_the_files_and_world_sizes():
    argv = ["--peers", "mpi", "--json", "a.json", "--world-sizes=2,4", "--plot", "p.png", "--iters", "3"]
    assert bench._without(argv, ("--json", "--plot", "--world-sizes")) == ["--peers", "mpi", "--iters", "3"]
