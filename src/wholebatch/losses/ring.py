"""Ring forms of the softmax losses (CLIP, InfoNCE): each rank keeps its own rows and one block in flight.

`PositiveRing` computes what `tiles.PositiveLSE` computes over all-gathered
keys, without ever holding them: each rank's key block travels once around
the ring (W - 1 shifts, receive from rank - 1), and every rank folds the block
it holds into its rows' running (m, l) pair, tile by tile. The column
statistics of a block (CLIP's text → image direction, InfoNCE's
doc_to_query) travel WITH the block, each rank folding in its own rows, and
return to the block's owner with one last shift. Nothing N-sized is kept for
the backward: it re-sends the blocks with their column coefficients and
accumulates each block's gradient in flight (the recipe of Inf-CL,
arXiv:2410.17243, and of `tiles.SigmoidRing`). The shift of the next key block
is posted before the current block's tiles are computed, so the transfer
overlaps the compute; the small statistics and the accumulated gradient
follow each block after its tiles.

Per rank: memory O(B·J·D + T²) whatever N and W (own rows, the block held and
the one arriving, one tile); bytes: the key blocks once around the ring in the
forward ((W - 1)·B·J·D·e, the least a rank can receive and still see every
key), in the backward the blocks again with their gradients (compute dtype)
and one shift that brings each gradient home.

Legend: W ranks, B this rank's query rows, Bq the rows of rank q's block, J key
rows per query row in a block (1 + k for InfoNCE's [document | negatives], 1
for CLIP's texts), D embedding dim, T the tile size. The running pair is (m, l).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from wholebatch.comm.collectives import ring_peers
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.comm.sizes import ring_block
from wholebatch.losses import fused
from wholebatch.losses.tiles import (
    _accelerated,
    _finish,
    _logits,
    _mask_rows,
    _mm_acc,
    _running,
    _scaled_rows,
    _softmax_coef,
    _threaded,
    _tiles,
    compute_dtype,
)

__all__ = ["PositiveRing", "RingShift"]


class RingShift:
    """One ring step whose sizes are agreed, posted now and finished by `wait()`.

    Sends each of `xs` to rank + 1 and receives from rank - 1 a tensor of
    `recv_rows` rows of each (same trailing shape and dtype): `ring_pass`, but
    asynchronous, so a kernel can compute on the block it holds while the next
    one arrives. A side that moves nothing skips its half, and so does its peer
    (the sizes agree). Every rank of `group` must post it, in the same order.
    """

    def __init__(
        self, xs: Sequence[Tensor], recv_rows: int, group: Any, peers: tuple[int, int]
    ) -> None:
        arrive("ring_pass", xs[0], group)
        src, dst = peers
        sends = [x.contiguous() for x in xs]
        self.outs = [x.new_empty((recv_rows, *x.shape[1:])) for x in sends]
        ops = [dist.P2POp(dist.isend, x, dst, group=group) for x in sends if x.numel() > 0]
        ops += [dist.P2POp(dist.irecv, o, src, group=group) for o in self.outs if o.numel() > 0]
        self._sends = sends  # alive until sent
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[Tensor]:
        """The received tensors, once both halves are done."""
        for work in self._works:
            work.wait()
        self._sends = []
        return self.outs


def _shift(
    xs: Sequence[Tensor], recv_rows: int, group: Any, peers: tuple[int, int]
) -> list[Tensor]:
    return RingShift(xs, recv_rows, group, peers).wait()


def _candidates(blk_BX: Tensor, j: int, d: int, dtype: torch.dtype) -> Tensor:
    """A block's keys in candidate order (all first keys, then all second, ...): (J·Bq, D)."""
    rows = blk_BX.shape[0]
    cand = blk_BX if j == 1 else blk_BX.view(rows, j, d).transpose(0, 1).reshape(j * rows, d)
    return cand.to(dtype)


