"""SigLIP's fused Triton tiles (`fused.sigmoid_sum`, `fused.sigmoid_grads`) on CPU under TRITON_INTERPRET=1.

Skipped when triton is not installed (the optional `triton` extra). The
kernels' per-row softplus sums and their gradients (both towers, the scale's
and the bias's terms) are compared with the formula on float32 and bfloat16
inputs at shapes that are not multiples of the 32 x 32 blocks (masked edges),
with and without the masked positives (the diagonal of a rank's own block,
and a shifted one); then `siglip_loss` with ``WHOLEBATCH_TILES=triton``
against ``WHOLEBATCH_TILES=torch`` and against the ±1-label formula in
float64, saturated pairs included. Two mutations (a kernel that ignores the
edge masks, one that drops the bias) fail the same comparisons, and a kernel
that fails to build falls back to the PyTorch tiles. The ring form over W > 1
ranks is `tests/distributed/test_loss_fused_ring.py`'s. GPU speed is
`make gpu`'s: not measured here.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.features import skip_module_unless
from wholebatch.losses import fused, siglip_loss
from wholebatch.losses.sigmoid import _softplus_sum

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
skip_module_unless("triton_kernels")  # an interpreter that cannot run them: why

from wholebatch.losses import _triton_tiles  # noqa: E402  (after the skip: needs triton)

# float32 sums of <= 70 terms of size <= ~10 (softplus of logits s·q·k + b with
# |q·k| <= ~25): round-off ~1e-5 relative; bf16 inputs are widened exactly, so the
# same bound holds against the widened formula. The mutations miss it by > 0.1.
TOL = dict(rtol=2e-5, atol=2e-5)
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 53, 20), (5, 70, 33), (32, 32, 16), (9, 40, 100)]  # D = 100: two chunks of 64
S, BIAS = 0.6, -1.5


def _inputs(b: int, c: int, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(b * 1000 + c)
    return torch.randn(b, d, generator=g).to(dtype), torch.randn(c, d, generator=g).to(dtype)


def _logits(q: Tensor, k: Tensor, offset: int, masks: tuple[int, ...]) -> Tensor:
    """z = s·q·kᵀ + b in float32 from the (widened) inputs, masked entries at -inf."""
    z = S * q.float() @ k.float().T + BIAS
    rows = torch.arange(q.shape[0])
    for t in masks:
        cols = rows + offset + t
        ok = (cols >= 0) & (cols < k.shape[0])
        z[rows[ok], cols[ok]] = float("-inf")
    return z


def _kernel_args(q: Tensor, k: Tensor, offset: int, masks: tuple[int, ...]) -> tuple[object, ...]:
    return q, k, torch.tensor(S), torch.tensor(BIAS), offset, masks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "c", "d"), SHAPES)
@pytest.mark.parametrize(("offset", "masks"), [(0, (0,)), (3, (0, -20)), (0, ())])
def test_softplus_sums_match_the_formula(
    b: int, c: int, d: int, dtype: torch.dtype, offset: int, masks: tuple[int, ...]
) -> None:
    q, k = _inputs(b, c, d, dtype)
    want = -F.logsigmoid(-_logits(q, k, offset, masks)).sum(1)  # softplus, 0 where masked
    got = fused.sigmoid_sum(*_kernel_args(q, k, offset, masks))  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "c", "d"), SHAPES)
def test_gradients_match_the_formula(b: int, c: int, d: int, dtype: torch.dtype) -> None:
    q, k = _inputs(b, c, d, dtype)
    offset, masks = 2, (0,)
    p = torch.sigmoid(_logits(q, k, offset, masks))  # d softplus(z) / dz; 0 where masked
    uq, uk, p_B = fused.sigmoid_grads(*_kernel_args(q, k, offset, masks))  # type: ignore[arg-type]
    torch.testing.assert_close(uq, p @ k.float(), **TOL)
    torch.testing.assert_close(uk, p.T @ q.float(), **TOL)
    torch.testing.assert_close(p_B, p.sum(1), **TOL)


def test_empty_sides_give_zeros() -> None:
    q, k = _inputs(0, 7, 5, torch.float32)
    assert fused.sigmoid_sum(*_kernel_args(q, k, 0, (0,))).shape == (0,)  # type: ignore[arg-type]
    uq, uk, p_B = fused.sigmoid_grads(*_kernel_args(q, k, 0, (0,)))  # type: ignore[arg-type]
    assert uq.shape == (0, 5) and p_B.shape == (0,)
    assert uk.shape == (7, 5) and not uk.any()


# -- mutations: the same comparisons must reject a kernel that is known to be wrong --


@triton.jit
def _masked_no_edges(s, rows, cols, b, c, offset, mask_ptr, n_masks, col_limit):  # type: ignore[no-untyped-def]
    """`_triton_tiles._masked` without the edge masks (the padded rows and columns kept)."""
    bad = rows[:, None] < -1  # nothing
    for t in range(n_masks):
        shift = tl.load(mask_ptr + t)
        bad = bad | (cols[None, :] == rows[:, None] + offset + shift)
    return tl.where(bad, float("-inf"), s)


@triton.jit
def _sig_logits_no_bias(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, rows, cols, b, c, d, offset, scale_ptr, bias_ptr, mask_ptr, n_masks,
    BD: tl.constexpr,
):  # fmt: skip
    """`_triton_tiles._sig_logits` with the bias left out."""
    safe_rows = tl.where(rows < b, rows, -1)
    safe_cols = tl.where(cols < c, cols, -1)
    z = _triton_tiles._logits(q_ptr, k_ptr, safe_rows, safe_cols, d, scale_ptr, BD)
    return _triton_tiles._masked(z, rows, cols, b, c, offset, mask_ptr, n_masks, c)


@pytest.mark.parametrize("mutant", ["_masked", "_sig_logits"])
def test_a_mutated_kernel_is_rejected(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutations: edges not masked (37 x 53 leaves padded rows and columns at z = b), or no bias."""
    q, k = _inputs(37, 53, 20, torch.float32)
    args = _kernel_args(q, k, 0, (0,))
    z = _logits(q, k, 0, (0,))
    p = torch.sigmoid(z)
    want = [-F.logsigmoid(-z).sum(1), p @ k, p.T @ q, p.sum(1)]
    # the real kernels pass (the comparison is the one the mutants meet)
    real = [fused.sigmoid_sum(*args), *fused.sigmoid_grads(*args)]  # type: ignore[arg-type]
    assert all(torch.allclose(a, b, **TOL) for a, b in zip(real, want, strict=True))
    fake = _masked_no_edges if mutant == "_masked" else _sig_logits_no_bias
    monkeypatch.setattr(_triton_tiles, mutant, fake)
    got = [fused.sigmoid_sum(*args), *fused.sigmoid_grads(*args)]  # type: ignore[arg-type]
    # the forward sum and the bias's term (Σ σ) are both caught: padded entries count
    # softplus(b) and σ(b) (their q and k rows load as 0, so uq and uk hide the edges)
    assert not torch.allclose(got[0], want[0], **TOL)
    assert not torch.allclose(got[3], want[3], **TOL)


