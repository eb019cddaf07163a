"""Softmax rows with a known positive over all-gathered keys (CLIP, InfoNCE, SupCon): `PositiveLSE`.

Row i's loss term is softplus(a_i), a_i = lse over its negatives − its positive
logit (tiles.py, precision); the kernel keeps the running (max, sum) of every
row and, where the loss asks, of every positive column, and recomputes each tile
in the backward. On CUDA the fused Triton kernels (`fused`) take the tiles.

Legend: B this rank's query rows, C candidate (key) rows, D dim, T the tile size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.collectives import all_gather
from wholebatch.comm.groups import is_distributed
from wholebatch.losses import fused
from wholebatch.losses.tiles import (
    combine,
    compute_dtype,
    finish,
    logits_tile,
    mask_ids,
    mask_rows,
    mm_acc,
    running,
    scaled_rows,
    softmax_coef,
    threaded,
    tile_grid,
)

__all__ = ["Ids", "PositiveLSE", "gathered_ids"]

Ids = tuple[Tensor, Tensor] | None
"""(the query rows' ids (B,), the first candidate columns' ids (N,)) of `ids_B=`, or None."""


def gathered_ids(
    ids_B: Tensor | None, sizes: Sequence[int], group: ProcessGroup | None
) -> tuple[Tensor, Tensor] | None:
    """(this rank's ids, every rank's, in rank order) for `PositiveLSE`'s id mask, or None."""
    if ids_B is None:
        return None
    return ids_B, all_gather(ids_B, sizes=list(sizes), group=group, check=False)


def _mask_tile_ids(s_TT: Tensor, ids: Ids, i0: int, i1: int, j0: int, j1: int) -> None:
    if ids is not None:
        mask_ids(s_TT, ids[0][i0:i1], ids[1][j0:j1])


