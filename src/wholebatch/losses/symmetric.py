"""NT-Xent's self-similarity over the 2N views, the upper triangle dealt to the ranks: `SymmetricLSE`.

The logits Z·Zᵀ are symmetric, so only the tiles on and above the diagonal are
computed; panel pairs are dealt to the ranks from M and W alone (never from a
tile size), so ranks may tile differently. Serves NT-Xent and DCL (their row
terms differ: softplus of a_i, or a_i itself).

Legend: M rows of the self-similarity matrix (2N), D dim, T the tile size, W ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from wholebatch.comm.collectives import all_gather, apply
from wholebatch.comm.groups import get_rank, get_world_size, is_distributed
from wholebatch.losses import fused
from wholebatch.losses.call import Call
from wholebatch.losses.small import eye, lse_rows
from wholebatch.losses.tiles import (
    combine,
    compute_dtype,
    finish,
    logits_tile,
    mm_acc,
    running,
    scaled_rows,
    softmax_coef,
    threaded,
)

__all__ = ["SymmetricLSE", "two_view_formula", "two_view_terms"]


def _panels(m: int, w: int) -> list[tuple[int, int]]:
    """Row panels of an M x M matrix, from M and W only (never from a tile size).

    One panel on one rank; on W ranks, p panels with p(p+1)/2 >= 4W pairs on and
    above the diagonal, enough for an even deal.
    """
    p = 1
    if w > 1:
        while p * (p + 1) // 2 < 4 * w:
            p += 1
    size = max(1, -(-m // p))
    return [(a, min(a + size, m)) for a in range(0, m, size)]


def _dealt_pairs(m: int, w: int, r: int) -> list[tuple[int, int, int, int]]:
    """Rank r's panel pairs (i0, i1, j0, j1), j0 >= i0, of an M x M symmetric matrix.

    Every rank computes the same deal from (M, W) alone: the pairs, heaviest
    first (a diagonal pair is half a square), each to the least loaded rank.
    The tile size never enters, so ranks may tile their pairs differently
    (issue 14: a per-rank tile size once changed the deal and the answer).
    """
    panels = _panels(m, w)
    pairs = [(a, b) for a in range(len(panels)) for b in range(a, len(panels))]

    def weight(pair: tuple[int, int]) -> float:
        (i0, i1), (j0, j1) = panels[pair[0]], panels[pair[1]]
        return (i1 - i0) * (i1 - i0 + 1) / 2 if pair[0] == pair[1] else (i1 - i0) * (j1 - j0)

    load = [0.0] * w
    mine: list[tuple[int, int, int, int]] = []
    for pair in sorted(pairs, key=lambda p: (-weight(p), p)):
        owner = min(range(w), key=lambda q: (load[q], q))
        load[owner] += weight(pair)
        if owner == r:
            mine.append((*panels[pair[0]], *panels[pair[1]]))
    return sorted(mine)


def _uppertiles(m: int, tile: int, group: Any) -> Iterator[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1) of this rank's tiles on and above the diagonal of an M x M matrix."""
    for a0, a1, b0, b1 in _dealt_pairs(m, get_world_size(group), get_rank(group)):
        for i0 in range(a0, a1, tile):
            for j0 in range(i0 if a0 == b0 else b0, b1, tile):
                yield i0, min(i0 + tile, a1), j0, min(j0 + tile, b1)


def _mask_sym(s_TT: Tensor, i0: int, j0: int, half: int) -> None:
    """Mask what is not a negative in tile (i0, j0): the diagonal, and the positives i ↔ i ± half."""
    if i0 == j0:
        s_TT.fill_diagonal_(float("-inf"))
        s_TT.diagonal(-half).fill_(float("-inf"))
    s_TT.diagonal(half + i0 - j0).fill_(float("-inf"))


