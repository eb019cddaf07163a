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
   ride in its all-gather while every rank's fit the exchange's room (the
   same on every rank, fitted to the rows of the group's last calls:
   `wholebatch.losses.room`; at most `sizing.carry_bytes(W)`, 256 KiB at W = 2:
   64 rows of two 512-dim float32 towers), else ONE more all-gather (raw bytes,
   uneven rows and empty ranks included); without the exchange, each rank's
   scalars and reduction code ride in that all-gather (one float64 row after
   its rows) and every rank agrees on their maximum, as `common.prepare`'s
   agreement would;
3. computes the whole loss L on the N rows in one autograd node (`run`, a
   kernel: `clip`, `siglip` in closed form, `nt_xent`, `info_nce` by autograd
   through their formula): every rank the same value, with no whole-batch sum.

The backward needs one collective of one number: the other ranks' rows are
constants here, so the kernel gives this rank dL/d(its own rows) (CLIP and
SigLIP: dL/dz in closed form, then B x N products instead of autograd's
N x N), and every rank already holds the whole dL/ds of each replicated
scalar; only the upstream gradient of L is agreed (its mean over ranks, one
all-reduce), so a rank's rows receive every rank's upstream gradient, as
through the tiled forms' whole-batch sum, whatever each rank back-propagates.
The gradient conventions (DESIGN.md, "gradient conventions";
`wholebatch.conventions`) are met by scaling: with grad_reduction="mean" this
rank's rows get W·dL/dx (DDP's mean over ranks then gives dL/dθ) and its copy
of a scalar gets dL/ds (the mean of W equal copies); with "sum", dL/dx and
dL/ds / W. Without the exchange a scalar's gradient goes, W-fold, to the ranks
holding the agreed maximum, split among ties (every rank when they agree, as
the caller promises).

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.agree import write_rows
from wholebatch.comm.collectives import all_reduce, gather_rows
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.losses.common import Prepared
from wholebatch.losses.tiles import compute_dtype, softplus

__all__ = ["clip", "info_nce", "nt_xent", "siglip"]

# A kernel computes the whole loss on the whole batch (every rank the same, no
# collective) and, in the backward, the gradient of ONLY this rank's rows:
#   forward(rows, scalars, need_grad) -> (L, state);
#   backward(state, dL, (lo, hi)) -> (per embedding its rows [lo:hi] of dL/d(rows),
#                                    per scalar dL/ds)
Kernel = tuple[
    Callable[[list[Tensor], list[Tensor], bool], tuple[Tensor, Any]],
    Callable[[Any, Tensor, tuple[int, int]], tuple[list[Tensor], list[Tensor]]],
]


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """Every rank's rows of every embedding, and how their gradients go home."""

    rows: list[Tensor]
    """Per embedding, (N, ...) in its dtype: every rank's rows in rank order (fresh buffers)."""
    values: list[Tensor]
    """The agreed scalars (0-d, compute dtype): what the formula uses on every rank."""
    shares: list[Tensor | float]
    """What this rank's copy of each scalar gets of dL/ds (the convention, ties)."""
    row_factor: Tensor | float
    """What this rank's rows get of dL/dx: W ("mean") or 1 ("sum")."""
    span: tuple[int, int]
    """This rank's rows among the N."""


