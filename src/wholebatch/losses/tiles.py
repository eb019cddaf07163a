"""Tiled autograd kernels behind `wholebatch.losses`: logits live one tile at a time.

No kernel ever holds a B x N logits matrix. The forward walks T x T tiles
of the logits and keeps only a running (max, sum of exponentials) pair (m, l) per row (and
per column); the backward recomputes each tile from the saved inputs and those
statistics (the memory recipe of Inf-CL, arXiv:2410.17243, and FlashAttention).
Peak memory is O(N·D + T²) for `PositiveLSE` and `SymmetricLSE` (the
self-similarity logits of NT-Xent, whose tiles below the diagonal are the
transposes of those above and are never computed) and O(B·D + T²) for
`SigmoidRing`, independent of W.

**Precision (issue 14).** A softmax cross-entropy row loss is
lse_j(s_ij) − s_i,pos = softplus(a_i) with a_i = lse_{j ≠ pos}(s_ij) − s_i,pos:
the log-sum-exp over the NEGATIVES only, minus the positive logit. The kernels
mask each row's positive and return a_i, computed as (m_i − s_i,pos) + log l_i
from the running max m_i (an exact logit) and sum l_i, never as the difference
of two large rounded numbers; the loss softplus(a_i) and its gradient
(sigmoid(a_i) times the softmax over negatives, and −sigmoid(a_i) for the
positive, never 1 − p) then have an error relative to the loss, also when a
pair is nearly saturated (loss → 0) in float32. SigLIP likewise masks the
positive pairs, whose terms softplus(−z_ii) are computed on their own.
16-bit inputs are computed in float32, tile by tile.

On CUDA (D <= 256, triton installed) every kernel here hands its tiles to the
fused Triton kernels of `wholebatch.losses.fused` instead, logits never in
memory; ``WHOLEBATCH_TILES=torch|triton`` forces either, and a kernel that
fails to build falls back to the tiles below with a warning.

On CPU the tiles' elementwise passes (exp, subtract, multiply) cost as much as
their matrix products, so the kernels scale the queries once (B x D) instead
of every tile, and fuse what they can (`addcmul_`).

Legend: W ranks in the group, B this rank's query rows, N global rows, C
candidate (key) rows, M rows of a self-similarity matrix, D embedding dim, T
the tile size (rows and columns of one logits tile). A tile passed transposed
is named by its shape (`k_DT`), never by a `_T` suffix. The running (max, sum
of exponentials) pair is (m, l), suffixed by its axis: `m_row, l_row`,
`m_col, l_col`, `m_M, l_M`; `m_vec, l_vec` in the helpers that serve either.

The kernels are collectives when the group holds more than one rank: every
rank must call them, in the same order, and back-propagate through them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from wholebatch.comm.collectives import all_gather, ring_pass, ring_peers
from wholebatch.comm.groups import get_rank, get_world_size, is_distributed
from wholebatch.comm.sizes import ring_block
from wholebatch.errors import WholebatchError
from wholebatch.losses import fused
from wholebatch.losses.sizing import (
    ACCEL_TILE_BUDGET,
    CPU_TILE,
    TILE_BUFFERS,
    stats_gathered,
    tile_size_for,
)

__all__ = [
    "ACCEL_TILE_BUDGET",
    "CPU_TILE",
    "TILE_BUFFERS",
    "PositiveLSE",
    "SigmoidRing",
    "SymmetricLSE",
    "compute_dtype",
    "cpu_tile_threads",
    "softplus",
    "tile_size_for",
]

_THREADS_ENV = "WHOLEBATCH_TILE_THREADS"


# Default intra-op threads of a CPU tile loop. Measured (benchmarks/RESULTS.md,
# "contention"; CLIP N = 4,096, D = 256, 2 cores): with torch's 2 threads the tile
# loop took 1.4-15x the plain formula whenever anything else ran on the machine
# (other processes, a second rank), against 0.59-0.77x on one thread; every tile is a
# dozen small parallel ops, each ending at a barrier that a descheduled thread stalls.
DEFAULT_CPU_TILE_THREADS = 1


def _tile_threads() -> int | None:
    """Intra-op threads for a CPU tile loop; None: torch's own setting."""
    want = os.environ.get(_THREADS_ENV, "").strip()
    if not want:
        return DEFAULT_CPU_TILE_THREADS
    try:
        n = int(want)
    except ValueError:
        raise WholebatchError(
            f"{_THREADS_ENV}={want!r}: expected a number of threads (0: torch's own setting)"
        ) from None
    return None if n <= 0 else n


