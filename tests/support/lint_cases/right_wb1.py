# Correct distributed code: nothing here may be flagged.
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

import wholebatch
from wholebatch import all_gather, all_ranks_agree


def train_contrastive(model, loader, optimizer):
    for images, texts in loader:
        img, txt = model(images, texts)
        all_img = wholebatch.all_gather(img)  # differentiable: backward is reduce-scatter
        loss = F.cross_entropy(txt @ all_img.T, torch.arange(len(txt)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def clip_loss(img, txt):
    all_txt = all_gather(txt)
    return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))


def clip_loss_torch(img, txt):
    all_txt = torch.cat(dist_nn.all_gather(txt))
    return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))


def clip_loss_local_slice(img, txt, rank, world_size):
    # open_clip's `gather_with_grad=False`: the local slice is put back with its gradient.
    gathered = [torch.zeros_like(txt) for _ in range(world_size)]
    dist.all_gather(gathered, txt)
    gathered[rank] = txt
    all_txt = torch.cat(gathered)
    return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))


def gather_for_logging(loss, world_size):
    # all_gather of a detached metric, never backpropagated: fine.
    losses = [torch.zeros_like(loss) for _ in range(world_size)]
    dist.all_gather(losses, loss.detach())
    return torch.stack(losses).mean().item()


def reduce_loss(loss, world_size):
    out = [torch.zeros_like(loss) for _ in range(world_size)]
    dist.all_gather(out, loss.detach())
    return torch.stack(out).mean()


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def sync_grads(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def sync_grads_gather_then_sum(model, world_size):
    for p in model.parameters():
        bufs = [torch.zeros_like(p.grad) for _ in range(world_size)]
        dist.all_gather(bufs, p.grad)
        p.grad = torch.stack(bufs).sum(0)


def wholebatch_sync(model):
    for p in model.parameters():
        p.grad = wholebatch.all_reduce(p.grad)


def grad_norms(model, world_size):
    norms = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(norms, torch.stack([p.grad.norm() for p in model.parameters()]).norm())
    return norms


def save(model, path, rank):
    if rank == 0:
        torch.save(model.state_dict(), path)
        print("saved")
    dist.barrier()


def broadcast_config(rank):
    if rank == 0:
        objs = [{"lr": 0.1}]
    else:
        objs = [None]
    dist.broadcast_object_list(objs, src=0)
    return objs[0]


def both_branches(x, rank):
    if rank == 0:
        dist.broadcast(x, src=0)
    else:
        dist.broadcast(x, src=0)


def send_recv(x, rank):
    if rank == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(x, src=0)


def subgroup(x, rank, group, ranks):
    if rank in ranks:
        dist.all_reduce(x, group=group)
    if rank < 2:
        dist.all_reduce(x, group=group)


def zero_first(local_rank):
    # The Hugging Face "main process first" pattern: every rank calls barrier once.
    if local_rank not in (-1, 0):
        dist.barrier()
    prepare_data()
    if local_rank == 0:
        dist.barrier()


def prepare_data():
    pass


def early_exit_no_collective(model, rank, path):
    if rank != 0:
        return
    torch.save(model.state_dict(), path)


def skip_nan_agreed(model, loader, optimizer):
    for x in loader:
        loss = model(x).mean()
        if not all_ranks_agree(torch.isfinite(loss)):
            continue
        loss.backward()
        dist.all_reduce(loss.detach())
        optimizer.step()
        optimizer.zero_grad()


def skip_nan_reduced(model, loader, optimizer):
    for x in loader:
        loss = model(x).mean()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if not torch.isfinite(total):
            continue
        dist.all_reduce(loss.detach())


def hf_is_distributed(args, loss):
    # `local_rank != -1` means "launched distributed": true on every rank.
    if args.local_rank != -1:
        dist.all_reduce(loss)
    return loss
