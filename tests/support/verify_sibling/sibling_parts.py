"""The parts `spec.py` imports as a sibling module (by its bare name, as `python spec.py` would)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROWS = 14


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(ROWS, 5, generator=g, dtype=torch.float64), torch.randn(
        ROWS, generator=g, dtype=torch.float64
    )


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def mean_squared(model: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
    x, y = b
    return ((model(x).squeeze(-1) - y) ** 2).mean()


def step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]) -> None:
    rows = torch.tensor(float(sum(len(mb[0]) for mb in mbs)), dtype=torch.float64)
    dist.all_reduce(rows)
    for x, y in mbs:
        (((model(x).squeeze(-1) - y) ** 2).sum() / rows * dist.get_world_size()).backward()
    opt.step()
