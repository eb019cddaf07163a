"""Small batches: every rank gathers the whole batch once and computes the whole loss itself.

At a few rows per rank a whole-batch loss call is latency, not arithmetic: the
tiled forms spend 4-6 collectives per call (the exchange, the keys, the column
statistics, the whole-batch sum; the same again in the backward), ~0.3-1 ms each
on 2 CPU ranks, where the whole N x N logits cost microseconds. While the batch
is small (`wholebatch.losses.sizing.replicates`: N <= `small_rows()`, 512 by
default, and the gathered rows within 16 MiB) each loss instead:

1. runs the exchange as always (`common.prepare`: every check, the same error on
   every rank), unless `sizes=` is given with the checks off;
2. gathers every rank's rows of ALL its embeddings: with the exchange, they
   ride in its all-gather while every rank's fit `sizing.carry_bytes(W)`
   (256 KiB at W = 2: 64 rows of two 512-dim float32 towers), else ONE more
   all-gather (raw bytes, uneven rows and empty ranks included); without the
   exchange, each rank's scalars and reduction code ride in that all-gather
   (one float64 row after its rows) and every rank agrees on their maximum,
   as `common.prepare`'s agreement would;
3. computes the whole loss L with plain tensor ops on the N rows: every rank the
   same value, with no whole-batch sum.

The backward needs one collective of one number: the other ranks' rows are
constants here, so autograd gives this rank dL/d(its own rows) from the full
logits, and every rank already holds the whole dL/ds of each replicated scalar;
only the upstream gradient of L is agreed (`common.whole`: its mean over ranks),
so a rank's rows receive every rank's upstream gradient, as through the tiled
forms' whole-batch sum, whatever each rank back-propagates. The gradient
conventions (DESIGN.md, "gradient conventions"; `wholebatch.conventions`) are
met by scaling: with grad_reduction="mean" this rank's rows get W·dL/dx (DDP's
mean over ranks then gives dL/dθ) and its copy of a scalar gets dL/ds (the mean
of W equal copies); with "sum", dL/dx and dL/ds / W. Without the exchange a
scalar's gradient goes, W-fold, to the ranks holding the agreed maximum, split
among ties (every rank when they agree, as the caller promises).

`wholebatch.losses.sizing.set_small_rows(0)` (or ``WHOLEBATCH_SMALL_ROWS=0``)
turns the small path off.

Collectives per call: 1 forward with the checks on (the exchange carrying the
rows; 2 when a rank's rows pass the room), 1 with `sizes=` and `check=False`;
1 in the backward (the upstream gradient, 8 bytes). open_clip's
``ClipLoss(gather_with_grad=True, local_loss=True)`` makes 2 forward and 2 backward.

Legend: W ranks, B this rank's rows, N global rows, D dim, R elements of one
sample over all embeddings, S replicated scalars.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.collectives import all_gather
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.losses.common import Prepared, rows_as_bytes, whole as whole_loss
from wholebatch.losses.tiles import compute_dtype, softplus

__all__ = ["Whole", "clip", "gather_whole", "info_nce_terms", "nt_xent", "siglip"]


@dataclasses.dataclass(frozen=True)
class Whole:
    """The whole batch on this rank, in the compute dtype, ready for a plain formula."""

    rows: list[Tensor]
    """Per embedding, every rank's rows in rank order (N, ...): this rank's slice carries its
    gradient (scaled by the convention), the others are constants."""
    scalars: list[Tensor]
    """The agreed replicated scalars (0-d); their gradient reaches this rank's own copies."""
    n: int
    """N."""


