"""What the tiled kernels share: the tile loop's pieces, its precision and its threads.

The kernels (`lse.PositiveLSE`, `ring.PositiveRing`, `symmetric.SymmetricLSE`,
`sigmoid.SigmoidRing`, `late.MaxSimLSE`) build on the helpers here.

No kernel ever holds a B x N logits matrix. The forward walks T x T tiles
of the logits and keeps only a running (max, sum of exponentials) pair (m, l) per row (and
per column); the backward recomputes each tile from the saved inputs and those
statistics (the memory recipe of Inf-CL, arXiv:2410.17243, and FlashAttention).
Peak memory is O(N·D + T²) for the gathered forms and O(B·D + T²) for the
rings, independent of W.

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

from wholebatch.comm.collectives import all_gather
from wholebatch.comm.groups import get_world_size, is_distributed
from wholebatch.errors import WholebatchError
from wholebatch.losses.sizing import (
    ACCEL_TILE_BUDGET,
    CPU_TILE,
    TILE_BUFFERS,
    stats_gathered,
    tile_size_for,
)

__all__ = [
    "ACCELERATED_ON_CPU",
    "ACCEL_TILE_BUDGET",
    "CPU_TILE",
    "DEFAULT_CPU_TILE_THREADS",
    "TILE_BUFFERS",
    "accelerated",
    "combine",
    "compute_dtype",
    "cpu_tile_threads",
    "finish",
    "logits_tile",
    "mask_ids",
    "mask_rows",
    "mm_acc",
    "running",
    "scaled_rows",
    "softmax_coef",
    "softplus",
    "threaded",
    "tile_grid",
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


def threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
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


ACCELERATED_ON_CPU = False
"""Take the accelerator path on CPU too (the tests set it: `mm(out_dtype=)` then falls back
to upcasting, and the path's logic runs on machines without a GPU)."""


def accelerated(x: Tensor) -> bool:
    """Whether `x` takes the accelerator path: 16-bit rows kept as they are, products
    with float32 results, the scale applied per tile, 16-bit gradient tiles. On CUDA
    (or with `ACCELERATED_ON_CPU`)."""
    return x.is_cuda or ACCELERATED_ON_CPU


def mm_acc(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """`a @ b` with the result in `acc` (float32 or float64).

    16-bit operands on CUDA use the matrix units with a float32 result (each
    bf16 x bf16 product is exact in float32, the sum accumulates in float32:
    the same numbers as upcasting first, at the 16-bit speed); elsewhere the
    operands are upcast.
    """
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE and a.dtype != acc and accelerated(a) and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=acc)
        except (RuntimeError, TypeError):  # a torch or device without mm(out_dtype=): upcast
            _MM_OUT_DTYPE = False
    return a.to(acc) @ b.to(acc)


def scaled_rows(x: Tensor, scale: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(rows to multiply, scale left to apply per tile or None).

    Upcast path: the rows scaled once (B x D, no per-tile multiply). 16-bit on
    CUDA: the rows as they are and the scale applied to each float32 tile
    (rounding scaled rows to 16 bits would put 2**-9 relative error on every logit).
    """
    if accelerated(x) and x.dtype != acc:
        return x, scale.detach().to(acc)
    return x.to(acc) * scale.detach().to(acc), None


def logits_tile(qs_TD: Tensor, k_DT: Tensor, post: Tensor | None, acc: torch.dtype) -> Tensor:
    """One logits tile: the (scaled) query rows against the keys (passed transposed, D x T)."""
    s_TT = mm_acc(qs_TD, k_DT, acc)
    return s_TT if post is None else s_TT.mul_(post)


def running(
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


def combine(m_vec: Tensor, l_vec: Tensor, group: Any) -> tuple[Tensor, Tensor]:
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


def finish(m_vec: Tensor, l_vec: Tensor, pos: Tensor) -> Tensor:
    """a = lse(negatives) − positive, as (m_vec − pos) + log(sum): no large terms cancel."""
    return (m_vec - pos) + l_vec.log()


def softmax_coef(m_vec: Tensor, l_vec: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(shift, g / sum) so that g·softmax = exp(s − shift)·(g / sum); zeros where nothing is left."""
    live = l_vec > 0
    shift = torch.where(live, m_vec, torch.zeros_like(m_vec))
    coef = torch.where(
        live, g / torch.where(live, l_vec, torch.ones_like(l_vec)), torch.zeros_like(g)
    )
    return shift, coef


def mask_rows(s_TT: Tensor, masks: tuple[int, ...], shift: int) -> None:
    """Set entries (i, t + shift + i) of a tile to -inf for every t in `masks`."""
    for t in masks:
        s_TT.diagonal(t + shift).fill_(float("-inf"))


def tile_grid(rows: int, cols: int, tile: int) -> Iterator[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1) of every T x T tile of a `rows` x `cols` sweep, row by row."""
    for i0 in range(0, rows, tile):
        for j0 in range(0, cols, tile):
            yield i0, min(i0 + tile, rows), j0, min(j0 + tile, cols)


def mask_ids(s_TT: Tensor, ids_rows: Tensor | None, ids_cols: Tensor | None) -> None:
    """Set entries (i, j) of a tile to -inf where row i's id equals column j's (`ids_B=`: rows of
    one id are never each other's negatives; the positive, also of its own id, is masked apart).
    `ids_cols` covers the tile's first columns only (a sweep's keys beyond its first N, the
    hard negatives, carry no id)."""
    if ids_rows is None or ids_cols is None or not ids_cols.numel():
        return
    cols = ids_cols.shape[0]
    s_TT[:, :cols].masked_fill_(ids_rows[:, None] == ids_cols[None, :], float("-inf"))
