"""Collective communication built only from point-to-point send/recv.

Drop-in for the ``torch.distributed`` collectives::

    import collectives as dist          # instead of: import torch.distributed as dist
    dist.init_process_group()           # gloo point-to-point underneath
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

Point-to-point (``send``/``recv``/``isend``/``irecv``/``batch_isend_irecv``, ``p2p.py``), object
collectives (``objects.py``) and torch's group helpers (``compat.py``) are there too; every name of
torch.distributed and where it stands: ``docs/api-coverage.md``.

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
    symmetric_empty,
)
from . import trace
from .backends import backend_names, register_backend
from .compat import (
    Backend,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    FileStore,
    GroupMember,
    HashStore,
    PrefixStore,
    ProcessGroup,
    QueueEmptyError,
    Store,
    TCPStore,
    all_gather_single,
    default_pg_timeout,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    monitored_barrier,
    new_subgroups,
    new_subgroups_by_enumeration,
    record_comm,
    reduce_scatter_single,
    supports_complex,
)
from .elastic import ElasticGroup, FencedError
from .errors import CollectiveError, CollectiveTimeoutError
from .group import (
    Group,
    NonMember,
    destroy_process_group,
    get_default_group,
    get_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    is_non_member,
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
from .persistent import PersistentAllReduce, all_reduce_init
from .work import Work
from . import torch_backend

torch_backend.register()  # torch.distributed.init_process_group(backend="ringddp")

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "ElasticGroup",
    "FencedError",
    "FileStore",
    "Group",
    "GroupMember",
    "HashStore",
    "LaunchError",
    "NonMember",
    "P2POp",
    "PersistentAllReduce",
    "PrefixStore",
    "ProcessGroup",
    "QueueEmptyError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_init",
    "all_to_all",
    "all_to_all_single",
    "backend_names",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_default_group",
    "get_global_rank",
    "get_group",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
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
    "is_non_member",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "record_comm",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_backend",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "supports_complex",
    "symmetric_empty",
]
