"""A script written against torch's types: ProcessGroup annotations, group.WORLD, DistError."""

from typing import Optional

import torch
import torch.distributed as dist


def average(t: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t / dist.get_world_size(group)


def describe(group: dist.ProcessGroup) -> str:
    return f"{isinstance(group, dist.ProcessGroup)} size {dist.get_world_size(group)}"


def main():
    dist.init_process_group(backend=dist.Backend.GLOO)
    rank = dist.get_rank()
    world: dist.ProcessGroup = dist.group.WORLD
    print(f"rank {rank}: world {describe(world)} same as GroupMember.WORLD {world is dist.GroupMember.WORLD}")
    print(f"rank {rank}: average {average(torch.tensor([float(rank)]), world).item():.4f}")
    print(f"rank {rank}: available {dist.is_available()} gloo {dist.is_gloo_available()} "
          f"initialized {dist.is_initialized()} elastic {dist.is_torchelastic_launched()}")
    print(f"rank {rank}: DistError is a RuntimeError {issubclass(dist.DistError, RuntimeError)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
