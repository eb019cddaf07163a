"""NT-Xent's fused tiles (`tiles.SymmetricLSE` with ``WHOLEBATCH_TILES=triton``) on one process.

Under TRITON_INTERPRET=1 on CPU (skipped without triton): the fused loss and
gradients (both views and the temperature) against the PyTorch tiles and the
float64 formula, float32 and bf16, at 2N not a multiple of the kernels' 32-row
blocks. One process is one panel, its whole square by rows (the lower
triangle, where the positives are i − N, included); a mask list without the
positives below the diagonal is rejected (the mutation). W > 1 (off-diagonal
panel pairs and their column statistics) is
`tests/distributed/test_loss_fused_ring.py`'s.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.features import skip_module_unless
from wholebatch.losses import nt_xent_loss, symmetric

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
skip_module_unless("triton_kernels")  # an interpreter that cannot run them: why

# float32 log-sum-exps of <= 80 terms and gradient sums of as many: ~1e-6 relative
TOL = dict(rtol=2e-5, atol=2e-5)
TAU = 0.3


def _views(n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(n)
    x = F.normalize(torch.randn(n, 12, generator=g), dim=-1)
    y = F.normalize(x + 0.5 * torch.randn(n, 12, generator=g), dim=-1)
    return x.to(dtype), y.to(dtype)


def _run(mode: str, x: Tensor, y: Tensor) -> list[Tensor]:
    os.environ["WHOLEBATCH_TILES"] = mode
    a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
    tau = torch.tensor(TAU, requires_grad=True)
    value = nt_xent_loss(a, b, tau, tile_size=8)
    value.backward()
    return [value.detach(), a.grad, b.grad, tau.grad]  # type: ignore[list-item]


def _reference(x: Tensor, y: Tensor) -> list[Tensor]:
    a, b = x.double().requires_grad_(), y.double().requires_grad_()
    tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
    n = x.shape[0]
    z = torch.cat([a, b])
    logits = (z @ z.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    value = F.cross_entropy(logits, torch.cat([torch.arange(n) + n, torch.arange(n)]))
    value.backward()
    return [value.detach(), a.grad, b.grad, tau.grad]  # type: ignore[list-item]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [21, 40])
def test_nt_xent_fused_equals_pytorch_tiles_and_formula(
    n: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WHOLEBATCH_TILES", "torch")  # restored after the test
    x, y = _views(n, dtype)
    want, got, ref = _run("torch", x, y), _run("triton", x, y), _reference(x, y)
    # bf16: input gradients rounded to bf16 on both sides (2**-8 relative)
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for a, b, r in zip(got, want, ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)
        torch.testing.assert_close(a.double(), r, **tol)


def test_positives_below_the_diagonal_must_be_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: the masks without i − N (the second views' positives) miss the formula."""
    monkeypatch.setenv("WHOLEBATCH_TILES", "triton")
    x, y = _views(21, torch.float32)
    ref = _reference(x, y)
    torch.testing.assert_close(_run("triton", x, y)[0].double(), ref[0], **TOL)
    monkeypatch.setattr(symmetric, "_sym_masks", lambda m: (0, m // 2))
    assert not torch.allclose(_run("triton", x, y)[0].double(), ref[0], **TOL)
