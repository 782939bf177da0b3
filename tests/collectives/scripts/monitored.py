"""monitored_barrier: first everyone arrives; then the last rank is late and rank 0 names it."""

import datetime
import re
import time

import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    print(f"rank {rank}: everyone arrived")
    if rank == world - 1:
        time.sleep(3)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=1), wait_all_ranks=True)
        print(f"rank {rank}: passed")
    except RuntimeError as exc:
        found = re.search(r"Ranks? [\d, ]+ failed to pass monitoredBarrier", str(exc))
        print(f"rank {rank}: " + (found.group(0) if rank == 0 and found else "barrier failed"))


if __name__ == "__main__":
    main()