def _gather(tensors: Sequence[Tensor], prep: Prepared, group: ProcessGroup | None) -> _Gathered:
    """Every rank's rows of every tensor in `tensors` (each (B, ...), one dtype): carried by
    the exchange when they fit its room, else by one all-gather (raw bytes, uneven rows and
    empty ranks included); without the exchange, with each rank's agreement row after its
    rows. Every rank of `group` must call it, after `common.prepare` chose the small path."""
    w, r = get_world_size(group), get_rank(group)
    sizes, first = prep.sizes, tensors[0]
    elem = first.element_size()
    widths = [math.prod(t.shape[1:]) for t in tensors]
    head = 0 if prep.checked else 8 * (len(prep.scalars) + 1)
    byte_sizes = [q * sum(widths) * elem + head for q in sizes]
    carried = prep.carried_WC
    if carried is not None and max(byte_sizes) <= carried.shape[1]:
        got_WC = carried  # every rank's rows came with the exchange: no second collective
    else:
        arrive("small path rows", first, group)  # debug mode: every rank checks in first
        got_WC = gather_rows(_payload(tensors, prep, byte_sizes[r]), byte_sizes, group)
    offset = sum(sizes[:r])
    span = (offset, offset + sizes[r])
    rows = _rows(got_WC, tensors, sizes, widths, byte_sizes)
    if not head:  # the exchange found the scalars and the reduction equal on every rank
        factor = prep.grad_factor
        return _Gathered(rows, prep.scalars, [factor] * len(prep.scalars), factor * w, span)
    starts = [sum(byte_sizes[:q]) for q in range(w)]
    table_WS = torch.cat(
        [got_WC[o + nb - head : o + nb] for o, nb in zip(starts, byte_sizes, strict=True)]
    )
    acc = compute_dtype(first.dtype)
    table_WS = table_WS.view(torch.float64).view(w, -1)
    agreed: Tensor | float
    if table_WS.device.type == "cpu":  # on the host already: the same rule in plain numbers
        values, shares, agreed = _agreed_here(table_WS.tolist(), r, w, acc, first.device)
    else:
        values_S, shares_S, agreed = _agreed(table_WS, r, w, acc)
        values, shares = list(values_S.unbind()), list(shares_S.unbind())
    return _Gathered(rows, values, shares, agreed * w, span)


def _rows(
    got: Tensor,
    tensors: Sequence[Tensor],
    sizes: list[int],
    widths: list[int],
    byte_sizes: list[int],
) -> list[Tensor]:
    """Per tensor, every rank's rows (N, ...) out of the received bytes: `got` is (W, C),
    rank p's bytes in row p (the exchange's room), or 1-D with rank p's `byte_sizes[p]` bytes
    in turn (an all-gather of raw bytes); each rank's tensors in turn (`write_rows`)."""
    n, elem, dtype = sum(sizes), tensors[0].element_size(), tensors[0].dtype
    if got.dim() == 1:
        starts = [sum(byte_sizes[:q]) for q in range(len(sizes))]
    out = []
    for k, x in enumerate(tensors):
        before = sum(widths[:k])
        if got.dim() == 2 and len(set(sizes)) == 1:  # equal rows: one strided copy
            at, length = sizes[0] * before * elem, sizes[0] * widths[k] * elem
            flat = got[:, at : at + length].reshape(-1)
        elif got.dim() == 2:
            flat = torch.cat([got[p, q * before * elem : q * (before + widths[k]) * elem]
                              for p, q in enumerate(sizes)])  # fmt: skip
        else:
            flat = torch.cat([got[o + q * before * elem : o + q * (before + widths[k]) * elem]
                              for o, q in zip(starts, sizes, strict=True)])  # fmt: skip
        flat = flat if flat.device == x.device else flat.to(x.device)  # the wire's device: gloo
        out.append(flat.view(dtype).view(n, *x.shape[1:]))
    return out


def _payload(tensors: Sequence[Tensor], prep: Prepared, nbytes: int) -> Tensor:
    """This rank's rows as bytes (`nbytes` in all, each tensor's in turn: `write_rows`);
    without the exchange, its agreement row after them (S scalars and the reduction code,
    float64)."""
    payload = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    rows = nbytes - (0 if prep.checked else 8 * (len(prep.scalars) + 1))
    write_rows(payload[:rows], tensors)
    if not prep.checked:
        code = torch.full((1,), float(prep.grad_factor != 1.0), dtype=torch.float64)
        row_S1 = torch.cat(
            [torch.stack(prep.scalars).detach().to(torch.float64), code.to(payload.device)]
        )
        payload[rows:].copy_(row_S1.view(torch.uint8))
    return payload


