# The right forms of wrong_cross.py, split across functions the same way: nothing to report.
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F

import wholebatch


# -- gathers in helpers that keep the gradient ------------------------------------------


def collect(x):
    return wholebatch.all_gather(x)  # backward: reduce-scatter (sum)


def collect_torch(x):
    return torch.cat(dist_fn.all_gather(x))


def clip_loss(img, txt):
    logits = img @ collect(txt).T
    return F.cross_entropy(logits, torch.arange(len(img))) + collect_torch(img).sum() * 0


def gather_keep_local(x, rank, world_size):
    # sentence-transformers' form: the local slice put back on every path
    parts = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    parts[rank] = x
    return torch.cat(parts)


def scaled_clip_loss(img, txt, rank, world_size):
    return F.cross_entropy(img @ gather_keep_local(txt, rank, world_size).T, torch.arange(8))


@torch.no_grad()
def concat_all_gather(x, world_size):
    # MoCo's key gather: no gradient on purpose (a momentum encoder's keys)
    out = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(out, x)
    return torch.cat(out)


class MoCoLoss(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.world_size = world_size

    def forward(self, q, k):
        keys = concat_all_gather(k, self.world_size)
        return F.cross_entropy(q @ keys.T, torch.arange(len(q)))


def gather_metric(x, world_size):
    out = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(out, x)
    return torch.cat(out)


def evaluate(model, loader, world_size):
    accs = [gather_metric(model(x).argmax(-1) == y, world_size) for x, y in loader]
    return torch.cat(accs).float().mean()  # a metric, not a loss


# -- zero_grad, backward and step in helpers, in the right order ------------------------


def reset(model):
    model.zero_grad(set_to_none=True)


def train_reset_first(model, loader, optimizer, criterion):
    for x, y in loader:
        reset(model)
        criterion(model(x), y).backward()
        optimizer.step()


def reset_opt(opt):
    opt.zero_grad()


def train_gan(gen, disc, loader, opt_g, opt_d, criterion):
    for x, z in loader:
        loss_d = criterion(disc(x), disc(gen(z).detach()))
        loss_d.backward()
        reset_opt(opt_g)  # the generator's gradients, not the discriminator's
        opt_d.step()
        opt_d.zero_grad()


class Trainer:
    def __init__(self, model, optimizer, criterion):
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion

    def train_step(self, x, y):
        self.optimizer.zero_grad()
        loss = self.criterion(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def fit(self, loader):
        for x, y in loader:
            self.train_step(x, y)

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def fit_with_step_helper(self, loader):
        for x, y in loader:
            self.criterion(self.model(x), y).backward()
            self.optimizer_step()

    def maybe_clear(self, step):
        if step % 2 == 0:
            self.optimizer.zero_grad()

    def fit_unknown(self, loader, hooks):
        for i, (x, y) in enumerate(loader):
            self.criterion(self.model(x), y).backward()
            hooks.on_after_backward(self)  # unknown: may zero, may not; no finding
            self.maybe_clear(i)  # zeroes only sometimes: not a certain zero_grad
            self.optimizer.step()


def run_batch(model, batch, criterion):
    criterion(model(batch[0]), batch[1]).backward()


def train_backward_in_helper(model, loader, optimizer, criterion):
    for batch in loader:
        optimizer.zero_grad()
        loss = run_batch(model, batch, criterion)
        optimizer.step()
        print(loss)


# -- collectives in helpers, called on every rank ---------------------------------------


def sync_metrics(t):
    dist.all_reduce(t)
    return t


def log(rank, loss):
    loss = sync_metrics(loss)  # every rank
    if rank == 0:
        print(loss.item())


def maybe_sync(t, enabled):
    if enabled:
        dist.all_reduce(t)
    return t


def log_main_only(rank, loss):
    if rank == 0:
        print(maybe_sync(loss, enabled=False))  # the helper's collective is conditional


def sync_group(t, group):
    dist.all_reduce(t, group=group)


def log_subgroup(rank, loss, group):
    if rank in (0, 1):
        sync_group(loss, group=group)


# -- recursion and gather layers with a reducing backward in a helper -----------------


def depth_first(node):
    if node is None:
        return 0
    return 1 + depth_first(node.left) + depth_first(node.right)


def _sum_over_ranks(grads):
    all_grads = torch.stack(grads)
    dist.all_reduce(all_grads)
    return all_grads


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return _sum_over_ranks(grads)[dist.get_rank()]


def sync_grads(model, world_size):
    for p in model.parameters():
        p.grad = sync_metrics(p.grad) / world_size
