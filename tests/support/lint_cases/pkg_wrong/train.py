import torch
import torch.nn.functional as F

from pkg_wrong import gather_features
from pkg_wrong.losses import gather_grads

from . import steps
from .steps import BaseTrainer


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def forward(self, img, txt):
        all_txt = gather_features(txt, self.rank, self.world_size, local_loss=True)
        return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))


def train(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        steps.clear(model)  # expect: WB202
        optimizer.step()


def log(rank, loss):
    if rank == 0:
        print(steps.sync(loss))  # expect: WB104


def sync_grads(model, world_size):
    for p in model.parameters():
        p.grad = gather_grads(p.grad, world_size)


class Trainer(BaseTrainer):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def fit(self, loader):
        for x in loader:
            self.backward(self.model(x).sum())
            self.step()  # expect: WB201
