"""Tracing collectives outside DDP with ``collectives.trace``."""

from __future__ import annotations

import json

import pytest
import torch

import collectives
from collectives import trace


def traced_job(rank, world_size):
    with trace.tracing() as tracer:
        with trace.span("compute", "user", step=1):
            t = torch.ones(1000)
            with trace.label("my gradients"):
                work = collectives.all_reduce(t, async_op=True)
            work.wait()
        collectives.broadcast(torch.zeros(10, dtype=torch.float64), src=0)
    collectives.all_reduce(torch.ones(1))  # after the block: not recorded
    return tracer.export()


@pytest.mark.timeout(120)
def test_collectives_and_spans_are_recorded_per_rank(tmp_path):
    per_rank = collectives.launch(traced_job, 2, timeout=20.0, join_timeout=90)
    for rank, events in enumerate(per_rank):
        spans = {e["name"]: e for e in events if e["ph"] == "X"}
        assert set(spans) == {"compute", "my gradients", "broadcast"}, spans.keys()
        assert all(e["pid"] == rank for e in events)
        assert spans["my gradients"]["args"] == {"op": "all_reduce", "group": "world", "bytes": 4000, "async": True}
        assert spans["broadcast"]["args"]["bytes"] == 80
        assert spans["compute"]["args"] == {"step": 1}
        # the async all-reduce ran on the communication thread, inside the compute span
        assert spans["my gradients"]["tid"] != spans["compute"]["tid"]
        c, g = spans["compute"], spans["my gradients"]
        assert c["ts"] <= g["ts"] and g["ts"] + g["dur"] <= c["ts"] + c["dur"] + 1
    path = tmp_path / "trace.json"
    trace.write_chrome_trace(path, per_rank)
    doc = json.loads(path.read_text())
    assert min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X") == 0
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_spans_are_free_when_not_tracing():
    assert trace.active() is None
    with trace.span("nothing"):
        pass
    assert trace.active() is None
