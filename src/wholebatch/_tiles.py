"""Tiled autograd kernels behind `wholebatch.losses`: logits live one tile at a time.

Neither kernel ever holds a B x N logits matrix. The forward walks T x T tiles
of the logits and keeps only per-row (and per-column) running log-sum-exps;
the backward recomputes each tile from the saved inputs and those log-sum-exps
(the memory recipe of Inf-CL, arXiv:2410.17243, and FlashAttention). Peak memory
is O(N·D + T²) for `TiledLSE` and O(B·D + T²) for `SigmoidRing`, independent of W.

Legend: W ranks in the group, B this rank's query rows, N global key rows,
D embedding dim, T the tile size (rows and columns of one logits tile).

Both kernels are collectives when the group holds more than one rank: every
rank must call them, in the same order, and back-propagate through them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from wholebatch.comm import ring_shift
from wholebatch.groups import get_rank, get_world_size, is_distributed

__all__ = ["SigmoidRing", "TiledLSE", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype tiles are computed in: float32 for 16-bit inputs (exp of bf16 logits is too coarse)."""
    return torch.promote_types(dtype, torch.float32)


def _mask_tile(
    s_TT: Tensor, exclude_B: Tensor | None, i0: int, i1: int, j0: int, j1: int
) -> Tensor:
    """Set s_TT[i, exclude[i] - j0] = -inf where that column lies in this tile."""
    if exclude_B is None:
        return s_TT
    local = exclude_B[i0:i1] - j0
    rows = ((local >= 0) & (local < j1 - j0)).nonzero().squeeze(1)
    if rows.numel():
        s_TT[rows, local[rows]] = float("-inf")
    return s_TT


