"""The backend registry, and a user backend defined in this file running everything.

``counting`` below is what a user writes to study their own transport: a file with a Transport
and one ``register_backend`` call. Named ``"tests.collectives.test_backends:counting"`` it runs in
spawned ranks (which import this module first), the property-test kit, the bench CLI and DDP,
without touching the package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import collectives
from collectives import backends
from collectives.engine import AlgorithmEngine, Engine
from collectives.testing import WorkerPool, assert_matches_reference, cases
from collectives.transport.base import Peer, Request
from collectives.transport.torch_p2p import TorchP2PTransport

# ---------------------------------------------------------------------------- the user's backend


class CountingTransport(TorchP2PTransport):
    """The gloo point-to-point transport, counting the messages it posts."""

    def __init__(self, group: collectives.Group) -> None:
        super().__init__(group.process_group, group.rank(), group.timeout)
        self.sent = self.received = 0

    def isend(self, tensor: torch.Tensor, peer: Peer) -> Request:
        self.sent += 1
        return super().isend(tensor, peer)

    def irecv(self, tensor: torch.Tensor, peer: Peer) -> Request:
        self.received += 1
        return super().irecv(tensor, peer)


collectives.register_backend(
    "counting", "cpu", make_transport=lambda group, device: CountingTransport(group),
    description="gloo point-to-point that counts messages (tests)",
)

BACKEND = "tests.collectives.test_backends:counting"
ROOT = Path(__file__).resolve().parents[2]


def _messages(rank: int = 0, world_size: int = 0) -> tuple[int, int]:
    """Messages sent and received so far by this rank's ``counting`` transport (default group)."""
    transport = collectives.get_group().engine(torch.device("cpu"), "test").transport
    return transport.sent, transport.received


# ---------------------------------------------------------------------------- registry


def test_names_aliases_and_environment(monkeypatch):
    assert {"auto", "p2p", "nccl-cupy", "torch", "counting"} <= set(backends.backend_names())
    for given_name, want in [("gloo", "p2p"), ("NCCL", "nccl-cupy"), ("reference", "torch"), ("Auto", "auto"),
                             (BACKEND, "counting"), ("collectives.backends:p2p", "p2p")]:
        assert backends.resolve_backend(given_name) == want
    monkeypatch.setenv("RINGDDP_BACKEND", "gloo")
    assert backends.resolve_backend(None) == "p2p"
    monkeypatch.delenv("RINGDDP_BACKEND")
    assert backends.resolve_backend(None) == "auto"
    assert backends.get_backend("counting").description.startswith("gloo point-to-point")


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown backend 'mpi'; registered: auto, p2p, nccl-cupy, torch, .*counting"):
        backends.resolve_backend("mpi")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        backends.resolve_backend("no_such_module:counting")
    with pytest.raises(ValueError, match="unknown backend 'collectives:nope'"):
        backends.resolve_backend("collectives:nope")
    make = lambda group, device: CountingTransport(group)  # noqa: E731
    with pytest.raises(ValueError, match=r"\['counting'\] already registered"):
        collectives.register_backend("counting", "cpu", make_transport=make)
    with pytest.raises(ValueError, match=r"\['gloo'\] already registered"):
        collectives.register_backend("mine", "cpu", make_transport=make, aliases=("gloo",))
    with pytest.raises(ValueError, match="device types must be among"):
        collectives.register_backend("mine", "tpu", make_transport=make)
    with pytest.raises(ValueError, match="exactly one of make_transport and make_engine"):
        collectives.register_backend("mine", "cpu")
    with pytest.raises(ValueError, match="invalid backend name"):
        collectives.register_backend("my:backend", "cpu", make_transport=make)
    collectives.register_backend("not-an-engine", "cpu", make_engine=lambda group, device: object())
    try:
        with pytest.raises(TypeError, match="make_engine returned object, which lacks Engine methods"):
            backends.get_backend("not-an-engine").build(None, torch.device("cpu"))
    finally:
        backends.unregister_backend("not-an-engine")
    assert "mine" not in backends.backend_names()
    # the same definition registered again (a script imported as __main__ and by name) is no error
    record = backends.get_backend("counting")
    collectives.register_backend("counting", "cpu", make_transport=record.make_transport,
                                 description=record.description)
    with pytest.raises(ValueError, match=r"the nccl-cupy backend moves cuda tensors only, got a cpu tensor"):
        backends.select_backend("nccl-cupy", "cpu", None, "all_reduce")
    with pytest.raises(ValueError, match="all_reduce: no backend moves meta tensors"):
        backends.select_backend("auto", "meta", None, "all_reduce")


@dataclasses.dataclass
class Hosts:
    """The part of ``transport.base.GroupInfo`` that ``auto``'s ``usable`` predicates read."""

    hosts: list[str]
    name: str = "test"

    def size(self) -> int:
        return len(self.hosts)


def test_auto_defaults():
    """README, Backends: ``auto`` picks, per device type, the usable backend of highest priority:
    shm for CPU tensors when every rank is on one host, else p2p; nccl-cupy for CUDA."""
    one_host, two_hosts = Hosts(["a", "a", "a"]), Hosts(["a", "a", "b"])
    assert backends.select_backend("auto", "cpu", one_host).name == ("shm" if sys.platform == "linux" else "p2p")
    assert backends.select_backend("auto", "cpu", two_hosts).name == "p2p"
    for group in (one_host, two_hosts):
        assert backends.select_backend("auto", "cuda", group).name == "nccl-cupy"
    # without a group the predicates are skipped: the highest priority for the device type
    assert backends.select_backend("auto", "cpu", None).name == "shm"
    assert backends.select_backend("auto", "cuda", None).name == "nccl-cupy"


