"""The α/β cost model: fitting, predictions, derived tuning, and the bench's model column."""

from __future__ import annotations

import json

import pytest

from collectives import bench
from collectives.costmodel import Link, algorithm_for, fit, predict, tuning
from collectives.tuning import Tuning
from collectives.topology import Layout

TWO_BY_TWO = Layout(((0, 1), (2, 3)))
ONE_HOST = Layout(((0, 1, 2, 3),))


def test_fit_recovers_a_line_and_ignores_a_burst():
    assert fit([(s, 1e-4 + 2e-9 * s) for s in (8, 1 << 10, 1 << 20, 4 << 20)]) == pytest.approx(Link(1e-4, 2e-9))
    # a token bucket lets the first 256 KiB through at line rate: the slope still comes from the large sizes
    burst = [(8, 40e-6), (16 << 10, 40e-6), (256 << 10, 170e-6), (1 << 20, 6.8e-3), (4 << 20, 33.2e-3), (16 << 20, 134e-3)]
    assert fit(burst).beta == pytest.approx(8e-9, rel=0.05)
    with pytest.raises(ValueError):
        fit([(8, 1e-5)])


def test_predictions_follow_the_formulas():
    net, local = Link(1e-3, 8e-9), Link(5e-5, 5e-10)
    s = 64 << 20
    ring = predict("all_reduce", s, TWO_BY_TWO, net, local, algorithm="ring")
    assert ring == pytest.approx(6 * 1e-3 + 1.5 * s * 8e-9)
    hier = predict("all_reduce", s, TWO_BY_TWO, net, local, algorithm="hierarchical")
    assert hier == pytest.approx(2 * 5e-5 + s * 5e-10 + 2 * 1e-3 + s * 8e-9)
    # intra-host phases over shared memory: two synchronisations and 2.5 copies of S at two ranks per host
    shm = Link(2e-5, 1e-10)
    over_shm = predict("all_reduce", s, TWO_BY_TWO, net, local, algorithm="hierarchical", shm=shm)
    assert over_shm == pytest.approx(2 * 2e-5 + 2.5 * s * 1e-10 + 2 * 1e-3 + s * 8e-9)
    gather = predict("all_gather", s, TWO_BY_TWO, net, local, shm=shm)
    assert gather == pytest.approx(2e-5 + s * 1e-10 + 1e-3 + s / 2 * 8e-9)
    one_each = predict("all_reduce", s, Layout(((0,), (1,))), net, local, algorithm="hierarchical", shm=shm)
    assert one_each == pytest.approx(2 * 1e-3 + s * 8e-9)  # one rank per host: no intra-host phase
    assert hier < ring and predict("all_reduce", 4096, TWO_BY_TWO, net, local, algorithm="hierarchical") < predict(
        "all_reduce", 4096, TWO_BY_TWO, net, local, algorithm="ring")
    assert algorithm_for("all_reduce", "auto", s, TWO_BY_TWO, Tuning()) == "hierarchical"
    assert algorithm_for("all_reduce", "auto", 4096, ONE_HOST, Tuning()) == "recursive_doubling"
    assert predict("all_reduce", s, ONE_HOST, net, local) == pytest.approx(6 * 5e-5 + 1.5 * s * 5e-10)
    # host-major recursive doubling: the first round pairs ranks of one host, the second crosses
    # with both ranks of a host sending the whole buffer through its interface
    rd = predict("all_reduce", s, TWO_BY_TWO, net, local, algorithm="recursive_doubling")
    assert rd == pytest.approx(5e-5 + s * 5e-10 + 1e-3 + 2 * s * 8e-9)
    interleaved = predict("all_reduce", s, Layout(((0, 2), (1, 3))), net, local, algorithm="recursive_doubling")
    assert interleaved == pytest.approx(2 * (1e-3 + 2 * s * 8e-9))


def test_tuning_from_alpha_beta():
    t = tuning(Link(1e-3, 8e-9), 8)  # 1 ms, 1 Gbit/s, 8 ranks
    # recursive doubling 3(a + Sb) = ring 14a + 1.75 Sb  at  S = 11a / 1.25b
    assert t.small_bytes == pytest.approx(11 * 1e-3 / (1.25 * 8e-9), rel=1e-6)
    assert t.chain_bytes == t.small_bytes
    assert t.segment_bytes == 1 << 20  # 8 a / b = 1 MB, as a power of two
    assert tuning(Link(1e-3, 8e-9), 2).small_bytes >= 1 << 40  # two ranks: always recursive doubling
    assert tuning(Link(1e-6, 1e-10), 4).segment_bytes == 1 << 16  # clamped


@pytest.mark.timeout(180)
def test_bench_prints_the_model_next_to_each_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--world-sizes", "2", "--min-bytes", "4K", "--max-bytes", "8K", "--iters", "2", "--model",
            "--algorithm", "ring", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["algorithm"] for r in rows] == ["ring", "ring"] and all(r["model_us"] > 0 for r in rows)
    # every link fitted twice: from the fastest repetitions and from the medians (sim validate's)
    assert all(rows[0][f"{kind}_beta"] >= 0 for kind in ("net", "net_median", "reduce", "reduce_median"))
    assert "model us" in capsys.readouterr().out