class TiledLSE(torch.autograd.Function):
    """Row (and optionally column) log-sum-exp of `scale * q_BD @ k_NDᵀ`, tile by tile.

    Outputs `row_B[i] = logsumexp_j(scale * q_i·k_j)` over every key j (less the
    one `exclude_B[i]` names, if given) and, when `cols` is set, `col_N[j] =
    logsumexp_i(scale * q_i·k_j)` over the query rows of EVERY rank of `group`
    (combined across ranks in the forward: one all-reduce of N floats for the
    max, one for the sums). With `cols` unset `col_N` is empty.

    Backward: `row_B`'s gradient is local; `col_N` is a collective output (the
    same on every rank, a function of every rank's rows), so its gradient is
    first all-reduced (sum) and each rank then adds the part of every column's
    gradient that flows through its own rows: the exact adjoint, so the sum over
    ranks of every rank's scalar has its true gradient. Tiles are recomputed
    from `q_BD`, `k_ND`, `scale` and the saved log-sum-exps; memory O(N·D + T²).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BD: Tensor,
        k_ND: Tensor,
        scale: Tensor,
        exclude_B: Tensor | None,
        cols: bool,
        tile: int,
        group: Any,
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b, n = q_BD.shape[0], k_ND.shape[0]
        s = scale.detach().to(acc)
        row_B = q_BD.new_full((b,), float("-inf"), dtype=acc)
        col_N = q_BD.new_full((n if cols else 0,), float("-inf"), dtype=acc)
        for i0 in range(0, b, tile):
            i1 = min(i0 + tile, b)
            q_TD = q_BD[i0:i1].to(acc)
            for j0 in range(0, n, tile):
                j1 = min(j0 + tile, n)
                s_TT = _mask_tile((q_TD @ k_ND[j0:j1].to(acc).T).mul_(s), exclude_B, i0, i1, j0, j1)
                row_B[i0:i1] = torch.logaddexp(row_B[i0:i1], torch.logsumexp(s_TT, 1))
                if cols:
                    col_N[j0:j1] = torch.logaddexp(col_N[j0:j1], torch.logsumexp(s_TT, 0))
        if cols and is_distributed(group):
            # Combine each rank's partial column log-sum-exp: max, then sum of exps.
            m_N = col_N.clone()
            dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=group)
            m_N = torch.where(torch.isfinite(m_N), m_N, torch.zeros_like(m_N))
            sum_N = (col_N - m_N).exp_()
            dist.all_reduce(sum_N, op=dist.ReduceOp.SUM, group=group)
            col_N = m_N + sum_N.log_()
        ctx.save_for_backward(q_BD, k_ND, scale, row_B, col_N, exclude_B)
        ctx.cols, ctx.tile, ctx.group = cols, tile, group
        return row_B, col_N

    @staticmethod
    def backward(ctx: Any, g_row_B: Tensor, g_col_N: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, k_ND, scale, row_B, col_N, exclude_B = ctx.saved_tensors
        acc, tile, cols = row_B.dtype, ctx.tile, ctx.cols
        b, n = q_BD.shape[0], k_ND.shape[0]
        s = scale.detach().to(acc)
        g_row_B = g_row_B.to(acc)
        if cols:
            # backward of the cross-rank combine: all-reduce (sum) of the column gradient.
            g_col_N = g_col_N.to(acc).contiguous().clone()
            if is_distributed(ctx.group):
                dist.all_reduce(g_col_N, op=dist.ReduceOp.SUM, group=ctx.group)
        dq_BD = torch.zeros(q_BD.shape, dtype=acc, device=q_BD.device)
        dk_ND = torch.zeros(k_ND.shape, dtype=acc, device=k_ND.device)
        ds = torch.zeros((), dtype=acc, device=q_BD.device)
        for i0 in range(0, b, tile):
            i1 = min(i0 + tile, b)
            q_TD = q_BD[i0:i1].to(acc)
            for j0 in range(0, n, tile):
                j1 = min(j0 + tile, n)
                k_TD = k_ND[j0:j1].to(acc)
                s_TT = _mask_tile((q_TD @ k_TD.T).mul_(s), exclude_B, i0, i1, j0, j1)
                # d(lse_i)/d(s_ij) = softmax along the row; likewise along the column.
                g_TT = torch.sub(s_TT, row_B[i0:i1, None]).exp_().mul_(g_row_B[i0:i1, None])
                if cols:
                    g_TT.add_(s_TT.sub_(col_N[None, j0:j1]).exp_().mul_(g_col_N[None, j0:j1]))
                gk_TD = g_TT @ k_TD
                ds += (q_TD * gk_TD).sum()  # sum_ij g_ij q_i·k_j without a second T x T product
                dq_BD[i0:i1] += gk_TD.mul_(s)
                dk_ND[j0:j1] += (g_TT.T @ q_TD).mul_(s)
        need = ctx.needs_input_grad
        return (
            dq_BD.to(q_BD.dtype) if need[0] else None,
            dk_ND.to(k_ND.dtype) if need[1] else None,
            ds.to(scale.dtype) if need[2] else None,
            None,
            None,
            None,
            None,
        )


def _ring_sizes(sizes: tuple[int, ...], step: int) -> list[int]:
    """Rows each rank holds at ring step `step`: rank q holds the block of rank q - step."""
    w = len(sizes)
    return [sizes[(q - step) % w] for q in range(w)]


def _softplus_sum(
    img_BD: Tensor, blk_MD: Tensor, s: Tensor, b: Tensor, tile: int, acc: torch.dtype
) -> Tensor:
    """sum_ij softplus(s * img_i·blk_j + b), tile by tile (softplus(z) = -logsigmoid(-z), exact)."""
    total = torch.zeros((), dtype=acc, device=img_BD.device)
    for i0 in range(0, img_BD.shape[0], tile):
        q_TD = img_BD[i0 : i0 + tile].to(acc)
        for j0 in range(0, blk_MD.shape[0], tile):
            z_TT = (q_TD @ blk_MD[j0 : j0 + tile].to(acc).T).mul_(s).add_(b)
            total -= F.logsigmoid(z_TT.neg_()).sum()
    return total


class SigmoidRing(torch.autograd.Function):
    """sum over this rank's image rows i and EVERY rank's text rows j of softplus(s·Iᵢ·Tⱼ + b).

    Text blocks travel around the ring with `ring_shift` (receive from rank - 1),
    one block in memory at a time: W - 1 shifts in the forward. Nothing exchanged
    is saved: the backward re-exchanges the blocks and sends each block's
    gradient along with it, W - 1 shifts of [block | gradient] and one last
    shift that returns each gradient to its owner. Peak memory O(B·D + T²),
    independent of W.

    Backward: exact adjoint of the distributed sum; each rank's text gradient
    collects every rank's image rows' contributions, so the sum over ranks of
    every rank's scalar has its true gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        img_BD: Tensor,
        txt_BD: Tensor,
        scale: Tensor,
        bias: Tensor,
        sizes: tuple[int, ...],
        tile: int,
        group: Any,
    ) -> Tensor:
        acc = compute_dtype(img_BD.dtype)
        s, b = scale.detach().to(acc), bias.detach().to(acc)
        w = get_world_size(group)
        blk_MD = txt_BD.detach()
        total = torch.zeros((), dtype=acc, device=img_BD.device)
        for step in range(w):
            total += _softplus_sum(img_BD, blk_MD, s, b, tile, acc)
            if step < w - 1:
                blk_MD = ring_shift(
                    blk_MD, 1, sizes=_ring_sizes(sizes, step), group=group, check=False
                )
        ctx.save_for_backward(img_BD, txt_BD, scale, bias)
        ctx.sizes, ctx.tile, ctx.group = sizes, tile, group
        return total

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        img_BD, txt_BD, scale, bias = ctx.saved_tensors
        acc, tile, sizes, group = compute_dtype(img_BD.dtype), ctx.tile, ctx.sizes, ctx.group
        s, b, g = scale.detach().to(acc), bias.detach().to(acc), g.to(acc)
        w, d = get_world_size(group), img_BD.shape[1]
        di_BD = torch.zeros(img_BD.shape, dtype=acc, device=img_BD.device)
        ds = torch.zeros((), dtype=acc, device=img_BD.device)
        db = torch.zeros((), dtype=acc, device=img_BD.device)
        blk_MD = txt_BD.detach().to(acc)
        dblk_MD = torch.zeros_like(blk_MD)
        for step in range(w):
            for i0 in range(0, img_BD.shape[0], tile):
                q_TD = img_BD[i0 : i0 + tile].to(acc)
                for j0 in range(0, blk_MD.shape[0], tile):
                    k_TD = blk_MD[j0 : j0 + tile]
                    # d softplus(z)/dz = sigmoid(z)
                    g_TT = (q_TD @ k_TD.T).mul_(s).add_(b).sigmoid_().mul_(g)
                    gk_TD = g_TT @ k_TD
                    ds += (q_TD * gk_TD).sum()
                    db += g_TT.sum()
                    di_BD[i0 : i0 + tile] += gk_TD.mul_(s)
                    dblk_MD[j0 : j0 + tile] += (g_TT.T @ q_TD).mul_(s)
            ring = _ring_sizes(sizes, step)
            if step < w - 1:
                both = torch.cat([blk_MD, dblk_MD], 1)
                both = ring_shift(both, 1, sizes=ring, group=group, check=False)
                blk_MD, dblk_MD = both[:, :d], both[:, d:]
            elif w > 1:
                # The gradient of the block held now belongs to the next rank on the ring.
                dblk_MD = ring_shift(dblk_MD, 1, sizes=ring, group=group, check=False)
        if w > 1:
            assert dblk_MD.shape[0] == sizes[get_rank(group)]
        need = ctx.needs_input_grad
        return (
            di_BD.to(img_BD.dtype) if need[0] else None,
            dblk_MD.to(txt_BD.dtype) if need[1] else None,
            ds.to(scale.dtype) if need[2] else None,
            db.to(bias.dtype) if need[3] else None,
            None,
            None,
            None,
        )
