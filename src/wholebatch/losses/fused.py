"""Fused Triton tiles for the softmax losses: logits never leave the kernel (flash-attention style).

The PyTorch tiles (`tiles.PositiveLSE`, `ring.PositiveRing`) form each T x T
logits tile in memory and make several float32 elementwise passes over it; on
a GPU those passes, not the product, set the time. These kernels compute a
block of logits in registers, fold it into the running (max, sum) pair (m, l)
at once, and write only the B (or C) statistics; the backward recomputes each
block and accumulates the query and key gradients, again without writing a
logit:

- `row_stats`: (m, l) per query row over every candidate column, with the
  masked entries (i, offset + i + t) left out (the positives);
- `col_stats`: the same per candidate column (its first `n_cols` columns) over
  the query rows;
- `grads`: uq = Σ_j g_ij k_j and uk = Σ_i g_ij q_i with
  g_ij = exp(s_ij − sh_i)·cf_i + exp(s_ij − sh'_j)·cf'_j (the softmax over row
  i's negatives times its gradient, plus the column part), unscaled;
- `sigmoid_sum` (SigLIP's forward): Σ_ij softplus(z_ij), z_ij = s·(q_i·k_j) + b,
  over the pairs that are not masked (the negatives: the masked entries are the
  positives, whose terms the caller computes on its own), per query row;
- `sigmoid_grads` (its backward): uq = Σ_j σ(z_ij) k_j, uk = Σ_i σ(z_ij) q_i
  and Σ_ij σ(z_ij), unscaled (times g·s they are the rows' gradients; the
  scale's is g·Σ q·uq, the bias's g·Σ σ).

NT-Xent's panel pairs (`tiles.SymmetricLSE`) use `row_stats`, `col_stats`
and `grads` with the masks (0, M/2, −M/2): the diagonal and both positives.

Chosen automatically on CUDA when triton is installed (the `triton` extra)
and D <= `MAX_AUTO_DIM`, the PyTorch tiles otherwise (and for the rest of the
process if a kernel fails to build or run: a warning says so); ``WHOLEBATCH_TILES=torch`` forces the PyTorch
tiles, ``WHOLEBATCH_TILES=triton`` the fused ones (also on CPU under
``TRITON_INTERPRET=1``, how the tests check them against the PyTorch tiles).
Logits are s·(q·k) in float32 from inputs of any float dtype.

Legend: B query rows, C candidate rows, D embedding dim, BM x BN the block of
logits one program holds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from wholebatch.errors import WholebatchError

__all__ = [
    "MAX_AUTO_DIM",
    "attempt",
    "available",
    "col_stats",
    "disable",
    "forced",
    "grads",
    "merge",
    "row_stats",
    "sigmoid_grads",
    "sigmoid_sum",
    "use_fused",
]

_ENV = "WHOLEBATCH_TILES"


@functools.cache
def available() -> bool:
    """Whether triton imports (the optional `triton` extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(x: Tensor) -> bool:
    """Whether the tiles of a loss on `x` run fused: CUDA with triton, unless the env says.

    float64 inputs always take the PyTorch tiles (the kernels compute in float32).
    """
    if x.dtype == torch.float64:
        return False
    want = os.environ.get(_ENV, "").strip().lower()
    if want not in ("", "torch", "triton", "auto"):
        raise WholebatchError(f"{_ENV}={want!r}: expected 'torch', 'triton' or 'auto'")
    if want == "torch":
        return False
    if want == "triton":
        if not available():
            raise WholebatchError(f"{_ENV}=triton but triton is not installed: pip install triton")
        return True
    return x.is_cuda and x.shape[-1] <= MAX_AUTO_DIM and available() and not _FAILED


# The backward keeps a BM x D float32 accumulator per program: chosen automatically up to
# this D (larger D: the PyTorch tiles, unless WHOLEBATCH_TILES=triton).
MAX_AUTO_DIM = 256
_FAILED: list[str] = []


def forced() -> bool:
    """Whether ``WHOLEBATCH_TILES=triton`` asks for the kernels (then a failure is raised)."""
    return os.environ.get(_ENV, "").strip().lower() == "triton"


def disable(why: BaseException) -> None:
    """Fall back to the PyTorch tiles for the rest of the process (a kernel failed to build or run)."""
    import warnings

    _FAILED.append(repr(why))
    warnings.warn(
        f"wholebatch: the fused Triton tiles failed ({why!r}); using the PyTorch tiles "
        f"(set {_ENV}=torch to skip them, {_ENV}=triton to see the error)",
        RuntimeWarning,
        stacklevel=3,
    )


def attempt(kernel: Callable[..., Any], *args: Any) -> Any:
    """`kernel(*args)` (True when it returns nothing), or None if it fails to build or run
    here: then `disable`, and the caller takes the PyTorch tiles from now on. Raised
    instead when ``WHOLEBATCH_TILES=triton`` forces the kernels.

    A kernel fails before it writes anything (it does not build, or does not launch),
    so the PyTorch step that follows starts from the same state.
    """
    try:
        out = kernel(*args)
    except Exception as failure:
        if forced():
            raise
        disable(failure)
        return None
    return True if out is None else out


def _blocks(d: int) -> tuple[int, int, int]:
    """(BM, BN, BD): tl.dot needs sides of at least 16; D padded to a power of two."""
    bd = max(16, 1 << (d - 1).bit_length())
    return 32, 32, bd


@functools.cache
def _kernels() -> dict[str, Any]:
    from wholebatch.losses import _triton_tiles

    return _triton_tiles.KERNELS


def _masks(masks: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor(list(masks) or [0], dtype=torch.int64, device=device)


def _scale(scale: Tensor, like: Tensor) -> Tensor:
    """The scale as a 1-element float32 tensor on the device: read by the kernel, never the host."""
    return scale.detach().reshape(1).to(device=like.device, dtype=torch.float32)


def merge(m: Tensor, lsum: Tensor, m2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Two (m, l) pairs of the same rows combined (a block's statistics folded into running ones)."""
    m_new = torch.maximum(m, m2)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    return m_new, lsum * (m - safe).exp() + l2 * (m2 - safe).exp()


def row_stats(
    q_BD: Tensor, k_CD: Tensor, scale: Tensor, offset: int, masks: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """(m, l) per query row over every candidate, entries (i, offset + i + t), t in `masks`, left out."""
    b, d = q_BD.shape
    c = k_CD.shape[0]
    m = torch.empty(b, dtype=torch.float32, device=q_BD.device)
    lsum = torch.empty(b, dtype=torch.float32, device=q_BD.device)
    if b == 0:
        return m, lsum
    bm, bn, bd = _blocks(d)
    mk, scale_t = _masks(masks, q_BD.device), _scale(scale, q_BD)
    _kernels()["row"][(-(-b // bm),)](
        q_BD.contiguous(),
        k_CD.contiguous(),
        m,
        lsum,
        mk,
        len(masks),
        b,
        c,
        d,
        offset,
        scale_t,
        BM=bm,
        BN=bn,
        BD=bd,
    )
    return m, lsum


def col_stats(
    q_BD: Tensor, k_CD: Tensor, scale: Tensor, offset: int, masks: tuple[int, ...], n_cols: int
) -> tuple[Tensor, Tensor]:
    """(m, l) per candidate column of the first `n_cols` over the query rows (masks as rows)."""
    b, d = q_BD.shape
    c = k_CD.shape[0]
    m = torch.full((n_cols,), float("-inf"), dtype=torch.float32, device=q_BD.device)
    lsum = torch.zeros(n_cols, dtype=torch.float32, device=q_BD.device)
    if n_cols == 0 or b == 0:
        return m, lsum
    bm, bn, bd = _blocks(d)
    mk, scale_t = _masks(masks, q_BD.device), _scale(scale, q_BD)
    _kernels()["col"][(-(-n_cols // bn),)](
        q_BD.contiguous(),
        k_CD.contiguous(),
        m,
        lsum,
        mk,
        len(masks),
        b,
        c,
        d,
        offset,
        scale_t,
        n_cols,
        BM=bm,
        BN=bn,
        BD=bd,
    )
    return m, lsum


def grads(
    q_BD: Tensor,
    k_CD: Tensor,
    scale: Tensor,
    offset: int,
    masks: tuple[int, ...],
    row_coef: tuple[Tensor, Tensor],
    col_coef: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """(uq, uk), float32 and unscaled: Σ_j g_ij k_j and Σ_i g_ij q_i (see the module docstring)."""
    b, d = q_BD.shape
    c = k_CD.shape[0]
    n_cols = col_coef[0].shape[0]
    uq = torch.zeros((b, d), dtype=torch.float32, device=q_BD.device)
    uk = torch.zeros((c, d), dtype=torch.float32, device=q_BD.device)
    if b == 0 or c == 0:
        return uq, uk
    bm, bn, bd = _blocks(d)
    mk = _masks(masks, q_BD.device)
    f32 = [x.float().contiguous() for x in (*row_coef, *col_coef)]
    if n_cols == 0:
        f32[2:] = [torch.zeros(1, device=q_BD.device)] * 2
    q, k = q_BD.contiguous(), k_CD.contiguous()
    common = (b, c, d, offset, _scale(scale, q_BD), n_cols)
    _kernels()["dq"][(-(-b // bm),)](q, k, *f32, mk, len(masks), uq, *common, BM=bm, BN=bn, BD=bd)
    _kernels()["dk"][(-(-c // bn),)](q, k, *f32, mk, len(masks), uk, *common, BM=bm, BN=bn, BD=bd)
    return uq, uk


def _pair(q_BD: Tensor, k_CD: Tensor) -> tuple[Tensor, Tensor]:
    """Both towers in one dtype (one dot's operands), contiguous; widened if they differ."""
    if q_BD.dtype != k_CD.dtype:
        dtype = torch.promote_types(q_BD.dtype, k_CD.dtype)
        q_BD, k_CD = q_BD.to(dtype), k_CD.to(dtype)
    return q_BD.contiguous(), k_CD.contiguous()


def sigmoid_sum(
    q_BD: Tensor, k_CD: Tensor, scale: Tensor, bias: Tensor, offset: int, masks: tuple[int, ...]
) -> Tensor:
    """Σ_ij softplus(s·(q_i·k_j) + b) per query row (B, float32), entries (i, offset + i + t) left out."""
    b, d = q_BD.shape
    c = k_CD.shape[0]
    out_B = torch.zeros(b, dtype=torch.float32, device=q_BD.device)
    if b == 0 or c == 0:
        return out_B
    bm, bn, bd = _blocks(d)
    q, k = _pair(q_BD, k_CD)
    _kernels()["sig_row"][(-(-b // bm),)](
        q,
        k,
        out_B,
        _masks(masks, q.device),
        len(masks),
        b,
        c,
        d,
        offset,
        _scale(scale, q),
        _scale(bias, q),
        BM=bm,
        BN=bn,
        BD=bd,
    )
    return out_B


def sigmoid_grads(
    q_BD: Tensor, k_CD: Tensor, scale: Tensor, bias: Tensor, offset: int, masks: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """(uq, uk, p_B), float32: Σ_j σ(z_ij) k_j, Σ_i σ(z_ij) q_i, Σ_j σ(z_ij), masks as `sigmoid_sum`."""
    b, d = q_BD.shape
    c = k_CD.shape[0]
    uq = torch.zeros((b, d), dtype=torch.float32, device=q_BD.device)
    uk = torch.zeros((c, d), dtype=torch.float32, device=q_BD.device)
    p_B = torch.zeros(b, dtype=torch.float32, device=q_BD.device)
    if b == 0 or c == 0:
        return uq, uk, p_B
    bm, bn, bd = _blocks(d)
    q, k = _pair(q_BD, k_CD)
    mk, s, bias_t = _masks(masks, q.device), _scale(scale, q), _scale(bias, q)
    common = (mk, len(masks), b, c, d, offset, s, bias_t)
    _kernels()["sig_dq"][(-(-b // bm),)](q, k, uq, p_B, *common, BM=bm, BN=bn, BD=bd)
    _kernels()["sig_dk"][(-(-c // bn),)](q, k, uk, *common, BM=bm, BN=bn, BD=bd)
    return uq, uk, p_B
