"""SigLIP's sigmoid pairs, text blocks around the ring: `SigmoidRing`.

Every pair's softplus(y·z), the positives' terms computed apart (tiles.py,
precision); memory O(B·D + T²) whatever W.

Legend: B this rank's rows, D dim, T the tile size, W ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from wholebatch.comm.collectives import ring_pass, ring_peers
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.comm.sizes import ring_block
from wholebatch.losses import fused
from wholebatch.losses.tiles import accelerated, compute_dtype, mm_acc, threaded

__all__ = ["SigmoidRing"]


def _ring_next(sizes: tuple[int, ...], rank: int, step: int) -> int:
    """Rows group rank `rank` receives at ring step `step` -> step + 1: rank (rank - step - 1)'s block."""
    return ring_block(sizes, rank, step + 1)


def _sigmoid_block_fused(
    img_BD: Tensor, blk_MD: Tensor, s: Tensor, b: Tensor, g: Tensor, own: bool, acc: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """One block's (d img, d blk, d scale, d bias) from the fused kernels, or None (see `_fused_or_none`)."""
    got = fused.attempt(fused.sigmoid_grads, img_BD, blk_MD, s, b, 0, (0,) if own else ())
    if got is None:
        return None
    uq_BD, uk_MD, p_B = (x.to(acc) for x in got)
    # z = s·q·k + b: dz/dq = s·k, dz/ds = q·k, dz/db = 1; d softplus(z)/dz = σ(z)
    ds = g * (img_BD.to(acc) * uq_BD).sum()
    return uq_BD.mul_(g * s), uk_MD.mul_(g * s), ds, g * p_B.sum()


def _sigmoid_block_torch(
    img: Tensor,
    blk_MD: Tensor,
    s: Tensor,
    b: Tensor,
    g: Tensor,
    tile: int,
    acc: torch.dtype,
    own: bool,
    di_BD: Tensor,
    dblk_MD: Tensor,
    ds: Tensor,
    db: Tensor,
) -> None:
    """One block's gradients, tile by tile, added in place to (di_BD, dblk_MD, ds, db)."""
    for i0 in range(0, img.shape[0], tile):
        q_TD = img[i0 : i0 + tile]
        for j0 in range(0, blk_MD.shape[0], tile):
            k_TD = blk_MD[j0 : j0 + tile]
            z_TT = mm_acc(q_TD, k_TD.T, acc).mul_(s).add_(b)
            if own:
                z_TT.diagonal(i0 - j0).fill_(float("-inf"))
            # d softplus(z)/dz = sigmoid(z)
            g_TT = z_TT.sigmoid_().mul_(g)
            gk_TD = mm_acc(g_TT.to(k_TD.dtype), k_TD, acc)
            ds += (q_TD.to(acc) * gk_TD).sum()
            db += g_TT.sum()
            di_BD[i0 : i0 + tile] += gk_TD.mul_(s)
            dblk_MD[j0 : j0 + tile] += mm_acc(g_TT.T.to(q_TD.dtype), q_TD, acc).mul_(s)


def _softplus_sum(
    img_BD: Tensor, blk_MD: Tensor, s: Tensor, b: Tensor, tile: int, acc: torch.dtype, own: bool
) -> Tensor:
    """sum_ij softplus(s * img_i·blk_j + b) over the negative pairs, tile by tile.

    `own`: the block is this rank's own texts, whose pairs (i, i) are the
    positives, left out (their terms softplus(−z_ii) are computed apart).
    """
    if fused.use_fused(img_BD):
        got: Tensor | None = fused.attempt(
            fused.sigmoid_sum, img_BD, blk_MD, s, b, 0, (0,) if own else ()
        )
        if got is not None:
            return got.sum().to(acc)
    total = torch.zeros((), dtype=acc, device=img_BD.device)
    for i0 in range(0, img_BD.shape[0], tile):
        q_TD = img_BD[i0 : i0 + tile]
        for j0 in range(0, blk_MD.shape[0], tile):
            z_TT = mm_acc(q_TD, blk_MD[j0 : j0 + tile].T, acc).mul_(s).add_(b)
            if own:
                z_TT.diagonal(i0 - j0).fill_(float("-inf"))
            total -= F.logsigmoid(z_TT.neg_()).sum()
    return total


class SigmoidRing(torch.autograd.Function):
    """sum over this rank's image rows i and EVERY rank's text rows j of softplus(s·Iᵢ·Tⱼ + b), j ≠ i.

    The positive pairs (this rank's own (i, i)) are left out: the caller adds
    softplus(−z_ii), so no term is formed as a difference (issue 14).

    Text blocks travel around the ring with `ring_pass` (receive from rank - 1),
    one block in memory at a time: W - 1 shifts in the forward. Nothing exchanged
    is saved: the backward re-exchanges the blocks and sends each block's
    gradient along with it, W - 1 shifts of the block (its own dtype) and its
    gradient (the compute dtype), and one last shift that returns each
    gradient to its owner. Peak memory O(B·D + T²),
    independent of W. Each block's softplus sum and gradients come from the
    fused kernels (`fused.sigmoid_sum`, `fused.sigmoid_grads`) where
    `fused.use_fused` says, else the PyTorch tiles.

    Backward: exact adjoint of the distributed sum; each rank's text gradient
    collects every rank's image rows' contributions, so the sum over ranks of
    every rank's scalar has its true gradient.
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
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
        rank, peers = get_rank(group), ring_peers(group) if w > 1 else (0, 0)
        for step in range(w):
            total += _softplus_sum(img_BD, blk_MD, s, b, tile, acc, own=step == 0)
            if step < w - 1:
                rows = _ring_next(sizes, rank, step)
                (blk_MD,) = ring_pass([blk_MD], rows, group=group, peers=peers)
        ctx.save_for_backward(img_BD, txt_BD, scale, bias)
        ctx.sizes, ctx.tile, ctx.group = sizes, tile, group
        return total

    @staticmethod
    @threaded
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        img_BD, txt_BD, scale, bias = ctx.saved_tensors
        acc, tile, sizes, group = compute_dtype(img_BD.dtype), ctx.tile, ctx.sizes, ctx.group
        s, b, g = scale.detach().to(acc), bias.detach().to(acc), g.to(acc)
        w = get_world_size(group)
        low = accelerated(img_BD) and img_BD.dtype != acc
        img = img_BD if low else img_BD.to(acc)
        di_BD = torch.zeros(img_BD.shape, dtype=acc, device=img_BD.device)
        ds = torch.zeros((), dtype=acc, device=img_BD.device)
        db = torch.zeros((), dtype=acc, device=img_BD.device)
        # The block travels in the embeddings' dtype (as in the forward), its gradient in
        # the compute dtype; each rank widens the block it holds for its tiles.
        wire_MD = txt_BD.detach()
        dblk_MD = torch.zeros(wire_MD.shape, dtype=acc, device=wire_MD.device)
        rank, peers = get_rank(group), ring_peers(group) if w > 1 else (0, 0)
        fast = fused.use_fused(img_BD)
        for step in range(w):
            # the fused kernels for this block, or (failed, or not chosen) the PyTorch tiles
            got = _sigmoid_block_fused(img_BD, wire_MD, s, b, g, step == 0, acc) if fast else None
            fast = got is not None
            if got is not None:
                di_BD += got[0]
                dblk_MD += got[1]
                ds += got[2]
                db += got[3]
            else:
                _sigmoid_block_torch(
                    img,
                    wire_MD.to(img.dtype),
                    s,
                    b,
                    g,
                    tile,
                    acc,
                    step == 0,
                    di_BD,
                    dblk_MD,
                    ds,
                    db,
                )
            rows = _ring_next(sizes, rank, step) if w > 1 else 0
            if step < w - 1:
                wire_MD, dblk_MD = ring_pass([wire_MD, dblk_MD], rows, group=group, peers=peers)
            elif w > 1:
                # The gradient of the block held now belongs to the next rank on the ring
                # (it receives the gradient of its own block: `rows` = its own size).
                (dblk_MD,) = ring_pass([dblk_MD], rows, group=group, peers=peers)
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
