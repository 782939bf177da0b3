"""The main job, run as a user would: ``python -m ddp.train`` (or its ``main`` in this process)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

import pytest


def run_train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ddp.train", *args], capture_output=True, text=True, timeout=240, env=env)


def run_train_here(*args: str) -> subprocess.CompletedProcess:
    """What :func:`run_train` returns, with the launcher (``ddp.train.main``) in this process. The
    ranks are still processes of their own, forked from this session's warm forkserver: a run
    costs no interpreter start and no torch import. ``stderr``: the launcher's log and argparse's
    messages, then what the ranks wrote."""
    from ddp.train import main

    text, root, saved_env = io.StringIO(), logging.getLogger(), os.environ.get("OMP_NUM_THREADS")
    handler, level, saved_fd = logging.StreamHandler(text), root.level, os.dup(2)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryFile() as ranks:
        os.dup2(ranks.fileno(), 2)  # the ranks get this process's stderr as of their start
        try:
            with contextlib.redirect_stderr(text):
                code = main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            root.removeHandler(handler)
            root.setLevel(level)
            if saved_env is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved_env
        ranks.seek(0)
        stderr = text.getvalue() + ranks.read().decode(errors="replace")
    return subprocess.CompletedProcess(["ddp.train", *args], code, "", stderr)


def final_accuracy(out: subprocess.CompletedProcess) -> float:
    found = re.search(r"parameters identical on every rank; final test accuracy ([\d.]+)%", out.stderr)
    assert found, out.stderr[-3000:]
    return float(found.group(1))


@pytest.mark.timeout(300)
def test_default_job_trains_and_writes_trace_and_plot(tmp_path):
    trace_path, plot_path = tmp_path / "trace.json", tmp_path / "loss.png"
    out = run_train("--epochs", "4", "--trace", str(trace_path), "--plot", str(plot_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert final_accuracy(out) > 90.0
    assert "bucket layout" in out.stderr and "epoch  4/4" in out.stderr
    assert "done: 2 ranks, bucketed DDP, sampler data, shm backend (auto): trained 4 epochs in" in out.stderr
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {e["name"] for e in spans}
    assert {"forward", "backward", "backward (gradient hooks)", "wait for buckets", "optimizer step"} <= names
    assert "all_reduce bucket 0" in names and "all_reduce bucket 3" in names
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"compute (main thread)", "communication (world)"}
    bucket = next(e for e in spans if e["name"] == "all_reduce bucket 0")
    assert bucket["args"]["bytes"] > 0 and bucket["dur"] > 0


@pytest.mark.timeout(300)
def test_naive_scatter_accumulation_on_three_ranks():
    out = run_train_here("--epochs", "2", "-n", "3", "--naive", "--data", "scatter", "--accum", "2", "--backend", "p2p")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 3 ranks, naive DDP, scatter data, p2p backend: trained 2 epochs" in out.stderr
    assert final_accuracy(out) > 70.0


@pytest.mark.timeout(300)
def test_torch_ddp_on_the_ringddp_backend_trains_like_ours():
    """--torch-ddp: torch's own DistributedDataParallel, on backend "ringddp". Same data, seed and
    updates at two ranks, so the same losses as our DDP (a sum of two floats has one rounding)."""
    ours, torchs = run_train_here("--epochs", "2"), run_train_here("--epochs", "2", "--torch-ddp")
    assert torchs.returncode == 0, torchs.stderr[-3000:]
    assert "done: 2 ranks, torch's DDP, sampler data, shm backend (auto):" in torchs.stderr
    assert final_accuracy(torchs) == final_accuracy(ours) and _losses(torchs) == _losses(ours)


def test_plot_title_and_last_line_name_what_ran():
    """The title names the mode (stage, torch's DDP, naive), the data mode and the backend that ran
    (with the one asked for where they differ); the last line counts epochs in English."""
    from ddp.train import done_message, parse_args, plot_title

    def title(args: str, backend: str, world_size: int = 2) -> str:
        return plot_title(parse_args(args.split()), world_size, backend)

    assert title("--zero 2 -n 3 --data scatter", "shm", 3) == (
        "digits: 3 ranks, ZeRO-2, scatter data, shm backend (auto)\n0.05 MB buckets")
    assert title("--torch-ddp --bucket-mb 1", "shm") == "digits: 2 ranks, torch's DDP, sampler data, shm backend (auto)\n1 MB buckets"
    assert title("--naive --accum 2 --backend gloo", "p2p") == (
        "digits: 2 ranks, naive DDP, sampler data, p2p backend\ngradients all-reduced after backward, 2 micro-batches per step")
    assert title("--zero 3 --backend shm", "p2p", 1) == (  # shm found no shared memory and fell back
        "digits: 1 rank, ZeRO-3, sampler data, p2p backend (shm)\none unit per module")
    assert title("", "shm").startswith("digits: 2 ranks, bucketed DDP, sampler data, shm backend (auto)\n")
    one = {"run": "2 ranks", "epochs": [{}], "seconds": 0.25, "final_test_accuracy": 0.9}
    assert done_message(one).startswith("done: 2 ranks: trained 1 epoch in 0.2s;")
    assert "trained 3 epochs" in done_message(dict(one, epochs=[{}] * 3))


@pytest.mark.parametrize("epochs", [1, 3, 40])
def test_curve_has_whole_epoch_ticks_and_nothing_overlapping(epochs):
    """``--plot``'s figure: the title given, ticks on whole epochs within the run, and the legend,
    title and axis labels each clear of the others and of the axes (one epoch: both points apart)."""
    from ddp.train import curve_figure

    rows = [{"epoch": e, "loss": 1.5 / e, "test_accuracy": 0.9 + 0.05 * (e > 1)} for e in range(1, epochs + 1)]
    fig = curve_figure(rows, "digits: a title\nits second line")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax, twin = fig.axes
    assert ax.get_title() == "digits: a title\nits second line"
    ticks = [t for t in ax.get_xticks() if 0.5 <= t <= epochs + 0.5]
    assert ticks and all(t == int(t) and 1 <= t <= epochs for t in ticks), ticks
    boxes = {"legend": fig.legends[0].get_window_extent(renderer), "title": ax.title.get_window_extent(renderer),
             "axes": ax.get_window_extent(renderer)}
    for name, label in (("x label", ax.xaxis.label), ("loss label", ax.yaxis.label), ("accuracy label", twin.yaxis.label)):
        boxes[name] = label.get_window_extent(renderer)
    names = sorted(boxes)
    clashes = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if boxes[a].overlaps(boxes[b])]
    assert not clashes, clashes
    assert all(fig.bbox.contains(*box.min) and fig.bbox.contains(*box.max) for box in boxes.values()), boxes
    if epochs == 1:  # the two single points must not hide each other
        loss_at = ax.transData.transform((1, rows[0]["loss"]))
        accuracy_at = twin.transData.transform((1, 100 * rows[0]["test_accuracy"]))
        assert abs(loss_at[1] - accuracy_at[1]) > 20, (loss_at, accuracy_at)


def test_bad_arguments_are_rejected():
    out = run_train_here("--world-size", "0")
    assert out.returncode == 2 and "--world-size" in out.stderr
    out = run_train_here("--naive", "--zero", "2")
    assert out.returncode == 2 and "--zero" in out.stderr
    out = run_train_here("--fault-tolerant", "--spares", "-1")
    assert out.returncode == 2 and "--spares" in out.stderr
    out = run_train_here("--shrink", "--zero", "1")
    assert out.returncode == 2 and "go with --fault-tolerant" in out.stderr


@pytest.mark.timeout(300)
def test_zero3_job_trains_and_prints_memory_per_rank():
    out = run_train_here("--epochs", "2", "--zero", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unit layout (4 units" in out.stderr and "done: 2 ranks, ZeRO-3, sampler data, shm backend (auto):" in out.stderr
    table = out.stderr.split("memory per rank after the last step, ZeRO-3")[1].splitlines()[1:4]
    assert table[0].split() == ["rank", "parameters", "gradients", "optimizer", "state"]
    # 85,514 float32 parameters (334 KiB); each rank holds its half of them, of their gradients
    # and of the momentum buffer: 42,757 elements = 0.163 MiB
    for r, line in enumerate(table[1:]):
        cells = line.split()
        assert cells[0] == str(r) and cells[1] == cells[4] == cells[-1] == "0.163", line  # held (peak ...)
    assert final_accuracy(out) > 90.0


def _losses(out: subprocess.CompletedProcess) -> list[float]:
    return [float(x) for x in re.findall(r"train loss ([\d.]+)", out.stderr)]


@pytest.mark.timeout(600)
def test_gpu_training_matches_the_cpu_run():
    """The same job on the nccl-cupy backend (one GPU per rank) follows the CPU run's losses."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible: the GPU training run is skipped")
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install ringddp[cuda])")
    n = "2" if torch.cuda.device_count() >= 2 else "1"  # NCCL allows one rank per GPU
    gpu = run_train("--epochs", "3", "-n", n, "--backend", "nccl-cupy")
    cpu = run_train("--epochs", "3", "-n", n, "--backend", "p2p")
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    # Same seeds and data; only float rounding differs between the devices' kernels.
    assert _losses(gpu) == pytest.approx(_losses(cpu), rel=2e-3) and len(_losses(gpu)) == 3
    assert abs(final_accuracy(gpu) - final_accuracy(cpu)) <= 1.0


def _verdicts(rank, world_size):
    """The "parameters identical" verdict on equal models, and on models that differ on rank 1."""
    import torch

    from ddp.train import _identical_parameters, make_model

    torch.manual_seed(0)
    model = make_model(8)
    same = _identical_parameters(model)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).view(-1)[3] += 2.0**-20
    return same, _identical_parameters(model)


@pytest.mark.timeout(120)
def test_identical_parameters_verdict_sees_a_one_bit_difference(pools):
    assert pools(2).run(_verdicts) == [(True, False), (True, False)]
