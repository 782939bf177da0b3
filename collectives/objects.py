"""Object collectives: picklable Python objects over the tensor collectives, as torch does it.

``broadcast_object_list``, ``all_gather_object``, ``gather_object``, ``scatter_object_list``,
``send_object_list`` and ``recv_object_list`` have torch.distributed's signatures and results.
Each object is pickled exactly as torch pickles it (``pickle.Pickler`` with the default protocol)
into a ``uint8`` tensor; the sizes travel first (``int64``), then the bytes, over our own
collectives (``collectives.api``) and point-to-point (``collectives.p2p``).

.. warning::
   Like torch's, these functions unpickle what other ranks send, and unpickling can run arbitrary
   code. Only use them between trusted peers.

Cost: one small collective for the sizes plus one for the bytes (padded to the largest object
where the collective needs equal sizes).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from . import api, p2p
from .group import Group, NonMember, get_group, get_rank, get_world_size, member


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    f = io.BytesIO()
    pickle.Pickler(f).dump(obj)
    return torch.frombuffer(bytearray(f.getvalue()), dtype=torch.uint8).to(device)


def _to_object(t: torch.Tensor) -> Any:
    return pickle.Unpickler(io.BytesIO(t.cpu().numpy().tobytes())).load()


def _device(g: Group, device: torch.device | str | None) -> torch.device:
    """Where the byte tensors live: ``device`` if given, else the current GPU on the NCCL backend, else CPU."""
    if device is not None:
        return torch.device(device)
    if g.backend == "nccl-cupy":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _root(g: Group, name: str, what: str, rank: int | None, group_rank: int | None) -> int:
    """Global rank of the root from ``src``/``dst`` or ``group_src``/``group_dst`` (default: group rank 0)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"{name}: pass either {what} or group_{what}, not both")
    if group_rank is None:
        return g.ranks[0] if rank is None else g.ranks[g.group_rank(rank, what, name)]
    if isinstance(group_rank, bool) or not isinstance(group_rank, int):
        raise TypeError(f"{name}: group_{what} must be an int rank, got {type(group_rank).__name__}")
    if not 0 <= group_rank < get_world_size(g):
        raise ValueError(f"{name}: group_{what}={group_rank} is out of range for a group of {get_world_size(g)}")
    return g.ranks[group_rank]


def _check_list(obj: object, name: str, what: str, length: int | None = None) -> list:
    if not isinstance(obj, list):
        raise TypeError(f"{name}: {what} must be a list, got {type(obj).__name__}")
    if length is not None and len(obj) != length:
        raise ValueError(f"{name}: {what} has {len(obj)} entries; expected {length} (one per rank)")
    return obj


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group | NonMember | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list`` on every rank with the source rank's (same length on every rank)."""
    name = "broadcast_object_list"
    if (g := member(group, name)) is None:  # not a member: nothing, as in torch
        return None
    root = _root(g, name, "src", src, group_src)
    _check_list(object_list, name, "object_list")
    dev = _device(g, device)
    is_root = g.ranks[get_rank(g)] == root
    if is_root:
        parts = [_to_tensor(obj, dev) for obj in object_list]
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
    else:
        sizes = torch.empty(len(object_list), dtype=torch.int64, device=dev)
    api.broadcast(sizes, src=root, group=g)
    flat = torch.cat(parts) if is_root and parts else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
    api.broadcast(flat, src=root, group=g)
    if not is_root:
        for i, piece in enumerate(flat.split(sizes.tolist())):
            object_list[i] = _to_object(piece)


def all_gather_object(object_list: list[Any], obj: Any, group: Group | NonMember | None = None) -> None:
    """``object_list[i]`` = the ``obj`` of group rank ``i``, on every rank."""
    name = "all_gather_object"
    if (g := member(group, name)) is None:  # not a member: nothing, as in torch
        return None
    n = get_world_size(g)
    _check_list(object_list, name, "object_list", n)
    mine = _to_tensor(obj, _device(g, None))
    for i, piece in enumerate(_all_gather_bytes(g, mine)):
        object_list[i] = _to_object(piece)


