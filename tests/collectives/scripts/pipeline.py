"""Pipeline parallelism by hand: each rank owns one stage of an MLP; activations go forward with
send/recv, gradients come back with isend/irecv, then a ring exchange with batch_isend_irecv."""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage = torch.nn.Linear(4, 4)
    batch = 3

    # forward: stage r receives activations from r - 1 and sends its output to r + 1
    if rank == 0:
        torch.manual_seed(100)
        x = torch.randn(batch, 4)
    else:
        x = torch.empty(batch, 4)
        src = dist.recv(x, src=rank - 1)
        print(f"rank {rank}: got activations from {src}")
    x.requires_grad_(True)
    y = stage(x)
    if rank < world - 1:
        dist.send(y.detach(), dst=rank + 1)
        grad_y = torch.empty_like(y)
        req = dist.irecv(grad_y, src=rank + 1)
        req.wait()
    else:
        loss = y.pow(2).sum()
        print(f"rank {rank}: loss {loss.item():.4f}")
        grad_y = torch.autograd.grad(loss, y, retain_graph=True)[0]
    y.backward(grad_y)
    if rank > 0:
        dist.isend(x.grad, dst=rank - 1).wait()
    print(f"rank {rank}: weight grad norm {stage.weight.grad.norm().item():.4f}")

    # ring exchange of one value per rank, posted together
    right, left = (rank + 1) % world, (rank - 1) % world
    send_buf = torch.tensor([float(rank * 10)])
    recv_buf = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, send_buf, right), dist.P2POp(dist.irecv, recv_buf, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    print(f"rank {rank}: ring got {recv_buf.item():.1f} from {left}")

    # tagged messages, received in the order they were sent
    if rank == 0:
        for tag in (1, 2):
            dist.send(torch.tensor([float(tag)]), dst=world - 1, tag=tag)
    elif rank == world - 1:
        got = []
        for tag in (1, 2):
            t = torch.zeros(1)
            dist.recv(t, src=0, tag=tag)
            got.append(t.item())
        print(f"rank {rank}: tagged {got}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
