"""DDP on uneven data: rank r has 3 + 2r batches; join() lets the ranks that run out shadow the
others. Also the wrapper's surface: model.module, state_dict keys, device_ids/output_device."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = DDP(net, device_ids=None, output_device=None)
    print(f"rank {rank}: module is the net {model.module is net}")
    print(f"rank {rank}: state_dict keys {list(model.state_dict())}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(3 + 2 * rank)]
    with model.join():
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    print(f"rank {rank}: trained on {len(batches)} batches")
    for name, t in model.module.state_dict().items():
        if t.is_floating_point():
            print(f"rank {rank}: {name} sum {t.sum().item():.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
