"""The small path: every rank gathers the whole batch once and evaluates the loss's reference formula.

At a few rows per rank a loss call is latency, not arithmetic: the tiled forms
spend 4-6 collectives per call where the whole N x N logits cost microseconds.
While the batch is small (`sizing.replicates`: N <= `small_rows()`, 512 by
default, and the gathered rows within 16 MiB; `Call.choose` decides from agreed
numbers) every rank instead:

1. gathers every rank's rows of all the loss's inputs (embeddings, and per-row
   ids, labels or masks) in ONE all-gather of raw bytes, uneven rows and empty
   ranks included; without the exchange (`sizes=` with the checks off) each
   rank's scalars and reduction code ride after its rows and every rank agrees
   on their maximum, as the tiled forms' agreement would;
2. evaluates the loss's ONE reference formula on the N rows (the same function
   that defines the loss in its module) inside one autograd node: every rank the
   same value, with no whole-batch sum. The backward is autograd's through that
   formula: nothing is written twice.

The backward needs one collective of one number: the other ranks' rows are
constants here, so autograd gives this rank dL/d(its own rows) and the whole
dL/ds of every scalar; only the upstream gradient of L is agreed (its mean over
ranks, one all-reduce), so a rank's rows receive every rank's upstream gradient,
as through the tiled forms' whole-batch sum, whatever each rank back-propagates.
The gradient conventions (DESIGN.md) are met by scaling: with
grad_reduction="mean" this rank's rows get W·dL/dx (DDP's mean then gives
dL/dθ) and its copy of a scalar dL/ds; with "sum", dL/dx and dL/ds / W. Without
the exchange a scalar's gradient goes, W-fold, to the ranks holding the agreed
maximum, split among ties (every rank when they agree, as the caller promises).

Collectives per call: forward the exchange (checks on) and the rows' all-gather;
backward one all-reduce of one element. `sizes=` with `check=False`: 1 + 1.
`sizing.set_small_rows(0)` (or ``WHOLEBATCH_SMALL_ROWS=0``) turns the path off.

Legend: W ranks, B this rank's rows, N global rows, S the scalars.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from wholebatch.comm.collectives import all_reduce, apply
from wholebatch.comm.debug import arrive
from wholebatch.comm.moves import gather_rows
from wholebatch.losses.call import Call

__all__ = ["Formula", "evaluate", "eye", "lse_rows", "masked"]

Formula = Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]
"""A loss's reference formula: L of the whole batch's rows (name -> (N, ...) tensor, floats in
the compute dtype) and its scalars (name -> 0-d tensor). Differentiable by autograd."""


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """Every rank's rows of every input, and what this rank's gradients get."""

    rows: dict[str, Tensor]
    """Per input, (N, ...): every rank's rows in rank order (fresh buffers)."""
    values: dict[str, Tensor]
    """The agreed scalars (0-d, compute dtype): what the formula uses on every rank."""
    shares: dict[str, Tensor | float]
    """What this rank's copy of each scalar gets of dL/ds (the convention, ties)."""
    row_factor: Tensor | float
    """What this rank's rows get of dL/dx: W ("mean") or 1 ("sum")."""
    span: tuple[int, int]
    """This rank's rows among the N."""


def _gather(call: Call, tensors: Mapping[str, Tensor]) -> _Gathered:
    """Every rank's rows of `tensors` (each (B, ...), the same trailing shape on every rank),
    in one all-gather of raw bytes; without the exchange, with each rank's agreement row
    (its scalars and reduction code, float64) after its rows."""
    w, r, sizes = call.world, call.rank, call.sizes
    widths = {name: math.prod(x.shape[1:]) * x.element_size() for name, x in tensors.items()}
    head = 0 if call.checked else 8 * (len(call.scalars) + 1)
    per_row = sum(widths.values())
    nbytes = [q * per_row + head for q in sizes]
    first = next(iter(tensors.values()))
    parts = [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in tensors.values()]
    if head:
        code = torch.full((1,), float(call.reduction == "sum"), dtype=torch.float64)
        own = [v.detach().to(torch.float64).reshape(1) for v in call.scalars.values()]
        parts.append(torch.cat([*own, code.to(first.device)]).view(torch.uint8))
    arrive("small path rows", first, call.group)  # debug mode: every rank checks in first
    got = gather_rows(torch.cat(parts), nbytes, call.group)
    starts = [sum(nbytes[:q]) for q in range(w)]
    rows, at = {}, 0
    for name, x in tensors.items():
        pieces = [
            got[o + at * q : o + (at + widths[name]) * q]
            for o, q in zip(starts, sizes, strict=True)
        ]
        rows[name] = torch.cat(pieces).view(x.dtype).view(-1, *x.shape[1:])
        at += widths[name]
    offset = sum(sizes[:r])
    span = (offset, offset + sizes[r])
    if not head:  # the exchange found the scalars and the reduction equal on every rank
        factor = call.grad_factor
        return _Gathered(rows, call.scalars, dict.fromkeys(call.scalars, factor), factor * w, span)
    table_WS = torch.stack([got[o + n - head : o + n] for o, n in zip(starts, nbytes, strict=True)])
    values, shares, factor_t = _agreed(table_WS.view(torch.float64), r, w, call.acc)
    names = list(call.scalars)
    return _Gathered(
        rows,
        dict(zip(names, values.unbind(), strict=True)),
        dict(zip(names, shares.unbind(), strict=True)),
        factor_t * w,
        span,
    )


