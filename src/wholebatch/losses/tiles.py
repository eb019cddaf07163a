"""Tiled autograd kernels behind `wholebatch.losses`: logits live one tile at a time.

No kernel ever holds a B x N logits matrix. The forward walks T x T tiles
of the logits and keeps only per-row (and per-column) running log-sum-exps;
the backward recomputes each tile from the saved inputs and those log-sum-exps
(the memory recipe of Inf-CL, arXiv:2410.17243, and FlashAttention). Peak memory
is O(N·D + T²) for `TiledLSE` and `SymmetricLSE` (the self-similarity logits of
NT-Xent, whose tiles below the diagonal are the transposes of those above and
are never computed) and O(B·D + T²) for `SigmoidRing`, independent of W.

On CPU the tiles' elementwise passes (exp, subtract, multiply) cost as much as
their matrix products, so the kernels scale the queries once (B x D) instead
of every tile, and fuse what they can (`addcmul_`).

Legend: W ranks in the group, B this rank's query rows, N global key rows,
D embedding dim, T the tile size (rows and columns of one logits tile).

The kernels are collectives when the group holds more than one rank: every
rank must call them, in the same order, and back-propagate through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from wholebatch.comm.collectives import ring_shift
from wholebatch.comm.groups import get_rank, get_world_size, is_distributed
from wholebatch.comm.sizes import ring_sizes

__all__ = ["SigmoidRing", "SymmetricLSE", "TiledLSE", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype tiles are computed in: float32 for 16-bit inputs (exp of bf16 logits is too coarse)."""
    return torch.promote_types(dtype, torch.float32)


