"""The one-shot all-reduce as one native call, and the two-shot's fold: ``oneshot.c``, built by
``scripts/setup.sh``.

A 4 KiB one-shot in Python is ~500 bytecodes of protocol (copy in, publish the step, wake,
wait, compare signatures, fold, publish done) around two small torch calls; the same steps in
C take one call of a small CPython extension module (DESIGN §3 has the numbers; a ``ctypes``
call of one or two arguments alone cost 1-1.6 µs here, the module's of eight 0.06).
``oneshot.c`` implements exactly the steps of :func:`collectives.shm_algorithms._one_shot`
over :class:`.regions.Regions`, on the same control words, so ranks running it and ranks
running the Python path interoperate. Only
its busy spin (:data:`.waiting.BUSY_SPIN`, none when ranks outnumber cores) runs in C: a wait
not over by then returns to Python, which waits with the transport's waiter (yielding, sleep,
deadline, dead peers, abandoned groups, the same errors) and calls again where it stopped.

Bitwise equal to the Python path, which stays the reference: each element is folded by the
same IEEE operation, in the same rank order ``((x0 op x1) op x2) ...``, compiled without
``-ffast-math`` and with ``-ffp-contract=off`` (torch's ``add`` is ``a + 1 * b``, exact);
integer sums and products wrap like torch's. Offered for float32/64 SUM, AVG (the sum, then
the Python division) and PRODUCT, and for integer SUM, PRODUCT, MIN and MAX; float MIN/MAX
(torch's NaN and signed-zero rules differ between its vector and scalar loops), bool,
half precision and anything else run the Python path. The one difference: where two NaNs
with different payloads meet in a float sum or product, either payload may come out (C and
torch may order the operands of ``+`` differently); both are NaN.

The two-shot (above 2 ranks, past the one-shot's size) keeps its protocol in Python, a few
steps per megabytes-sized piece; the kernel does its fold of a rank's slice (:func:`fold_copy`):
into the rank's region and its output in one pass, 16 KiB at a time while they are in cache,
instead of a fold and a copy that reads the region again (a 2 MiB slice 0.37 instead of 0.49
ms, 8 MiB 1.45-1.50 instead of 1.93, single process).

The module is built by the system C compiler against this interpreter's headers and named
after a CRC of ``oneshot.c`` and the interpreter's ABI, so a changed source or another Python is
never run from a stale build. When it cannot be loaded (not built: no compiler or no Python
headers at set-up; another platform) or ``RINGDDP_NATIVE=0``, :func:`kernel` returns None, one
``logging`` line says why, and the Python path runs.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import subprocess
import sysconfig
import types
import zlib
from typing import Callable, Sequence

import torch

from ...ops import ReduceOp
from .control import CALL, DONE, ON_CALL, ON_DONE, ON_STEP, SEQ, SLEEPING, TAG

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("oneshot.c")
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-std=gnu11", "-fvisibility=hidden")
#: ranks the kernel keeps its operands for on the stack (``MAX_STACK_RANKS`` in oneshot.c).
MAX_RANKS = 64
#: what a call of the kernel that did not finish asks for (its reply ``>> 32``; the peer in the
#: low 32 bits): wait until the peer is done with the piece before last, or has reached the
#: step, then call again with this phase; or the peer's signature differs.
WAIT_DONE, WAIT_STEP, MISMATCH = 1, 2, 3

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.int32: 2, torch.int64: 3, torch.uint8: 4, torch.int8: 5}
_FLOAT_OPS = {ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.PRODUCT: 1}
_INT_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3}


class Plan(ctypes.Structure):
    """``plan_t`` of oneshot.c: what stays the same from call to call."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "rank", "world", "dtype", "op", "nbytes", "numel",
        "seq", "tag", "done", "sleeping", "call", "on_step", "on_done", "on_call")] + [
        ("ctrl", ctypes.POINTER(ctypes.c_void_p)),
        ("half0", ctypes.POINTER(ctypes.c_void_p)),
        ("half1", ctypes.POINTER(ctypes.c_void_p)),
        ("fds", ctypes.POINTER(ctypes.c_int64)),
    ]


def library_path() -> pathlib.Path:
    """Where the module built from the current ``oneshot.c`` for this interpreter lies."""
    crc = zlib.crc32(SOURCE.read_bytes())
    return SOURCE.with_name(f"_oneshot_{crc:08x}{sysconfig.get_config_var('EXT_SUFFIX')}")


