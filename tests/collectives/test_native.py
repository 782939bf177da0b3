"""The native one-shot kernel (``collectives/transport/shm/oneshot.c``) and its two-shot fold against the
Python paths, their reference: the same bits, the same protocol (ranks running either meet in one
call), and ``RINGDDP_NATIVE=0`` switches them off with a log line."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig

import pytest
import torch

import collectives
from collectives.ops import ReduceOp
from collectives.transport.shm import native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory")

#: regions of 64 KiB (pieces of 32 KiB): all-reduces up to a piece run one-shot, larger ones one
#: one-shot per piece at 2 ranks and two-shot at 3.
REGION = "64K"
#: one element; odd and below the kernel's block; above it and odd (3 ranks: its block loop;
#: 8-byte dtypes: 2 pieces); over a piece for every dtype (int8: 2 pieces, float64: 10, the
#: two-shot's slices odd, folded and copied out by the kernel's ``fold_copy`` in blocks).
SIZES = (1, 1001, 5003, 40_009)
#: (dtype, op) pairs the kernel offers, and one it does not (the Python path under the same call).
CASES = [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG), (torch.float64, ReduceOp.PRODUCT),
         (torch.int32, ReduceOp.SUM), (torch.int64, ReduceOp.PRODUCT), (torch.int8, ReduceOp.MIN),
         (torch.uint8, ReduceOp.MAX), (torch.float32, ReduceOp.MAX)]


def _operand(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Floats of magnitudes 1e-6..1e6 (rounding depends on the order of the terms) with an inf and
    a -0.0, and on rank 0 a NaN; integers spanning the dtype, so sums and products wrap."""
    g = torch.Generator().manual_seed(77 + rank + numel)
    if dtype.is_floating_point:
        scale = 10.0 ** torch.randint(-6, 7, (numel,), generator=g)
        t = (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)
        if numel > 3:
            t[1], t[2] = float("inf") if rank else 1.0, -0.0
            t[3] = float("nan") if rank == 0 else 5.0
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _fold(world_size: int, numel: int, dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """The Python reference's expression: ``((x0 op x1) op x2) ...`` with torch, AVG divided."""
    combine = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
               ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}[op]
    acc = _operand(0, numel, dtype)
    for q in range(1, world_size):
        acc = combine(acc, _operand(q, numel, dtype))
    return acc / world_size if op is ReduceOp.AVG else acc


def both_paths(rank: int, world_size: int, python_ranks: tuple[int, ...]) -> dict:
    """Each case by ``all_reduce`` twice (the second planned where one-shot) and by a plan's starts; ranks in
    ``python_ranks`` run with ``RINGDDP_NATIVE=0`` (set before the first collective loads the kernel)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(native.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the switch is logged at INFO (a missing library at WARNING)
    if rank in python_ranks:
        os.environ["RINGDDP_NATIVE"] = "0"
    os.environ["RINGDDP_SHM_REGION_BYTES"] = REGION  # read at the transport's set-up (rank 0's wins)
    out: dict = {"results": {}}
    for dtype, op in CASES:
        for numel in SIZES:
            t = _operand(rank, numel, dtype)
            plain, again = t.clone(), t.clone()
            collectives.all_reduce(plain, op)
            collectives.all_reduce(again, op)  # its shape ran: the planned path
            plan = collectives.all_reduce_init(t.clone(), op)
            starts = []
            for _ in range(3):  # the first start runs the plain call and plans; the others the plan
                plan.tensor.copy_(t)
                plan.start()
                starts.append(plan.tensor.clone())
            out["results"][(str(dtype), op.name, numel)] = [plain, again] + starts
    out["loaded"] = native.library() is not None
    out["log"] = records
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, python_ranks", [(2, (1,)), (3, (1,))])
def test_native_one_shot_gives_the_python_paths_bits_and_meets_it(world_size, python_ranks):
    """DESIGN §3: the kernel folds in rank order with the same IEEE operations, so every rank gets
    the Python reference's bits (here: the fold computed with torch), floats with inf, -0.0 and
    a NaN, integers that wrap, in one-shots (one piece or many) and in the two-shot's fold of
    each rank's slice; rank 1 runs the Python path beside the native ranks in the same calls
    (one protocol); a dtype/op the kernel does not offer takes the Python path."""
    if native.library() is None:
        buildable = shutil.which(os.environ.get("CC", "gcc")) and os.path.exists(
            os.path.join(sysconfig.get_paths()["include"], "Python.h"))
        assert not buildable, "a C compiler and Python's headers are here: bash scripts/setup.sh builds the kernel"
        pytest.skip("no C compiler or no Python headers: only the Python path runs here")
    results = collectives.launch(both_paths, world_size, python_ranks, backend="shm", timeout=30.0, join_timeout=200)
    for rank, result in enumerate(results):
        assert result["loaded"] == (rank not in python_ranks)
        if rank in python_ranks:
            assert any("RINGDDP_NATIVE=0" in line for line in result["log"]), result["log"]
        for dtype, op in CASES:
            for numel in SIZES:
                expected = _fold(world_size, numel, dtype, op)
                for i, got in enumerate(result["results"][(str(dtype), op.name, numel)]):
                    same = torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
                    assert same, (rank, dtype, op, numel, ("plain", "plain again")[i] if i < 2 else f"start {i - 1}")


def test_a_missing_build_is_logged_and_leaves_the_python_path(tmp_path, monkeypatch, caplog):
    """README / DESIGN §3: where the module was not built for the current source (here: a source
    whose CRC names no built file), loading says so in one WARNING and returns None (the
    callers then run the Python one-shot); building it is ``scripts/setup.sh``'s job."""
    changed = tmp_path / "oneshot.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native._load() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "scripts/setup.sh" in caplog.records[0].getMessage()