def _upper_tiles(m: int, tile: int, group: Any) -> Iterator[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1) of this rank's tiles on and above the diagonal of an M x M matrix.

    The upper-triangle tiles, in row-major order, are dealt round-robin to the
    ranks of `group` (every rank gets them all when the group has one rank).
    """
    w, r = get_world_size(group), get_rank(group)
    starts = range(0, m, tile)
    pairs = [(i0, j0) for i0 in starts for j0 in starts if j0 >= i0]
    for i0, j0 in pairs[r::w]:
        yield i0, min(i0 + tile, m), j0, min(j0 + tile, m)


def _combine_lse(part_N: Tensor, group: Any) -> Tensor:
    """Each entry's log-sum-exp over every rank's partial one: all-reduce max, then sum of exps."""
    m_N = part_N.clone()
    dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=group)
    m_N = torch.where(torch.isfinite(m_N), m_N, torch.zeros_like(m_N))
    sum_N = (part_N - m_N).exp_()
    dist.all_reduce(sum_N, op=dist.ReduceOp.SUM, group=group)
    return m_N + sum_N.log_()


class TiledLSE(torch.autograd.Function):
    """Row (and optionally column) log-sum-exp of `scale * q_BD @ k_NDᵀ`, tile by tile.

    Outputs `row_B[i] = logsumexp_j(scale * q_i·k_j)` over every key j and, when
    `cols` is set, `col_N[j] = logsumexp_i(scale * q_i·k_j)` over the query rows
    of EVERY rank of `group` (combined across ranks in the forward: one
    all-reduce of N floats for the max, one for the sums). With `cols` unset
    `col_N` is empty.

    Backward: `row_B`'s gradient is local; `col_N` is a collective output (the
    same on every rank, a function of every rank's rows), so its gradient is
    first all-reduced (sum) and each rank then adds the part of every column's
    gradient that flows through its own rows: the exact adjoint, so the sum over
    ranks of every rank's scalar has its true gradient. Tiles are recomputed
    from `q_BD`, `k_ND`, `scale` and the saved log-sum-exps; memory O(N·D + T²)
    (the queries are scaled once, B x D, rather than every tile).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BD: Tensor,
        k_ND: Tensor,
        scale: Tensor,
        cols: bool,
        tile: int,
        group: Any,
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b, n = q_BD.shape[0], k_ND.shape[0]
        qs_BD = q_BD.to(acc) * scale.detach().to(acc)
        k = k_ND.to(acc)
        row_B = qs_BD.new_full((b,), float("-inf"))
        col_N = qs_BD.new_full((n if cols else 0,), float("-inf"))
        for i0 in range(0, b, tile):
            i1 = min(i0 + tile, b)
            for j0 in range(0, n, tile):
                j1 = min(j0 + tile, n)
                s_TT = qs_BD[i0:i1] @ k[j0:j1].T
                row_B[i0:i1] = torch.logaddexp(row_B[i0:i1], torch.logsumexp(s_TT, 1))
                if cols:
                    col_N[j0:j1] = torch.logaddexp(col_N[j0:j1], torch.logsumexp(s_TT, 0))
        if cols and is_distributed(group):
            col_N = _combine_lse(col_N, group)
        ctx.save_for_backward(q_BD, k_ND, scale, row_B, col_N)
        ctx.cols, ctx.tile, ctx.group = cols, tile, group
        return row_B, col_N

    @staticmethod
    def backward(ctx: Any, g_row_B: Tensor, g_col_N: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, k_ND, scale, row_B, col_N = ctx.saved_tensors
        acc, tile, cols = row_B.dtype, ctx.tile, ctx.cols
        b, n = q_BD.shape[0], k_ND.shape[0]
        s = scale.detach().to(acc)
        q, k = q_BD.to(acc), k_ND.to(acc)
        qs_BD = q * s
        g_row_B = g_row_B.to(acc)
        if cols:
            # backward of the cross-rank combine: all-reduce (sum) of the column gradient.
            g_col_N = g_col_N.to(acc).contiguous().clone()
            if is_distributed(ctx.group):
                dist.all_reduce(g_col_N, op=dist.ReduceOp.SUM, group=ctx.group)
        # Unscaled: dq = s·uq, dk = s·uk, d scale = sum_ij g_ij q_i·k_j = (q · uq).sum().
        uq_BD = torch.zeros(q.shape, dtype=acc, device=q.device)
        uk_ND = torch.zeros(k.shape, dtype=acc, device=k.device)
        for i0 in range(0, b, tile):
            i1 = min(i0 + tile, b)
            for j0 in range(0, n, tile):
                j1 = min(j0 + tile, n)
                s_TT = qs_BD[i0:i1] @ k[j0:j1].T
                # d(lse_i)/d(s_ij) = softmax along the row; likewise along the column.
                g_TT = torch.sub(s_TT, row_B[i0:i1, None]).exp_().mul_(g_row_B[i0:i1, None])
                if cols:
                    g_TT.addcmul_(s_TT.sub_(col_N[None, j0:j1]).exp_(), g_col_N[None, j0:j1])
                uq_BD[i0:i1] += g_TT @ k[j0:j1]
                uk_ND[j0:j1] += g_TT.T @ q[i0:i1]
        need = ctx.needs_input_grad
        ds = (q * uq_BD).sum() if need[2] else None
        return (
            uq_BD.mul_(s).to(q_BD.dtype) if need[0] else None,
            uk_ND.mul_(s).to(k_ND.dtype) if need[1] else None,
            ds.to(scale.dtype) if ds is not None else None,
            None,
            None,
            None,
        )


class SymmetricLSE(torch.autograd.Function):
    """Row log-sum-exp of the symmetric `scale * z_MD @ z_MDᵀ`, its diagonal excluded, tile by tile.

    Outputs `lse_M[i] = logsumexp_{j != i}(scale * z_i·z_j)` for EVERY row of
    `z_MD` (the same on every rank of `group`). The logits are symmetric, so only
    the tiles on and above the diagonal are computed: an off-diagonal tile
    serves its rows (a row log-sum-exp) and, transposed, its columns (a column
    log-sum-exp), in the forward and in the recomputing backward; a diagonal
    tile serves its rows only. The upper-triangle tiles are dealt to the ranks
    of `group` round-robin, so each rank does 1/W of half the work; the partial
    log-sum-exps are combined across ranks in the forward (one all-reduce of M
    floats for the max, one for the sums).

    Backward: `lse_M` is a collective output, so its gradient is first
    all-reduced (sum); each rank then returns the part of every row's gradient
    that flows through its own tiles: the exact adjoint, so the sum over ranks
    of every rank's scalar has its true gradient (`z_MD`'s gradient is summed
    over ranks by the all-gather's reduce-scatter upstream). Tiles are
    recomputed from `z_MD`, `scale` and `lse_M`; memory O(M·D + T²).

    With G the tile's gradient (row part + transposed column part, which holds
    both (i, j) and (j, i)) and U = sum over tiles of G·z (unscaled):
    d z = scale·U and d scale = (z · U).sum() / 2, since z·U counts every pair twice.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, z_MD: Tensor, scale: Tensor, tile: int, group: Any
    ) -> Tensor:
        acc = compute_dtype(z_MD.dtype)
        m = z_MD.shape[0]
        z = z_MD.to(acc)
        zs_MD = z * scale.detach().to(acc)  # scaled once: no per-tile multiply
        lse_M = z.new_full((m,), float("-inf"))
        for i0, i1, j0, j1 in _upper_tiles(m, tile, group):
            s_TT = zs_MD[i0:i1] @ z[j0:j1].T
            if i0 == j0:
                s_TT.fill_diagonal_(float("-inf"))
            lse_M[i0:i1] = torch.logaddexp(lse_M[i0:i1], torch.logsumexp(s_TT, 1))
            if i0 != j0:  # the mirrored tile (j, i): its rows are this tile's columns
                lse_M[j0:j1] = torch.logaddexp(lse_M[j0:j1], torch.logsumexp(s_TT, 0))
        if is_distributed(group):
            lse_M = _combine_lse(lse_M, group)
        ctx.save_for_backward(z_MD, scale, lse_M)
        ctx.tile, ctx.group = tile, group
        return lse_M

    @staticmethod
    def backward(ctx: Any, g_M: Tensor) -> tuple[Tensor | None, ...]:
        z_MD, scale, lse_M = ctx.saved_tensors
        acc, tile, group = lse_M.dtype, ctx.tile, ctx.group
        # backward of the cross-rank combine: all-reduce (sum) of the gradient.
        g_M = g_M.to(acc).contiguous().clone()
        if is_distributed(group):
            dist.all_reduce(g_M, op=dist.ReduceOp.SUM, group=group)
        z = z_MD.to(acc)
        s = scale.detach().to(acc)
        zs_MD = z * s
        u_MD = torch.zeros(z.shape, dtype=acc, device=z.device)
        for i0, i1, j0, j1 in _upper_tiles(z.shape[0], tile, group):
            s_TT = zs_MD[i0:i1] @ z[j0:j1].T
            if i0 == j0:
                s_TT.fill_diagonal_(float("-inf"))
            # d lse_i / d s_ij = softmax along row i; the column part is d lse_j / d s_ji.
            g_TT = torch.sub(s_TT, lse_M[i0:i1, None]).exp_().mul_(g_M[i0:i1, None])
            g_TT.addcmul_(s_TT.sub_(lse_M[None, j0:j1]).exp_(), g_M[None, j0:j1])
            u_MD[i0:i1] += g_TT @ z[j0:j1]
            if i0 != j0:
                u_MD[j0:j1] += g_TT.T @ z[i0:i1]
        need = ctx.needs_input_grad
        ds = (z * u_MD).sum() / 2 if need[1] else None
        dz = u_MD.mul_(s) if need[0] else None
        return (
            dz.to(z_MD.dtype) if dz is not None else None,
            ds.to(scale.dtype) if ds is not None else None,
            None,
            None,
        )


def _ring_sizes(sizes: tuple[int, ...], step: int) -> list[int]:
    """Rows each rank holds at ring step `step`: rank q holds the block of rank q - step."""
    return list(ring_sizes(sizes, step))


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
