"""Inputs for any whole-batch loss, built from its spec: what `wholebatch selftest` and the tests run.

A spec names its positional tensors (`LossSpec.inputs`) and its optional keyword
ones (`extras`); each name says its shape, so inputs for a new loss come with
its spec:

| suffix | tensor |
|---|---|
| `_BD` | rows x dim, float |
| `_BKD` | rows x k x dim (k = 2 hard negatives), float |
| `_BQD`, `_BTD` | token sets: rows x Q (or T) x dim, float; Q = 2 or 3 and T = 3 or 4 by rank (ragged) |
| `_BQ`, `_BT` | their masks (bool; a row's first token always valid) |
| `_B` | an integer per row: `labels_B` among 3 labels, `ids_B` among 4 ids (repeats across ranks) |

Every rank's rows differ (seeded by rank), in float64 by default.

    tensors = inputs(spec, sizes=[2, 0, 3], rank=r)
    loss = call(spec, tensors, scalars(spec), group=...)       # the loss itself
    want = reference(spec)(whole(spec, [inputs(spec, sizes, q) for q in range(3)]),
                           {k: torch.tensor(v) for k, v in scalars(spec).items()})

Legend: B a rank's rows, D = 3.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from wholebatch.losses.specs import LossSpec

__all__ = ["DIM", "SCALARS", "call", "inputs", "reference", "scalars", "whole"]

DIM = 3
SCALARS = {"logit_scale": 2.5, "logit_bias": -0.8, "temperature": 0.6}
"""The value each scalar name takes in the examples."""


def _tokens(letter: str, rank: int) -> int:
    return (2 if letter == "Q" else 3) + rank % 2


def inputs(
    spec: LossSpec,
    sizes: Sequence[int],
    rank: int,
    *,
    extras: Sequence[str] = (),
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """Rank `rank`'s tensors for `spec`'s loss (its inputs, and the `extras` named), by name."""
    b = sizes[rank]
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    out: dict[str, Tensor] = {}
    for name in (*spec.inputs, *extras):
        shape = name.rsplit("_", 1)[-1]
        if shape == "BD":
            out[name] = torch.randn(b, DIM, generator=gen, dtype=dtype) * 0.7
        elif shape == "BKD":
            out[name] = torch.randn(b, 2, DIM, generator=gen, dtype=dtype) * 0.7
        elif shape in ("BQD", "BTD"):
            out[name] = torch.randn(b, _tokens(shape[1], rank), DIM, generator=gen, dtype=dtype)
        elif shape in ("BQ", "BT"):
            mask = torch.rand(b, _tokens(shape[1], rank), generator=gen) > 0.4
            mask[:, 0] = True
            out[name] = mask
        elif shape == "B":
            span = 3 if name.startswith("label") else 4
            out[name] = torch.randint(0, span, (b,), generator=gen)
        else:
            raise ValueError(f"{spec.name}: input {name!r} has no shape suffix examples know")
    return out


def scalars(spec: LossSpec, *, optional: bool = False) -> dict[str, float]:
    """The loss's scalars (with `optional`, its optional ones too), by name."""
    names = (*spec.scalars, *(spec.optional_scalars if optional else ()))
    return {name: SCALARS.get(name, 1.5) for name in names}


def call(spec: LossSpec, tensors: dict[str, Tensor], values: dict[str, Any], **kw: Any) -> Tensor:
    """`spec`'s loss on these tensors and scalars: inputs and scalars positional, the rest by name."""
    fn = getattr(importlib.import_module(spec.home), spec.function)
    args = [tensors[n] for n in spec.inputs] + [values[n] for n in spec.scalars]
    named = {n: tensors[n] for n in spec.extras if n in tensors}
    named.update({n: values[n] for n in spec.optional_scalars if n in values})
    out: Tensor = fn(*args, **named, **kw)
    return out


def whole(spec: LossSpec, per_rank: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Every rank's tensors concatenated in rank order (token sets padded to the longest, the
    pads not valid): the whole batch, as one process sees it."""
    out = {}
    for name in per_rank[0]:
        parts = [t[name] for t in per_rank]
        if parts[0].dim() >= 2 and name.rsplit("_", 1)[-1] in ("BQD", "BTD", "BQ", "BT"):
            longest = max(p.shape[1] for p in parts)
            pad = (0, 0) if parts[0].dim() == 3 else ()
            parts = [F.pad(p, (*pad, 0, longest - p.shape[1])) for p in parts]
        out[name] = torch.cat(parts)
    return out


def reference(spec: LossSpec) -> Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]:
    """`spec`'s one reference formula (`LossSpec.formula` in its `home`)."""
    formula: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor] = getattr(
        importlib.import_module(spec.home), spec.formula
    )
    return formula
