"""DDP parity with torch's wrapper: join() on uneven inputs, model.module, state_dict keys, device_ids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp import DistributedDataParallel

WRAPPERS = {"torch": TorchDDP, "ours": DistributedDataParallel}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def uneven_training(rank, world_size, lib, extra_per_rank, accumulate):
    """Rank r trains on 2 + extra_per_rank * r batches inside join(); every ``accumulate``-th step
    runs under no_sync. Returns the final state (rounded) and the wrapper's surface."""
    net = _net()
    model = WRAPPERS[lib](net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    steps = 2 + extra_per_rank * rank
    with model.join():
        for step in range(steps):
            x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
            if accumulate and step % accumulate == 0:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
                continue
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    state = {k: [round(v, 4) for v in t.reshape(-1).tolist()] for k, t in model.module.state_dict().items()
             if t.is_floating_point()}
    return state, list(model.state_dict()), model.module is net


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("extra,accumulate", [(0, 0), (2, 0), (1, 3)])
def test_join_matches_torch(pools, world_size, extra, accumulate):
    pool = pools(world_size)
    expected = pool.run(uneven_training, "torch", extra, accumulate)
    got = pool.run(uneven_training, "ours", extra, accumulate)
    assert got == expected
    assert all(state == expected[0][0] for state, _, _ in got)  # replicas agree at the end
    assert got[0][1][0].startswith("module.") and got[0][2]


def bad_arguments(rank, world_size):
    net = torch.nn.Linear(2, 2)
    out = []
    for kwargs in ({"device_ids": [0]}, {"output_device": 0}, {"device_ids": [0, 1]}, {"device_ids": "cpu"}):
        for lib in ("torch", "ours"):
            try:
                WRAPPERS[lib](net, **kwargs)
                out.append("no error")
            except ValueError:
                out.append("ValueError")
    model = DistributedDataParallel(net, device_ids=None, output_device=None, process_group=None)
    for kwargs in ({"divide_by_initial_world_size": False}, {"throw_on_early_termination": True}, {"enable": "yes"}):
        try:
            model.join(**kwargs)
            out.append("no error")
        except (ValueError, TypeError) as exc:
            out.append(type(exc).__name__)
    with model.join(enable=False):  # a no-op
        model(torch.ones(1, 2)).sum().backward()
    return out


@pytest.mark.timeout(120)
def test_bad_arguments(pools):
    for out in pools(2).run(bad_arguments):
        # same answers as torch: device_ids must name the CPU module's device (None); output_device is ignored
        assert out[:8] == ["ValueError"] * 2 + ["no error"] * 2 + ["ValueError"] * 4, out
        assert out[8:] == ["ValueError", "ValueError", "TypeError"]