class _Scaled(torch.autograd.Function):
    """Forward: `value` (a copy); backward: the gradient times `factor`, sent to `x`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, factor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(factor)
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (factor,) = ctx.saved_tensors
        return grad * factor.to(grad.dtype), None, None


def _scaled(x: Tensor, value: Tensor, factor: Tensor) -> Tensor:
    out: Tensor = _Scaled.apply(x, value, factor)  # type: ignore[no-untyped-call]
    return out


def gather_whole(tensors: Sequence[Tensor], prep: Prepared, group: ProcessGroup | None) -> Whole:
    """Every rank's rows of every tensor in `tensors` (each (B, ...), one dtype) by one all-gather.

    Every rank of `group` must call it, after `common.prepare` chose the small
    path. Backward: none across ranks; this rank's slice of each returned
    tensor sends its gradient, times W (grad_reduction "mean") or 1 ("sum"),
    to the input it came from; see the module docstring for the scalars.
    """
    w, r = get_world_size(group), get_rank(group)
    sizes, b = prep.sizes, prep.sizes[r]
    first = tensors[0]
    dtype, acc, elem = first.dtype, compute_dtype(first.dtype), first.element_size()
    shapes = [tuple(t.shape[1:]) for t in tensors]
    width = sum(math.prod(shape) for shape in shapes)
    head = 0 if prep.checked else 8 * (len(prep.scalars) + 1)
    byte_sizes = [q * width * elem + head for q in sizes]
    carried = prep.carried_WC
    if carried is not None and max(byte_sizes) <= carried.shape[1]:
        # every rank's rows came with the exchange: no second collective
        got = torch.cat([carried[q, :nb] for q, nb in enumerate(byte_sizes)]).to(first.device)
    else:
        got = all_gather(_payload(tensors, prep), sizes=byte_sizes, group=group, check=False)
    n = sum(sizes)
    if head:
        starts = [sum(byte_sizes[:q]) for q in range(w)]
        body = [got[o : o + q * width * elem] for o, q in zip(starts, sizes, strict=True)]
        rows_bytes = torch.cat(body)  # a fresh, aligned buffer
        table_WS = torch.cat([got[o + q * width * elem : o + byte_sizes[i]]
                              for i, (o, q) in enumerate(zip(starts, sizes, strict=True))])  # fmt: skip
        scalars, factor = _agreed(table_WS.view(torch.float64).view(w, -1), prep, r, w, acc)
    else:
        rows_bytes = got
        factor = torch.as_tensor(prep.grad_factor, dtype=acc, device=first.device)
        scalars = [_scaled(s, s, factor) for s in prep.scalars]
    all_NR = rows_bytes.view(dtype).view(n, width)
    offset = sum(sizes[:r])
    rows = _own_rows(all_NR, shapes, (offset, offset + b), acc, factor * w, tensors)
    return Whole(rows=rows, scalars=scalars, n=n)


def _own_rows(
    all_NR: Tensor,
    shapes: list[tuple[int, ...]],
    span: tuple[int, int],
    acc: torch.dtype,
    factor: Tensor,
    tensors: Sequence[Tensor],
) -> list[Tensor]:
    """`_Rows`: the whole batch per embedding; this rank's rows' gradient, times `factor`, home."""
    return list(_Rows.apply(all_NR, shapes, span, acc, factor, *tensors))  # type: ignore[no-untyped-call]


def _payload(tensors: Sequence[Tensor], prep: Prepared) -> Tensor:
    """This rank's rows as bytes; without the exchange, its agreement row after them."""
    payload = rows_as_bytes(tensors)
    if prep.checked:
        return payload
    # the agreement's row rides along: S scalars and the reduction code, float64
    factor = torch.as_tensor(prep.grad_factor, dtype=torch.float64, device=payload.device)
    code = (factor != 1.0).to(torch.float64).reshape(1)
    row_S1 = torch.cat([*[s.detach().to(torch.float64).reshape(1) for s in prep.scalars], code])
    return torch.cat([payload, row_S1.view(torch.uint8)])


class _Rows(torch.autograd.Function):
    """Forward: the whole batch per embedding, from `all_NR` (where this rank's rows are its
    inputs, bit for bit), in the compute dtype; backward: this rank's rows of each output's
    gradient, times `factor`, to the input they came from (nothing to the other ranks' rows)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        all_NR: Tensor,
        shapes: list[tuple[int, ...]],
        span: tuple[int, int],
        acc: torch.dtype,
        factor: Tensor,
        *own: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.save_for_backward(factor)
        ctx.span, ctx.dtypes = span, [t.dtype for t in own]
        whole_NR = all_NR.to(acc, copy=True)
        n = whole_NR.shape[0]
        parts = torch.split(whole_NR, [math.prod(shape) for shape in shapes], 1)
        return tuple(p.reshape(n, *shape) for p, shape in zip(parts, shapes, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        (factor,) = ctx.saved_tensors
        lo, hi = ctx.span
        own = [
            None if g is None else (g[lo:hi] * factor.to(g.dtype)).to(dt)
            for g, dt in zip(grads, ctx.dtypes, strict=True)
        ]
        return (None, None, None, None, None, *own)


def _agreed(
    table_WS: Tensor, prep: Prepared, r: int, w: int, acc: torch.dtype
) -> tuple[list[Tensor], Tensor]:
    """The scalars and the reduction agreed from every rank's row (their maximum), on the device.

    A scalar's gradient goes to the ranks holding the maximum, W-fold split among ties.
    """
    max_S = table_WS.max(0).values
    ties_S = (table_WS == max_S).sum(0)
    mine_S = (table_WS[r] == max_S).to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=table_WS.device)
    factor = torch.where(max_S[-1] > 0.5, one / w, one)  # "sum" anywhere: every rank sums
    share_S = factor * w * mine_S / ties_S
    scalars = [_scaled(s, max_S[k].to(acc), share_S[k].to(acc)) for k, s in enumerate(prep.scalars)]
    return scalars, factor.to(acc)


# ---------------------------------------------------------------------------
# The losses on the whole batch
# ---------------------------------------------------------------------------


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with `mask`ed entries at the dtype's lowest value: exp() of them is 0, and a row of
    them only (one row in the whole batch) has a finite log-sum-exp whose softplus is 0."""
    return x.masked_fill(mask, torch.finfo(x.dtype).min)


