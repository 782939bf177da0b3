"""Other libraries' all-reduce, timed by :mod:`collectives.bench` beside ours (``--peers``).

The libraries people compare CPU collectives against are MPI over shared memory (MPICH, Open
MPI) rather than gloo. With the optional extra ``pip install 'ringddp[peers]'`` (mpi4py and the
``mpich`` wheel, the pairing this was run with), ``python -m collectives.bench --peers mpi``
starts its ranks with that library's ``mpiexec`` instead of :func:`collectives.launch.launch`:
every rank is one MPI process *and* one of ours (it joins our group through ``env://``, rank and
size taken from the MPI launcher's variables), so the ``mpi`` column is timed call by call,
interleaved with ours and torch's, in the same processes, on the same buffers. Open MPI's
launcher variables (``OMPI_COMM_WORLD_RANK``) are recognised too, but that pairing has not been
run here. The MPI call is ``MPI_Allreduce(MPI_IN_PLACE, ...)`` on a NumPy view of the tensor
(no copy), the form a NumPy or torch user calls; its result is checked against torch's like
every other column.

mpi4py is imported only when ``--peers mpi`` is given; it is never a default dependency.
(DeepSpeed's CPU shared-memory all-reduce is not a column: it needs DeepSpeed and a C++
toolchain to JIT-build its op.)
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch

#: peers ``--peers`` accepts.
PEERS = ("mpi",)

#: how each MPI launcher tells a process its rank and the number of processes.
_RANK_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))

_MPI_DTYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T", torch.int64: "INT64_T",
               torch.uint8: "UINT8_T"}


def unavailable(peer: str) -> str | None:
    """Why ``peer`` cannot run here (what to install), or None."""
    if peer != "mpi":
        return f"unknown peer {peer!r}; expected one of {PEERS}"
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


def make(peer: str, rank: int) -> Any:
    """The peer object for ``peer`` on this rank."""
    if peer == "mpi":
        return MpiPeer(rank)
    raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
