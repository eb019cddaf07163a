"""Single-process references: all W ranks of a collective simulated in one process.

Each function takes every rank's input (a list, rank order) and returns every
rank's output, built from `torch.cat`, `sum`, `split` and friends under
autograd, so backward through them is the whole-batch gradient by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def all_gather(xs: Sequence[Tensor], dim: int = 0) -> list[Tensor]:
    out = torch.cat(list(xs), dim)
    return [out for _ in xs]


def reduce_scatter(
    xs: Sequence[Tensor], dim: int = 0, sizes: Sequence[int] | None = None
) -> list[Tensor]:
    total = torch.stack(list(xs)).sum(0)
    w = len(xs)
    split = list(sizes) if sizes is not None else [total.shape[dim] // w] * w
    return list(total.split(split, dim))


def all_to_all(
    xs: Sequence[Tensor], send_sizes: Sequence[Sequence[int]], dim: int = 0
) -> list[Tensor]:
    w = len(xs)
    chunks = [x.split(list(send_sizes[r]), dim) for r, x in enumerate(xs)]
    return [torch.cat([chunks[r][j] for r in range(w)], dim) for j in range(w)]


def all_reduce(xs: Sequence[Tensor], op: str = "sum") -> list[Tensor]:
    stacked = torch.stack(list(xs))
    out = {
        "sum": lambda: stacked.sum(0),
        "mean": lambda: stacked.mean(0),
        "max": lambda: stacked.amax(0),  # amax splits the gradient evenly among ties
        "min": lambda: stacked.amin(0),
    }[op]()
    return [out for _ in xs]


def broadcast(xs: Sequence[Tensor], src: int = 0) -> list[Tensor]:
    return [xs[src] for _ in xs]


def ring_shift(xs: Sequence[Tensor], shift: int = 1) -> list[Tensor]:
    w = len(xs)
    return [xs[(r - shift) % w] for r in range(w)]
