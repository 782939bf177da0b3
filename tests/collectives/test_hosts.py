"""Collectives across emulated hosts (network namespaces on a bridge): `pytest -m hosts`.

Needs root, `ip` and `tc`; skips with the reason elsewhere. Every test checks that it leaves no
namespace behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.group import get_default_group
from collectives.ops import ReduceOp
from collectives.testing import Case, bitwise_equal
from collectives.testing.calls import expected
from collectives.testing.checks import inputs_of, run_case
from collectives.testing.hosts import HostNet, sweep, unavailable
from collectives.testing.strategies import COLLECTIVES, REDUCING

pytestmark = pytest.mark.hosts


@pytest.fixture(autouse=True)
def namespace_hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    yield
    assert not _ours(), f"namespaces left behind: {_ours()}"


def _ours() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"rdh{os.getpid()}x")]


def _cases(world_size: int, dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    shapes = [(), (0,), (world_size - 1,), (7, 3), (1001,)]
    out = []
    for i, (name, dtype, shape) in enumerate((n, d, s) for n in COLLECTIVES for d in dtypes for s in shapes):
        if name in ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor") and not shape:
            continue
        if name == "all_to_all_single":  # dim 0 splits evenly
            shape = (shape[0] * world_size,) + shape[1:]
        ops = [ReduceOp.SUM, ReduceOp.MAX] + ([ReduceOp.AVG] if dtype.is_floating_point else [ReduceOp.PRODUCT])
        algorithms = ["auto", "hierarchical"] if name in ("all_reduce", "broadcast") else ["auto"]
        for op in ops if name in REDUCING else [ReduceOp.SUM]:
            for algorithm in algorithms:
                out.append(Case(name, dtype, shape, op, ("contiguous", "strided")[i % 2], (0, world_size - 1)[i % 2],
                                seed=i, algorithm=algorithm, world_size=world_size))
    return out


def compare_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    get_default_group().tuning.small_bytes = 64  # exercise the hierarchical ring paths at small sizes
    return [run_case(rank, world_size, case) for case in cases]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "hosts,per_host,dtypes", [(2, 2, (torch.float32, torch.float16, torch.int64)), (3, 2, (torch.float32,))]
)
def test_every_collective_matches_torch(hosts, per_host, dtypes):
    n = hosts * per_host
    cases = _cases(n, dtypes)
    with HostNet(hosts=hosts) as net:
        results = net.launch(compare_cases, per_host, cases, timeout=30, join_timeout=200)
    for c, case in enumerate(cases):
        want = expected(case, [inputs_of(case, r) for r in range(n)])  # the kit's hand-computed answer
        for rank in range(n):
            got = results[rank][c]
            assert not got["outside"], f"{case}: rank {rank} wrote outside a view: {got['outside']}"
            for name, tensor in want[rank].items():
                if tensor is not None:
                    assert bitwise_equal(got["got"][name], tensor), (
                        f"{case}: rank {rank} {name} differs from the expected result\n"
                        f"ours {got['got'][name]}\nwant {tensor}")
        if case.collective == "all_reduce":
            first = results[0][c]["got"]["tensor"]
            assert all(bitwise_equal(results[r][c]["got"]["tensor"], first) for r in range(n)), case


def layout_and_choice(rank: int, world_size: int) -> tuple:
    engine = get_default_group().engine(torch.device("cpu"), "test")
    t = torch.ones(1 << 12)
    collectives.all_reduce(t)
    return engine.layout.hosts, engine.hierarchy().intra.world_size, engine.hierarchy().inter.world_size, t[0].item()


@pytest.mark.timeout(60)
def test_layout_from_namespaces():
    with HostNet(hosts=2) as net:
        results = net.launch(layout_and_choice, 2, timeout=20)
    assert results == [(((0, 1), (2, 3)), 2, 2, 4.0)] * 4


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def hierarchical_against_torch(rank: int, world_size: int, sizes: list[int]) -> dict:
    """Our hierarchical collectives next to torch's on the same inputs, and what the intra-host
    phases ran over. Inputs are small integers, so every sum is exact whatever torch's order."""
    records = _Records()
    logging.getLogger("collectives").addHandler(records)
    get_default_group().tuning.small_bytes = 64  # all_gather / reduce_scatter go hierarchical too
    n, checks = world_size, {}
    for numel in sizes:
        x = torch.randint(-4, 5, (numel,), generator=torch.Generator().manual_seed(1000 * rank + numel)).float()
        for op, ref_op in ((ReduceOp.SUM, dist.ReduceOp.SUM), (ReduceOp.MAX, dist.ReduceOp.MAX),
                           (ReduceOp.AVG, dist.ReduceOp.SUM)):
            ours, ref = x.clone(), x.clone()
            collectives.all_reduce(ours, op, algorithm="hierarchical")
            dist.all_reduce(ref, op=ref_op)
            checks[f"all_reduce {op.name} {numel}"] = bitwise_equal(ours, ref / n if op is ReduceOp.AVG else ref)
        ours, ref = x.clone(), x.clone()
        collectives.broadcast(ours, n - 1, algorithm="hierarchical")
        dist.broadcast(ref, n - 1)
        checks[f"broadcast {numel}"] = bitwise_equal(ours, ref)
        outs, refs = [torch.empty(numel) for _ in range(n)], [torch.empty(numel) for _ in range(n)]
        collectives.all_gather(outs, x)
        dist.all_gather(refs, x)
        checks[f"all_gather {numel}"] = all(bitwise_equal(o, r) for o, r in zip(outs, refs))
        ins = [x + i for i in range(n)]
        ours, ref = torch.empty(numel), torch.empty(numel)
        collectives.reduce_scatter(ours, ins, ReduceOp.AVG)
        dist.reduce_scatter(ref, ins)
        checks[f"reduce_scatter AVG {numel}"] = bitwise_equal(ours, ref / n)
    intra = get_default_group().engine(torch.device("cpu"), "test").hierarchy().intra
    logging.getLogger("collectives").removeHandler(records)
    return {"intra": (type(intra).__name__, intra.shared_regions() is not None), "checks": checks,
            "warnings": records.messages}