class PositiveRing(torch.autograd.Function):
    """`PositiveLSE`'s outputs for queries against EVERY rank's key block, blocks passed around a ring.

    Inputs: this rank's queries `q_BD`, its key block `keys_BX` (B x J·D: row i
    holds the J keys of sample i, the first its positive), `scale`, the
    positive logits `pos_B` (computed by the caller with autograd), `j`,
    `masks` (the key indices 0..J-1 left out of row i against its OWN sample's
    keys: (0,) for a positive, range(J) for InfoNCE's doc_to_doc), `columns`
    (also return the column terms of every block's first keys), the agreed
    `sizes`, the `tile` and `group`. Outputs, as `PositiveLSE`:

    - `row_B[i] = lse over row i's negatives − pos_B[i]` (its loss: softplus);
    - `col_B[i]` the same for column i (key 0 of sample i) over EVERY rank's
      query rows, when `columns`; else empty.

    Backward (gradient contract): the exact adjoint of the distributed sum.
    Each rank re-sends its block around the ring with its column coefficients;
    each rank adds its rows' part of the block's gradient to the accumulator
    that travels with it, which returns to the block's owner with one last
    shift. `pos_B` gets −(its rows' and columns' gradients). Memory O(B·J·D + T²).
    """

    @staticmethod
    @_threaded
    def forward(  # type: ignore[override]
        ctx: Any,
        q_BD: Tensor,
        keys_BX: Tensor,
        scale: Tensor,
        pos_B: Tensor,
        j: int,
        masks: tuple[int, ...],
        columns: bool,
        sizes: tuple[int, ...],
        tile: int,
        group: Any,
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b, d = q_BD.shape
        w, rank = get_world_size(group), get_rank(group)
        peers = ring_peers(group) if w > 1 else (0, 0)
        qs_BD, post = _scaled_rows(q_BD, scale, acc)
        fast = fused.use_fused(q_BD)
        kdt = keys_BX.dtype if post is not None or fast else acc
        m_row = torch.full((b,), float("-inf"), dtype=acc, device=q_BD.device)
        l_row = torch.zeros(b, dtype=acc, device=q_BD.device)
        # the (m, l) of the held block's columns, as one (Bq, 2) tensor that travels with it
        stats_B2 = _fresh_stats(b if columns else 0, acc, q_BD.device)
        blk_BX = keys_BX.detach()
        buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
        for step in range(w):
            bq = blk_BX.shape[0]
            nxt = None
            if step < w - 1:  # the next block is on its way while this one is computed
                nxt = RingShift([blk_BX], ring_block(sizes, rank, step + 1), group, peers)
            cand = _candidates(blk_BX, j, d, kdt)
            own = masks if step == 0 else ()
            if fast:
                fast = _try(_fold_fused, q_BD, cand, scale, bq, own, m_row, l_row, stats_B2)
            if not fast:
                _fold(qs_BD, cand, post, acc, tile, bq, own, m_row, l_row, stats_B2, buf)
            if nxt is not None:
                (blk_BX,) = nxt.wait()
                if columns:
                    (stats_B2,) = _shift([stats_B2], blk_BX.shape[0], group, peers)
        if columns and w > 1:  # the held block's columns are complete: home to their owner
            (stats_B2,) = _shift([stats_B2], b, group, peers)
        pos = pos_B.detach().to(acc)
        row_B = _finish(m_row, l_row, pos)
        m_col, l_col = stats_B2[:, 0].contiguous(), stats_B2[:, 1].contiguous()
        col_B = _finish(m_col, l_col, pos) if columns else pos.new_zeros(0)
        ctx.save_for_backward(q_BD, keys_BX, scale, m_row, l_row, m_col, l_col)
        ctx.j, ctx.masks, ctx.columns, ctx.sizes, ctx.tile = j, masks, columns, sizes, tile
        ctx.group, ctx.pos_dtype = group, pos_B.dtype
        return row_B, col_B

    @staticmethod
    @_threaded
    def backward(ctx: Any, g_row_B: Tensor, g_col_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, keys_BX, scale, m_row, l_row, m_col, l_col = ctx.saved_tensors
        acc, j, tile, group, columns = m_row.dtype, ctx.j, ctx.tile, ctx.group, ctx.columns
        b, d = q_BD.shape
        w, rank = get_world_size(group), get_rank(group)
        peers = ring_peers(group) if w > 1 else (0, 0)
        g_row_B = g_row_B.to(acc)
        sh_row, cf_row = _softmax_coef(m_row, l_row, g_row_B)
        # the column coefficients (shift, g / sum) of the held block, (Bq, 2): they travel with it
        if columns:
            g_col_B = g_col_B.to(acc)
            coef_B2 = torch.stack(_softmax_coef(m_col, l_col, g_col_B), 1)
        else:
            coef_B2 = torch.zeros((b, 0), dtype=acc, device=q_BD.device)
        fast = fused.use_fused(q_BD)
        low = _accelerated(q_BD) and q_BD.dtype != acc
        q = q_BD if low or fast else q_BD.to(acc)
        # The scale is applied to each tile, not to a scaled copy of the queries: the
        # backward sets the ring's peak, and that copy was one B x D buffer of it.
        qs_BD, post = q, scale.detach().to(acc)
        kdt = keys_BX.dtype if low or fast else acc
        uq_BD = torch.zeros((b, d), dtype=acc, device=q_BD.device)  # unscaled: dq = s·uq
        blk_BX = keys_BX.detach()
        dblk_BX = torch.zeros(keys_BX.shape, dtype=acc, device=keys_BX.device)
        buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
        coefs = (sh_row, cf_row)
        for step in range(w):
            nxt = None
            if step < w - 1:
                rows = ring_block(ctx.sizes, rank, step + 1)
                nxt = RingShift([blk_BX, coef_B2], rows, group, peers)
            cand = _candidates(blk_BX, j, d, kdt)
            own = ctx.masks if step == 0 else ()
            # one key per row: the candidates are the wire layout, accumulate in place
            dcand = dblk_BX if j == 1 else torch.zeros(cand.shape, dtype=acc, device=cand.device)
            if fast:
                fast = _try(_grad_block_fused, q, cand, scale, own, coefs, coef_B2, uq_BD, dcand)
            if not fast:
                _grad_block(qs_BD, q, cand, post, acc, tile, own, coefs, coef_B2, uq_BD, dcand, buf)
            if j > 1:
                _add_wire(dblk_BX, dcand, j, d)
            del cand, dcand
            if nxt is not None:
                blk_BX, coef_B2 = nxt.wait()
                (dblk_BX,) = _shift([dblk_BX], blk_BX.shape[0], group, peers)
        if w > 1:  # the held block's gradient is complete: home to its owner
            (dblk_BX,) = _shift([dblk_BX], b, group, peers)
        need = ctx.needs_input_grad
        s = scale.detach().to(acc)
        ds = (q_BD.to(acc) * uq_BD).sum() if need[2] else None
        g_pos = -g_row_B - g_col_B if columns else -g_row_B
        return (
            uq_BD.mul_(s).to(q_BD.dtype) if need[0] else None,
            dblk_BX.mul_(s).to(keys_BX.dtype) if need[1] else None,
            ds.to(scale.dtype) if ds is not None else None,
            g_pos.to(ctx.pos_dtype) if need[3] else None,
            *([None] * 6),
        )


def _fresh_stats(rows: int, acc: torch.dtype, device: torch.device) -> Tensor:
    stats = torch.zeros((rows, 2), dtype=acc, device=device)
    stats[:, 0] = float("-inf")
    return stats


def _fold(
    qs_BD: Tensor,
    cand: Tensor,
    post: Tensor | None,
    acc: torch.dtype,
    tile: int,
    bq: int,
    own: tuple[int, ...],
    m_row: Tensor,
    l_row: Tensor,
    stats_B2: Tensor,
    buf: Tensor,
) -> None:
    """Fold one key block into the rows' (m, l) and, for its first `bq` keys, its columns' (in place)."""
    b, c = qs_BD.shape[0], cand.shape[0]
    n_cols = stats_B2.shape[0]
    masks = tuple(t * bq for t in own)
    for i0, i1, j0, j1 in _tiles(b, c, tile):
        s_TT = _logits(qs_BD[i0:i1], cand[j0:j1].T, post, acc)
        _mask_rows(s_TT, masks, i0 - j0)  # this rank's own samples: not negatives
        e = buf[: s_TT.numel()].view(s_TT.shape)
        m_row[i0:i1], l_row[i0:i1] = _running(m_row[i0:i1], l_row[i0:i1], s_TT, 1, e)
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            e = buf[: sc.numel()].view(sc.shape)
            m_c, l_c = stats_B2[j0:jc, 0].clone(), stats_B2[j0:jc, 1].clone()
            stats_B2[j0:jc, 0], stats_B2[j0:jc, 1] = _running(m_c, l_c, sc, 0, e)


def _try(fn: Any, *args: Any) -> bool:
    """Run a fused step; False (and the PyTorch tiles from now on) if its kernel fails here.

    A kernel fails before it writes anything (it does not build, or does not launch),
    so the PyTorch step that follows starts from the same state.
    """
    try:
        fn(*args)
    except Exception as failure:
        if fused.forced():
            raise
        fused.disable(failure)
        return False
    return True


def _fold_fused(
    q_BD: Tensor,
    cand: Tensor,
    scale: Tensor,
    bq: int,
    own: tuple[int, ...],
    m_row: Tensor,
    l_row: Tensor,
    stats_B2: Tensor,
) -> None:
    """`_fold` with the fused Triton kernels (`losses.fused`): the block's statistics, merged."""
    masks = tuple(t * bq for t in own)
    m_b, l_b = fused.row_stats(q_BD, cand, scale, 0, masks)
    m_new, l_new = fused.merge(m_row, l_row, m_b.to(m_row.dtype), l_b.to(l_row.dtype))
    m_row.copy_(m_new)
    l_row.copy_(l_new)
    if stats_B2.shape[0]:
        m_c, l_c = fused.col_stats(q_BD, cand, scale, 0, masks, stats_B2.shape[0])
        m2, l2 = fused.merge(
            stats_B2[:, 0], stats_B2[:, 1], m_c.to(m_row.dtype), l_c.to(m_row.dtype)
        )
        stats_B2[:, 0], stats_B2[:, 1] = m2, l2


def _grad_block_fused(
    q: Tensor,
    cand: Tensor,
    scale: Tensor,
    own: tuple[int, ...],
    row_coefs: tuple[Tensor, Tensor],
    coef_B2: Tensor,
    uq_BD: Tensor,
    dcand: Tensor,
) -> None:
    """`_grad_block` with the fused Triton kernels (`losses.fused`)."""
    bq = coef_B2.shape[0]
    none = coef_B2.new_zeros(0)
    cols = (coef_B2[:, 0], coef_B2[:, 1]) if coef_B2.shape[1] else (none, none)
    masks = tuple(t * bq for t in own)
    uq, uk = fused.grads(q, cand, scale, 0, masks, row_coefs, cols)
    uq_BD += uq
    dcand += uk


def _grad_block(
    qs_BD: Tensor,
    q: Tensor,
    cand: Tensor,
    post: Tensor | None,
    acc: torch.dtype,
    tile: int,
    own: tuple[int, ...],
    row_coefs: tuple[Tensor, Tensor],
    coef_B2: Tensor,
    uq_BD: Tensor,
    dcand: Tensor,
    buf: Tensor,
) -> None:
    """One block's tiles recomputed: adds the rows' gradient to `uq_BD`, the keys' to `dcand` (unscaled)."""
    sh_row, cf_row = row_coefs
    b, c = qs_BD.shape[0], cand.shape[0]
    n_cols = coef_B2.shape[0] if coef_B2.shape[1] else 0
    sh_col, cf_col = (coef_B2[:, 0], coef_B2[:, 1]) if n_cols else (coef_B2, coef_B2)
    bq = coef_B2.shape[0]
    masks = tuple(t * bq for t in own)
    for i0, i1, j0, j1 in _tiles(b, c, tile):
        s_TT = _logits(qs_BD[i0:i1], cand[j0:j1].T, post, acc)
        _mask_rows(s_TT, masks, i0 - j0)
        # d a_i / d s_ij = softmax over row i's negatives; likewise along the columns.
        g_TT = buf[: s_TT.numel()].view(s_TT.shape)
        torch.sub(s_TT, sh_row[i0:i1, None], out=g_TT).exp_().mul_(cf_row[i0:i1, None])
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            g_TT[:, : jc - j0].addcmul_(sc.sub_(sh_col[None, j0:jc]).exp_(), cf_col[None, j0:jc])
        uq_BD[i0:i1] += _mm(g_TT, cand[j0:j1], acc)
        dcand[j0:j1] += _mm(g_TT.T, q[i0:i1], acc)


def _mm(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    return _mm_acc(a.to(b.dtype), b, acc)


def _add_wire(dblk_BX: Tensor, dcand: Tensor, j: int, d: int) -> None:
    """Add a block's key gradients (candidate order, J·Bq x D) into its wire layout (Bq x J·D)."""
    rows = dblk_BX.shape[0]
    if j == 1:
        dblk_BX += dcand
    else:
        dblk_BX.view(rows, j, d).add_(dcand.view(j, rows, d).transpose(0, 1))