def _agreed(table_WS: Tensor, r: int, w: int, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(the agreed scalars, this rank's shares of their gradients, the reduction's factor) from
    every rank's row: the maximum of each; a scalar's gradient goes to the ranks holding the
    maximum, W-fold split among ties."""
    max_S = table_WS.max(0).values
    ties_S = (table_WS == max_S).sum(0)
    mine_S = (table_WS[r] == max_S).to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=table_WS.device)
    factor = torch.where(max_S[-1] > 0.5, one / w, one)  # "sum" anywhere: every rank sums
    share_S = factor * w * mine_S / ties_S
    return max_S[:-1].to(acc), share_S[:-1].to(acc), factor.to(acc)


def evaluate(call: Call, tensors: Mapping[str, Tensor | None], formula: Formula) -> Tensor:
    """The whole loss L by `formula` on every rank's rows of `tensors` (this rank's, None
    skipped): the same value on every rank.

    Every rank of the call's group must call it. Backward: all-reduce (mean) of the
    upstream gradient of L (one number), then autograd's gradient of this rank's rows
    through `formula`, times W ("mean") or 1 ("sum"), and of each scalar, times this
    rank's share.
    """
    given = {name: x for name, x in tensors.items() if x is not None}
    g = _gather(call, given)
    inputs = [x for x in given.values() if x.is_floating_point()]
    scalars = list(call.scalars.values())
    need = torch.is_grad_enabled() and any(t.requires_grad for t in [*inputs, *scalars])
    loss: Tensor = apply(_WholeLoss, formula, need, g, call, *inputs, *scalars)
    return loss


class _WholeLoss(torch.autograd.Function):
    """Forward: `formula`'s L on the gathered rows (its graph kept when a gradient is needed);
    backward: see `evaluate`."""

    @staticmethod
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any, formula: Formula, need: bool, g: _Gathered, call: Call, *inputs: Tensor
    ) -> Tensor:
        acc = call.acc
        rows = {n: x.to(acc) if x.is_floating_point() else x for n, x in g.rows.items()}
        if not need:
            return formula(rows, g.values)
        floats = [n for n, x in rows.items() if x.is_floating_point()]
        for n in floats:
            rows[n] = rows[n].detach().requires_grad_()
        values = {n: v.detach().requires_grad_() for n, v in g.values.items()}
        with torch.enable_grad():
            loss = formula(rows, values)
        ctx.state = (loss, [rows[n] for n in floats], list(values.values()))
        ctx.g, ctx.call, ctx.dtypes = g, call, [t.dtype for t in inputs]
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g: _Gathered = ctx.g
        if ctx.call.world > 1:  # every rank's upstream gradient, to every rank's rows
            grad = all_reduce(grad.contiguous(), "mean", group=ctx.call.group, check=False)
        loss, rows, values = ctx.state
        ctx.state = None  # the formula's graph goes now, not with the outer graph
        got = torch.autograd.grad(loss, [*rows, *values], grad.to(loss.dtype), allow_unused=True)
        full = [
            torch.zeros_like(x) if d is None else d
            for d, x in zip(got, [*rows, *values], strict=True)
        ]
        lo, hi = g.span
        own = [d[lo:hi] * g.row_factor for d in full[: len(rows)]]
        shares = list(g.shares.values())
        grads = own + [d * share for d, share in zip(full[len(rows) :], shares, strict=True)]
        wanted = ctx.needs_input_grad[4:]
        out = [
            gr.to(dt) if want else None
            for gr, dt, want in zip(grads, ctx.dtypes, wanted, strict=True)
        ]
        return (None, None, None, None, *out)


# ---------------------------------------------------------------------------
# Pieces the reference formulas share
# ---------------------------------------------------------------------------


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with `mask`ed entries at the dtype's lowest value: exp() of them is 0, and a row of
    them only (a whole batch of one row) has a finite log-sum-exp whose softplus is 0, with
    gradient 0 (never the NaN of a log-sum-exp over nothing)."""
    return x.masked_fill(mask, torch.finfo(x.dtype).min)


def eye(n: int, device: torch.device) -> Tensor:
    """The N x N boolean identity."""
    return torch.eye(n, dtype=torch.bool, device=device)


def lse_rows(z: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """The log-sum-exp along `dim` of `z` with `mask`ed entries left out (`masked`)."""
    return torch.logsumexp(masked(z, mask), dim)
