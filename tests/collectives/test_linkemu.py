"""The userspace link emulator (collectives.testing.linkemu) between namespace hosts.

Spec parsing runs everywhere. The rest is marked `hosts` (`pytest -m hosts`): it needs root, `ip`
and /dev/net/tun and skips with the reason elsewhere; after every such test, pass or fail, no
namespace and no process it started (forwarder, probes, ranks, whose segments die with them)
may remain, and whatever remains is removed. Delay and rate are checked as lower bounds only
(a busy machine only ever adds time), with loose upper bounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

import collectives
from collectives.testing.hosts import HostNet, link_unavailable, netem_missing, sweep, unavailable
from collectives.testing.linkemu import LinkSpec
from tests import leaks

from .linkprobe import measure


@pytest.mark.parametrize("spec,want", [
    ("netem delay 1ms rate 1gbit", LinkSpec(delay=1e-3, rate=1e9)),
    ("delay 500us", LinkSpec(delay=500e-6)),
    ("netem delay 0.1s limit 10", LinkSpec(delay=0.1, limit=10)),
    ("netem delay 250", LinkSpec(delay=250e-6)),  # tc: a bare time is microseconds
    ("netem rate 100mbit delay 2ms", LinkSpec(delay=2e-3, rate=1e8)),
    ("netem rate 1mbps", LinkSpec(rate=8e6)),  # tc: bps is bytes per second
    ("netem rate 1kibit", LinkSpec(rate=1024)),
    ("netem", LinkSpec()),
])
def test_parse(spec, want):
    assert LinkSpec.parse(spec) == want


@pytest.mark.parametrize("spec,match", [
    ("netem delay 1ms loss 1%", "'loss' is not supported"),
    ("netem delay 1ms 10ms distribution normal", "'10ms' is not supported"),
    ("tbf rate 1gbit", "'tbf' is not supported"),
    ("netem delay", "'delay' needs a value"),
    ("netem delay 1ms delay 2ms", "'delay' is repeated"),
    ("netem delay 1xs", "bad delay '1xs'"),
    ("netem delay -1ms", "bad delay"),
    ("netem rate 0gbit", "bad rate"),
    ("netem rate fast", "bad rate"),
    ("netem limit 1.5", "whole number"),
    ("netem limit 0", "whole number"),
])
def test_parse_errors_name_what_is_supported(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        LinkSpec.parse(spec)
    assert "delay TIME" in str(info.value) or "limit" in str(info.value)


def test_bad_emulator_arguments_raise_before_anything_is_made():
    with pytest.raises(ValueError, match="emulator must be one of"):
        HostNet(2, "netem delay 1ms", emulator="kernel")
    with pytest.raises(ValueError, match="emulates netem links"):
        HostNet(2, "tbf rate 1gbit burst 256kb latency 50ms", emulator="user")
    with pytest.raises(ValueError, match="'loss' is not supported"):
        HostNet(2, "netem loss 1%", emulator="user")


def _ours() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"rdh{os.getpid()}x")]


def _gone(pid: int) -> bool:
    """No such process (reaped), or only a zombie of one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def emulated_hosts():
    """Skip unless the userspace emulator can run here; afterwards, pass or fail, no namespace of
    this process and no process the test started may remain (removed, then reported)."""
    reason = unavailable() or link_unavailable("netem delay 1ms", emulator="user")
    if reason:
        pytest.skip(reason)
    before = set(leaks.session_processes())
    yield
    deadline = time.monotonic() + 5
    while (started := set(leaks.session_processes()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    spaces = _ours()
    leaks.kill_all(started)
    for ns in spaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert not spaces, f"namespaces left behind: {spaces}"
    assert not started, f"processes left behind: {started}"


hosts = pytest.mark.usefixtures("emulated_hosts")


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(60)
def test_delay_sets_the_round_trip():
    with HostNet(2, "netem delay 1ms", emulator="user") as net:
        assert net.emulated == LinkSpec(delay=1e-3)
        forwarder = net._forwarder.pid
        rtts = measure(net, pings=40)["rtts"]
    median = statistics.median(rtts)
    assert 2e-3 <= median < 50e-3, f"median round trip {median * 1e3:.3f} ms with 1 ms each way"
    assert min(rtts) >= 2e-3
    assert _gone(forwarder), "the forwarder outlived close()"


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(60)
def test_rate_bounds_a_bulk_transfer():
    nbytes, rate = 5_000_000, 100e6
    with HostNet(2, "netem rate 100mbit", emulator="user") as net:
        got = measure(net, pings=1, nbytes=nbytes)
    assert got["bytes"] == nbytes
    assert got["seconds"] >= nbytes * 8 / rate, got  # every byte crossed the 100 Mbit/s link
    assert got["seconds"] < 20 * nbytes * 8 / rate, got


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(60)
def test_link_down_and_up_again():
    with HostNet(2, "netem delay 100us", emulator="user") as net:
        net.set_link(1, up=False)
        with pytest.raises(RuntimeError, match="probe ping from host 0 failed"):
            measure(net, pings=1, timeout=1.0)  # the client's connect times out
        net.set_link(1, up=True)
        assert len(measure(net, pings=3)["rtts"]) == 3


SIZES = (0, 1, 7, 1001, 300_000)  # 300 000 floats: 1.2 MB, many 64 KB packets
ALGORITHMS = ("auto", "ring", "hierarchical")


def sums(rank: int, world_size: int) -> list[torch.Tensor]:
    out = []
    for numel in SIZES:
        for algorithm in ALGORITHMS:
            t = torch.arange(numel, dtype=torch.float32) * (rank + 1)
            collectives.all_reduce(t, algorithm=algorithm)
            out.append(t)
    return out


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 1)])  # 3 hosts: packets routed among 3 devices
def test_all_reduce_over_the_emulated_link(hosts, per_host):
    n = hosts * per_host
    with HostNet(hosts, "netem delay 1ms rate 1gbit", emulator="user") as net:
        results = net.launch(sums, per_host, timeout=30, join_timeout=100)
    want = [torch.arange(numel, dtype=torch.float32) * sum(range(1, n + 1)) for numel in SIZES for _ in ALGORITHMS]
    for rank in range(n):
        assert len(results[rank]) == len(want)
        for got, w, (numel, algorithm) in zip(results[rank], want, [(n, a) for n in SIZES for a in ALGORITHMS]):
            assert torch.equal(got, w), (rank, numel, algorithm)


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(30)
def test_a_forwarder_that_fails_to_start_is_reported(tmp_path, monkeypatch):
    from collectives.testing import hosts as hosts_module

    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('no TUN for you', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(hosts_module, "FORWARDER", str(script))
    with pytest.raises(hosts_module.HostNetError, match="exited with code 3: no TUN for you"):
        with HostNet(2, "netem delay 1ms", emulator="user"):
            pass


HOLDER = """
import sys, time
from collectives.testing.hosts import HostNet
net = HostNet(2, "netem delay 1ms", emulator="user").__enter__()
print(net._forwarder.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(60)
def test_nothing_survives_a_killed_parent():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    forwarder = None
    try:
        forwarder = int(holder.stdout.readline())
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"rdh{holder.pid}x0-h1" in listing and not _gone(forwarder)
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 10
        while not _gone(forwarder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(forwarder), "the forwarder outlived its parent"
        sweep()  # (another run's sweep may have been first)
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"rdh{holder.pid}x" not in listing
    finally:  # pass or fail: neither the holder, nor its forwarder, nor its namespaces stay
        holder.kill()
        holder.wait()
        holder.stdout.close()
        if forwarder is not None and not _gone(forwarder):
            leaks.kill_all([forwarder])
        sweep()


@pytest.mark.hosts
@hosts
@pytest.mark.timeout(300)
def test_bench_with_netem_delay_and_rate(tmp_path):
    from collectives import bench

    out = tmp_path / "bench.json"
    argv = ["--hosts", "2", "--world-sizes", "2", "--netem", "delay 1ms rate 1gbit", "--emulator", "user",
            "--model", "--min-bytes", "64K", "--max-bytes", "64K", "--iters", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert rows[0]["net_alpha"] >= 1e-3  # one way: at least the 1 ms delay
    assert rows[0]["ours_us"] >= 2e3  # a 2-rank all_reduce crosses the link both ways


@pytest.mark.hosts
def test_bench_refuses_a_link_it_cannot_make(capsys):
    from collectives import bench

    if unavailable():
        pytest.skip(unavailable())
    if not netem_missing():
        pytest.skip("this kernel has netem")
    with pytest.raises(SystemExit):
        bench.main(["--hosts", "2", "--netem", "delay 1ms", "--emulator", "tc"])
    assert "CONFIG_NET_SCH_NETEM" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--hosts", "2", "--netem", "delay 1ms loss 1%"])
    assert "'loss' is not supported" in capsys.readouterr().err
