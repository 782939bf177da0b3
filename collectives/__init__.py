"""Collective communication built only from point-to-point send/recv.

Drop-in for the ``torch.distributed`` collectives::

    import collectives as dist          # instead of: import torch.distributed as dist
    dist.init_process_group()           # gloo point-to-point underneath
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

See ``collectives/ring.py`` for the ring algorithms, ``tree.py`` for the small-message ones,
``direct.py`` for scatter/gather/all-to-all, ``transport/`` for the wire, and ``backends.py`` to
plug in your own transport (:func:`register_backend`).
"""

from .api import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from . import trace
from .backends import backend_names, register_backend
from .compat import (
    Backend,
    GroupMember,
    ProcessGroup,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    is_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    monitored_barrier,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from .errors import CollectiveError, CollectiveTimeoutError
from .group import (
    Group,
    destroy_process_group,
    get_default_group,
    get_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from .launch import LaunchError, launch
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .ops import SUPPORTED_DTYPES, ReduceOp
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .work import Work

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Group",
    "GroupMember",
    "LaunchError",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "backend_names",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_default_group",
    "get_global_rank",
    "get_group",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "launch",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "register_backend",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
]
