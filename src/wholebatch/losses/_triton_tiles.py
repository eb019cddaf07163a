"""The Triton kernels behind `wholebatch.losses.fused` (imported only when triton is installed).

Kept apart so that importing `fused` (to ask whether to use them) never needs triton.
Legend: BM x BN the block of logits one program holds, BD the padded embedding dim.
"""

# mypy: ignore-errors

# No `from __future__ import annotations`: triton's interpreter (up to 3.0, torch 2.4's
# pin) finds constexpr parameters by their annotation's class; the string the future
# import makes of `BM: tl.constexpr` is missed, and BM arrives as a tensor.
import os

import triton
import triton.language as tl

__all__ = ["KERNELS"]

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no 16-bit dot: there the
# operands are widened first, which gives the same products (a bf16 x bf16 product is
# exact in float32); only the summation order can differ from the GPU's 16-bit dot.
UPCAST: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "") == "1")


@triton.jit
def _logits(q_ptr, k_ptr, rows, cols, d, scale_ptr, BD: tl.constexpr):  # type: ignore[no-untyped-def]
    # D in chunks of at most 64: the operands of one dot stay small at any D
    BK: tl.constexpr = 64 if BD > 64 else BD
    s = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32)
    for d0 in range(0, d, BK):
        offs_d = d0 + tl.arange(0, BK)
        q = tl.load(
            q_ptr + rows[:, None] * d + offs_d[None, :],
            mask=(rows[:, None] >= 0) & (offs_d[None, :] < d),
            other=0.0,
        )
        k = tl.load(
            k_ptr + cols[:, None] * d + offs_d[None, :],
            mask=(cols[:, None] >= 0) & (offs_d[None, :] < d),
            other=0.0,
        )
        if q.dtype == tl.float32 or UPCAST:  # exact float32 products: never TF32
            s += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # 16-bit operands: exact products, float32 accumulation
            s += tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    return s * tl.load(scale_ptr).to(tl.float32)


@triton.jit
def _masked(s, rows, cols, b, c, offset, mask_ptr, n_masks, col_limit):  # type: ignore[no-untyped-def]
    bad = (rows[:, None] >= b) | (cols[None, :] >= col_limit)
    for t in range(n_masks):
        shift = tl.load(mask_ptr + t)
        bad = bad | (cols[None, :] == rows[:, None] + offset + shift)
    return tl.where(bad, float("-inf"), s)


@triton.jit
def row_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, m_ptr, l_ptr, mask_ptr, n_masks, b, c, d, offset, scale_ptr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    safe_rows = tl.where(rows < b, rows, -1)
    m = tl.full((BM,), float("-inf"), tl.float32)
    lsum = tl.zeros((BM,), tl.float32)
    for j0 in range(0, c, BN):
        cols = j0 + tl.arange(0, BN)
        safe_cols = tl.where(cols < c, cols, -1)
        s = _logits(q_ptr, k_ptr, safe_rows, safe_cols, d, scale_ptr, BD)
        s = _masked(s, rows, cols, b, c, offset, mask_ptr, n_masks, c)
        m_new = tl.maximum(m, tl.max(s, 1))
        live = m_new > float("-inf")
        shift = tl.where(live, m_new, 0.0)
        lsum = lsum * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=rows < b)
    tl.store(l_ptr + rows, lsum, mask=rows < b)


@triton.jit
def col_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, m_ptr, l_ptr, mask_ptr, n_masks, b, c, d, offset, scale_ptr, n_cols,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    safe_cols = tl.where(cols < n_cols, cols, -1)
    m = tl.full((BN,), float("-inf"), tl.float32)
    lsum = tl.zeros((BN,), tl.float32)
    for i0 in range(0, b, BM):
        rows = i0 + tl.arange(0, BM)
        safe_rows = tl.where(rows < b, rows, -1)
        s = _logits(q_ptr, k_ptr, safe_rows, safe_cols, d, scale_ptr, BD)
        s = _masked(s, rows, cols, b, c, offset, mask_ptr, n_masks, n_cols)
        m_new = tl.maximum(m, tl.max(s, 0))
        live = m_new > float("-inf")
        shift = tl.where(live, m_new, 0.0)
        lsum = lsum * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[None, :]), 0)
        m = m_new
    tl.store(m_ptr + cols, m, mask=cols < n_cols)
    tl.store(l_ptr + cols, lsum, mask=cols < n_cols)


