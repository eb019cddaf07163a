"""A tiny two-tower model with dropout for the gradient-caching tests (float64)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["TwoTower", "embed"]


class TwoTower(nn.Module):
    """Image and text towers, each with dropout (so a second pass without RNG replay differs).

    With `inner_scale`, a `logit_scale` parameter lives inside the module but is
    not used by `forward`: only the loss uses it (open_clip's layout).
    """

    def __init__(self, d_in: int = 4, d_out: int = 3, *, inner_scale: float | None = None) -> None:
        super().__init__()
        self.img = nn.Sequential(
            nn.Linear(d_in, 6), nn.Tanh(), nn.Dropout(0.4), nn.Linear(6, d_out)
        )
        self.txt = nn.Sequential(
            nn.Linear(d_in, 6), nn.Dropout(0.4), nn.Tanh(), nn.Linear(6, d_out)
        )
        if inner_scale is not None:
            self.logit_scale = nn.Parameter(torch.tensor(inner_scale, dtype=torch.float64))
        self.double()

    def forward(self, x_img: Tensor, x_txt: Tensor) -> tuple[Tensor, Tensor]:
        return self.img(x_img), self.txt(x_txt)


def embed(model: nn.Module, micro_batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`embed_fn` for `CachedStep`: the two towers' outputs for one micro-batch."""
    out: tuple[Tensor, Tensor] = model(*micro_batch)
    return out