# -- the whole loss: fused against the PyTorch tiles and against the formula --


def _siglip(mode: str, x: Tensor, y: Tensor, s: float, b: float, tile: int) -> list[Tensor]:
    os.environ["WHOLEBATCH_TILES"] = mode
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    st = torch.tensor(s, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    value = siglip_loss(xs, ys, st, bt, tile_size=tile)
    value.backward()
    return [value.detach(), xs.grad, ys.grad, st.grad, bt.grad]  # type: ignore[list-item]


def _reference(x: Tensor, y: Tensor, s: float, b: float) -> list[Tensor]:
    """The ±1-label formula in float64 on the (widened) inputs: loss and every gradient."""
    xs = x.double().requires_grad_()
    ys = y.double().requires_grad_()
    st = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    n = x.shape[0]
    y_NN = 2 * torch.eye(n, dtype=torch.float64) - 1
    value = -F.logsigmoid(y_NN * (st * xs @ ys.T + bt)).sum() / n
    value.backward()
    return [value.detach(), xs.grad, ys.grad, st.grad, bt.grad]  # type: ignore[list-item]


def _pair(n: int, d: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    # texts near their images: positives with large logits, negatives spread
    y = F.normalize(x + 0.5 * torch.randn(n, d, generator=g), dim=-1)
    return x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "d", "tile"), [(37, 12, 8), (33, 40, 64)])
def test_siglip_fused_equals_pytorch_tiles_and_formula(
    n: int, d: int, tile: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")  # restored after the test
    x, y = _pair(n, d, dtype, seed=n)
    want = _siglip("torch", x, y, 10.0, -4.0, tile)
    got = _siglip("triton", x, y, 10.0, -4.0, tile)
    ref = _reference(x, y, 10.0, -4.0)
    # bf16: the loss and scalar gradients in float32 agree; the input gradients are
    # rounded to bf16 (2**-8 relative) on both sides
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for a, b, r in zip(got, want, ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
        torch.testing.assert_close(a.double(), r, **tol)


def test_saturated_pairs_keep_their_relative_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every negative far below 0 (softplus ≈ exp(z) ~ 1e-9): the fused loss and bias
    gradient keep float32 error relative to their size (no log(1 + tiny) rounding to 0)."""
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")
    x, y = _pair(21, 8, torch.float32, seed=5)
    got = _siglip("triton", x, y, 4.0, -24.0, 8)
    ref = _reference(x, y, 4.0, -24.0)
    # the positives' terms are computed apart; check the negatives' part on its own too
    z = 4.0 * x.double() @ y.double().T - 24.0
    negatives = -F.logsigmoid(-z).sum() + F.logsigmoid(-z.diagonal()).sum()
    os.environ["WHOLEBATCH_TILES"] = "triton"
    part = _softplus_sum(x, y, torch.tensor(4.0), torch.tensor(-24.0), 8, torch.float32, own=True)
    assert 0 < negatives.item() < 1e-6
    torch.testing.assert_close(part.double(), negatives, rtol=1e-5, atol=0)
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[4].double(), ref[4], rtol=1e-5, atol=0)


def test_a_sigmoid_kernel_that_fails_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chosen automatically (not forced): a failing kernel warns and the PyTorch tiles run;
    forced (``WHOLEBATCH_TILES=triton``), the failure is raised."""
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")  # restored after the test
    x, y = _pair(9, 6, torch.float32, seed=2)
    want = _siglip("torch", x, y, 3.0, -1.0, 4)

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("out of resources")

    monkeypatch.setattr(fused, "_FAILED", [])
    monkeypatch.setattr(fused, "sigmoid_sum", broken)
    monkeypatch.setattr(fused, "sigmoid_grads", broken)
    monkeypatch.setattr(fused, "use_fused", lambda x: fused.forced() or not fused._FAILED)
    with pytest.warns(RuntimeWarning, match="fused Triton tiles failed"):
        got = _siglip("", x, y, 3.0, -1.0, 4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(RuntimeError, match="out of resources"):
        _siglip("triton", x, y, 3.0, -1.0, 4)
