"""Which normalisation a step applies to its items, read from its gradient (`NormFit`).

When a spec gives `normalize` (the items' mask and sequence/group ids) and
`item_losses` (their losses), verify writes the failing split gradient g, and
the reference's, as sums over cells:

    g = sum_c a_c grad(sum_{i in c} m_i l_i)

A cell is the items of one micro-batch that share a (sequence id, group id)
pair. Every mode of `wholebatch.Normalize`, over the whole step or per
micro-batch, gives the items of a cell one weight (token: one N; sequence: the
sequence's n_s and the S of the step or of the micro-batch; group: likewise;
constant: C), so the a_c (least squares over every parameter entry, exact to
round-off when the step is such a sum) are every item's weight w_i = a_c(i) m_i.
`read_weights` then asks `mode_weights` which (mode, scope) gives those weights:
the declared mode over the whole step first, then the same mode per micro-batch,
then the others, so a batch on which two modes coincide is named by the mode
that was declared.

Legend: W ranks, K micro-batches per rank, J = W x K micro-batches, I items of
one micro-batch, C cells of the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from wholebatch.errors import WholebatchError
from wholebatch.train.normalize import MODES, Mode, Normalize, Scope, mode_weights, read_items

__all__ = ["MATCH_TOL", "cells_of", "item_weights", "read_weights"]

# Item weights match a mode when every one is within this fraction of the largest weight:
# the fitted weights are exact to round-off (float64: ~1e-12; float32 ~1e-6 amplified by
# the fit's conditioning), while modes that differ on a ragged batch differ by far more.
MATCH_TOL = 1e-3

Items = dict[str, Tensor]


def cells_of(norm: Normalize, micro_batch: Any, index: int) -> tuple[Items, Tensor, int]:
    """`norm.items(micro_batch)` (mask, sequence, group as given) and each item's cell [I] (-1: masked out).

    Raises:
        WholebatchError: `items` raised or returned bad ids (`read_items`'s text).
    """
    ids, error = read_items(norm, micro_batch, index)
    if error is not None:
        raise WholebatchError(f"normalize: {error}")
    assert ids is not None
    out = norm.items(micro_batch)
    items: Items = {k: out[k] for k in ("mask", "sequence", "group") if k in out}
    mask_I = items["mask"].reshape(-1)
    minus = torch.full_like(mask_I, -1, dtype=torch.long)
    seq_I = items.get("sequence", minus).reshape(-1)
    grp_I = items.get("group", minus).reshape(-1)
    cell_I = torch.full_like(minus, -1)
    if bool(mask_I.any()):
        pairs = torch.stack([seq_I[mask_I], grp_I[mask_I]], dim=1)
        uniq, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        cell_I[mask_I] = inverse
        return items, cell_I, int(uniq.shape[0])
    return items, cell_I, 0


def item_weights(
    cells: Sequence[Tensor], offsets: Sequence[int], a_C: Sequence[float]
) -> list[Tensor]:
    """Each micro-batch's item weights [I] (float64) from the fitted cell weights a_C."""
    a = torch.tensor(list(a_C), dtype=torch.float64)
    out = []
    for cell_I, start in zip(cells, offsets, strict=True):
        w = torch.zeros(cell_I.numel(), dtype=torch.float64)
        live = cell_I >= 0
        w[live] = a[cell_I[live] + start]
        out.append(w)
    return out


def _candidates(first: Mode, constant: float | None) -> list[tuple[Mode, Scope]]:
    order: list[tuple[Mode, Scope]] = [(first, "step"), (first, "micro_batch")]
    order += [(m, s) for m in MODES for s in ("step", "micro_batch") if (m, s) not in order]
    return [(m, s) for m, s in order if m != "constant" or constant is not None]


def _close(want: Sequence[Sequence[Tensor]], got: Sequence[Sequence[Tensor]]) -> bool:
    x = torch.cat([t.reshape(-1).double() for r in want for t in r])
    y = torch.cat([t.reshape(-1).double() for r in got for t in r])
    if x.numel() != y.numel() or x.numel() == 0:
        return False
    scale = float(x.abs().max())
    return scale > 0 and float((x - y).abs().max()) <= MATCH_TOL * scale


def read_weights(
    items: Sequence[Sequence[Mapping[str, Tensor]]],
    weights: Sequence[Sequence[Tensor]],
    *,
    first: Mode,
    constant: float | None,
) -> tuple[Mode, Scope] | None:
    """The (mode, scope) whose weights `mode_weights` gives `items` [rank][micro-batch] are `weights`.

    Tried in the order `first` over the step, `first` per micro-batch, then every other
    mode ("constant" only with a `constant`); None when none matches.
    """
    for mode, scope in _candidates(first, constant):
        try:
            want = mode_weights(
                mode, items, constant=constant if mode == "constant" else None, scope=scope
            )
        except WholebatchError:  # the ids this mode needs are not given
            continue
        if _close(want, weights):
            return mode, scope
    return None
