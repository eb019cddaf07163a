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
arXiv:2410.17243, and of `tiles.SigmoidRing`).

Blocks travel in chunks of about one tile of candidates (`sizing.ring_chunk_rows`,
from agreed numbers only: ranks may pass different tile sizes): a
chunk goes on to rank + 1, with its statistics or its coefficients and
gradient, as soon as its tiles are done, while the next chunk is computed, and
the next block's chunks arrive alike (`_pipeline`). So the transfer overlaps
the compute, and a rank holds about ONE block of each travelling tensor (the
chunks not yet sent and the ones arrived) where a whole-block double buffer
holds two.

Per rank, float32, in B·D units (J = 1): the backward holds the queries'
gradient (accumulated in the buffer that is returned), the travelling block
and its travelling gradient, a chunk or two of each in flight and the tiles;
at the end the gradient's chunks and their join. The positives s·q_i·k_i0
(`pos_B=None`) have their gradient added in place, and d scale is summed by
chunks: about 3 B·D + O(T·D + T²) whatever N and W. Bytes: the key blocks
once around the ring in the forward ((W - 1)·B·J·D·e, the least a rank can
receive and still see every key), in the backward the blocks again with their
gradients (compute dtype) and one shift that brings each gradient home.

Legend: W ranks, B this rank's query rows, Bq the rows of rank q's block, J key
rows per query row in a block (1 + k for InfoNCE's [document | negatives], 1
for CLIP's texts), D embedding dim, T the tile size. The running pair is (m, l).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from wholebatch.comm.collectives import ring_peers
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.comm.sizes import ring_block
from wholebatch.losses import fused
from wholebatch.losses.lse import Ids
from wholebatch.losses.sizing import ring_chunk_rows
from wholebatch.losses.tiles import (
    accelerated,
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

__all__ = ["PositiveRing"]


class _Exchange:
    """One batch of a chunked ring step: `sends` to rank + 1, `recvs` filled from rank - 1, posted now.

    Empty tensors are skipped on both sides (their sizes agree). `wait()` returns
    `recvs` once both halves are done and drops the references to `sends`.
    """

    def __init__(
        self, sends: Sequence[Tensor], recvs: list[Tensor], group: Any, peers: tuple[int, int]
    ) -> None:
        src, dst = peers
        self._sends = [x.contiguous() for x in sends]
        ops = [dist.P2POp(dist.isend, x, dst, group=group) for x in self._sends if x.numel() > 0]
        ops += [dist.P2POp(dist.irecv, o, src, group=group) for o in recvs if o.numel() > 0]
        self.recvs = recvs
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        self._sends = []
        return self.recvs


def _bounds(rows: int, r: int) -> list[tuple[int, int]]:
    return [(r0, min(r0 + r, rows)) for r0 in range(0, rows, r)]


def _row_ranges(
    b: int, r0: int, r1: int, own: tuple[int, ...]
) -> list[tuple[int, int, tuple[int, ...]]]:
    """The query rows against chunk [r0, r1) of this rank's OWN block, with the masks they need.

    Rows r0..r1 - 1 leave out their own samples' keys (entry (i - r0) + t·(r1 - r0) of the
    chunk's candidates); the other rows have no own key in the chunk, and are swept apart
    so that no diagonal of theirs falls on another sample's key.
    """
    if not own:
        return [(0, b, ())]
    parts = [(0, r0, ()), (r0, r1, own), (r1, b, ())]
    return [p for p in parts if p[1] > p[0]]


def _pipeline(
    n_held: int,
    compute: Any,
    arrive_bounds: list[tuple[int, int]],
    likes: Sequence[tuple[Sequence[int], torch.dtype]],
    device: torch.device,
    group: Any,
    peers: tuple[int, int],
    alone: bool,
) -> list[list[Tensor]]:
    """One ring step, chunk by chunk: `compute(c)` works on held chunk c and returns what goes on.

    What it returns goes to rank + 1 at once, while chunk c + 1 is computed; the chunks
    of the block that arrives (rows `arrive_bounds`, each tensor shaped and typed as in
    `likes`) come from rank - 1 alike. The sent chunk is released one chunk later, so a
    rank holds about one block (held + arriving) of each travelling tensor, not two.
    `alone` (W = 1): rank + 1 is this rank, so what goes on is what arrives.
    """
    arrived: list[list[Tensor]] = []
    if alone:
        for c in range(n_held):
            sent = compute(c)
            if c < len(arrive_bounds):
                arrived.append(sent)
        return arrived
    pending: _Exchange | None = None
    for c in range(max(n_held, len(arrive_bounds))):
        sends = compute(c) if c < n_held else []
        recvs = []
        if c < len(arrive_bounds):
            rows = arrive_bounds[c][1] - arrive_bounds[c][0]
            recvs = [torch.empty((rows, *shape), dtype=dt, device=device) for shape, dt in likes]
        ex = _Exchange(sends, recvs, group, peers) if sends or recvs else None
        if pending is not None and pending.recvs:
            arrived.append(pending.wait())
        elif pending is not None:
            pending.wait()
        pending = ex
    if pending is not None and pending.recvs:
        arrived.append(pending.wait())
    elif pending is not None:
        pending.wait()
    return arrived


def _rowdot(a_BD: Tensor, b_BD: Tensor, acc: torch.dtype, r: int) -> Tensor:
    """Σ_d a[i, d]·b[i, d] in `acc`, `r` rows at a time (no B x D product)."""
    out = torch.empty(a_BD.shape[0], dtype=acc, device=a_BD.device)
    for r0, r1 in _bounds(a_BD.shape[0], r):
        out[r0:r1] = (a_BD[r0:r1].to(acc) * b_BD[r0:r1].to(acc)).sum(1)
    return out


def _add_rows(dst_BD: Tensor, src_BD: Tensor, coef_B: Tensor, r: int) -> None:
    """dst[i] += coef[i]·src[i] in place, `r` rows at a time."""
    for r0, r1 in _bounds(dst_BD.shape[0], r):
        dst_BD[r0:r1].addcmul_(src_BD[r0:r1].to(dst_BD.dtype), coef_B[r0:r1, None])


def _dot(a_BD: Tensor, b_BD: Tensor, acc: torch.dtype, r: int) -> Tensor:
    """Σ a ⊙ b in `acc`, `r` rows at a time."""
    total = torch.zeros((), dtype=acc, device=a_BD.device)
    for r0, r1 in _bounds(a_BD.shape[0], r):
        total += (a_BD[r0:r1].to(acc) * b_BD[r0:r1].to(acc)).sum()
    return total


def _candidates(blk_BX: Tensor, j: int, d: int, dtype: torch.dtype) -> Tensor:
    """A block's keys in candidate order (all first keys, then all second, ...): (J·Bq, D)."""
    rows = blk_BX.shape[0]
    cand = blk_BX if j == 1 else blk_BX.view(rows, j, d).transpose(0, 1).reshape(j * rows, d)
    return cand.to(dtype)


class PositiveRing(torch.autograd.Function):
    """`PositiveLSE`'s outputs for queries against EVERY rank's key block, blocks passed around a ring.

    Inputs: this rank's queries `q_BD`, its key block `keys_BX` (B x J·D: row i
    holds the J keys of sample i, the first its positive), `scale`, the
    positive logits `pos_B` (computed by the caller with autograd), or None:
    then they are s·q_i·k_i0 (row i's first key), computed here and their
    gradient added in place into the inputs' (no B x D buffers of their own);
    `j`, `masks` (the key indices 0..J-1 left out of row i against its OWN
    sample's keys: (0,) for a positive, range(J) for InfoNCE's doc_to_doc),
    `columns` (also return the column terms of every
    block's first keys), the agreed `sizes`, this rank's `tile` (its own
    arithmetic only: blocks travel in chunks of `sizing.ring_chunk_rows` rows,
    the same on every rank), `group`, and `ids` (this rank's rows' ids, or None:
    each block travels with its owner's, and rows of one id are never each
    other's negatives; the fused kernels take no ids). Outputs, as `PositiveLSE`:

    - `row_B[i] = lse over row i's negatives − pos_B[i]` (its loss: softplus);
    - `col_B[i]` the same for column i (key 0 of sample i) over EVERY rank's
      query rows, when `columns`; else empty.

    Backward (gradient contract): the exact adjoint of the distributed sum.
    Each rank re-sends its block around the ring with its column coefficients;
    each rank adds its rows' part of the block's gradient to the accumulator
    that travels with it, which returns to the block's owner with one last
    shift. A given `pos_B` gets −(its rows' and columns' gradients). Memory
    O(B·J·D + T·J·D + T²).
    """

    @staticmethod
    @threaded
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        q_BD: Tensor,
        keys_BX: Tensor,
        scale: Tensor,
        pos_B: Tensor | None,
        j: int,
        masks: tuple[int, ...],
        columns: bool,
        sizes: tuple[int, ...],
        tile: int,
        group: Any,
        ids: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b, d = q_BD.shape
        w, rank = get_world_size(group), get_rank(group)
        peers = ring_peers(group) if w > 1 else (0, 0)
        if w > 1:
            arrive("ring_pass", keys_BX, group)
        qs_BD, post = scaled_rows(q_BD, scale, acc)
        fast = ids is None and fused.use_fused(q_BD)
        kdt = keys_BX.dtype if post is not None or fast else acc
        m_row = torch.full((b,), float("-inf"), dtype=acc, device=q_BD.device)
        l_row = torch.zeros(b, dtype=acc, device=q_BD.device)
        r, keys = ring_chunk_rows(q_BD.device.type, max(sizes), j), keys_BX.detach()
        # each chunk travels with the (m, l) of its columns, (rows, 2) (or (rows, 0)), and its ids
        held: list[Any] = [
            [
                keys[r0:r1],
                _fresh_stats(r1 - r0, 2 if columns else 0, acc, q_BD.device),
                *_ids_of(ids, r0, r1),
            ]
            for r0, r1 in _bounds(b, r)
        ]
        buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
        st = SimpleNamespace(
            q=q_BD,
            qs=qs_BD,
            post=post,
            acc=acc,
            tile=tile,
            j=j,
            d=d,
            b=b,
            ids=ids,
            kdt=kdt,
            scale=scale,
            m_row=m_row,
            l_row=l_row,
            fast=fast,
            buf=buf,
        )
        run = (q_BD.device, group, peers, w == 1)
        for step in range(w):
            last, own = step == w - 1, masks if step == 0 else ()
            bounds = _bounds(ring_block(sizes, rank, step), r)
            compute = functools.partial(_fold_chunk, st, held, bounds, own, last)
            if not last:
                nxt = _bounds(ring_block(sizes, rank, step + 1), r)
                likes = [
                    (tuple(keys.shape[1:]), keys.dtype),
                    ((2 if columns else 0,), acc),
                    *_id_likes(ids),
                ]
                held = _pipeline(len(bounds), compute, nxt, likes, *run)
            else:  # the held block's columns are complete: home to their owner
                home = _pipeline(
                    len(bounds), compute, _bounds(b, r) if columns else [], [((2,), acc)], *run
                )
        stats = [x for (x,) in home]
        stats_B2 = torch.cat(stats) if columns and stats else _fresh_stats(0, 2, acc, q_BD.device)
        inside = pos_B is None
        sc = scale.detach().to(acc)
        pos = sc * _rowdot(q_BD, keys[:, :d], acc, r) if pos_B is None else pos_B.detach().to(acc)
        row_B = finish(m_row, l_row, pos)
        m_col, l_col = stats_B2[:, 0].contiguous(), stats_B2[:, 1].contiguous()
        col_B = finish(m_col, l_col, pos) if columns else pos.new_zeros(0)
        ctx.save_for_backward(q_BD, keys_BX, scale, m_row, l_row, m_col, l_col)
        ctx.j, ctx.masks, ctx.columns, ctx.sizes, ctx.tile = j, masks, columns, sizes, tile
        ctx.group, ctx.inside, ctx.ids, ctx.r = group, inside, ids, r
        ctx.pos_dtype = acc if pos_B is None else pos_B.dtype
        return row_B, col_B

    @staticmethod
    @threaded
    def backward(ctx: Any, g_row_B: Tensor, g_col_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, keys_BX, scale, m_row, l_row, m_col, l_col = ctx.saved_tensors
        acc, columns = m_row.dtype, ctx.columns
        b, d = q_BD.shape
        r = ctx.r
        g_row_B = g_row_B.to(acc)
        sh_row, cf_row = softmax_coef(m_row, l_row, g_row_B)
        # the column coefficients (shift, g / sum) of the held block, (Bq, 2): they travel with it
        if columns:
            g_col_B = g_col_B.to(acc)
            coef_B2 = torch.stack(softmax_coef(m_col, l_col, g_col_B), 1)
        else:
            coef_B2 = torch.zeros((b, 0), dtype=acc, device=q_BD.device)
        uq_BD = torch.zeros((b, d), dtype=acc, device=q_BD.device)  # unscaled: dq = s·uq
        dk_BX = _ring_grads(ctx, q_BD, keys_BX, scale, (sh_row, cf_row), coef_B2, uq_BD, r)
        g_pos = -g_row_B - g_col_B if columns else -g_row_B
        if ctx.inside:  # pos_i = s·q_i·k_i0: its gradient, in place (unscaled, as uq)
            _add_rows(uq_BD, keys_BX.detach()[:, :d], g_pos, r)
            _add_rows(dk_BX[:, :d], q_BD.detach(), g_pos, r)
        need = ctx.needs_input_grad
        s = scale.detach().to(acc)
        ds = _dot(q_BD, uq_BD, acc, r) if need[2] else None
        return (
            uq_BD.mul_(s).to(q_BD.dtype) if need[0] else None,
            dk_BX.mul_(s).to(keys_BX.dtype) if need[1] else None,
            ds.to(scale.dtype) if ds is not None else None,
            g_pos.to(ctx.pos_dtype) if need[3] and not ctx.inside else None,
            *([None] * 7),
        )


def _ids_of(ids: Tensor | None, r0: int, r1: int) -> list[Tensor]:
    """A chunk's ids, to travel with it ([] without ids)."""
    return [] if ids is None else [ids[r0:r1]]


def _id_likes(ids: Tensor | None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The ids' shape and dtype among a chunk's travelling tensors ([] without ids)."""
    return [] if ids is None else [((), ids.dtype)]


def _ring_grads(
    ctx: Any,
    q_BD: Tensor,
    keys_BX: Tensor,
    scale: Tensor,
    coefs: tuple[Tensor, Tensor],
    coef_B2: Tensor,
    uq_BD: Tensor,
    r: int,
) -> Tensor:
    """The backward's rings: adds the rows' gradient to `uq_BD`; returns this rank's keys' (unscaled).

    Each chunk of a block travels with its column coefficients and its gradient,
    accumulated in place by every rank it visits; at the last step the gradient
    chunks go home, where they are joined.
    """
    acc, j, tile, group = uq_BD.dtype, ctx.j, ctx.tile, ctx.group
    b, d = q_BD.shape
    w, rank = get_world_size(group), get_rank(group)
    peers = ring_peers(group) if w > 1 else (0, 0)
    if w > 1:
        arrive("ring_pass", keys_BX, group)
    fast = ctx.ids is None and fused.use_fused(q_BD)
    low = accelerated(q_BD) and q_BD.dtype != acc
    q = q_BD if low or fast else q_BD.to(acc)
    # The scale is applied to each tile, not to a scaled copy of the queries.
    post = scale.detach().to(acc)
    kdt = keys_BX.dtype if low or fast else acc
    keys, width = keys_BX.detach(), keys_BX.shape[1]
    held: list[Any] = [
        [keys[r0:r1], coef_B2[r0:r1], None, *_ids_of(ctx.ids, r0, r1)] for r0, r1 in _bounds(b, r)
    ]
    buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
    st = SimpleNamespace(
        q=q,
        post=post,
        acc=acc,
        tile=tile,
        j=j,
        d=d,
        b=b,
        kdt=kdt,
        scale=scale,
        coefs=coefs,
        uq=uq_BD,
        fast=fast,
        buf=buf,
        width=width,
        ids=ctx.ids,
    )
    run = (q_BD.device, group, peers, w == 1)
    for step in range(w):
        last, own = step == w - 1, ctx.masks if step == 0 else ()
        bounds = _bounds(ring_block(ctx.sizes, rank, step), r)
        compute = functools.partial(_grad_chunk, st, held, bounds, own, last)
        if not last:
            nxt = _bounds(ring_block(ctx.sizes, rank, step + 1), r)
            likes = [
                ((width,), keys.dtype),
                ((coef_B2.shape[1],), acc),
                ((width,), acc),
                *_id_likes(ctx.ids),
            ]
            held = _pipeline(len(bounds), compute, nxt, likes, *run)
        else:  # the held block's gradient is complete: home to its owner
            home = [
                x
                for (x,) in _pipeline(len(bounds), compute, _bounds(b, r), [((width,), acc)], *run)
            ]
    return torch.cat(home) if home else torch.zeros((0, width), dtype=acc, device=q_BD.device)


def _fold_chunk(
    st: Any,
    held: list[Any],
    bounds: list[tuple[int, int]],
    own: tuple[int, ...],
    last: bool,
    c: int,
) -> list[Tensor]:
    """The forward's work on held chunk `c`: fold it into the rows' (m, l) and its columns'.

    Returns what goes on: the chunk and its statistics, or at the last step only the
    statistics (home). The held reference is dropped, so the chunk lives only while sent.
    """
    (blk, stats, *ids), held[c] = held[c], None
    r0, r1 = bounds[c]
    cand = _candidates(blk, st.j, st.d, st.kdt)
    for a0, a1, mk in _row_ranges(st.b, r0, r1, own):
        rows = (st.m_row[a0:a1], st.l_row[a0:a1], stats)
        if st.fast:
            st.fast = (
                fused.attempt(_fold_fused, st.q[a0:a1], cand, st.scale, r1 - r0, mk, *rows)
                is not None
            )
        if not st.fast:
            pair = (st.ids[a0:a1], ids[0]) if ids else None
            _fold(st.qs[a0:a1], cand, st.post, st.acc, st.tile, r1 - r0, mk, *rows, st.buf, pair)
    return [stats] if last else [blk, stats, *ids]


def _grad_chunk(
    st: Any,
    held: list[Any],
    bounds: list[tuple[int, int]],
    own: tuple[int, ...],
    last: bool,
    c: int,
) -> list[Tensor]:
    """The backward's work on held chunk `c`: its tiles recomputed, the rows' gradient added to
    `st.uq`, the chunk's to the gradient that travels with it (created here for the own block).

    Returns what goes on: the chunk, its coefficients and gradient, or at the last step the
    gradient alone (home).
    """
    (blk, cf, g, *ids), held[c] = held[c], None
    r0, r1 = bounds[c]
    if g is None:  # this rank's own block: its gradient starts here
        g = torch.zeros((r1 - r0, st.width), dtype=st.acc, device=blk.device)
    cand = _candidates(blk, st.j, st.d, st.kdt)
    # one key per row: the candidates are the wire layout, accumulate in place
    dcand = g if st.j == 1 else torch.zeros(cand.shape, dtype=st.acc, device=cand.device)
    for a0, a1, mk in _row_ranges(st.b, r0, r1, own):
        rc = (st.coefs[0][a0:a1], st.coefs[1][a0:a1])
        q, uq = st.q[a0:a1], st.uq[a0:a1]
        if st.fast:
            st.fast = (
                fused.attempt(_grad_block_fused, q, cand, st.scale, mk, rc, cf, uq, dcand)
                is not None
            )
        if not st.fast:
            pair = (st.ids[a0:a1], ids[0]) if ids else None
            _grad_block(q, q, cand, st.post, st.acc, st.tile, mk, rc, cf, uq, dcand, st.buf, pair)
    if st.j > 1:
        _add_wire(g, dcand, st.j, st.d)
    return [g] if last else [blk, cf, g, *ids]


def _fresh_stats(rows: int, cols: int, acc: torch.dtype, device: torch.device) -> Tensor:
    stats = torch.zeros((rows, cols), dtype=acc, device=device)
    if cols:
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
    ids: Ids,
) -> None:
    """Fold one key block into the rows' (m, l) and, for its first `bq` keys, its columns' (in place)."""
    b, c = qs_BD.shape[0], cand.shape[0]
    n_cols = stats_B2.shape[0] if stats_B2.shape[1] else 0
    masks = tuple(t * bq for t in own)
    for i0, i1, j0, j1 in tile_grid(b, c, tile):
        s_TT = logits_tile(qs_BD[i0:i1], cand[j0:j1].T, post, acc)
        mask_rows(s_TT, masks, i0 - j0)  # this rank's own samples: not negatives
        if ids is not None:  # rows of one id: the block's first keys carry its rows' ids
            mask_ids(s_TT, ids[0][i0:i1], ids[1][j0:j1])
        e = buf[: s_TT.numel()].view(s_TT.shape)
        m_row[i0:i1], l_row[i0:i1] = running(m_row[i0:i1], l_row[i0:i1], s_TT, 1, e)
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            e = buf[: sc.numel()].view(sc.shape)
            m_c, l_c = stats_B2[j0:jc, 0].clone(), stats_B2[j0:jc, 1].clone()
            stats_B2[j0:jc, 0], stats_B2[j0:jc, 1] = running(m_c, l_c, sc, 0, e)


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
    if stats_B2.shape[0] and stats_B2.shape[1]:
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
    ids: Ids,
) -> None:
    """One block's tiles recomputed: adds the rows' gradient to `uq_BD`, the keys' to `dcand` (unscaled)."""
    sh_row, cf_row = row_coefs
    b, c = qs_BD.shape[0], cand.shape[0]
    n_cols = coef_B2.shape[0] if coef_B2.shape[1] else 0
    sh_col, cf_col = (coef_B2[:, 0], coef_B2[:, 1]) if n_cols else (coef_B2, coef_B2)
    bq = coef_B2.shape[0]
    masks = tuple(t * bq for t in own)
    for i0, i1, j0, j1 in tile_grid(b, c, tile):
        s_TT = logits_tile(qs_BD[i0:i1], cand[j0:j1].T, post, acc)
        mask_rows(s_TT, masks, i0 - j0)
        if ids is not None:
            mask_ids(s_TT, ids[0][i0:i1], ids[1][j0:j1])
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
    return mm_acc(a.to(b.dtype), b, acc)


def _add_wire(dblk_BX: Tensor, dcand: Tensor, j: int, d: int) -> None:
    """Add a block's key gradients (candidate order, J·Bq x D) into its wire layout (Bq x J·D)."""
    rows = dblk_BX.shape[0]
    if j == 1:
        dblk_BX += dcand
    else:
        dblk_BX.view(rows, j, d).add_(dcand.view(j, rows, d).transpose(0, 1))
