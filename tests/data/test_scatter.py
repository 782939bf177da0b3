"""data.ScatterDataset with 1-4 real processes.

Spawning a job costs seconds, so each world size runs *one* job (``_checks``) that exercises
everything and returns a plain-Python report per rank (tensors cannot be returned through
``collectives.launch``); the tests below only read the reports. Error cases are caught inside
the job on every rank, with the time each took, so one job checks that every rank raised the same
exception promptly. ``test_bad_input_propagates_through_launch`` lets one escape for real.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import collectives
from data import DistributedSampler, ScatterDataset, global_order

N = 103  # uneven over 2, 3 and 4 ranks
SEED = 7
BIG = (4096, 64)  # float32, 1 MiB: for the memory check
LAUNCH = dict(timeout=20, join_timeout=120)
PROMPT = 5.0  # seconds: an error path that waits for a timeout (20 s) would take longer


def _make() -> dict[str, torch.Tensor]:
    i = torch.arange(N)
    return {
        "x": torch.arange(N * 4, dtype=torch.float32).view(N, 4),  # row i = 4i .. 4i+3
        "y": i.clone(),
        "mask": i % 3 == 0,
        "z": i.double().view(N, 1, 1) + torch.arange(6, dtype=torch.float64).view(1, 2, 3) / 10,
    }


def _row_ok(x, y, mask, z) -> bool:
    i = int(y)
    return x.tolist() == [4.0 * i + k for k in range(4)] and bool(mask) == (i % 3 == 0) and torch.allclose(
        z, i + torch.arange(6, dtype=torch.float64).view(2, 3) / 10
    )


def _ids(ds: ScatterDataset) -> list[int]:
    """Row numbers recovered from the *content* of the local shard."""
    x = ds.fields[0]
    return (x[:, 0] / 4).long().tolist() if x.dim() == 2 else []


def _attempt(fn) -> tuple[str, str, float]:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the report says what it was
        return type(exc).__name__, str(exc), time.perf_counter() - started
    return "no error", "", time.perf_counter() - started


def _checks(rank: int, world_size: int) -> dict:
    root = rank == 0
    d = _make()
    x, y, mask, z = d["x"], d["y"], d["mask"], d["z"]
    report: dict = {"rank": rank}

    # one tensor
    ds = ScatterDataset(x if root else None, seed=SEED)
    report["tensor"] = dict(ids=_ids(ds), indices=ds.indices.tolist(), len=len(ds), num_rows=ds.num_rows,
                            row_type=type(ds[0]).__name__, lengths=ds.shard_lengths())  # fmt: skip

    # tuple, list and dict keep their structure and keep the fields of a row together
    tds = ScatterDataset((x, y, mask, z) if root else None, seed=SEED)
    lds = ScatterDataset([x, y] if root else None, seed=SEED)
    dds = ScatterDataset({"x": x, "标签": y, "mask": mask, "z": z} if root else None, seed=SEED)
    report["tuple"] = dict(
        types={type(tds[0]).__name__, type(lds[0]).__name__, type(dds[0]).__name__},
        rows_ok=all(_row_ok(*tds[i]) for i in range(len(tds))),
        dict_rows_ok=all(_row_ok(r["x"], r["标签"], r["mask"], r["z"]) for r in (dds[i] for i in range(len(dds)))),
        keys=dds.keys,
        ids=_ids(tds),
        dict_ids=_ids(dds),
        list_ids=_ids(lds),
        list_len=len(lds[0]) if len(lds) else None,
        z_shape=list(tds.fields[3].shape[1:]),
        dtypes=[str(f.dtype) for f in dds.fields],
    )

    # works with DataLoader (rows are already shuffled globally: no sampler needed)
    loader_ids = [int(v) for _, yb, _, _ in DataLoader(tds, batch_size=8) for v in yb]
    report["loader"] = dict(ids=loader_ids)

    # set_epoch: a new global permutation per epoch, the same one when an epoch comes back
    e0 = _ids(tds)
    seen = []
    for e in (1, 2, 1):
        tds.set_epoch(e)
        seen.append(_ids(tds))
    tds.set_epoch(1)  # same epoch again: only the agreement round
    report["epochs"] = dict(
        e0=e0, e1=seen[0], e2=seen[1], e1_again=seen[2], e1_indices=tds.indices.tolist(),
        noop_bytes=tds.last_round_bytes_received, rows_ok_after=all(_row_ok(*tds[i]) for i in range(len(tds))),
    )  # fmt: skip
    report["seed8"] = _ids(ScatterDataset(x if root else None, seed=SEED + 1))
    report["noshuffle"] = _ids(ScatterDataset(x if root else None, shuffle=False))
    dl = ScatterDataset(x if root else None, seed=SEED, drop_last=True)
    report["drop_last"] = dict(ids=_ids(dl), indices=dl.indices.tolist(), len=len(dl))
    dl.set_epoch(3)
    report["drop_last"]["e3"] = _ids(dl)

    # memory: the non-source ranks hold ~1/N of the data
    big = torch.randn(*BIG) if root else None
    mds = ScatterDataset(big, seed=SEED)
    report["memory"] = dict(nbytes=mds.nbytes, source=mds.source_nbytes, received=mds.bytes_received,
                            len=len(mds), reshuffle=None)  # fmt: skip
    mds.set_epoch(1)
    report["memory"]["reshuffle"] = mds.last_round_bytes_received

    # the sampler reads its defaults from the collectives' group
    sampler = DistributedSampler(range(N), seed=SEED)
    report["sampler"] = dict(rank=sampler.rank, replicas=sampler.num_replicas, indices=list(sampler))

    # a pickled copy (DataLoader workers under spawn) keeps the shard but cannot reshuffle
    copy = pickle.loads(pickle.dumps(tds))
    report["pickle"] = dict(
        same=len(copy) == len(tds) and all(torch.equal(a, b) for a, b in zip(copy.fields, tds.fields)),
        no_source=copy.source_nbytes == 0,
        set_epoch=_attempt(lambda: copy.set_epoch(5))[:2],
    )

    # bad input: every rank must raise the same error, promptly
    def bad(data, **kw):
        return lambda: ScatterDataset(data if root else None, **kw)

    cases = {
        "no_data": lambda: ScatterDataset(None),
        "mismatch": bad((x, y[:-1])),
        "mismatch_dict": bad({"x": x, "y": y[:50]}),
        "zero_rows": bad(x[:0]),
        "empty_tuple": bad(()),
        "empty_dict": bad({}),
        "dtype": bad(torch.zeros(N, dtype=torch.complex64)),
        "int16": bad((x, torch.zeros(N, dtype=torch.int16))),
        "not_tensor": bad((x, list(range(N)))),
        "zero_dim": bad(torch.tensor(3.0)),
        "not_data": bad("rows"),
        "bad_src": lambda: ScatterDataset(x if root else None, src=world_size),
        "bad_seed": bad(x, seed=1.5),
    }
    if world_size > 1:
        cases |= {
            "nonroot_data": lambda: ScatterDataset(x),
            "nonroot_data_one": lambda: ScatterDataset(x if rank in (0, world_size - 1) else None),
            "seed_mismatch": lambda: ScatterDataset(x if root else None, seed=rank),
            "epoch_mismatch": lambda: tds.set_epoch(10 + rank),
            "drop_last_too_few": bad(x[: world_size - 1], drop_last=True),
        }
    report["errors"] = {name: _attempt(fn) for name, fn in cases.items()}

    # the group is still usable after all that
    after = ScatterDataset(x if root else None, seed=SEED)
    report["after_errors"] = _ids(after) == report["tensor"]["ids"]
    return report


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda ws: f"ws{ws}")
def job(request) -> tuple[int, list[dict], float]:
    started = time.monotonic()
    reports = collectives.launch(_checks, request.param, **LAUNCH)
    return request.param, reports, time.monotonic() - started


def _order(epoch: int, seed: int = SEED, shuffle: bool = True) -> list[int]:
    return global_order(N, shuffle, seed, epoch).tolist()


pytestmark = pytest.mark.timeout(180)


def test_union_of_shards_is_the_data_set_exactly_once(job):
    ws, reports, _ = job
    for key in ("tensor", "tuple"):
        shards = [r[key]["ids"] for r in reports]
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(N)), key  # union == all rows, no overlap
    lengths = [r["tensor"]["len"] for r in reports]
    assert sum(lengths) == N and max(lengths) - min(lengths) <= 1
    assert all(r["tensor"]["lengths"] == lengths for r in reports)
    assert all(r["tensor"]["num_rows"] == N for r in reports)


def test_shards_follow_the_global_order_like_distributed_sampler(job):
    ws, reports, _ = job
    order = _order(0)
    for r, rep in enumerate(reports):
        assert rep["tensor"]["ids"] == rep["tensor"]["indices"] == order[r::ws]
        # same rows as torch's DistributedSampler on this rank, minus its wrap-around padding
        torch_indices = list(TorchSampler(range(N), ws, r, shuffle=True, seed=SEED))
        assert rep["tensor"]["ids"] == torch_indices[: rep["tensor"]["len"]]
        assert rep["sampler"] == dict(rank=r, replicas=ws, indices=torch_indices)
        assert rep["noshuffle"] == list(range(r, N, ws))
        assert rep["seed8"] == _order(0, SEED + 1)[r::ws]


def test_structure_and_dtypes_are_kept(job):
    ws, reports, _ = job
    for rep in reports:
        t = rep["tuple"]
        assert rep["tensor"]["row_type"] == "Tensor"
        assert t["types"] == {"tuple", "list", "dict"}
        assert t["rows_ok"] and t["dict_rows_ok"]
        assert t["keys"] == ["x", "标签", "mask", "z"]
        assert t["ids"] == t["dict_ids"] == t["list_ids"] == rep["tensor"]["ids"]
        assert t["list_len"] == 2
        assert t["z_shape"] == [2, 3]
        assert t["dtypes"] == ["torch.float32", "torch.int64", "torch.bool", "torch.float64"]
        assert rep["loader"]["ids"] == t["ids"]


def test_set_epoch_reshuffles_deterministically(job):
    ws, reports, _ = job
    for r, rep in enumerate(reports):
        e = rep["epochs"]
        assert e["e1"] == e["e1_again"] == e["e1_indices"] == _order(1)[r::ws]
        assert e["e2"] == _order(2)[r::ws]
        assert e["rows_ok_after"]
        assert e["noop_bytes"] == (ws - 1) * 12 * 8  # the agreement table only
    for key in ("e0", "e1", "e2"):
        assert sorted(i for rep in reports for i in rep["epochs"][key]) == list(range(N))
    if ws > 1:
        assert reports[0]["epochs"]["e0"] != reports[0]["epochs"]["e1"]


def test_drop_last_gives_equal_shards(job):
    ws, reports, _ = job
    total = N // ws * ws
    for r, rep in enumerate(reports):
        d = rep["drop_last"]
        assert d["len"] == N // ws
        assert d["ids"] == d["indices"] == _order(0)[:total][r::ws]
        assert d["ids"] == list(TorchSampler(range(N), ws, r, seed=SEED, drop_last=True))
        assert d["e3"] == _order(3)[:total][r::ws]
    assert sorted(i for rep in reports for i in rep["drop_last"]["ids"]) == sorted(_order(0)[:total])


def test_non_source_ranks_hold_about_one_nth(job):
    ws, reports, _ = job
    size = BIG[0] * BIG[1] * 4
    row = BIG[1] * 4
    for r, rep in enumerate(reports):
        m = rep["memory"]
        assert m["len"] in (BIG[0] // ws, -(-BIG[0] // ws))
        assert m["nbytes"] <= size / ws + row  # at most one padding row more than its share
        if r == 0:
            assert m["source"] == size
        else:
            assert m["source"] == 0
            assert m["nbytes"] <= size / ws + row
            # received: the shard (with padding), metadata and agreement tables; nothing more
            assert size / ws <= m["received"] <= size / ws + row + 1024
            assert size / ws <= m["reshuffle"] <= size / ws + row + 1024


def test_pickled_copy_keeps_the_shard(job):
    _, reports, _ = job
    for rep in reports:
        p = rep["pickle"]
        assert p["same"] and p["no_source"]
        assert p["set_epoch"][0] == "RuntimeError" and "no group" in p["set_epoch"][1]


EXPECTED_ERRORS = {
    "no_data": ("ValueError", "rank 0 (the source): passed no data"),
    "mismatch": ("ValueError", "different first dimensions (#0: 103, #1: 102)"),
    "mismatch_dict": ("ValueError", "different first dimensions ('x': 103, 'y': 50)"),
    "zero_rows": ("ValueError", "data has 0 rows"),
    "empty_tuple": ("ValueError", "data has no fields (an empty tuple)"),
    "empty_dict": ("ValueError", "data has no fields (an empty dict)"),
    "dtype": ("TypeError", "dtype torch.complex64, which cannot be scattered"),
    "int16": ("TypeError", "field #1 has dtype torch.int16"),
    "not_tensor": ("TypeError", "field #1 must be a torch.Tensor, got list"),
    "zero_dim": ("ValueError", "0-dim tensor"),
    "not_data": ("TypeError", "data must be a tensor, a tuple/list of tensors or a dict of tensors, got str"),
    "bad_src": ("ValueError", "is not a rank of this group"),
    "bad_seed": ("TypeError", "seed must be an int, got float 1.5"),
    "nonroot_data": ("ValueError", "rank 1: passed data, but only the source rank 0 does"),
    "nonroot_data_one": ("ValueError", "passed data, but only the source rank 0 does"),
    "seed_mismatch": ("ValueError", "ranks disagree on seed (rank 0: 0, rank 1: 1"),
    "epoch_mismatch": ("ValueError", "ranks disagree on epoch (rank 0: 10, rank 1: 11"),
    "drop_last_too_few": ("ValueError", "with drop_last=True every shard would be empty"),
}


def test_bad_input_raises_the_same_error_on_every_rank_promptly(job):
    ws, reports, _ = job
    names = set(reports[0]["errors"])
    assert names == {k for k in EXPECTED_ERRORS if ws > 1 or k not in (
        "nonroot_data", "nonroot_data_one", "seed_mismatch", "epoch_mismatch", "drop_last_too_few")}  # fmt: skip
    for name in names:
        kinds = {rep["errors"][name][:2] for rep in reports}
        assert len(kinds) == 1, (name, kinds)  # same type and message everywhere
        (kind, message), = kinds
        want_kind, want_text = EXPECTED_ERRORS[name]
        assert kind == want_kind and want_text in message, (name, kind, message)
        assert message.startswith("ScatterDataset: ")
        slowest = max(rep["errors"][name][2] for rep in reports)
        assert slowest < PROMPT, (name, slowest)
    assert all(rep["after_errors"] for rep in reports)


def _bad_job(rank: int, world_size: int) -> None:
    x = torch.zeros(10, 3)
    ScatterDataset((x, torch.zeros(9)) if rank == 0 else None)  # escapes: launch re-raises it
    collectives.barrier()


def test_bad_input_propagates_through_launch():
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"different first dimensions \(#0: 10, #1: 9\)") as info:
        collectives.launch(_bad_job, 2, timeout=60, join_timeout=120)
    elapsed = time.monotonic() - started
    notes = "\n".join(getattr(info.value, "__notes__", []))
    # both ranks raised the ValueError themselves (none was stopped or timed out waiting) ...
    assert "rank 0 raised ValueError" in notes and "rank 1 raised ValueError" in notes, notes
    assert "stopped" not in notes and "Timeout" not in notes, notes
    # ... well before the 60 s collective timeout a hang would have needed
    assert elapsed < 45, elapsed

