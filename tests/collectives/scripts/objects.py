"""Object collectives: a config broadcast from rank 0, per-rank statistics gathered, work items
scattered, and a checkpoint-like dict sent point to point."""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    config = [{"lr": 0.1, "layers": [4, 8, 2], "name": "mlp"}, None] if rank == 0 else [None, None]
    dist.broadcast_object_list(config, src=0)
    print(f"rank {rank}: config {config}")

    stats = {"rank": rank, "seen": list(range(rank + 1)), "ok": rank % 2 == 0}
    everyone = [None] * world
    dist.all_gather_object(everyone, stats)
    print(f"rank {rank}: all stats {everyone}")

    at_root = [None] * world if rank == 0 else None
    dist.gather_object(f"hello from {rank}" * (rank + 1), at_root, dst=0)
    if rank == 0:
        print(f"rank {rank}: gathered {at_root}")

    mine = [None]
    work = [{"shard": i, "files": [f"part-{i}-{j}" for j in range(i + 1)]} for i in range(world)] if rank == 0 else None
    dist.scatter_object_list(mine, work, src=0)
    print(f"rank {rank}: work {mine[0]}")

    if rank == 0:
        dist.send_object_list([{"step": 7, "weights": torch.arange(3.0)}, "tail"], dst=world - 1)
    elif rank == world - 1:
        box = [None, None]
        dist.recv_object_list(box, src=0)
        print(f"rank {rank}: checkpoint step {box[0]['step']} weights {box[0]['weights'].tolist()} {box[1]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
