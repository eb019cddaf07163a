"""SigLIP's ring with the fused Triton tiles (``WHOLEBATCH_TILES=triton``, TRITON_INTERPRET=1 on CPU).

W = 3 gloo ranks with rows [5, 0, 8] (uneven, one empty rank), inputs different
on every rank, float32 and bfloat16: on every rank the fused ring's loss and
gradients (both towers, scale, bias) equal the PyTorch tiles' ring, and both
equal one process computing the ±1-label formula in float64 on the
concatenated batch (input gradients times W: DDP's mean then gives dL; the
scalars' gradients averaged over ranks). The remote blocks have no masked
diagonal and the own block has one, so a kernel call that masked the wrong
block would miss the formula. Skipped without triton.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank
from wholebatch.losses import siglip_loss

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

SIZES = [5, 0, 8]
D, SCALE, BIAS, TILE = 12, 6.0, -2.0, 4
# float32 sums of ~200 terms of size <= ~10: ~1e-5 relative round-off
F32 = dict(rtol=3e-5, atol=3e-5)
# bf16: the loss and the scalars' gradients are float32; input gradients rounded to bf16
BF16 = dict(rtol=1e-2, atol=2e-3)


def _inputs() -> list[tuple[Tensor, Tensor]]:
    out = []
    for r, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(50 + r)
        x = F.normalize(torch.randn(n, D, generator=g), dim=-1)
        y = F.normalize(x + 0.6 * torch.randn(n, D, generator=g), dim=-1)
        out.append((x, y))
    return out


def _rank_run(inputs: list[tuple[Tensor, Tensor]]) -> dict[str, list[Tensor]]:
    """Every (dtype, tiles) combination on this rank: [loss, d image, d text, d scale, d bias]."""
    x0, y0 = inputs[get_rank()]
    before = os.environ.get("WHOLEBATCH_TILES")
    out: dict[str, list[Tensor]] = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for mode in ("torch", "triton"):
                os.environ["WHOLEBATCH_TILES"] = mode
                x = x0.to(dtype, copy=True).requires_grad_()
                y = y0.to(dtype, copy=True).requires_grad_()
                s = torch.tensor(SCALE, requires_grad=True)
                b = torch.tensor(BIAS, requires_grad=True)
                loss = siglip_loss(x, y, s, b, tile_size=TILE)
                loss.backward()
                out[f"{dtype} {mode}"] = [loss.detach(), x.grad, y.grad, s.grad, b.grad]  # type: ignore[list-item]
    finally:
        if before is None:
            os.environ.pop("WHOLEBATCH_TILES", None)
        else:
            os.environ["WHOLEBATCH_TILES"] = before
    return out


def _reference(inputs: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> list[Tensor]:
    """One process, the whole batch, float64 from the (rounded) inputs."""
    x = torch.cat([a for a, _ in inputs]).to(dtype).double().requires_grad_()
    y = torch.cat([b for _, b in inputs]).to(dtype).double().requires_grad_()
    s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    n = x.shape[0]
    y_NN = 2 * torch.eye(n, dtype=torch.float64) - 1
    loss = -F.logsigmoid(y_NN * (s * x @ y.T + b)).sum() / n
    loss.backward()
    return [loss.detach(), x.grad, y.grad, s.grad, b.grad]  # type: ignore[list-item]


def test_fused_ring_equals_pytorch_ring_and_one_process() -> None:
    inputs = _inputs()
    got = run_ranks(len(SIZES), _rank_run, inputs, timeout=120)
    w = len(SIZES)
    for dtype, tol in ((torch.float32, F32), (torch.bfloat16, BF16)):
        ref = _reference(inputs, dtype)
        gx, gy = ref[1].split(SIZES), ref[2].split(SIZES)
        for r, per_rank in enumerate(got):
            fused_r, torch_r = per_rank[f"{dtype} triton"], per_rank[f"{dtype} torch"]
            for i, (a, b) in enumerate(zip(fused_r, torch_r, strict=True)):
                torch.testing.assert_close(
                    a.float(), b.float(), **tol, msg=lambda m, r=r, i=i: f"rank {r} [{i}]: {m}"
                )
            torch.testing.assert_close(fused_r[0].double(), ref[0], **tol)
            torch.testing.assert_close(fused_r[1].double(), w * gx[r], **tol)
            torch.testing.assert_close(fused_r[2].double(), w * gy[r], **tol)
        for i in (3, 4):  # DDP's mean of the scalars' gradients
            mean = sum(p[f"{dtype} triton"][i].double() for p in got) / w
            torch.testing.assert_close(mean, ref[i], **tol)