def _positive_stats(
    q_BD: Tensor,
    k_CD: Tensor,
    scale: Tensor,
    offset: int,
    masks: tuple[int, ...],
    n_cols: int,
    tile: int,
    ids: Ids,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(m_row, l_row, m_col, l_col) of `scale * q_BD @ k_CDᵀ` with the masked entries left out:
    the fused Triton kernels where `fused.use_fused` says (they take no ids), else the tiles."""
    if ids is None and fused.use_fused(q_BD):
        try:
            m_row, l_row = fused.row_stats(q_BD, k_CD, scale, offset, masks)
            m_col, l_col = fused.col_stats(q_BD, k_CD, scale, offset, masks, n_cols)
            return m_row, l_row, m_col, l_col
        except Exception as failure:  # a kernel that does not build here: the PyTorch tiles
            if fused.forced():
                raise
            fused.disable(failure)
    acc = compute_dtype(q_BD.dtype)
    b, c = q_BD.shape[0], k_CD.shape[0]
    qs_BD, post = scaled_rows(q_BD, scale, acc)
    m_row = qs_BD.new_full((b,), float("-inf"), dtype=acc)
    l_row = torch.zeros(b, dtype=acc, device=q_BD.device)
    m_col = torch.full((n_cols,), float("-inf"), dtype=acc, device=q_BD.device)
    l_col = torch.zeros(n_cols, dtype=acc, device=q_BD.device)
    buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
    k = k_CD if post is not None else k_CD.to(acc)
    for i0, i1, j0, j1 in tile_grid(b, c, tile):
        s_TT = logits_tile(qs_BD[i0:i1], k[j0:j1].T, post, acc)
        # the positives (i, offset + i) are not negatives: masked in rows and columns
        mask_rows(s_TT, masks, offset + i0 - j0)
        _mask_tile_ids(s_TT, ids, i0, i1, j0, j1)
        e = buf[: s_TT.numel()].view(s_TT.shape)
        m_row[i0:i1], l_row[i0:i1] = running(m_row[i0:i1], l_row[i0:i1], s_TT, 1, e)
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            e = buf[: sc.numel()].view(sc.shape)  # the rows' exponentials are summed: reuse
            m_col[j0:jc], l_col[j0:jc] = running(m_col[j0:jc], l_col[j0:jc], sc, 0, e)
    return m_row, l_row, m_col, l_col


def _positive_grads(
    q_BD: Tensor,
    k_CD: Tensor,
    scale: Tensor,
    offset: int,
    masks: tuple[int, ...],
    tile: int,
    row_coef: tuple[Tensor, Tensor],
    col_coef: tuple[Tensor, Tensor],
    ids: Ids,
) -> tuple[Tensor, Tensor]:
    """(uq, uk), unscaled (dq = s·uq, dk = s·uk): every tile recomputed and its softmax
    gradient applied; fused where `fused.use_fused` says (without ids), else the tiles."""
    acc = row_coef[0].dtype
    if ids is None and fused.use_fused(q_BD):
        try:
            uq, uk = fused.grads(q_BD, k_CD, scale, offset, masks, row_coef, col_coef)
            return uq.to(acc), uk.to(acc)
        except Exception as failure:  # a kernel that does not build here: the PyTorch tiles
            if fused.forced():
                raise
            fused.disable(failure)
    (sh_row, cf_row), (sh_col, cf_col) = row_coef, col_coef
    b, c, n_cols = q_BD.shape[0], k_CD.shape[0], col_coef[0].shape[0]
    qs_BD, post = scaled_rows(q_BD, scale, acc)
    low = post is not None
    q = q_BD if low else q_BD.to(acc)
    k = k_CD if low else k_CD.to(acc)
    # Unscaled: dq = s·uq, dk = s·uk, d scale = sum_ij g_ij q_i·k_j = (q · uq).sum().
    uq_BD = torch.zeros(q_BD.shape, dtype=acc, device=q_BD.device)
    uk_CD = torch.zeros(k_CD.shape, dtype=acc, device=k_CD.device)
    buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
    for i0, i1, j0, j1 in tile_grid(b, c, tile):
        s_TT = logits_tile(qs_BD[i0:i1], k[j0:j1].T, post, acc)
        mask_rows(s_TT, masks, offset + i0 - j0)
        _mask_tile_ids(s_TT, ids, i0, i1, j0, j1)
        # d a_i / d s_ij = softmax over row i's negatives; likewise along the columns.
        g_TT = buf[: s_TT.numel()].view(s_TT.shape)
        torch.sub(s_TT, sh_row[i0:i1, None], out=g_TT).exp_().mul_(cf_row[i0:i1, None])
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            g_TT[:, : jc - j0].addcmul_(sc.sub_(sh_col[None, j0:jc]).exp_(), cf_col[None, j0:jc])
        uq_BD[i0:i1] += mm_acc(g_TT.to(k.dtype), k[j0:j1], acc)
        uk_CD[j0:j1] += mm_acc(g_TT.T.to(q.dtype), q[i0:i1], acc)
    return uq_BD, uk_CD


class PositiveLSE(torch.autograd.Function):
    """Softmax cross-entropy terms of `scale * q_BD @ k_CDᵀ` with known positives, tile by tile.

    Query row i (global row `offset + i`) has its positive at candidate column
    `offset + i`; the candidates at `t + offset + i` for t in `masks` (which
    holds 0) are left out of row i, every other candidate is a negative
    (InfoNCE's document-to-document direction leaves out a row's own hard
    negatives, at t = N, 2N, ...). With `ids` (the query rows' ids, the first
    candidate columns' ids: `ids_B=`), every (i, j) of equal ids is left out too:
    rows of one id are never each other's negatives. Outputs:

    - `row_B[i] = lse_{j ∉ masked}(s_ij) − pos_B[i]`: row i's loss is softplus(row_B[i]);
    - when `n_cols > 0`, `col_B[i] = lse_{i' ≠ offset+i}(s_{i', offset+i}) − pos_B[i]`
      over the query rows of EVERY rank of `group` (column `offset + i` of the
      first `n_cols` candidates, those that are some row's positive; partial
      statistics combined across ranks: one all-reduce of n_cols floats for the
      max, one for the sums). Empty when `n_cols == 0`.

    `pos_B` (the positive logits, computed by the caller with autograd) is an
    input, so that each output is formed as (max − positive) + log(sum): its
    error is relative to the loss (module docstring).

    Backward: `row_B`'s gradient is local; `col_B` of every rank depends on every
    rank's rows, so the column gradients are all-gathered (N floats) and each
    rank adds the part flowing through its own rows: the exact adjoint, so the
    sum over ranks of every rank's scalar has its true gradient. `pos_B` gets
    −(its rows' gradients). Tiles are recomputed from the inputs and the saved
    (max, sum) statistics; memory O(C·D + T²).
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        q_BD: Tensor,
        k_CD: Tensor,
        scale: Tensor,
        pos_B: Tensor,
        offset: int,
        masks: tuple[int, ...],
        n_cols: int,
        sizes: tuple[int, ...],
        tile: int,
        group: Any,
        ids: Ids,
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b = q_BD.shape[0]
        m_row, l_row, m_col, l_col = _positive_stats(
            q_BD, k_CD, scale, offset, masks, n_cols, tile, ids
        )
        if n_cols:  # the same on every rank (N and the directions are agreed): no empty calls
            m_col, l_col = combine(m_col, l_col, group)
        pos = pos_B.detach().to(acc)
        row_B = finish(m_row, l_row, pos)
        col_B = (
            finish(m_col[offset : offset + b], l_col[offset : offset + b], pos)
            if n_cols
            else pos.new_zeros(0)
        )
        ctx.save_for_backward(q_BD, k_CD, scale, m_row, l_row, m_col, l_col)
        ctx.offset, ctx.n_cols, ctx.sizes, ctx.tile, ctx.group = offset, n_cols, sizes, tile, group
        ctx.masks, ctx.ids = masks, ids
        ctx.pos_dtype = pos_B.dtype
        return row_B, col_B

    @staticmethod
    @threaded
    def backward(ctx: Any, g_row_B: Tensor, g_col_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, k_CD, scale, m_row, l_row, m_col, l_col = ctx.saved_tensors
        acc, tile, n_cols, offset, masks = m_row.dtype, ctx.tile, ctx.n_cols, ctx.offset, ctx.masks
        s = scale.detach().to(acc)
        g_row_B = g_row_B.to(acc)
        sh_row, cf_row = softmax_coef(m_row, l_row, g_row_B)
        if n_cols:
            g_col_B = g_col_B.to(acc).contiguous()
            # every rank's rows feed every column: the column gradients, all-gathered.
            g_col_N = (
                all_gather(g_col_B, sizes=ctx.sizes, group=ctx.group, check=False)
                if is_distributed(ctx.group)
                else g_col_B
            )
            sh_col, cf_col = softmax_coef(m_col, l_col, g_col_N)
        else:
            sh_col = cf_col = m_col  # empty: no columns
        cols = (sh_col, cf_col)
        uq_BD, uk_CD = _positive_grads(
            q_BD, k_CD, scale, offset, masks, tile, (sh_row, cf_row), cols, ctx.ids
        )
        need = ctx.needs_input_grad
        ds = (q_BD.to(acc) * uq_BD).sum() if need[2] else None
        g_pos = -g_row_B
        if n_cols:
            g_pos = g_pos - g_col_B
        return (
            uq_BD.mul_(s).to(q_BD.dtype) if need[0] else None,
            uk_CD.mul_(s).to(k_CD.dtype) if need[1] else None,
            ds.to(scale.dtype) if ds is not None else None,
            g_pos.to(ctx.pos_dtype) if need[3] else None,
            *([None] * 7),
        )
