"""ddp.elastic: members killed (SIGKILL) and stopped (SIGSTOP) from outside mid-training are
replaced, the lost steps redone, and the final parameters and optimizer state are bitwise those
of the same run without failures."""

from __future__ import annotations

import signal

import pytest
import torch

from ddp import elastic


def _final(out: elastic.Outcome) -> dict:
    assert all(r["identical"] for r in out.reports.values()), out.reports
    return {"model": out.reports[0]["state"], "optimizer": out.reports[0]["optimizer"]}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        torch.equal(a["optimizer"]["state"][i]["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
        for i in a["optimizer"]["state"]
    )


@pytest.mark.timeout(400)
def test_kills_and_stops_end_bitwise_where_the_failure_free_run_ends():
    cfg = elastic.Config(world_size=3, steps=24, heartbeat=2.0, timeout=60.0, report_progress=True)
    reference = elastic.run(cfg)
    assert reference.recoveries == 0, reference.events
    chaos = [(4, 1, signal.SIGKILL), (10, 2, signal.SIGSTOP), (16, 0, signal.SIGKILL), (16, 1, signal.SIGSTOP)]
    out = elastic.run(cfg, chaos)
    assert out.recoveries == 4, out.events
    assert sum(r["failed_steps"] for r in out.reports.values()) >= 1, out.reports
    assert _same(_final(reference), _final(out)), out.events
    assert not _same(_final(reference), {"model": {k: v + 1 for k, v in _final(out)["model"].items()},
                                         "optimizer": _final(out)["optimizer"]})  # the check can fail


def test_chaos_needs_progress_reports():
    with pytest.raises(ValueError, match="report_progress"):
        elastic.run(elastic.Config(), [(1, 0, signal.SIGKILL)])