def _agreed(table_WS: Tensor, r: int, w: int, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(the agreed scalars, this rank's shares of their gradients, the reduction's factor), from
    every rank's row: the maximum of each; a scalar's gradient goes to the ranks holding the
    maximum, W-fold split among ties."""
    max_S = table_WS.max(0).values
    ties_S = (table_WS == max_S).sum(0)
    mine_S = (table_WS[r] == max_S).to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=table_WS.device)
    factor = torch.where(max_S[-1] > 0.5, one / w, one)  # "sum" anywhere: every rank sums
    share_S = factor * w * mine_S / ties_S
    return max_S[:-1].to(acc), share_S[:-1].to(acc), factor.to(acc)


def _agreed_here(
    table: list[list[float]], r: int, w: int, acc: torch.dtype, device: torch.device
) -> tuple[list[Tensor], list[Tensor | float], float]:
    """`_agreed` of a table on the host: the same maxima, shares and factor, as numbers (the
    scalars as 0-d tensors of `acc` on `device`)."""
    max_S = [math.nan if any(map(math.isnan, c)) else max(c) for c in zip(*table, strict=True)]
    factor = 1.0 / w if max_S[-1] > 0.5 else 1.0  # "sum" anywhere: every rank sums
    shares: list[Tensor | float] = []
    for k, m in enumerate(max_S[:-1]):
        ties = sum(row[k] == m for row in table)  # 0 for a NaN: its gradient NaN, as on a device
        shares.append(factor * w * (table[r][k] == m) / ties if ties else math.nan)
    values = list(torch.tensor(max_S[:-1], dtype=torch.float64).to(acc).to(device).unbind())
    return values, shares, factor


def run(
    kernel: Kernel, tensors: Sequence[Tensor], prep: Prepared, group: ProcessGroup | None
) -> Tensor:
    """The whole loss L of `tensors` (this rank's rows of each embedding) by `kernel`: the
    same value on every rank, one collective forward at most (`_gather`).

    Every rank of `group` must call it. Backward: all-reduce (mean) of the upstream
    gradient of L (one number), then `kernel`'s gradient of this rank's rows, times
    W ("mean") or 1 ("sum"), and of each scalar, times this rank's share.
    """
    g = _gather(tensors, prep, group)
    inputs = [*tensors, *prep.scalars]
    need = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    loss: Tensor = _WholeLoss.apply(kernel, need, g, group, *inputs)  # type: ignore[no-untyped-call]
    return loss


class _WholeLoss(torch.autograd.Function):
    """Forward: `kernel`'s L on the gathered rows (no autograd graph of its own unless the
    kernel keeps one); backward: see `run`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: Kernel,
        need: bool,
        g: _Gathered,
        group: ProcessGroup | None,
        *inputs: Tensor,
    ) -> Tensor:
        acc = compute_dtype(g.rows[0].dtype)  # fresh buffers: used as they are in that dtype
        rows = [x if x.dtype == acc else x.to(acc) for x in g.rows]
        loss, state = kernel[0](rows, g.values, need)
        if need:
            ctx.kernel, ctx.state, ctx.g, ctx.group = kernel, state, g, group
            ctx.dtypes = [t.dtype for t in inputs]
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if get_world_size(ctx.group) > 1:  # every rank's upstream gradient, to every rank's rows
            grad = all_reduce(grad.contiguous(), "mean", group=ctx.group, check=False)
        g: _Gathered = ctx.g
        rows, scalars = ctx.kernel[1](ctx.state, grad.to(compute_dtype(g.rows[0].dtype)), g.span)
        ctx.state = None  # the kernel's buffers go now, not with the graph
        own = [x * g.row_factor for x in rows]
        grads = own + [x * share for x, share in zip(scalars, g.shares, strict=True)]
        wanted = ctx.needs_input_grad[4:]
        out = [gr.to(dt) if want else None
               for gr, dt, want in zip(grads, ctx.dtypes, wanted, strict=True)]  # fmt: skip
        return (None, None, None, None, *out)


def by_autograd(formula: Callable[[list[Tensor], list[Tensor]], Tensor]) -> Kernel:
    """A kernel from a plain formula L(rows, scalars): its backward is autograd's through
    the formula's own graph (kept from the forward), this rank's rows sliced from it."""

    def forward(rows: list[Tensor], scalars: list[Tensor], need: bool) -> tuple[Tensor, Any]:
        if not need:
            return formula(rows, scalars), None
        leaves = [x.detach().requires_grad_() for x in [*rows, *scalars]]
        with torch.enable_grad():
            loss = formula(leaves[: len(rows)], leaves[len(rows) :])
        return loss.detach(), (loss, leaves, len(rows))

    def backward(
        state: Any, grad: Tensor, span: tuple[int, int]
    ) -> tuple[list[Tensor], list[Tensor]]:
        loss, leaves, k = state
        got = torch.autograd.grad(loss, leaves, grad, allow_unused=True)
        full = [torch.zeros_like(x) if d is None else d for d, x in zip(got, leaves, strict=True)]
        return [d[span[0] : span[1]] for d in full[:k]], full[k:]

    return forward, backward