def _auto_choice(g: collectives.Group) -> list[str]:
    """``auto`` on a real group with two extra candidates: usable on one host, and never usable."""
    make = lambda group, device: CountingTransport(group)  # noqa: E731
    collectives.register_backend("one-host", "cpu", make_transport=make, auto_priority=1000,
                                 usable=lambda group: len(set(group.hosts)) == 1)
    collectives.register_backend("never", "cpu", make_transport=make, auto_priority=2000, usable=lambda group: False)
    try:
        return [backends.select_backend("auto", t, g).name for t in ("cpu", "cuda")]
    finally:
        backends.unregister_backend("one-host")
        backends.unregister_backend("never")


# ---------------------------------------------------------------------------- it runs everything


def _group_facts(rank: int, world_size: int) -> dict:
    """What the user backend's group looks like, and point-to-point through every engine kind."""
    g = collectives.get_group()
    engine = g.engine(torch.device("cpu"), "test")
    facts = {"backend": g.backend, "engine": type(engine).__name__, "is_engine": isinstance(engine, Engine),
             "transport": type(engine.transport).__name__, "hosts": g.hosts, "rank": g.rank(), "size": g.size()}
    facts["auto"] = _auto_choice(g)
    sub = collectives.new_group([0, world_size - 1])
    reference = collectives.new_group(backend="torch")
    if not collectives.is_non_member(sub):
        sub.store.set("key", f"from {rank}")
        facts["sub"] = {"hosts": sub.hosts, "backend": sub.backend, "world_sees_key": g.store.check(["key"]),
                        "key": sub.store.get("key").decode()}
    # engine send/recv: a ring shift on our engine and on torch's
    for grp in (g, reference):
        e = grp.engine(torch.device("cpu"), "test")
        got = torch.empty(3)
        if world_size > 1:
            if rank % 2 == 0:
                e.send(torch.full((3,), float(rank)), (rank + 1) % world_size)
                e.recv(got, (rank - 1) % world_size)
            else:
                e.recv(got, (rank - 1) % world_size)
                e.send(torch.full((3,), float(rank)), (rank + 1) % world_size)
            facts.setdefault("shifted", []).append(got.tolist())
    return facts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_property_kit_runs_on_the_user_backend(world_size):
    with WorkerPool(world_size, backend=BACKEND, timeout=20.0, job_timeout=90.0) as pool:
        facts = pool.run(_group_facts)
        for rank, f in enumerate(facts):
            assert (f["backend"], f["engine"], f["transport"], f["is_engine"]) == (
                "counting", "AlgorithmEngine", "CountingTransport", True)
            assert (f["rank"], f["size"]) == (rank, world_size)
            assert len(f["hosts"]) == world_size and len(set(f["hosts"])) == 1
            assert f["auto"] == ["one-host", "nccl-cupy"]
            if rank in (0, world_size - 1):
                assert f["sub"]["backend"] == "counting" and f["sub"]["world_sees_key"] is False
                assert f["sub"]["hosts"] == f["hosts"][: len(f["sub"]["hosts"])]
                assert f["sub"]["key"].startswith("from ")
            if world_size > 1:
                left = float((rank - 1) % world_size)
                assert f["shifted"] == [[left] * 3, [left] * 3]
        before = pool.run(_messages)

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=cases(world_size))
        def check(case):
            assert_matches_reference(pool, case)

        check()
        after = pool.run(_messages)
    if world_size > 1:  # the collectives really went through the user's transport
        assert all(a[0] > b[0] and a[1] > b[1] for a, b in zip(after, before)), (before, after)


@pytest.mark.timeout(240)
def test_bench_cli_runs_the_user_backend(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "collectives.bench", "--backend", BACKEND, "--ops", "all_reduce,all_gather",
           "--world-sizes", "2", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "2", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    got = [(r["op"], r["wrong"], r["backend"]) for r in rows]
    assert got == [(op, 0, BACKEND) for op in ("all_reduce", "all_gather")]
    assert rows[0]["wire_busbw"] > 0  # a transport backend gets the wire row too
    bad = subprocess.run([*cmd[:3], "--backend", "nope"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=100)
    assert bad.returncode == 2 and "unknown backend 'nope'" in bad.stderr


def _ddp_job(rank: int, world_size: int) -> dict:
    """A few DDP steps on the user backend; gradients must equal the full-batch average."""
    from ddp import DistributedDataParallel

    torch.manual_seed(rank)  # different initial weights: DDP's broadcast must fix them
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    ddp_model = DistributedDataParallel(model, bucket_cap_mb=0.0001)
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    twin.load_state_dict(model.state_dict())
    data = [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    ddp_model(data[rank]).square().mean().backward()
    sum(twin(x).square().mean() for x in data).div(world_size).backward()
    errors = [float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), twin.parameters())]
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"error": max(errors), "grads": flat, "messages": _messages(), "backend": collectives.get_group().backend}


@pytest.mark.timeout(180)
def test_ddp_trains_through_the_user_backend():
    results = collectives.launch(_ddp_job, 3, backend=BACKEND, timeout=30, join_timeout=150)
    for r in results:
        assert r["backend"] == "counting" and r["error"] < 1e-6
        assert r["messages"][0] > 0 and r["messages"][1] > 0
        assert torch.equal(r["grads"], results[0]["grads"])  # bitwise identical on every rank
