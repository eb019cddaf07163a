"""The fused Triton tiles (`wholebatch.losses.fused`) against the PyTorch tiles, on CPU under TRITON_INTERPRET=1.

Skipped when triton is not installed (the optional `triton` extra). The
kernels' statistics and gradients are compared with the formula on float32
and bfloat16 inputs, at shapes that are not multiples of the kernels' blocks
(masked edges) and with masked positives; then whole losses (CLIP gather and
ring, InfoNCE with hard negatives and every direction) with
``WHOLEBATCH_TILES=triton`` against ``WHOLEBATCH_TILES=torch``. A kernel that
ignores the masks is rejected by the same comparison (the mutation). GPU
speed is `make gpu`'s: not measured here. The interpreter has no 16-bit dot, so
there bf16 operands are widened before the product (the same products; on a GPU
the kernels use the 16-bit dot with float32 accumulation, not checked here).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch

from tests.support.features import skip_module_unless
from wholebatch.errors import WholebatchError
from wholebatch.losses import clip_loss, fused, info_nce_loss

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
skip_module_unless("triton_kernels")  # an interpreter that cannot run them: why

# float32 sums of <= 60 products of size ~5: round-off ~1e-5 relative; bf16 inputs
# are widened exactly, so the same bound holds against the widened formula.
TOL = dict(rtol=2e-5, atol=2e-5)
DTYPES = [torch.float32, torch.bfloat16]


def _reference(q: torch.Tensor, k: torch.Tensor, s: float, offset: int, masks: tuple[int, ...]):  # type: ignore[no-untyped-def]
    logits = s * q.float() @ k.float().T
    rows = torch.arange(q.shape[0])
    for t in masks:
        cols = rows + offset + t
        ok = cols < k.shape[0]
        logits[rows[ok], cols[ok]] = float("-inf")
    return logits


def _lse_pair(s: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = s.amax(dim)
    return m, torch.exp(s - m.unsqueeze(dim)).sum(dim)


def _inputs(b: int, c: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 1000 + c)
    q = torch.randn(b, d, generator=g).to(dtype)
    k = torch.randn(c, d, generator=g).to(dtype)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "c", "d"), [(37, 53, 20), (5, 70, 33), (32, 32, 16)])
def test_statistics_match_the_formula(b: int, c: int, d: int, dtype: torch.dtype) -> None:
    q, k = _inputs(b, c, d, dtype)
    s, offset, masks = torch.tensor(1.7), 3, (0, 17)
    ref = _reference(q, k, 1.7, offset, masks)
    m, lsum = fused.row_stats(q, k, s, offset, masks)
    rm, rl = _lse_pair(ref, 1)
    torch.testing.assert_close(m, rm, **TOL)
    torch.testing.assert_close(lsum, rl, **TOL)
    n_cols = c - 4
    mc, lc = fused.col_stats(q, k, s, offset, masks, n_cols)
    cm, cl = _lse_pair(ref[:, :n_cols], 0)
    torch.testing.assert_close(mc, cm, **TOL)
    torch.testing.assert_close(lc, cl, **TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_the_formula(dtype: torch.dtype) -> None:
    b, c, d, n_cols = 37, 53, 20, 40
    q, k = _inputs(b, c, d, dtype)
    s, offset, masks = 1.3, 2, (0,)
    ref = _reference(q, k, s, offset, masks)
    rm, _ = _lse_pair(ref, 1)
    cm, _ = _lse_pair(ref[:, :n_cols], 0)
    g = torch.Generator().manual_seed(7)
    cf, cfc = torch.randn(b, generator=g), torch.randn(n_cols, generator=g)
    uq, uk = fused.grads(q, k, torch.tensor(s), offset, masks, (rm, cf), (cm, cfc))
    grad = torch.exp(ref - rm[:, None]) * cf[:, None]
    grad[:, :n_cols] += torch.exp(ref[:, :n_cols] - cm[None]) * cfc[None]
    grad = torch.where(torch.isinf(ref), torch.zeros_like(grad), grad)
    torch.testing.assert_close(uq, grad @ k.float(), **TOL)
    torch.testing.assert_close(uk, grad.T @ q.float(), **TOL)


def test_a_kernel_that_ignores_the_masks_is_rejected() -> None:
    """Mutation: the positives left in (no masks) must fail the same comparison."""
    q, k = _inputs(37, 53, 20, torch.float32)
    ref = _reference(q, k, 1.7, 3, (0,))
    rm, rl = _lse_pair(ref, 1)
    m, lsum = fused.row_stats(q, k, torch.tensor(1.7), 3, ())
    assert not (torch.allclose(m, rm, **TOL) and torch.allclose(lsum, rl, **TOL))


def _loss_and_grads(fn, *xs: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    s = torch.tensor(4.0, requires_grad=True)
    value = fn(*leaves, s, **kw)
    value.backward()
    return [value.detach(), *(x.grad for x in leaves), s.grad]


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_losses_fused_equal_pytorch_tiles(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(3)
    q, d = (
        torch.nn.functional.normalize(torch.randn(21, 12, generator=g), dim=-1).to(dtype)
        for _ in range(2)
    )
    h = torch.nn.functional.normalize(torch.randn(21, 2, 12, generator=g), dim=-1).to(dtype)
    all_dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    calls = [
        (clip_loss, (q, d), {"strategy": "gather"}),
        (clip_loss, (q, d), {"strategy": "ring"}),
        (lambda a, b, c, s, **kw: info_nce_loss(a, b, s, negatives_BKD=c, **kw), (q, d, h),
         {"directions": all_dirs, "strategy": "gather"}),
        (lambda a, b, c, s, **kw: info_nce_loss(a, b, s, negatives_BKD=c, **kw), (q, d, h),
         {"directions": all_dirs, "strategy": "ring"}),
    ]  # fmt: skip
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)  # bf16 gradients rounded
    for fn, xs, kw in calls:
        monkeypatch.setenv("WHOLEBATCH_TILES", "torch")
        want = _loss_and_grads(fn, *xs, tile_size=8, **kw)
        monkeypatch.setenv("WHOLEBATCH_TILES", "triton")
        got = _loss_and_grads(fn, *xs, tile_size=8, **kw)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def test_choice_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 3)
    monkeypatch.delenv("WHOLEBATCH_TILES", raising=False)
    assert not fused.use_fused(x)  # CPU: the PyTorch tiles unless asked
    monkeypatch.setenv("WHOLEBATCH_TILES", "triton")
    assert fused.use_fused(x) and not fused.use_fused(x.double())  # float64: never fused
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")
    assert not fused.use_fused(x)
    monkeypatch.setenv("WHOLEBATCH_TILES", "cuda")
    with pytest.raises(WholebatchError, match="WHOLEBATCH_TILES='cuda'"):
        fused.use_fused(x)
    monkeypatch.setenv("WHOLEBATCH_TILES", "triton")
    monkeypatch.setattr(fused, "available", lambda: False)
    with pytest.raises(WholebatchError, match="triton is not installed"):
        fused.use_fused(x)


def test_a_kernel_that_fails_falls_back_to_the_pytorch_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chosen automatically (not forced), a kernel that does not build warns and the PyTorch tiles run."""
    g = torch.Generator().manual_seed(5)
    q, d = (torch.randn(9, 6, generator=g) for _ in range(2))
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")
    want = clip_loss(q, d, 3.0)
    monkeypatch.delenv("WHOLEBATCH_TILES")

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("out of resources")

    monkeypatch.setattr(fused, "_FAILED", [])
    monkeypatch.setattr(fused, "row_stats", broken)
    monkeypatch.setattr(fused, "use_fused", lambda x: fused.forced() or not fused._FAILED)
    with pytest.warns(RuntimeWarning, match="fused Triton tiles failed"):
        got = clip_loss(q, d, 3.0)
    torch.testing.assert_close(got, want, **TOL)
    monkeypatch.setenv("WHOLEBATCH_TILES", "triton")  # forced: the failure is raised
    with pytest.raises(RuntimeError, match="out of resources"):
        clip_loss(q, d, 3.0)
