"""Generate docs/api-coverage.md: every public name of torch.distributed and where it stands here.

    python scripts/api_coverage.py            # rewrite docs/api-coverage.md
    python scripts/api_coverage.py --check    # exit 1 if the file is out of date

A public name is one in ``dir(torch.distributed)`` without a leading underscore, as a fresh
interpreter sees it right after ``import torch.distributed`` (read in a subprocess: submodules such
as ``torch.distributed.fsdp`` become attributes once anything imports them). Every name is
either provided by ``collectives`` (``hasattr``) or listed in ``MISSING`` with the reason; a name
in neither makes the script fail, so a torch upgrade that adds names cannot go unnoticed.
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402 - after the path fix, so the checkout's package is documented

OUTPUT = ROOT / "docs" / "api-coverage.md"

_OPTIONS = "option struct of torch's C++ ProcessGroup methods; our Group has no such methods (use the functions)"
_MODULE = "not an API: a module or object that torch.distributed's `__init__` happens to import"
_DDP = "internals of torch's C++ DDP reducer; our DDP is the `ddp` package (`ddp/distributed.py`)"
_DEBUG = "debug mode is `RINGDDP_DEBUG=DETAIL` (`collectives/debug.py`), not torch's debug level"
_RPC = "out of scope: torch's RPC framework (remote references, distributed autograd)"
_MESH = "out of scope: N-D parallelism (DeviceMesh underlies DTensor / FSDP2 / tensor parallel)"

#: Names we do not provide, and why.
MISSING: dict[str, str] = {
    "AllToAllOptions": _OPTIONS,
    "AllreduceCoalescedOptions": _OPTIONS,
    "AllreduceOptions": _OPTIONS,
    "BarrierOptions": _OPTIONS,
    "BroadcastOptions": _OPTIONS,
    "GatherOptions": _OPTIONS,
    "ReduceOptions": _OPTIONS,
    "ReduceScatterOptions": _OPTIONS,
    "ScatterOptions": _OPTIONS,
    "BackendConfig": "torch's per-device backend string; our backends are named records (`collectives/backends.py`)",
    "get_backend_config": "torch's per-device backend string; see `collectives.backend_names()`",
    "get_default_backend_for_device": "maps devices to torch's backend names; `auto` picks ours per device",
    "BuiltinCommHookType": _DDP,
    "GradBucket": _DDP,
    "Reducer": _DDP,
    "Logger": _DDP,
    "DebugLevel": _DEBUG,
    "get_debug_level": _DEBUG,
    "set_debug_level": _DEBUG,
    "set_debug_level_from_env": _DEBUG,
    "DeviceMesh": _MESH,
    "init_device_mesh": _MESH,
    "device_mesh": _MESH,
    "rpc": _RPC,
    "autograd": _RPC,
    "remote_device": _RPC,
    "algorithms": "DDP communication hooks and `Join`: the `ddp` package has its own (see docs/ddp.md)",
    "GroupName": "type alias of torch internals",
    "RankType": "type alias of torch internals",
    "ProcessGroupGloo": "torch's gloo backend class: our `p2p` backend uses it underneath, as a wire",
    "all_gather_coalesced": "deprecated in torch; call `all_gather` per tensor or on one flat tensor",
    "all_reduce_coalesced": "deprecated in torch; all-reduce one flat tensor (as DDP buckets do)",
    "breakpoint": "debugger helper for one rank; not provided",
    "shrink_group": "group surgery is not provided; create the group you need with `new_group`",
    "split_group": "group surgery is not provided; create the groups you need with `new_group`",
    "rendezvous": "we rendezvous through torch's (`init_method` / `store` are passed to torch)",
    "register_rendezvous_handler": "we rendezvous through torch's; register handlers there",
    "reduce_op": "deprecated alias of `ReduceOp` in torch",
    "c10d_logger": _MODULE,
    "config": _MODULE,
    "constants": _MODULE,
    "distributed_c10d": _MODULE,
    "logging_handlers": _MODULE,
    "utils": _MODULE,
    "log": _MODULE,
    "logging": _MODULE,
    "sys": _MODULE,
    "torch": _MODULE,
    "traceback": _MODULE,
    "typing": _MODULE,
    "timedelta": _MODULE,
}

#: Where a supported name behaves differently from torch's (all differences raise, none is silent).
NOTES: dict[str, str] = {
    "recv": "without `src`: the first message from any rank whose tag matches (first come, first served; CPU tensors); tags checked, not used to reorder",
    "irecv": "see `recv`; the handle's `source_rank()` / `_source_rank()` names the sender",
    "all_reduce": "sparse COO tensors: SUM only, as gloo (coalesced result)",
    "send": "tags checked at the receiver, not used to reorder; non-contiguous tensors accepted",
    "isend": "see `send`",
    "batch_isend_irecv": "all ops on one group and device",
    "P2POp": "accepts our or torch's `isend` / `irecv`",
    "recv_object_list": "`src` required",
    "new_group": "on non-members a `NonMember` equal to torch's `NON_GROUP_MEMBER`: collectives given it are no-ops with torch's warning, `get_rank`/`get_world_size` answer -1",
    "new_subgroups": "`group_size` required on CPU; non-member entries are `NonMember` (torch: `NON_GROUP_MEMBER`)",
    "get_backend": "our backend names (`p2p`, `auto`, `nccl-cupy`, `torch`, ...)",
    "Backend": "torch's constants plus ours (`P2P`, `NCCL_CUPY`, `AUTO`, `TORCH`)",
    "ProcessGroup": "alias of our `Group`",
    "group": "the module `collectives.group`; `group.WORLD` is the default group, read when accessed",
    "GroupMember": "`WORLD` read when accessed; `NON_GROUP_MEMBER` is torch's marker (-100), equal to what `new_group` gives non-members",
    "monitored_barrier": "any backend; raises `CollectiveTimeoutError` naming the late ranks",
    "is_available": "always true",
    "is_nccl_available": "whether our `nccl-cupy` backend can run (CUDA + CuPy)",
    "is_mpi_available": "always false (no MPI backend)",
    "is_ucc_available": "always false (no UCC backend)",
    "is_xccl_available": "always false (no XCCL backend)",
    "is_backend_available": "our backend names and aliases",
    "supports_complex": "always false: complex dtypes are not supported",
    "get_pg_count": "default group plus the subgroups this rank belongs to",
    "record_comm": "labels collectives in traces (`collectives.trace.label`)",
    "ReduceOp": "our enum; torch's values accepted everywhere",
    "Work": "our handle; same `wait` / `is_completed` / `is_success` / `exception`",
    "reduce": "non-root tensors are left unchanged",
    "barrier": "`device_ids` ignored",
    "init_process_group": "backend names: ours, plus `gloo` / `nccl` aliases",
    "get_global_rank": "checks `group_rank` is in the group (torch returns it unchecked for WORLD)",
    "all_gather_single": "alias of `all_gather_into_tensor`",
    "reduce_scatter_single": "alias of `reduce_scatter_tensor`",
}


SUPPORTED, REEXPORTED, MISSING_STATUS = "supported", "torch's own, re-exported", "not provided"


def _kind(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "value"


def public_names() -> list[str]:
    """``dir(torch.distributed)`` of a fresh interpreter, without the private names, sorted."""
    code = "import torch.distributed as d; print('\\n'.join(n for n in dir(d) if not n.startswith('_')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return sorted(done.stdout.split())


def rows() -> list[tuple[str, str, str, str]]:
    """(name, kind, status, note) for every public name of torch.distributed, sorted."""
    out = []
    unclassified = []
    for name in public_names():
        with warnings.catch_warnings():  # deprecated names warn when read
            warnings.simplefilter("ignore", FutureWarning)
            theirs = getattr(tdist, name)
            kind = _kind(theirs)
        if hasattr(collectives, name):
            ours = getattr(collectives, name)
            status = REEXPORTED if ours is theirs else SUPPORTED
            out.append((name, kind, status, NOTES.get(name, "")))
        elif name in MISSING:
            out.append((name, kind, MISSING_STATUS, MISSING[name]))
        else:
            unclassified.append(name)
    if unclassified:
        raise SystemExit(f"api_coverage: classify these torch.distributed names in MISSING: {unclassified}")
    return out


def render() -> str:
    table = rows()
    supported, reexported, missing = (sum(1 for r in table if r[2] == s) for s in (SUPPORTED, REEXPORTED, MISSING_STATUS))
    lines = [
        "# torch.distributed API coverage",
        "",
        f"Generated by `scripts/api_coverage.py` from `dir(torch.distributed)` of torch {torch.__version__.split('+')[0]}"
        " (public names only); `tests/collectives/test_api_coverage.py` fails when it is out of date.",
        "",
        f"Of {len(table)} names: {supported} supported by `collectives`, {reexported} re-exported from torch"
        f" (exceptions, stores), {missing} not provided (each with the reason).",
        "",
        "| name | kind | status | notes |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{n}` | {k} | {s} | {note} |" for n, k, s, note in table]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api-coverage.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python scripts/api_coverage.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
