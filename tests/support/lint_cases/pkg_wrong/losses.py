import torch
import torch.distributed as dist


def gather_features(x, rank, world_size, local_loss=False):
    parts = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)  # expect: WB101
    if not local_loss:
        parts[rank] = x
    return torch.cat(parts)


def gather_grads(g, world_size):
    bufs = [torch.zeros_like(g) for _ in range(world_size)]
    dist.all_gather(bufs, g)  # expect: WB103
    return torch.cat(bufs)
