"""Late interaction (MaxSim) over token sets: softmax rows of score(i, j), tiles that never hold N x tokens².

score(i, j) = Σ over query i's valid tokens t of the max over document j's valid
tokens u of q_it·d_ju (ColBERT, arXiv:2004.12832). Each query row's term is
a_i = lse_{j ≠ i}(s·score(i, j)) − s·score(i, i), its loss softplus(a_i), as
the other softmax kernels give (`tiles`, precision).

The kernels walk tiles of (query rows x document rows), each holding the
tile's token similarities (rows x docs x Q x T, sized to about one T² logits
tile) and folding its scores into each row's running (max, sum); nothing N-sized
but the gathered documents themselves is kept. The backward recomputes each tile
WITH autograd on the tile alone (its query and document tokens as leaves) and
back-propagates the softmax gradient of its scores: the max's gradient goes to the
document token that attains it (split among exact ties, as `amax` does), exact
and in O(tile) memory, with no routing table kept from the forward.

- `MaxSimLSE`: the queries against documents held in full (all-gathered:
  backward of the gather, reduce-scatter); the positives at `offset + i`.
- `MaxSimRing`: every rank's document block passed around the ring (W − 1
  shifts, receive from rank − 1), the backward sending each block again with its
  gradient, one last shift taking it home: O(B·T·D) memory whatever N and W.

Legend: B this rank's query rows, N documents, Q query tokens, T document tokens
(the largest rank's: blocks are padded to it), D dim, W ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from wholebatch.comm.collectives import ring_pass, ring_peers
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.comm.sizes import ring_block
from wholebatch.losses.tiles import compute_dtype, finish, running, softmax_coef, threaded

__all__ = ["MaxSimLSE", "MaxSimRing", "maxsim_pairs", "maxsim_scores"]


def maxsim_scores(q_BQD: Tensor, qm_BQ: Tensor, d_CTD: Tensor, dm_CT: Tensor) -> Tensor:
    """score(i, j) for every query row i and document j: (B, C), in the inputs' dtype.

    A document token that is not valid (mask False or 0) never attains the max; a query
    token that is not valid adds nothing. Every document must have a valid token (the
    loss checks it).
    """
    sim_BCQT = torch.einsum("bqd,ctd->bcqt", q_BQD, d_CTD)
    low = torch.finfo(sim_BCQT.dtype).min
    best_BCQ = sim_BCQT.masked_fill(~dm_CT.bool()[None, :, None, :], low).amax(-1)
    return (best_BCQ * qm_BQ.to(best_BCQ.dtype)[:, None, :]).sum(-1)


def maxsim_pairs(q_BQD: Tensor, qm_BQ: Tensor, d_BTD: Tensor, dm_BT: Tensor) -> Tensor:
    """score(i, i) of each row with its own document: (B,), B x Q x T similarities only."""
    sim_BQT = torch.einsum("bqd,btd->bqt", q_BQD, d_BTD)
    low = torch.finfo(sim_BQT.dtype).min
    best_BQ = sim_BQT.masked_fill(~dm_BT.bool()[:, None, :], low).amax(-1)
    return (best_BQ * qm_BQ.to(best_BQ.dtype)).sum(-1)


def _side(tile: int, q_tokens: int, d_tokens: int) -> int:
    """Rows (and documents) per tile: about one tile x tile of token similarities."""
    return max(1, math.isqrt(max(tile * tile // max(q_tokens * d_tokens, 1), 1)))


def _fold(
    q: Tensor,
    qm: Tensor,
    d: Tensor,
    dm: Tensor,
    s: Tensor,
    own: int | None,
    side: int,
    m_B: Tensor,
    l_B: Tensor,
) -> None:
    """Fold documents `d` into the rows' running (max, sum) of s·score (in place); the positive of
    row i, document `own` + i, left out (None: this block holds no row's positive)."""
    for i0 in range(0, q.shape[0], side):
        for j0 in range(0, d.shape[0], side):
            i1, j1 = min(i0 + side, q.shape[0]), min(j0 + side, d.shape[0])
            z_TT = s * maxsim_scores(q[i0:i1], qm[i0:i1], d[j0:j1], dm[j0:j1]).to(s.dtype)
            if own is not None:
                z_TT.diagonal(own + i0 - j0).fill_(float("-inf"))
            m_B[i0:i1], l_B[i0:i1] = running(m_B[i0:i1], l_B[i0:i1], z_TT, 1)


def _grads(
    q: Tensor,
    qm: Tensor,
    d: Tensor,
    dm: Tensor,
    s: Tensor,
    own: int | None,
    side: int,
    coef: tuple[Tensor, Tensor],
    dq: Tensor,
    dd: Tensor,
) -> Tensor:
    """Every tile of `q` x `d` recomputed with autograd: the softmax gradient of its scores added
    to `dq` and `dd` (in place); returns Σ G·score, the scale's gradient (G the tiles' dL/dz)."""
    shift, cf = coef
    ds = torch.zeros((), dtype=s.dtype, device=q.device)
    for i0 in range(0, q.shape[0], side):
        for j0 in range(0, d.shape[0], side):
            i1, j1 = min(i0 + side, q.shape[0]), min(j0 + side, d.shape[0])
            qt = q[i0:i1].detach().requires_grad_()
            dt = d[j0:j1].detach().requires_grad_()
            with torch.enable_grad():
                score_TT = maxsim_scores(qt, qm[i0:i1], dt, dm[j0:j1]).to(s.dtype)
            with torch.no_grad():
                z_TT = s * score_TT
                if own is not None:
                    z_TT.diagonal(own + i0 - j0).fill_(float("-inf"))
                # d a_i / d z_ij = softmax over row i's negatives, times the row's gradient
                g_TT = (z_TT - shift[i0:i1, None]).exp_().mul_(cf[i0:i1, None])
                ds += (g_TT * score_TT.detach()).sum()
            gq, gd = torch.autograd.grad(score_TT, (qt, dt), g_TT * s)
            dq[i0:i1] += gq.to(dq.dtype)
            dd[j0:j1] += gd.to(dd.dtype)
    return ds


class MaxSimLSE(torch.autograd.Function):
    """a_i = lse_{j ≠ i}(s·score(i, j)) − pos_B[i] of this rank's query rows against documents
    `d_NTD` held in full (row i's positive: document `offset` + i).

    Backward: the tiles recomputed (module docstring); `pos_B` (the caller's s·score(i, i),
    with autograd) gets −(its rows' gradients); memory O(N·T·D + tile).
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        q_BQD: Tensor,
        qm_BQ: Tensor,
        d_NTD: Tensor,
        dm_NT: Tensor,
        scale: Tensor,
        pos_B: Tensor,
        offset: int,
        tile: int,
    ) -> Tensor:
        acc = compute_dtype(q_BQD.dtype)
        b = q_BQD.shape[0]
        s = scale.detach().to(acc)
        m_B = torch.full((b,), float("-inf"), dtype=acc, device=q_BQD.device)
        l_B = torch.zeros(b, dtype=acc, device=q_BQD.device)
        side = _side(tile, q_BQD.shape[1], d_NTD.shape[1])
        q, d = q_BQD.detach().to(acc), d_NTD.detach().to(acc)
        _fold(q, qm_BQ, d, dm_NT, s, offset, side, m_B, l_B)
        ctx.save_for_backward(q_BQD, qm_BQ, d_NTD, dm_NT, scale, m_B, l_B)
        ctx.offset, ctx.side, ctx.pos_dtype = offset, side, pos_B.dtype
        return finish(m_B, l_B, pos_B.detach().to(acc))

    @staticmethod
    @threaded
    def backward(ctx: Any, g_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BQD, qm_BQ, d_NTD, dm_NT, scale, m_B, l_B = ctx.saved_tensors
        acc = m_B.dtype
        g = g_B.to(acc)
        s = scale.detach().to(acc)
        dq = torch.zeros(q_BQD.shape, dtype=acc, device=q_BQD.device)
        dd = torch.zeros(d_NTD.shape, dtype=acc, device=d_NTD.device)
        q, d = q_BQD.detach().to(acc), d_NTD.detach().to(acc)
        coef = softmax_coef(m_B, l_B, g)
        ds = _grads(q, qm_BQ, d, dm_NT, s, ctx.offset, ctx.side, coef, dq, dd)
        need = ctx.needs_input_grad
        return (
            dq.to(q_BQD.dtype) if need[0] else None,
            None,
            dd.to(d_NTD.dtype) if need[2] else None,
            None,
            ds.to(scale.dtype) if need[4] else None,
            (-g).to(ctx.pos_dtype) if need[5] else None,
            None,
            None,
        )


class MaxSimRing(torch.autograd.Function):
    """`MaxSimLSE`'s a_i with every rank's document block passed around the ring instead.

    Inputs: this rank's queries and documents (padded to the agreed T, blocks of every
    rank the same trailing shape), `scale`, `pos_B`, the agreed `sizes`, this rank's
    `tile` and `group`. Forward: W − 1 shifts of the (documents, mask) blocks, each
    folded on arrival. Backward: the blocks sent again, each with its gradient
    accumulator (every rank adds its rows' part), and one last shift that returns each
    gradient to its owner: the exact adjoint. Memory O(B·T·D + tile), whatever N and W.
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        q_BQD: Tensor,
        qm_BQ: Tensor,
        d_BTD: Tensor,
        dm_BT: Tensor,
        scale: Tensor,
        pos_B: Tensor,
        sizes: tuple[int, ...],
        tile: int,
        group: Any,
    ) -> Tensor:
        acc = compute_dtype(q_BQD.dtype)
        b, w, rank = q_BQD.shape[0], get_world_size(group), get_rank(group)
        s = scale.detach().to(acc)
        m_B = torch.full((b,), float("-inf"), dtype=acc, device=q_BQD.device)
        l_B = torch.zeros(b, dtype=acc, device=q_BQD.device)
        side = _side(tile, q_BQD.shape[1], d_BTD.shape[1])
        q = q_BQD.detach().to(acc)
        blk, mask = d_BTD.detach(), dm_BT
        peers = ring_peers(group) if w > 1 else (0, 0)
        for step in range(w):
            _fold(q, qm_BQ, blk.to(acc), mask, s, 0 if step == 0 else None, side, m_B, l_B)
            if step < w - 1:
                blk, mask = ring_pass(
                    [blk, mask], ring_block(sizes, rank, step + 1), group=group, peers=peers
                )
        ctx.save_for_backward(q_BQD, qm_BQ, d_BTD, dm_BT, scale, m_B, l_B)
        ctx.sizes, ctx.side, ctx.group, ctx.pos_dtype = sizes, side, group, pos_B.dtype
        return finish(m_B, l_B, pos_B.detach().to(acc))

    @staticmethod
    @threaded
    def backward(ctx: Any, g_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BQD, qm_BQ, d_BTD, dm_BT, scale, m_B, l_B = ctx.saved_tensors
        acc, sizes, group = m_B.dtype, ctx.sizes, ctx.group
        w, rank = get_world_size(group), get_rank(group)
        s = scale.detach().to(acc)
        coef = softmax_coef(m_B, l_B, g_B.to(acc))
        q = q_BQD.detach().to(acc)
        dq = torch.zeros(q_BQD.shape, dtype=acc, device=q_BQD.device)
        blk, mask = d_BTD.detach(), dm_BT
        dblk = torch.zeros(blk.shape, dtype=acc, device=blk.device)
        ds = torch.zeros((), dtype=acc, device=q_BQD.device)
        peers = ring_peers(group) if w > 1 else (0, 0)
        for step in range(w):
            own = 0 if step == 0 else None
            ds += _grads(q, qm_BQ, blk.to(acc), mask, s, own, ctx.side, coef, dq, dblk)
            rows = ring_block(sizes, rank, step + 1)
            if step < w - 1:
                blk, mask, dblk = ring_pass([blk, mask, dblk], rows, group=group, peers=peers)
            elif w > 1:  # the held block's gradient belongs to the next rank: home
                (dblk,) = ring_pass([dblk], rows, group=group, peers=peers)
        need = ctx.needs_input_grad
        return (
            dq.to(q_BQD.dtype) if need[0] else None,
            None,
            dblk.to(d_BTD.dtype) if need[2] else None,
            None,
            ds.to(scale.dtype) if need[4] else None,
            (-g_B.to(acc)).to(ctx.pos_dtype) if need[5] else None,
            None,
            None,
            None,
        )