SIZES = [0, 1, 5, 1001, 3 * 257]


def _failed(got: dict) -> list[str]:
    return [name for name, ok in got["checks"].items() if not ok]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hosts,per_host", [(2, 2), (2, 3)])
def test_hierarchical_intra_host_phases_run_over_shared_memory(hosts, per_host):
    env = {"RINGDDP_SHM_REGION_BYTES": "1024"}  # pieces of 512 bytes: many per call, on chunks of unequal size
    with HostNet(hosts=hosts) as net:
        results = net.launch(hierarchical_against_torch, per_host, SIZES, timeout=30, join_timeout=180, env=env)
    for rank, got in enumerate(results):
        assert got["intra"] == ("ShmTransport", True), f"rank {rank}: the intra-host phases ran over {got['intra']}"
        assert not got["warnings"], got["warnings"]
        assert all(got["checks"].values()), f"rank {rank} differs from torch: {_failed(got)}"


@pytest.mark.timeout(120)
def test_hierarchical_falls_back_to_the_group_transport_without_shared_memory(tmp_path):
    env = {"RINGDDP_SHM_DIR": str(tmp_path / "missing")}
    with HostNet(hosts=2) as net:
        results = net.launch(hierarchical_against_torch, 2, SIZES[:4], timeout=30, join_timeout=100, env=env)
    for rank, got in enumerate(results):
        assert got["intra"] == ("ShmTransport", False), f"rank {rank}: {got['intra']}"
        assert any("falling back" in w and "missing" in w for w in got["warnings"]), (rank, got["warnings"])
        assert all(got["checks"].values()), f"rank {rank} differs from torch: {_failed(got)}"


def all_reduce_until_error(rank: int, world_size: int, marker_dir: str) -> tuple:
    t = torch.ones(1 << 18)
    collectives.all_reduce(t)
    open(os.path.join(marker_dir, str(rank)), "w").close()
    start = time.monotonic()
    try:
        while True:
            collectives.all_reduce(t)
    except collectives.CollectiveError as exc:
        return type(exc).__name__, time.monotonic() - start, exc.op


@pytest.mark.timeout(90)
@pytest.mark.parametrize("link", [None, "netem delay 1ms"])  # a veth; a TUN device (where netem is emulated)
def test_link_down_mid_all_reduce_raises_everywhere(tmp_path, link):
    timeout = 5.0

    def cut(net: HostNet) -> None:
        while len(os.listdir(tmp_path)) < 4:
            time.sleep(0.05)
        time.sleep(0.2)
        net.set_link(1, up=False)

    with HostNet(hosts=2, link=link) as net:
        threading.Thread(target=cut, args=(net,), daemon=True).start()
        started = time.monotonic()
        results = net.launch(all_reduce_until_error, 2, str(tmp_path), timeout=timeout, join_timeout=60)
        elapsed = time.monotonic() - started
    for rank, (kind, after, op) in enumerate(results):
        assert op == "all_reduce", (rank, kind, op)
        assert after < 4 * timeout, f"rank {rank} raised {kind} only after {after:.1f}s"
    assert elapsed < 50


def hierarchical_until_a_rank_exits(rank: int, world_size: int, marker_dir: str) -> None:
    t = torch.ones(1 << 16)
    collectives.all_reduce(t, algorithm="hierarchical")
    open(os.path.join(marker_dir, f"ready{rank}"), "w").close()
    while len([f for f in os.listdir(marker_dir) if f.startswith("ready")]) < world_size:
        time.sleep(0.01)
    if rank == 1:  # local rank 1 of host 0: its host peer waits on it in shared memory
        os._exit(3)
    start = time.monotonic()
    try:
        while True:
            collectives.all_reduce(t, algorithm="hierarchical")
    except collectives.CollectiveError as exc:
        with open(os.path.join(marker_dir, f"raised{rank}"), "w") as f:
            f.write(f"{time.monotonic() - start} {exc.op}")


