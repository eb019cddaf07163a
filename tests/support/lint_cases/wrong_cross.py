# The classic mistakes split across functions (a helper, a method, a train_step the loop
# calls): each flagged line ends with `# expect: CODE`.
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# -- WB101: the no-gradient gather happens in a helper; the loss is built elsewhere --------


def collect(x, world_size):
    parts = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)  # expect: WB101
    return torch.cat(parts)


def clip_loss(img, txt, world_size):
    all_txt = collect(txt, world_size)
    logits = img @ all_txt.T
    return F.cross_entropy(logits, torch.arange(len(img)))


class GatherLoss(nn.Module):
    """The gather in a method, the loss in forward (through self.)."""

    def __init__(self, world_size):
        super().__init__()
        self.world_size = world_size

    def _gather(self, x):
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(out, x)  # expect: WB101
        return torch.cat(out)

    def _logits(self, img, txt):
        return img @ self._gather(txt).T

    def forward(self, img, txt):
        return F.cross_entropy(self._logits(img, txt), torch.arange(len(img)))


def gather_local_slice_sometimes(x, rank, world_size, local_loss):
    parts = [torch.zeros_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)  # expect: WB101
    if not local_loss:
        parts[rank] = x  # only on this path does the local slice keep its gradient
    return torch.cat(parts)


def train_contrastive(model, loader, optimizer, rank, world_size):
    for images, texts in loader:
        img, txt = model(images, texts)
        all_txt = gather_local_slice_sometimes(txt, rank, world_size, local_loss=True)
        loss = F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# -- WB202: zero_grad in a helper, called between backward and step --------------------


def reset(model):
    model.zero_grad(set_to_none=True)


def train_reset_in_helper(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        reset(model)  # expect: WB202
        optimizer.step()


# -- WB201: backward inside a train_step the loop calls; nothing ever zeroes ------------


class Trainer:
    def __init__(self, model, optimizer, criterion):
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion

    def train_step(self, x, y):
        loss = self.criterion(self.model(x), y)
        loss.backward()
        return loss.detach()

    def fit(self, loader):
        for x, y in loader:
            self.train_step(x, y)
            self.optimizer.step()  # expect: WB201

    def optimizer_step(self):
        self.optimizer.step()

    def fit_with_step_helper(self, loader):
        for x, y in loader:
            self.criterion(self.model(x), y).backward()
            self.optimizer_step()  # expect: WB201


# -- WB202 through a method: backward in train_step, zero in a helper, then the step -----


class ZeroingTrainer(Trainer):
    def clear(self):
        self.optimizer.zero_grad()

    def fit(self, loader):
        for x, y in loader:
            self.train_step(x, y)
            self.clear()  # expect: WB202
            self.optimizer.step()


# -- WB104 / WB105: a collective inside a helper ----------------------------------------


def sync_metrics(t):
    dist.all_reduce(t)
    return t


def log_on_main(rank, loss):
    if rank == 0:
        print(sync_metrics(loss).item())  # expect: WB104


def evaluate(model, loader, rank):
    total = torch.zeros(1)
    for x in loader:
        total += model(x).sum()
    if rank != 0:
        return None  # expect: WB105
    return sync_metrics(total)


# -- WB102: a gather layer whose forward gathers in a helper -----------------------------


def _gather_list(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


class HelperGatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tuple(_gather_list(x))

    @staticmethod
    def backward(ctx, *grads):  # expect: WB102
        return grads[dist.get_rank()]


# -- WB103: gradients gathered in a helper and stored back -------------------------------


def gather_cat(t, world_size):
    bufs = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(bufs, t)  # expect: WB103
    return torch.cat(bufs)


def sync_grads(model, world_size):
    for p in model.parameters():
        p.grad = gather_cat(p.grad, world_size)