@contextlib.contextmanager
def cpu_tile_threads(device: torch.device) -> Iterator[None]:
    """Run a CPU tile loop on ``WHOLEBATCH_TILE_THREADS`` intra-op threads (default 1).

    Every tile is a dozen small parallel ops, each ending at a barrier; when the
    machine is oversubscribed (other processes, W ranks on one host) a thread
    that is descheduled stalls every op, and the loop's time grows with the
    number of ops (benchmarks/RESULTS.md, contention: 10x the plain formula at 2
    threads, under 1x at 1). So by default the tile loop runs on one thread and
    the rest of the process keeps torch's setting. ``WHOLEBATCH_TILE_THREADS=N``
    uses N threads, ``0`` torch's own setting (a quiet many-core machine). Not
    used off the CPU.
    """
    want = _tile_threads() if device.type == "cpu" else None
    before = torch.get_num_threads()
    if want is None or want == before:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an autograd Function's forward or backward in `cpu_tile_threads`."""

    @functools.wraps(fn)
    def run(ctx: Any, first: Tensor, *args: Any) -> Any:
        with cpu_tile_threads(first.device):
            return fn(ctx, first, *args)

    return run


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)) to round-off for every x (`F.softplus` turns linear above 20: 2e-9 off)."""
    return -F.logsigmoid(-x)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype tiles are computed in: float32 for 16-bit inputs (exp of bf16 logits is too coarse)."""
    return torch.promote_types(dtype, torch.float32)


_MM_OUT_DTYPE = True  # False once `torch.mm(..., out_dtype=)` proved unavailable


def _accelerated(x: Tensor) -> bool:
    """Whether `x` takes the accelerator path: 16-bit rows kept as they are, products
    with float32 results, the scale applied per tile, 16-bit gradient tiles. On CUDA;
    the tests force it on CPU (where `mm(out_dtype=)` falls back to upcasting) so that
    its logic runs on machines without a GPU."""
    return x.is_cuda


def _mm_acc(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """`a @ b` with the result in `acc` (float32 or float64).

    16-bit operands on CUDA use the matrix units with a float32 result (each
    bf16 x bf16 product is exact in float32, the sum accumulates in float32:
    the same numbers as upcasting first, at the 16-bit speed); elsewhere the
    operands are upcast.
    """
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE and a.dtype != acc and _accelerated(a) and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=acc)
        except (RuntimeError, TypeError):  # a torch or device without mm(out_dtype=): upcast
            _MM_OUT_DTYPE = False
    return a.to(acc) @ b.to(acc)