def _eye(n: int, device: torch.device) -> Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


def clip(
    image_BD: Tensor, text_BD: Tensor, prep: Prepared, bias: bool, group: ProcessGroup | None
) -> Tensor:
    """`clip_loss` on the small path: L = (Σᵢ softplus(lse_{j≠i} zᵢⱼ − zᵢᵢ) + the same over columns) / 2N."""
    whole = gather_whole([image_BD, text_BD], prep, group)
    i_ND, t_ND = whole.rows
    s, n = whole.scalars[0], whole.n
    neg_NN = _masked(s * (i_ND @ t_ND.T), _eye(n, i_ND.device))
    pos_N = s * (i_ND * t_ND).sum(1)
    rows = softplus(torch.logsumexp(neg_NN, 1) - pos_N).sum()
    cols = softplus(torch.logsumexp(neg_NN, 0) - pos_N).sum()
    loss = (rows + cols) / (2 * n)
    if bias:
        loss = loss + 0.0 * whole.scalars[1]  # no effect on the loss; gradient exactly 0
    return whole_loss(loss, prep, group)


def siglip(image_BD: Tensor, text_BD: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """`siglip_loss` on the small path: (Σ_{i≠j} softplus(zᵢⱼ) + Σᵢ softplus(−zᵢᵢ)) / N."""
    whole = gather_whole([image_BD, text_BD], prep, group)
    i_ND, t_ND = whole.rows
    (s, b), n = whole.scalars, whole.n
    neg = softplus(s * (i_ND @ t_ND.T) + b).masked_fill(_eye(n, i_ND.device), 0.0).sum()
    pos = softplus(-(s * (i_ND * t_ND).sum(1) + b)).sum()
    return whole_loss((neg + pos) / n, prep, group)


def nt_xent(z1_BD: Tensor, z2_BD: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """`nt_xent_loss` on the small path: Z = [Z1; Z2], each row's softplus(lse over its negatives − its positive)."""
    whole = gather_whole([z1_BD, z2_BD], prep, group)
    z1_ND, z2_ND = whole.rows
    n = whole.n
    inv_tau = 1.0 / whole.scalars[0]
    z_MD = torch.cat([z1_ND, z2_ND])  # M = 2N
    eye = _eye(n, z_MD.device)
    pair_MM = torch.cat([torch.cat([eye, eye], 1)] * 2)  # itself and its other view
    neg_MM = _masked(inv_tau * (z_MD @ z_MD.T), pair_MM)
    pos_N = inv_tau * (z1_ND * z2_ND).sum(1)
    loss = softplus(torch.logsumexp(neg_MM, 1) - torch.cat([pos_N, pos_N])).sum() / (2 * n)
    return whole_loss(loss, prep, group)


def info_nce_terms(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    s: Tensor,
    pos_B: Tensor,
    wanted: set[str],
    prep: Prepared,
    tile_size: int | None,
    group: ProcessGroup | None,
) -> list[Tensor]:
    """`info_nce_loss`'s per-direction a_i = lse over its negatives − s·qᵢ·dᵢ for ALL N rows
    (query_to_doc, doc_to_query, query_to_query, doc_to_doc: those in `wanted`, in that order).

    The signature of the tiled forms' terms (info_nce.py); `s`, `pos_B` and
    `tile_size` are theirs and unused: the scalar is the agreed one, here."""
    parts_in = [query_BD, document_BD] + ([] if negatives_BKD is None else [negatives_BKD])
    whole = gather_whole(parts_in, prep, group)
    q_ND, d_ND = whole.rows[:2]
    s, n = whole.scalars[0], whole.n  # the agreed scale (the argument `s` is this rank's own)
    # candidates [all documents; all first negatives; ...]: the negatives of row g at t·N + g
    cand_CD = d_ND if negatives_BKD is None else torch.cat([d_ND, *whole.rows[2].unbind(1)])
    c = cand_CD.shape[0]
    pos_N = s * (q_ND * d_ND).sum(1)
    eye_NC = torch.zeros(n, c, dtype=torch.bool, device=q_ND.device)
    eye_NC[:, :n] = _eye(n, q_ND.device)
    q2d_NC = s * (q_ND @ cand_CD.T)
    parts = [torch.logsumexp(_masked(q2d_NC, eye_NC), 1) - pos_N]
    if "doc_to_query" in wanted:
        parts.append(torch.logsumexp(_masked(q2d_NC[:, :n], eye_NC[:, :n]), 0) - pos_N)
    if "query_to_query" in wanted:
        q2q = _masked(s * (q_ND @ q_ND.T), eye_NC[:, :n])
        parts.append(torch.logsumexp(q2q, 1) - pos_N)
    if "doc_to_doc" in wanted:
        own_NC = _eye(n, q_ND.device).repeat(1, c // n)  # d_i and its own hard negatives
        d2d = _masked(s * (d_ND @ cand_CD.T), own_NC)
        parts.append(torch.logsumexp(d2d, 1) - pos_N)
    return parts