# ---------------------------------------------------------------------------
# The losses on the whole batch
# ---------------------------------------------------------------------------


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with `mask`ed entries at the dtype's lowest value: exp() of them is 0, and a row of
    them only (one row in the whole batch) has a finite log-sum-exp whose softplus is 0."""
    return x.masked_fill(mask, torch.finfo(x.dtype).min)


def _eye(n: int, device: torch.device) -> Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


def _own_gradients(
    g_NN: Tensor, i_ND: Tensor, t_ND: Tensor, s: Tensor, span: tuple[int, int]
) -> list[Tensor]:
    """dL/d(this rank's rows of I and of T) for logits z = s·I·Tᵀ (+ b) with dL/dz = `g_NN`:
    s·G[own, :]·T and s·G[:, own]ᵀ·I (B x N products, not N x N)."""
    lo, hi = span
    return [s * (g_NN[lo:hi] @ t_ND), s * (g_NN[:, lo:hi].T @ i_ND)]


def _clip_forward(rows: list[Tensor], scalars: list[Tensor], need: bool) -> tuple[Tensor, Any]:
    i_ND, t_ND = rows
    s, n = scalars[0], i_ND.shape[0]
    u_NN = i_ND @ t_ND.T
    pos_N = s * u_NN.diagonal()
    neg_NN = s * u_NN
    neg_NN.diagonal().fill_(torch.finfo(neg_NN.dtype).min)  # exp() of it is 0: no positive
    lse_rows_N, lse_cols_N = torch.logsumexp(neg_NN, 1), torch.logsumexp(neg_NN, 0)
    # softplus(a) = −log σ(−a), a = lse − positive
    minus_a_N, minus_c_N = pos_N - lse_rows_N, pos_N - lse_cols_N
    loss = (F.logsigmoid(minus_a_N).sum() + F.logsigmoid(minus_c_N).sum()) / (-2 * n)
    if len(scalars) > 1:
        loss = loss + 0.0 * scalars[1]  # a bias has no effect on the loss; gradient exactly 0
    state = (i_ND, t_ND, s, u_NN, neg_NN, lse_rows_N, lse_cols_N, minus_a_N, minus_c_N)
    return loss, (state, len(scalars)) if need else None


def _clip_backward(
    state: Any, grad: Tensor, span: tuple[int, int]
) -> tuple[list[Tensor], list[Tensor]]:
    (i_ND, t_ND, s, u_NN, neg_NN, lse_rows_N, lse_cols_N, minus_a_N, minus_c_N), k = state
    n = i_ND.shape[0]
    w_rows_N = torch.sigmoid(-minus_a_N) * (grad / (2 * n))  # dL/da = σ(a)/2N
    w_cols_N = torch.sigmoid(-minus_c_N) * (grad / (2 * n))
    # dL/dz: each row's softmax over its negatives times its weight, and each column's
    g_NN = torch.exp(neg_NN - lse_rows_N[:, None]).mul_(w_rows_N[:, None])
    g_NN.add_(torch.exp(neg_NN - lse_cols_N[None, :]).mul_(w_cols_N[None, :]))
    g_NN.diagonal().copy_(-(w_rows_N + w_cols_N))  # the positives (both directions)
    scalars = [(g_NN * u_NN).sum()] + [grad * 0.0] * (k - 1)
    return _own_gradients(g_NN, i_ND, t_ND, s, span), scalars


def clip(image_BD: Tensor, text_BD: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """`clip_loss` on the small path: L = (Σᵢ softplus(lse_{j≠i} zᵢⱼ − zᵢᵢ) + the same over
    columns) / 2N, z = s·I·Tᵀ; its gradient in closed form (only this rank's rows)."""
    return run((_clip_forward, _clip_backward), [image_BD, text_BD], prep, group)


def _siglip_forward(rows: list[Tensor], scalars: list[Tensor], need: bool) -> tuple[Tensor, Any]:
    i_ND, t_ND = rows
    s, b = scalars
    u_NN = i_ND @ t_ND.T
    z_NN = torch.addcmul(b, s, u_NN)  # s·u + b
    n = z_NN.shape[0]
    # softplus(z) = −log σ(−z) for the negatives, softplus(−z) = −log σ(z) for the positives
    neg_NN = F.logsigmoid(-z_NN)
    neg_NN.diagonal().zero_()  # the positives are not negatives
    neg = neg_NN.sum()
    loss = (neg + F.logsigmoid(z_NN.diagonal()).sum()) / -n
    return loss, (i_ND, t_ND, s, u_NN, z_NN) if need else None


def _siglip_backward(
    state: Any, grad: Tensor, span: tuple[int, int]
) -> tuple[list[Tensor], list[Tensor]]:
    i_ND, t_ND, s, u_NN, z_NN = state
    scale = grad / z_NN.shape[0]
    g_NN = torch.sigmoid(z_NN).mul_(scale)  # d softplus(z)/dz, the negatives
    g_NN.diagonal().copy_(-torch.sigmoid(-z_NN.diagonal()) * scale)  # d softplus(−z)/dz
    return _own_gradients(g_NN, i_ND, t_ND, s, span), [(g_NN * u_NN).sum(), g_NN.sum()]


def siglip(image_BD: Tensor, text_BD: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """`siglip_loss` on the small path: (Σ_{i≠j} softplus(zᵢⱼ) + Σᵢ softplus(−zᵢᵢ)) / N,
    z = s·I·Tᵀ + b; its gradient in closed form (only this rank's rows)."""
    return run((_siglip_forward, _siglip_backward), [image_BD, text_BD], prep, group)


def _nt_xent(rows: list[Tensor], scalars: list[Tensor]) -> Tensor:
    """Z = [Z1; Z2], each row's softplus(lse over its negatives − its positive), mean over 2N."""
    z1_ND, z2_ND = rows
    n = z1_ND.shape[0]
    inv_tau = 1.0 / scalars[0]
    z_MD = torch.cat([z1_ND, z2_ND])  # M = 2N
    eye = _eye(n, z_MD.device)
    pair_MM = torch.cat([torch.cat([eye, eye], 1)] * 2)  # itself and its other view
    neg_MM = _masked(inv_tau * (z_MD @ z_MD.T), pair_MM)
    pos_N = inv_tau * (z1_ND * z2_ND).sum(1)
    return softplus(torch.logsumexp(neg_MM, 1) - torch.cat([pos_N, pos_N])).sum() / (2 * n)


_NT_XENT = by_autograd(_nt_xent)


def nt_xent(z1_BD: Tensor, z2_BD: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """`nt_xent_loss` on the small path (`_nt_xent`; the gradient by autograd through it)."""
    return run(_NT_XENT, [z1_BD, z2_BD], prep, group)


def info_nce(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    wanted: set[str],
    row_losses: Callable[[list[Tensor]], Tensor],
    prep: Prepared,
    group: ProcessGroup | None,
) -> Tensor:
    """`info_nce_loss` on the small path: `row_losses` of every row's per-direction terms
    (query_to_doc, doc_to_query, query_to_query, doc_to_doc: those in `wanted`, in that
    order), mean over the N rows; the gradient by autograd through it."""

    def formula(rows: list[Tensor], scalars: list[Tensor]) -> Tensor:
        parts = _info_nce_terms(rows, scalars[0], wanted)
        return row_losses(parts).sum() / rows[0].shape[0]

    parts_in = [query_BD, document_BD] + ([] if negatives_BKD is None else [negatives_BKD])
    return run(by_autograd(formula), parts_in, prep, group)


def _info_nce_terms(rows: list[Tensor], s: Tensor, wanted: set[str]) -> list[Tensor]:
    """Per direction a_i = lse over its negatives − s·qᵢ·dᵢ for ALL N rows."""
    q_ND, d_ND = rows[:2]
    n = q_ND.shape[0]
    # candidates [all documents; all first negatives; ...]: the negatives of row g at t·N + g
    cand_CD = d_ND if len(rows) == 2 else torch.cat([d_ND, *rows[2].unbind(1)])
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