def _all_gather_bytes(g: Group, mine: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's byte tensor (sizes first, then the bytes padded to the largest)."""
    n = get_world_size(g)
    sizes, padded = _pad_to_largest(g, mine)
    out = torch.empty(n * padded.numel(), dtype=torch.uint8, device=mine.device)
    api.all_gather_into_tensor(out, padded, group=g)
    return [piece[:size] for piece, size in zip(out.view(n, -1), sizes)]


def _pad_to_largest(g: Group, mine: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """All-gather the byte counts; return them and ``mine`` zero-padded to the largest."""
    sizes = torch.empty(get_world_size(g), dtype=torch.int64, device=mine.device)
    api.all_gather_into_tensor(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device), group=g)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    return sizes.tolist(), padded


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Group | NonMember | None = None,
    group_dst: int | None = None,
) -> None:
    """On the destination rank, ``object_gather_list[i]`` = the ``obj`` of group rank ``i``."""
    name = "gather_object"
    if (g := member(group, name)) is None:  # not a member: nothing, as in torch
        return None
    root = _root(g, name, "dst", dst, group_dst)
    n, is_root = get_world_size(g), g.ranks[get_rank(g)] == root
    if is_root:
        if object_gather_list is None:
            raise ValueError(f"{name}: the destination rank must pass object_gather_list")
        _check_list(object_gather_list, name, "object_gather_list", n)
    elif object_gather_list is not None:
        raise ValueError(f"{name}: only the destination rank passes object_gather_list")
    sizes, padded = _pad_to_largest(g, _to_tensor(obj, _device(g, None)))
    outs = [torch.empty_like(padded) for _ in range(n)] if is_root else None
    api.gather(padded, outs, dst=root, group=g)
    if is_root:
        assert object_gather_list is not None and outs is not None
        for i, (piece, size) in enumerate(zip(outs, sizes)):
            object_gather_list[i] = _to_object(piece[:size])


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Group | NonMember | None = None,
    group_src: int | None = None,
) -> None:
    """Group rank ``i`` gets the source's ``scatter_object_input_list[i]`` in ``scatter_object_output_list[0]``."""
    name = "scatter_object_list"
    if (g := member(group, name)) is None:  # not a member: nothing, as in torch
        return None
    root = _root(g, name, "src", src, group_src)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(f"{name}: scatter_object_output_list must be a list of at least one element")
    n, is_root = get_world_size(g), g.ranks[get_rank(g)] == root
    dev = _device(g, None)
    if is_root:
        if scatter_object_input_list is None:
            raise ValueError(f"{name}: the source rank must pass scatter_object_input_list")
        _check_list(scatter_object_input_list, name, "scatter_object_input_list", n)
        parts = [_to_tensor(obj, dev) for obj in scatter_object_input_list]
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
        width = torch.tensor([int(sizes.max())], dtype=torch.int64, device=dev)
    else:
        parts, sizes, width = [], None, torch.zeros(1, dtype=torch.int64, device=dev)
    api.broadcast(width, src=root, group=g)
    w = int(width.item())
    pieces = None
    if is_root:
        pieces = [torch.nn.functional.pad(p, (0, w - p.numel())) for p in parts]
    out = torch.empty(w, dtype=torch.uint8, device=dev)
    api.scatter(out, pieces, src=root, group=g)
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    api.scatter(size, list(sizes.view(n, 1)) if sizes is not None else None, src=root, group=g)
    scatter_object_output_list[0] = _to_object(out[: int(size.item())])


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Group | NonMember | None = None,
    device: torch.device | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst``, which receives them with ``recv_object_list``.

    ``use_batch`` is accepted for compatibility; the two messages are always sent in order.
    """
    name = "send_object_list"
    g = get_group(group, name)
    _check_list(object_list, name, "object_list")
    g.peer(name, "dst", dst, group_dst)  # before pickling or any traffic
    dev = _device(g, device)
    parts = [_to_tensor(obj, dev) for obj in object_list]
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=dev)
    p2p.send(sizes, dst, group=g, group_dst=group_dst)
    p2p.send(flat, dst, group=g, group_dst=group_dst)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Group | NonMember | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Fill ``object_list`` with the objects sent by ``src`` (same length as sent); returns ``src``.

    ``src`` is required: there is no any-source receive (see ``collectives.p2p``).
    """
    name = "recv_object_list"
    g = get_group(group, name)
    _check_list(object_list, name, "object_list")
    g.peer(name, "src", src, group_src)
    dev = _device(g, device)
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=dev)
    source = p2p.recv(sizes, src, group=g, group_src=group_src)
    flat = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
    p2p.recv(flat, src, group=g, group_src=group_src)
    for i, piece in enumerate(flat.split(sizes.tolist())):
        object_list[i] = _to_object(piece)
    return source