@pytest.mark.timeout(90)
def test_a_rank_exiting_mid_hierarchical_all_reduce_makes_every_other_rank_raise(tmp_path):
    timeout = 5.0
    with pytest.raises(collectives.LaunchError, match="rank 1"):
        with HostNet(hosts=2) as net:
            net.launch(hierarchical_until_a_rank_exits, 2, str(tmp_path), timeout=timeout, join_timeout=60)
    for rank in (0, 2, 3):
        path = tmp_path / f"raised{rank}"
        assert path.exists(), f"rank {rank} did not raise"
        after, op = path.read_text().split()
        assert op == "all_reduce" and float(after) < 2 * timeout, (rank, after, op)


def fails(rank: int, world_size: int) -> None:
    raise RuntimeError(f"rank {rank} fails on purpose")


@pytest.mark.timeout(60)
def test_cleanup_after_failure_and_stale_sweep():
    with pytest.raises(RuntimeError, match="fails on purpose"):
        with HostNet(hosts=2) as net:
            net.launch(fails, 1, timeout=10)
    assert not _ours()
    # a namespace named like one of a crashed run (a pid that no longer exists) is swept
    subprocess.run(["ip", "netns", "add", "rdh999999999x0-h0"], check=True)
    assert "rdh999999999x0-h0" in sweep()


@pytest.mark.timeout(300)
def test_bench_between_hosts_with_a_shaped_link(tmp_path, capsys):
    from collectives import bench
    from collectives.testing.hosts import link_unavailable

    tbf = "rate 1gbit burst 256kb latency 50ms"
    reason = link_unavailable(f"tbf {tbf}")
    if reason:
        pytest.skip(reason)
    out = tmp_path / "bench.json"
    argv = ["--hosts", "2", "--world-sizes", "4", "--tbf", tbf, "--model",
            "--ops", "all_reduce,broadcast,all_gather,reduce_scatter", "--min-bytes", "64K", "--max-bytes", "64K",
            "--small-bytes", "16K", "--iters", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert {r["op"]: r["algorithm"] for r in rows} == dict.fromkeys(
        ("all_reduce", "broadcast", "all_gather", "reduce_scatter"), "hierarchical")
    assert all(r["wrong"] == 0 and r["model_us"] > 0 for r in rows)
    assert rows[0]["net_beta"] > 2e-9  # the 1 Gbit/s bucket is slower than the veth
    # what `collectives.sim validate` models beyond α/β: the link's spec, the CPUs, a receive's CPU
    assert (rows[0]["link"], rows[0]["hosts"]) == (f"tbf {tbf}", 2) and rows[0]["cpus"] >= 1
    assert rows[0]["recv_cpu_beta"] > 0 and rows[0]["net_mean_alpha"] >= rows[0]["net_alpha"]



TORCHRUN_SCRIPT = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group(backend="ringddp")  # collectives is never imported: torch loads the backend
rank = dist.get_rank()
gloo = dist.new_group(backend="gloo")
def train(group):
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
ours, theirs = train(None), train(gloo)
t = torch.arange(6.0) * (rank + 1)
u = t.clone()
dist.all_reduce(t)
dist.all_reduce(u, group=gloo)
layout = dist.group.WORLD.group.engine(torch.device("cpu")).layout
with open(os.path.join(os.environ["OUT"], f"{rank}.txt"), "w") as f:
    print(dist.get_world_size(), layout.spans_hosts and layout.uniform, torch.equal(t, u),
          float((ours - theirs).abs().max()), file=f)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_torchrun_two_nodes_torch_ddp_on_ringddp(tmp_path):
    """Real torchrun (its c10d rendezvous), --nnodes 2 --nproc-per-node 2, one agent per emulated
    host; the script picks backend="ringddp" and nothing else of ours. The world spans hosts, so
    its collectives run the hierarchical algorithms; exact all-reduce equals gloo's bitwise, and
    torch's DDP training within float32 rounding (4 ranks: the sum's order differs from gloo's)."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    with HostNet(hosts=2) as net:
        procs = []
        for host in range(2):
            env = net.rank_env(0, 2, {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1"})
            for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                env.pop(key)  # torchrun sets these
            argv = [sys.executable, "-m",
                    "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{net.address(0)}:29400", "--rdzv-id", "ringddp-test",
                    "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", net.address(host), str(script)]
            procs.append(net.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=200)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    for rank in range(4):
        size, hierarchical, exact, diff = (tmp_path / f"{rank}.txt").read_text().split()
        assert (size, hierarchical, exact) == ("4", "True", "True"), rank
        assert float(diff) < 1e-6, (rank, diff)