def build(compiler: str | None = None) -> pathlib.Path:
    """Compile ``oneshot.c`` with the system C compiler (``$CC``, default ``gcc``) unless built
    already; returns the module's path. Raises ``OSError`` / ``CalledProcessError`` on failure."""
    target = library_path()
    if not target.exists():
        for stale in SOURCE.parent.glob("_oneshot_*.so"):
            stale.unlink()
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        cc = compiler or os.environ.get("CC", "gcc")
        include = sysconfig.get_paths()["include"]
        subprocess.run([cc, *FLAGS, f"-I{include}", "-o", str(partial), str(SOURCE)],
                       check=True, capture_output=True, text=True)
        os.replace(partial, target)  # atomic: a concurrent loader sees all or nothing
    return target


def _load() -> types.ModuleType | None:
    if os.environ.get("RINGDDP_NATIVE", "1") == "0":
        log.info("RINGDDP_NATIVE=0: the shm all-reduce (one-shot, two-shot fold) runs in Python")
        return None
    try:
        path = library_path()
        loader = importlib.machinery.ExtensionFileLoader(f"{__package__}._oneshot", str(path))
        spec = importlib.util.spec_from_file_location(loader.name, str(path), loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.warning("native one-shot kernel not loaded (%s; `bash scripts/setup.sh` builds it): "
                    "the shm all-reduce (one-shot, two-shot fold) runs in Python", exc)
        return None
    return module


_module: types.ModuleType | None | bool = False  # False: not loaded yet


def library() -> types.ModuleType | None:
    """The loaded module, or None (logged once) where it is unavailable or switched off."""
    global _module
    if _module is False:
        _module = _load()
    return _module  # type: ignore[return-value]


def codes(dtype: torch.dtype, op: ReduceOp) -> tuple[int, int] | None:
    """The kernel's codes for folding ``dtype`` with ``op``, or None where it offers no kernel."""
    d = _DTYPES.get(dtype)
    if d is None:
        return None
    o = (_FLOAT_OPS if dtype.is_floating_point else _INT_OPS).get(op)
    return None if o is None else (d, o)


def kernel() -> Callable[..., int] | None:
    """``one_shot(plan, buf, g, step, signature, phase, spin_ns)`` (addresses and ints; see
    oneshot.c), or None (see :func:`library`)."""
    module = library()
    return None if module is None else module.one_shot


def fold_copy(
    dtype: torch.dtype, op: ReduceOp
) -> Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], None] | None:
    """``run(out, also, operands)``: ``out`` = the fold of ``operands`` in rank order (AVG as
    SUM: the caller divides) and ``also`` = ``out``, a cache-sized block at a time, in one pass
    (the two-shot's reduction of a slice: into this rank's region and its output; oneshot.c's
    ``fold_copy``). Contiguous tensors of one size and ``dtype``; ``also`` may be one of the
    operands. None where the kernel is not loaded or does not offer ``(dtype, op)``."""
    found = codes(dtype, op)
    lib = library()
    if lib is None or found is None or not lib.offers(*found):
        return None
    d, o, fold = found[0], found[1], lib.fold_copy

    def run(out: torch.Tensor, also: torch.Tensor, operands: Sequence[torch.Tensor]) -> None:
        fold(d, o, out.data_ptr(), also.data_ptr(), out.numel(), *[x.data_ptr() for x in operands])

    return run


def plan(rank: int, world: int, dtype: torch.dtype, op: ReduceOp, numel: int,
         ctrl: list[int], halves: tuple[list[int], list[int]], fds: list[int]) -> Plan | None:
    """A :class:`Plan` for the kernel (it holds the arrays it points into), or None where the
    kernel does not apply: not loaded, ``(dtype, op)`` not offered, too many ranks. ``ctrl``,
    ``halves`` and ``fds``: per rank, the control block's and each half's address, and the
    socket to that peer (-1 for this rank)."""
    found = codes(dtype, op)
    lib = library()
    if lib is None or found is None or world > MAX_RANKS or not lib.offers(*found):
        return None
    words = ctypes.c_void_p * world
    return Plan(rank, world, found[0], found[1], numel * dtype.itemsize, numel,
                SEQ, TAG, DONE, SLEEPING, CALL, ON_STEP, ON_DONE, ON_CALL,
                words(*ctrl), words(*halves[0]), words(*halves[1]), (ctypes.c_int64 * world)(*fds))


def main() -> int:
    """``scripts/setup.sh``: build, or log why not (the Python path then runs); 0 either way."""
    logging.basicConfig(level=logging.INFO, format="ringddp: %(message)s")
    try:
        built = build()
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native one-shot kernel not built (%s); the Python path will run", detail)
    else:
        log.info("native one-shot kernel %s", built.name)
    return 0
