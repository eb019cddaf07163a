# A correct 100-line DDP training script with helpers: nothing to report. It is also the
# file `python -m benchmarks.bench_lint --startup` times `wholebatch lint FILE` on.
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import wholebatch


def setup() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def build_model(dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
    )


def contrastive_loss(img, txt, scale):
    all_img = wholebatch.all_gather(img)  # backward: reduce-scatter (sum)
    all_txt = wholebatch.all_gather(txt)
    logits = scale * all_img @ all_txt.T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def lr_at(step: int, total: int, base: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    return base * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def forward_backward(model, batch, scale, n_micro):
    img, txt = batch
    loss = contrastive_loss(model(img), model(txt), scale) / n_micro
    loss.backward()
    return loss.detach()


def optimizer_step(model, optimizer, clip: float) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def log(rank: int, step: int, loss) -> None:
    dist.all_reduce(loss)  # every rank joins; only rank 0 prints
    if rank == 0:
        print(f"step {step} loss {loss.item() / dist.get_world_size():.4f}")


def save(rank: int, model, path: str) -> None:
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, batches) -> float:
    total = sum(model(x).pow(2).mean().item() for x in batches)
    return total / max(1, len(batches))


def train(steps: int = 100, dim: int = 64, n_micro: int = 4) -> None:
    rank, world = setup()
    torch.manual_seed(rank)
    model = DDP(build_model(dim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scale = torch.tensor(10.0)
    for step in range(steps):
        set_lr(optimizer, lr_at(step, steps, 3e-4))
        total = torch.zeros(())
        for i in range(n_micro):
            batch = (torch.randn(8, dim), torch.randn(8, dim))
            if i < n_micro - 1:
                with model.no_sync():
                    total += forward_backward(model, batch, scale, n_micro)
            else:
                total += forward_backward(model, batch, scale, n_micro)
        optimizer_step(model, optimizer, 1.0)
        if step % 10 == 0:
            log(rank, step, total)
    save(rank, model, os.environ.get("CKPT", "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