def _sym_masks(m: int) -> tuple[int, ...]:
    """The entries (i, i + t) of an M x M self-similarity matrix that are not negatives:
    the diagonal and the positives i ± M/2 (out-of-range ones match no column)."""
    return (0, m // 2, -(m // 2))


def _sym_stats_fused(z_MD: Tensor, scale: Tensor, group: Any, m_M: Tensor, l_M: Tensor) -> bool:
    """This rank's panel pairs' (max, sum) from the fused kernels, merged into (m_M, l_M) in place.

    A diagonal pair is its whole square by rows (each entry once for its row, as
    the tiles on and above the diagonal give it); an off-diagonal pair serves its
    rows and, through the column statistics, the mirrored pair's rows.
    """
    masks = _sym_masks(z_MD.shape[0])
    parts = []  # every kernel first, then the merges: a failure leaves (m_M, l_M) untouched
    for a0, a1, b0, b1 in _dealt_pairs(z_MD.shape[0], get_world_size(group), get_rank(group)):
        za, zb, off = z_MD[a0:a1], z_MD[b0:b1], a0 - b0
        parts.append((a0, a1, fused.row_stats(za, zb, scale, off, masks)))
        if a0 != b0:
            parts.append((b0, b1, fused.col_stats(za, zb, scale, off, masks, b1 - b0)))
    for i0, i1, (m2, l2) in parts:
        m_M[i0:i1], l_M[i0:i1] = fused.merge(m_M[i0:i1], l_M[i0:i1], m2, l2)
    return True


def _sym_grads_fused(
    z_MD: Tensor, scale: Tensor, group: Any, shift: Tensor, coef: Tensor, u_MD: Tensor
) -> bool:
    """This rank's panel pairs' U = Σ G·z (unscaled) from the fused kernels, added to `u_MD`.

    A diagonal pair, its whole square by rows: G = R (row i's softmax gradient)
    and U gains R·z + Rᵀ·z, the same as the tiles' R + Rᵀ on and above the diagonal.
    """
    masks = _sym_masks(z_MD.shape[0])
    none = shift[:0]
    parts = []
    for a0, a1, b0, b1 in _dealt_pairs(z_MD.shape[0], get_world_size(group), get_rank(group)):
        za, zb, off = z_MD[a0:a1], z_MD[b0:b1], a0 - b0
        cols = (none, none) if a0 == b0 else (shift[b0:b1], coef[b0:b1])
        uq, uk = fused.grads(za, zb, scale, off, masks, (shift[a0:a1], coef[a0:a1]), cols)
        parts.append((a0, a1, b0, b1, uq, uk))
    for a0, a1, b0, b1, uq, uk in parts:
        u_MD[a0:a1] += uq.to(u_MD.dtype)
        u_MD[b0:b1] += uk.to(u_MD.dtype)
    return True


class SymmetricLSE(torch.autograd.Function):
    """NT-Xent's row terms over the symmetric `scale * z_MD @ z_MDᵀ`, tile by tile.

    Outputs, for EVERY row of `z_MD` (M = 2N; the positive of row i is row
    i ± N), `a_M[i] = lse_{j ∉ {i, pos(i)}}(scale·z_i·z_j) − pos_M[i]`: row i's
    loss is softplus(a_M[i]) (error relative to the loss, see the module
    docstring). The logits are symmetric, so only the tiles on and above the
    diagonal are computed: an off-diagonal tile serves its rows and,
    transposed, its columns, in the forward and in the recomputing backward; a
    diagonal tile serves its rows only. Panel pairs of the upper triangle are
    dealt to the ranks of `group` from M and W alone (so ranks may use
    different tile sizes), each rank doing about 1/W of half the work; the
    partial statistics are combined across ranks in the forward (one
    all-reduce of M floats for the max, one for the sums).

    Backward: `a_M` is a collective output (the same on every rank), so its
    gradient is first all-reduced (sum); each rank then returns the part of
    every row's gradient that flows through its own tiles, and −(its own
    upstream gradient) for `pos_M`: the exact adjoint, so the sum over ranks of
    every rank's scalar has its true gradient. Tiles are recomputed from
    `z_MD`, `scale` and the saved statistics; memory O(M·D + T²).

    With G the tile's gradient (row part + transposed column part, which holds
    both (i, j) and (j, i)) and U = sum over tiles of G·z (unscaled):
    d z = scale·U and d scale = (z · U).sum() / 2, since z·U counts every pair twice.
    Where `fused.use_fused` says, each dealt pair runs through the fused kernels
    instead (`_sym_stats_fused`, `_sym_grads_fused`): the same statistics and U.
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any, z_MD: Tensor, scale: Tensor, pos_M: Tensor, tile: int, group: Any
    ) -> Tensor:
        acc = compute_dtype(z_MD.dtype)
        m, half = z_MD.shape[0], z_MD.shape[0] // 2
        zs_MD, post = scaled_rows(z_MD, scale, acc)  # scaled once (upcast path)
        z = z_MD if post is not None else z_MD.to(acc)
        m_M = torch.full((m,), float("-inf"), dtype=acc, device=z_MD.device)
        l_M = torch.zeros(m, dtype=acc, device=z_MD.device)
        fast = fused.use_fused(z_MD)
        if fast:  # no collective inside: a rank whose kernel fails takes the PyTorch tiles alone
            fast = fused.attempt(_sym_stats_fused, z_MD, scale, group, m_M, l_M) is not None
        for i0, i1, j0, j1 in _uppertiles(m, tile, group) if not fast else ():
            s_TT = logits_tile(zs_MD[i0:i1], z[j0:j1].T, post, acc)
            _mask_sym(s_TT, i0, j0, half)
            m_M[i0:i1], l_M[i0:i1] = running(m_M[i0:i1], l_M[i0:i1], s_TT, 1)
            if i0 != j0:  # the mirrored tile (j, i): its rows are this tile's columns
                m_M[j0:j1], l_M[j0:j1] = running(m_M[j0:j1], l_M[j0:j1], s_TT, 0)
        m_M, l_M = combine(m_M, l_M, group)
        ctx.save_for_backward(z_MD, scale, m_M, l_M)
        ctx.tile, ctx.group, ctx.pos_dtype = tile, group, pos_M.dtype
        return finish(m_M, l_M, pos_M.detach().to(acc))

    @staticmethod
    @threaded
    def backward(ctx: Any, g_M: Tensor) -> tuple[Tensor | None, ...]:
        z_MD, scale, m_M, l_M = ctx.saved_tensors
        acc, tile, group = m_M.dtype, ctx.tile, ctx.group
        m, half = z_MD.shape[0], z_MD.shape[0] // 2
        g_local = g_M.to(acc)
        # backward of the cross-rank combine: all-reduce (sum) of the gradient.
        g_all = g_local.contiguous().clone()
        if is_distributed(group):
            dist.all_reduce(g_all, op=dist.ReduceOp.SUM, group=group)
        shift, coef = softmax_coef(m_M, l_M, g_all)
        s = scale.detach().to(acc)
        zs_MD, post = scaled_rows(z_MD, scale, acc)
        z = z_MD if post is not None else z_MD.to(acc)
        u_MD = torch.zeros(z_MD.shape, dtype=acc, device=z_MD.device)
        fast = fused.use_fused(z_MD)
        if fast:
            fast = (
                fused.attempt(_sym_grads_fused, z_MD, scale, group, shift, coef, u_MD) is not None
            )
        for i0, i1, j0, j1 in _uppertiles(m, tile, group) if not fast else ():
            s_TT = logits_tile(zs_MD[i0:i1], z[j0:j1].T, post, acc)
            _mask_sym(s_TT, i0, j0, half)
            # d a_i / d s_ij = softmax over row i's negatives; the column part is
            # d a_j / d s_ji (on a diagonal tile it makes G symmetric: one product serves).
            g_TT = torch.sub(s_TT, shift[i0:i1, None]).exp_().mul_(coef[i0:i1, None])
            g_TT.addcmul_(s_TT.sub_(shift[None, j0:j1]).exp_(), coef[None, j0:j1])
            u_MD[i0:i1] += mm_acc(g_TT.to(z.dtype), z[j0:j1], acc)
            if i0 != j0:
                u_MD[j0:j1] += mm_acc(g_TT.T.to(z.dtype), z[i0:i1], acc)
        need = ctx.needs_input_grad
        ds = (z_MD.to(acc) * u_MD).sum() / 2 if need[1] else None
        dz = u_MD.mul_(s) if need[0] else None
        return (
            dz.to(z_MD.dtype) if dz is not None else None,
            ds.to(scale.dtype) if ds is not None else None,
            (-g_local).to(ctx.pos_dtype) if need[2] else None,
            None,
            None,
        )


# ---------------------------------------------------------------------------
# Two views per sample (NT-Xent, DCL): the row terms a_i, tiled and dense
# ---------------------------------------------------------------------------


def two_view_terms(call: Call, a_BD: Tensor, b_BD: Tensor, s: Tensor) -> Tensor:
    """a_i = lse over row i's negatives − its positive, for this rank's 2B views of the 2N
    (its first views' rows, then its second views'), logits s·Z·Zᵀ of Z = [A; B]: the
    negatives of a view are every view but itself and its pair. `SymmetricLSE` over the
    all-gathered views (NT-Xent, DCL)."""
    n, off, b, d = call.n, call.offset, call.b, a_BD.shape[1]
    all_N2D = all_gather(
        torch.cat([a_BD, b_BD], 1), sizes=list(call.sizes), group=call.group, check=False
    )
    z_2ND = torch.cat([all_N2D[:, :d], all_N2D[:, d:]], 0)
    acc = call.acc
    pos_N = s * (all_N2D[:, :d].to(acc) * all_N2D[:, d:].to(acc)).sum(1)  # rows i and i + N
    tile = call.tile(2 * n, 2 * n)
    a_2N = apply(SymmetricLSE, z_2ND, s, torch.cat([pos_N, pos_N]), tile, call.group)
    return torch.cat([a_2N[off : off + b], a_2N[n + off : n + off + b]])


def two_view_formula(a_ND: Tensor, b_ND: Tensor, s: Tensor) -> Tensor:
    """`two_view_terms` of the whole batch, densely: a over all 2N views ([A; B] order)."""
    n = a_ND.shape[0]
    z_MD = torch.cat([a_ND, b_ND])  # M = 2N
    e = eye(n, z_MD.device)
    pair_MM = torch.cat([torch.cat([e, e], 1)] * 2)  # itself and its other view
    pos_N = s * (a_ND * b_ND).sum(1)
    return lse_rows(s * (z_MD @ z_MD.T), pair_MM) - torch.cat([pos_N, pos_N])