def _scaled_rows(x: Tensor, scale: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(rows to multiply, scale left to apply per tile or None).

    Upcast path: the rows scaled once (B x D, no per-tile multiply). 16-bit on
    CUDA: the rows as they are and the scale applied to each float32 tile
    (rounding scaled rows to 16 bits would put 2**-9 relative error on every logit).
    """
    if _accelerated(x) and x.dtype != acc:
        return x, scale.detach().to(acc)
    return x.to(acc) * scale.detach().to(acc), None


def _logits(qs_TD: Tensor, k_DT: Tensor, post: Tensor | None, acc: torch.dtype) -> Tensor:
    """One logits tile: the (scaled) query rows against the keys (passed transposed, D x T)."""
    s_TT = _mm_acc(qs_TD, k_DT, acc)
    return s_TT if post is None else s_TT.mul_(post)


def _running(
    m_vec: Tensor, l_vec: Tensor, s_TT: Tensor, dim: int, buf: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Fold one tile into the running (max, sum of exponentials) along `dim` (1: rows, 0: cols).

    Entries set to -inf (masked) count for nothing; a row with none left keeps
    (-inf, 0).
    """
    t_max = s_TT.amax(dim)
    m_new = torch.maximum(m_vec, t_max)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    shift = safe[:, None] if dim == 1 else safe[None, :]
    e = torch.sub(s_TT, shift, out=buf) if buf is not None else torch.sub(s_TT, shift)
    l_new = l_vec.mul_((m_vec - safe).exp_()).add_(e.exp_().sum(dim))
    return m_new, l_new


def _combine(m_vec: Tensor, l_vec: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """Every rank's partial (max, sum) combined: all-reduce max, then all-reduce sum of rescaled
    sums; or, while the pairs are small (`sizing.stats_gathered`), one all-gather of them."""
    if not is_distributed(group):
        return m_vec, l_vec
    w = get_world_size(group)
    if stats_gathered(m_vec.numel(), w, m_vec.element_size()):
        n = m_vec.numel()  # the same on every rank (N and the directions are agreed)
        pairs = all_gather(torch.stack([m_vec, l_vec], 1), sizes=[n] * w, group=group, check=False)
        m_WV, l_WV = pairs.view(w, -1, 2).unbind(2)  # every rank's, in rank order
        m_all = m_WV.amax(0)
        safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
        return m_all, (l_WV * (m_WV - safe).exp()).sum(0)
    m_all = m_vec.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    l_all = l_vec * (m_vec - safe).exp()
    dist.all_reduce(l_all, op=dist.ReduceOp.SUM, group=group)
    return m_all, l_all


def _finish(m_vec: Tensor, l_vec: Tensor, pos: Tensor) -> Tensor:
    """a = lse(negatives) − positive, as (m_vec − pos) + log(sum): no large terms cancel."""
    return (m_vec - pos) + l_vec.log()


def _softmax_coef(m_vec: Tensor, l_vec: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(shift, g / sum) so that g·softmax = exp(s − shift)·(g / sum); zeros where nothing is left."""
    live = l_vec > 0
    shift = torch.where(live, m_vec, torch.zeros_like(m_vec))
    coef = torch.where(
        live, g / torch.where(live, l_vec, torch.ones_like(l_vec)), torch.zeros_like(g)
    )
    return shift, coef


def _mask_rows(s_TT: Tensor, masks: tuple[int, ...], shift: int) -> None:
    """Set entries (i, t + shift + i) of a tile to -inf for every t in `masks`."""
    for t in masks:
        s_TT.diagonal(t + shift).fill_(float("-inf"))


def _tiles(rows: int, cols: int, tile: int) -> Iterator[tuple[int, int, int, int]]:
    for i0 in range(0, rows, tile):
        for j0 in range(0, cols, tile):
            yield i0, min(i0 + tile, rows), j0, min(j0 + tile, cols)


def _positive_stats(
    q_BD: Tensor,
    k_CD: Tensor,
    scale: Tensor,
    offset: int,
    masks: tuple[int, ...],
    n_cols: int,
    tile: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(m_row, l_row, m_col, l_col) of `scale * q_BD @ k_CDᵀ` with the masked entries left out:
    the fused Triton kernels where `fused.use_fused` says, else the PyTorch tiles."""
    if fused.use_fused(q_BD):
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
    qs_BD, post = _scaled_rows(q_BD, scale, acc)
    m_row = qs_BD.new_full((b,), float("-inf"), dtype=acc)
    l_row = torch.zeros(b, dtype=acc, device=q_BD.device)
    m_col = torch.full((n_cols,), float("-inf"), dtype=acc, device=q_BD.device)
    l_col = torch.zeros(n_cols, dtype=acc, device=q_BD.device)
    buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
    k = k_CD if post is not None else k_CD.to(acc)
    for i0, i1, j0, j1 in _tiles(b, c, tile):
        s_TT = _logits(qs_BD[i0:i1], k[j0:j1].T, post, acc)
        # the positives (i, offset + i) are not negatives: masked in rows and columns
        _mask_rows(s_TT, masks, offset + i0 - j0)
        e = buf[: s_TT.numel()].view(s_TT.shape)
        m_row[i0:i1], l_row[i0:i1] = _running(m_row[i0:i1], l_row[i0:i1], s_TT, 1, e)
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            e = buf[: sc.numel()].view(sc.shape)  # the rows' exponentials are summed: reuse
            m_col[j0:jc], l_col[j0:jc] = _running(m_col[j0:jc], l_col[j0:jc], sc, 0, e)
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
) -> tuple[Tensor, Tensor]:
    """(uq, uk), unscaled (dq = s·uq, dk = s·uk): every tile recomputed and its softmax
    gradient applied; fused where `fused.use_fused` says, else the PyTorch tiles."""
    acc = row_coef[0].dtype
    if fused.use_fused(q_BD):
        try:
            uq, uk = fused.grads(q_BD, k_CD, scale, offset, masks, row_coef, col_coef)
            return uq.to(acc), uk.to(acc)
        except Exception as failure:  # a kernel that does not build here: the PyTorch tiles
            if fused.forced():
                raise
            fused.disable(failure)
    (sh_row, cf_row), (sh_col, cf_col) = row_coef, col_coef
    b, c, n_cols = q_BD.shape[0], k_CD.shape[0], col_coef[0].shape[0]
    qs_BD, post = _scaled_rows(q_BD, scale, acc)
    low = post is not None
    q = q_BD if low else q_BD.to(acc)
    k = k_CD if low else k_CD.to(acc)
    # Unscaled: dq = s·uq, dk = s·uk, d scale = sum_ij g_ij q_i·k_j = (q · uq).sum().
    uq_BD = torch.zeros(q_BD.shape, dtype=acc, device=q_BD.device)
    uk_CD = torch.zeros(k_CD.shape, dtype=acc, device=k_CD.device)
    buf = torch.empty(tile * tile, dtype=acc, device=q_BD.device)
    for i0, i1, j0, j1 in _tiles(b, c, tile):
        s_TT = _logits(qs_BD[i0:i1], k[j0:j1].T, post, acc)
        _mask_rows(s_TT, masks, offset + i0 - j0)
        # d a_i / d s_ij = softmax over row i's negatives; likewise along the columns.
        g_TT = buf[: s_TT.numel()].view(s_TT.shape)
        torch.sub(s_TT, sh_row[i0:i1, None], out=g_TT).exp_().mul_(cf_row[i0:i1, None])
        if j0 < n_cols:
            jc = min(j1, n_cols)
            sc = s_TT[:, : jc - j0]
            g_TT[:, : jc - j0].addcmul_(sc.sub_(sh_col[None, j0:jc]).exp_(), cf_col[None, j0:jc])
        uq_BD[i0:i1] += _mm_acc(g_TT.to(k.dtype), k[j0:j1], acc)
        uk_CD[j0:j1] += _mm_acc(g_TT.T.to(q.dtype), q[i0:i1], acc)
    return uq_BD, uk_CD


class PositiveLSE(torch.autograd.Function):
    """Softmax cross-entropy terms of `scale * q_BD @ k_CDᵀ` with known positives, tile by tile.

    Query row i (global row `offset + i`) has its positive at candidate column
    `offset + i`; the candidates at `t + offset + i` for t in `masks` (which
    holds 0) are left out of row i, every other candidate is a negative
    (InfoNCE's document-to-document direction leaves out a row's own hard
    negatives, at t = N, 2N, ...). Outputs:

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
    @_threaded
    def forward(  # type: ignore[override]
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
    ) -> tuple[Tensor, Tensor]:
        acc = compute_dtype(q_BD.dtype)
        b = q_BD.shape[0]
        m_row, l_row, m_col, l_col = _positive_stats(q_BD, k_CD, scale, offset, masks, n_cols, tile)
        if n_cols:  # the same on every rank (N and the directions are agreed): no empty calls
            m_col, l_col = _combine(m_col, l_col, group)
        pos = pos_B.detach().to(acc)
        row_B = _finish(m_row, l_row, pos)
        col_B = (
            _finish(m_col[offset : offset + b], l_col[offset : offset + b], pos)
            if n_cols
            else pos.new_zeros(0)
        )
        ctx.save_for_backward(q_BD, k_CD, scale, m_row, l_row, m_col, l_col)
        ctx.offset, ctx.n_cols, ctx.sizes, ctx.tile, ctx.group = offset, n_cols, sizes, tile, group
        ctx.masks = masks
        ctx.pos_dtype = pos_B.dtype
        return row_B, col_B

    @staticmethod
    @_threaded
    def backward(ctx: Any, g_row_B: Tensor, g_col_B: Tensor) -> tuple[Tensor | None, ...]:
        q_BD, k_CD, scale, m_row, l_row, m_col, l_col = ctx.saved_tensors
        acc, tile, n_cols, offset, masks = m_row.dtype, ctx.tile, ctx.n_cols, ctx.offset, ctx.masks
        s = scale.detach().to(acc)
        g_row_B = g_row_B.to(acc)
        sh_row, cf_row = _softmax_coef(m_row, l_row, g_row_B)
        if n_cols:
            g_col_B = g_col_B.to(acc).contiguous()
            # every rank's rows feed every column: the column gradients, all-gathered.
            g_col_N = (
                all_gather(g_col_B, sizes=ctx.sizes, group=ctx.group, check=False)
                if is_distributed(ctx.group)
                else g_col_B
            )
            sh_col, cf_col = _softmax_coef(m_col, l_col, g_col_N)
        else:
            sh_col = cf_col = m_col  # empty: no columns
        cols = (sh_col, cf_col)
        uq_BD, uk_CD = _positive_grads(
            q_BD, k_CD, scale, offset, masks, tile, (sh_row, cf_row), cols
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
            None,
            None,
            None,
            None,
            None,
            None,
        )


# ---------------------------------------------------------------------------
# NT-Xent: the upper triangle of a symmetric matrix, dealt to the ranks
# ---------------------------------------------------------------------------


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


def _upper_tiles(m: int, tile: int, group: Any) -> Iterator[tuple[int, int, int, int]]:
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
    @_threaded
    def forward(  # type: ignore[override]
        ctx: Any, z_MD: Tensor, scale: Tensor, pos_M: Tensor, tile: int, group: Any
    ) -> Tensor:
        acc = compute_dtype(z_MD.dtype)
        m, half = z_MD.shape[0], z_MD.shape[0] // 2
        zs_MD, post = _scaled_rows(z_MD, scale, acc)  # scaled once (upcast path)
        z = z_MD if post is not None else z_MD.to(acc)
        m_M = torch.full((m,), float("-inf"), dtype=acc, device=z_MD.device)
        l_M = torch.zeros(m, dtype=acc, device=z_MD.device)
        fast = fused.use_fused(z_MD)
        if fast:  # no collective inside: a rank whose kernel fails takes the PyTorch tiles alone
            fast = fused.attempt(_sym_stats_fused, z_MD, scale, group, m_M, l_M) is not None
        for i0, i1, j0, j1 in _upper_tiles(m, tile, group) if not fast else ():
            s_TT = _logits(zs_MD[i0:i1], z[j0:j1].T, post, acc)
            _mask_sym(s_TT, i0, j0, half)
            m_M[i0:i1], l_M[i0:i1] = _running(m_M[i0:i1], l_M[i0:i1], s_TT, 1)
            if i0 != j0:  # the mirrored tile (j, i): its rows are this tile's columns
                m_M[j0:j1], l_M[j0:j1] = _running(m_M[j0:j1], l_M[j0:j1], s_TT, 0)
        m_M, l_M = _combine(m_M, l_M, group)
        ctx.save_for_backward(z_MD, scale, m_M, l_M)
        ctx.tile, ctx.group, ctx.pos_dtype = tile, group, pos_M.dtype
        return _finish(m_M, l_M, pos_M.detach().to(acc))

    @staticmethod
    @_threaded
    def backward(ctx: Any, g_M: Tensor) -> tuple[Tensor | None, ...]:
        z_MD, scale, m_M, l_M = ctx.saved_tensors
        acc, tile, group = m_M.dtype, ctx.tile, ctx.group
        m, half = z_MD.shape[0], z_MD.shape[0] // 2
        g_local = g_M.to(acc)
        # backward of the cross-rank combine: all-reduce (sum) of the gradient.
        g_all = g_local.contiguous().clone()
        if is_distributed(group):
            dist.all_reduce(g_all, op=dist.ReduceOp.SUM, group=group)
        shift, coef = _softmax_coef(m_M, l_M, g_all)
        s = scale.detach().to(acc)
        zs_MD, post = _scaled_rows(z_MD, scale, acc)
        z = z_MD if post is not None else z_MD.to(acc)
        u_MD = torch.zeros(z_MD.shape, dtype=acc, device=z_MD.device)
        fast = fused.use_fused(z_MD)
        if fast:
            fast = (
                fused.attempt(_sym_grads_fused, z_MD, scale, group, shift, coef, u_MD) is not None
            )
        for i0, i1, j0, j1 in _upper_tiles(m, tile, group) if not fast else ():
            s_TT = _logits(zs_MD[i0:i1], z[j0:j1].T, post, acc)
            _mask_sym(s_TT, i0, j0, half)
            # d a_i / d s_ij = softmax over row i's negatives; the column part is
            # d a_j / d s_ji (on a diagonal tile it makes G symmetric: one product serves).
            g_TT = torch.sub(s_TT, shift[i0:i1, None]).exp_().mul_(coef[i0:i1, None])
            g_TT.addcmul_(s_TT.sub_(shift[None, j0:j1]).exp_(), coef[None, j0:j1])
            u_MD[i0:i1] += _mm_acc(g_TT.to(z.dtype), z[j0:j1], acc)
            if i0 != j0:
                u_MD[j0:j1] += _mm_acc(g_TT.T.to(z.dtype), z[i0:i1], acc)
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
# SigLIP: every pair's softplus, text blocks around the ring
# ---------------------------------------------------------------------------


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
            z_TT = _mm_acc(q_TD, k_TD.T, acc).mul_(s).add_(b)
            if own:
                z_TT.diagonal(i0 - j0).fill_(float("-inf"))
            # d softplus(z)/dz = sigmoid(z)
            g_TT = z_TT.sigmoid_().mul_(g)
            gk_TD = _mm_acc(g_TT.to(k_TD.dtype), k_TD, acc)
            ds += (q_TD.to(acc) * gk_TD).sum()
            db += g_TT.sum()
            di_BD[i0 : i0 + tile] += gk_TD.mul_(s)
            dblk_MD[j0 : j0 + tile] += _mm_acc(g_TT.T.to(q_TD.dtype), q_TD, acc).mul_(s)


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
            z_TT = _mm_acc(q_TD, blk_MD[j0 : j0 + tile].T, acc).mul_(s).add_(b)
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
    @_threaded
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
    @_threaded
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        img_BD, txt_BD, scale, bias = ctx.saved_tensors
        acc, tile, sizes, group = compute_dtype(img_BD.dtype), ctx.tile, ctx.sizes, ctx.group
        s, b, g = scale.detach().to(acc), bias.detach().to(acc), g.to(acc)
        w = get_world_size(group)
        low = _accelerated(img_BD) and img_BD.dtype != acc
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
                    img, wire_MD.to(img.dtype), s, b, g, tile, acc, step == 0, di_BD, dblk_MD, ds, db
                )  # fmt: skip
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