@triton.jit
def _grad_tile(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, sr_ptr, cr_ptr, sc_ptr, cc_ptr, mask_ptr, n_masks, rows, cols,
    b, c, d, offset, scale_ptr, n_cols, BD: tl.constexpr,
):  # fmt: skip
    safe_rows = tl.where(rows < b, rows, -1)
    safe_cols = tl.where(cols < c, cols, -1)
    s = _logits(q_ptr, k_ptr, safe_rows, safe_cols, d, scale_ptr, BD)
    s = _masked(s, rows, cols, b, c, offset, mask_ptr, n_masks, c)
    sh_r = tl.load(sr_ptr + rows, mask=rows < b, other=0.0)
    cf_r = tl.load(cr_ptr + rows, mask=rows < b, other=0.0)
    g = tl.exp(s - sh_r[:, None]) * cf_r[:, None]
    in_cols = cols < n_cols
    sh_c = tl.load(sc_ptr + cols, mask=in_cols, other=0.0)
    cf_c = tl.load(cc_ptr + cols, mask=in_cols, other=0.0)
    g += tl.where(in_cols[None, :], tl.exp(s - sh_c[None, :]) * cf_c[None, :], 0.0)
    return tl.where(s > float("-inf"), g, 0.0)


@triton.jit
def dq_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, sr_ptr, cr_ptr, sc_ptr, cc_ptr, mask_ptr, n_masks, uq_ptr,
    b, c, d, offset, scale_ptr, n_cols, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    acc = tl.zeros((BM, BD), tl.float32)
    for j0 in range(0, c, BN):
        cols = j0 + tl.arange(0, BN)
        g = _grad_tile(
            q_ptr, k_ptr, sr_ptr, cr_ptr, sc_ptr, cc_ptr, mask_ptr, n_masks, rows, cols,
            b, c, d, offset, scale_ptr, n_cols, BD,
        )  # fmt: skip
        k = tl.load(
            k_ptr + cols[:, None] * d + offs_d[None, :],
            mask=(cols[:, None] < c) & (offs_d[None, :] < d), other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.dot(g, k, input_precision="ieee")
    tl.store(
        uq_ptr + rows[:, None] * d + offs_d[None, :], acc,
        mask=(rows[:, None] < b) & (offs_d[None, :] < d),
    )  # fmt: skip


@triton.jit
def dk_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, sr_ptr, cr_ptr, sc_ptr, cc_ptr, mask_ptr, n_masks, uk_ptr,
    b, c, d, offset, scale_ptr, n_cols, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    acc = tl.zeros((BN, BD), tl.float32)
    for i0 in range(0, b, BM):
        rows = i0 + tl.arange(0, BM)
        g = _grad_tile(
            q_ptr, k_ptr, sr_ptr, cr_ptr, sc_ptr, cc_ptr, mask_ptr, n_masks, rows, cols,
            b, c, d, offset, scale_ptr, n_cols, BD,
        )  # fmt: skip
        q = tl.load(
            q_ptr + rows[:, None] * d + offs_d[None, :],
            mask=(rows[:, None] < b) & (offs_d[None, :] < d), other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.dot(tl.trans(g), q, input_precision="ieee")
    tl.store(
        uk_ptr + cols[:, None] * d + offs_d[None, :], acc,
        mask=(cols[:, None] < c) & (offs_d[None, :] < d),
    )  # fmt: skip


# ---------------------------------------------------------------------------
# SigLIP: z = s·(q·k) + b, every negative pair's softplus(z) and its gradient sigmoid(z)
# ---------------------------------------------------------------------------


@triton.jit
def _softplus(z):  # type: ignore[no-untyped-def]
    # max(z, 0) + log1p(exp(-|z|)), log1p to float32 round-off even for tiny terms
    # (log(u)·x / (u − 1), u = 1 + x: Goldberg's identity), 0 at z = -inf
    x = tl.exp(-tl.abs(z))
    u = 1.0 + x
    lp = tl.where(u == 1.0, x, tl.log(u) * x / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.maximum(z, 0.0) + lp


@triton.jit
def _sigmoid(z):  # type: ignore[no-untyped-def]
    # either branch without overflow into its result; 0 at z = -inf
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _sig_logits(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, rows, cols, b, c, d, offset, scale_ptr, bias_ptr, mask_ptr, n_masks,
    BD: tl.constexpr,
):  # fmt: skip
    safe_rows = tl.where(rows < b, rows, -1)
    safe_cols = tl.where(cols < c, cols, -1)
    z = _logits(q_ptr, k_ptr, safe_rows, safe_cols, d, scale_ptr, BD)
    z = z + tl.load(bias_ptr).to(tl.float32)
    # padded rows and columns (z = b there, not 0) and the positives: -inf, worth nothing
    return _masked(z, rows, cols, b, c, offset, mask_ptr, n_masks, c)


@triton.jit
def sig_row_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, out_ptr, mask_ptr, n_masks, b, c, d, offset, scale_ptr, bias_ptr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    acc = tl.zeros((BM,), tl.float32)
    for j0 in range(0, c, BN):
        cols = j0 + tl.arange(0, BN)
        z = _sig_logits(
            q_ptr, k_ptr, rows, cols, b, c, d, offset, scale_ptr, bias_ptr, mask_ptr, n_masks, BD
        )  # fmt: skip
        acc += tl.sum(_softplus(z), 1)
    tl.store(out_ptr + rows, acc, mask=rows < b)


@triton.jit
def sig_dq_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, uq_ptr, p_ptr, mask_ptr, n_masks, b, c, d, offset, scale_ptr, bias_ptr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    acc = tl.zeros((BM, BD), tl.float32)
    psum = tl.zeros((BM,), tl.float32)
    for j0 in range(0, c, BN):
        cols = j0 + tl.arange(0, BN)
        z = _sig_logits(
            q_ptr, k_ptr, rows, cols, b, c, d, offset, scale_ptr, bias_ptr, mask_ptr, n_masks, BD
        )  # fmt: skip
        p = _sigmoid(z)
        psum += tl.sum(p, 1)
        k = tl.load(
            k_ptr + cols[:, None] * d + offs_d[None, :],
            mask=(cols[:, None] < c) & (offs_d[None, :] < d), other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.dot(p, k, input_precision="ieee")
    tl.store(
        uq_ptr + rows[:, None] * d + offs_d[None, :], acc,
        mask=(rows[:, None] < b) & (offs_d[None, :] < d),
    )  # fmt: skip
    tl.store(p_ptr + rows, psum, mask=rows < b)


@triton.jit
def sig_dk_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, uk_ptr, mask_ptr, n_masks, b, c, d, offset, scale_ptr, bias_ptr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    acc = tl.zeros((BN, BD), tl.float32)
    for i0 in range(0, b, BM):
        rows = i0 + tl.arange(0, BM)
        z = _sig_logits(
            q_ptr, k_ptr, rows, cols, b, c, d, offset, scale_ptr, bias_ptr, mask_ptr, n_masks, BD
        )  # fmt: skip
        q = tl.load(
            q_ptr + rows[:, None] * d + offs_d[None, :],
            mask=(rows[:, None] < b) & (offs_d[None, :] < d), other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.dot(tl.trans(_sigmoid(z)), q, input_precision="ieee")
    tl.store(
        uk_ptr + cols[:, None] * d + offs_d[None, :], acc,
        mask=(cols[:, None] < c) & (offs_d[None, :] < d),
    )  # fmt: skip


KERNELS = {
    "row": row_kernel,
    "col": col_kernel,
    "dq": dq_kernel,
    "dk": dk_kernel,
    "sig_row": sig_row_kernel,
    "sig_dq": sig_dq_kernel,
    "sig_dk": sig_dk_kernel,
}
