"""Subgroups: even/odd groups with new_group, pairs with new_subgroups, rank translation."""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mine)
    ranks = dist.get_process_group_ranks(mine)
    print(f"rank {rank}: parity group {ranks} sum {t.item():.1f} "
          f"group rank {dist.get_group_rank(mine, rank)} size {dist.get_world_size(mine)}")
    print(f"rank {rank}: group rank 0 is global {dist.get_global_rank(mine, 0)}")

    b = torch.tensor([float(rank * 100)])
    dist.broadcast(b, src=ranks[-1], group=mine)
    print(f"rank {rank}: broadcast from {ranks[-1]} -> {b.item():.1f}")

    pair, pairs = dist.new_subgroups(group_size=1)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pair)
    print(f"rank {rank}: singleton {dist.get_process_group_ranks(pair)} {t.item():.1f} of {len(pairs)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
