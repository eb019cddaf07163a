# Distributed mistakes: each flagged line ends with `# expect: CODE`.
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_gather as c10d_all_gather


def train_contrastive(model, loader, optimizer, world_size):
    for images, texts in loader:
        img, txt = model(images, texts)
        all_img = [torch.zeros_like(img) for _ in range(world_size)]
        dist.all_gather(all_img, img)  # expect: WB101
        all_img = torch.cat(all_img)
        logits = txt @ all_img.T
        loss = F.cross_entropy(logits, torch.arange(len(txt)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def clip_loss(img, txt, world_size):
    parts = []
    buf = [torch.empty_like(txt) for _ in range(world_size)]
    c10d_all_gather(buf, txt)  # expect: WB101
    for t in buf:
        parts.append(t.float())
    all_txt = torch.stack(parts).flatten(0, 1)
    return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # expect: WB102
        (x,) = ctx.saved_tensors
        grad_out = torch.zeros_like(x)
        grad_out[:] = grads[dist.get_rank()]
        return grad_out


def sync_grads(model, world_size):
    for p in model.parameters():
        bufs = [torch.zeros_like(p.grad) for _ in range(world_size)]
        dist.all_gather(bufs, p.grad)  # expect: WB103
        p.grad = torch.cat(bufs)


def sync_grads_into_tensor(model, world_size):
    for p in model.parameters():
        g = p.grad
        out = torch.empty(world_size * g.numel())
        dist.all_gather_into_tensor(out, g.flatten())  # expect: WB103
        p.grad.copy_(out.view(world_size, -1)[0].view_as(g))


def log_metrics(rank, loss):
    if rank == 0:
        dist.all_reduce(loss)  # expect: WB104
        print(loss.item())


def save(model, path):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
        dist.barrier()  # expect: WB104


def evaluate(model, loader, rank):
    if rank != 0:
        return  # expect: WB105
    total = torch.zeros(1)
    for x in loader:
        total += model(x).sum()
    dist.all_reduce(total)
    return total


def train_skip_nan(model, loader, optimizer):
    for x in loader:
        loss = model(x).mean()
        if not torch.isfinite(loss):
            continue  # expect: WB105
        loss.backward()
        dist.all_reduce(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
