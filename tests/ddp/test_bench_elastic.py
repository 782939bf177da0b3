"""ddp.bench_elastic: the fault-tolerant loop's step next to the plain one runs and reports every
mode and the A/A control (a smoke test: the numbers are the bench's business, not a test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_reports_every_mode(tmp_path):
    out = tmp_path / "ft.json"
    done = subprocess.run([sys.executable, "-m", "ddp.bench_elastic", "--world-sizes", "2", "--rounds", "1", "--warmup", "0",
                           "--steps", "2", "--modes", "ddp,zero1,zero2,aa", "--json", str(out)], capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world_size"], r["mode"]) for r in rows] == [(2, "ddp"), (2, "zero1"), (2, "zero2"), (2, "aa")]
    assert all(r["plain_ms"] > 0 and r["fault_tolerant_ms"] > 0 and r["cpu_overhead"] > -1 for r in rows), rows
    assert all(low <= r["overhead"] <= high for r in rows for low, high in [r["spread"]]), rows
    assert "| digits | 2 | zero2 |" in done.stdout and "| digits | 2 | aa |" in done.stdout
