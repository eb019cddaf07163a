"""The fused Triton tiles across ranks (``WHOLEBATCH_TILES=triton``, TRITON_INTERPRET=1 on CPU).

W = 3 gloo ranks with rows [5, 0, 8] (uneven, one empty rank), inputs different
on every rank, float32 and bfloat16, for SigLIP's ring and NT-Xent's dealt
panel pairs (on W > 1 the off-diagonal pairs, whose column statistics serve
the mirrored rows): on every rank the fused loss and gradients (both inputs
and the scalars) equal the PyTorch tiles', and both equal one process
computing the formula in float64 on the concatenated batch (input gradients
times W: DDP's mean then gives dL; the scalars' gradients averaged over
ranks). SigLIP's remote blocks have no masked diagonal and its own block has
one: a kernel call that masked every block fails here (checked by hand:
rank 0's image gradient misses). Skipped without triton.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.features import skip_module_unless
from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank
from wholebatch.losses import nt_xent_loss, siglip_loss

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the fused kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
skip_module_unless("triton_kernels")  # an interpreter that cannot run them: why

SIZES = [5, 0, 8]
D, SCALE, BIAS, TAU, TILE = 12, 6.0, -2.0, 0.3, 4
LOSSES = ("siglip", "nt_xent")
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


def _one(loss: str, x: Tensor, y: Tensor) -> list[Tensor]:
    """[loss, d x, d y, d scalars...] of one call."""
    scalars = [SCALE, BIAS] if loss == "siglip" else [TAU]
    sc = [torch.tensor(v, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       requires_grad=True) for v in scalars]  # fmt: skip
    fn = siglip_loss if loss == "siglip" else nt_xent_loss
    value = fn(x, y, *sc, tile_size=TILE)  # type: ignore[operator]
    value.backward()
    return [value.detach(), x.grad, y.grad, *(s.grad for s in sc)]  # type: ignore[list-item]


def _rank_run(inputs: list[tuple[Tensor, Tensor]]) -> dict[str, list[Tensor]]:
    """Every (loss, dtype, tiles) combination on this rank."""
    x0, y0 = inputs[get_rank()]
    before = os.environ.get("WHOLEBATCH_TILES")
    out: dict[str, list[Tensor]] = {}
    try:
        for loss in LOSSES:
            for dtype in (torch.float32, torch.bfloat16):
                for mode in ("torch", "triton"):
                    os.environ["WHOLEBATCH_TILES"] = mode
                    x = x0.to(dtype, copy=True).requires_grad_()
                    y = y0.to(dtype, copy=True).requires_grad_()
                    out[f"{loss} {dtype} {mode}"] = _one(loss, x, y)
    finally:
        if before is None:
            os.environ.pop("WHOLEBATCH_TILES", None)
        else:
            os.environ["WHOLEBATCH_TILES"] = before
    return out


def _reference(inputs: list[tuple[Tensor, Tensor]], loss: str, dtype: torch.dtype) -> list[Tensor]:
    """One process, the whole batch, float64 from the (rounded) inputs, the plain formula."""
    x = torch.cat([a for a, _ in inputs]).to(dtype).double().requires_grad_()
    y = torch.cat([b for _, b in inputs]).to(dtype).double().requires_grad_()
    n = x.shape[0]
    if loss == "siglip":
        s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
        y_NN = 2 * torch.eye(n, dtype=torch.float64) - 1
        value = -F.logsigmoid(y_NN * (s * x @ y.T + b)).sum() / n
        scalars = [s, b]
    else:
        tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
        z = torch.cat([x, y])
        logits = (z @ z.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
        value = F.cross_entropy(logits, torch.cat([torch.arange(n) + n, torch.arange(n)]))
        scalars = [tau]
    value.backward()
    return [value.detach(), x.grad, y.grad, *(s.grad for s in scalars)]  # type: ignore[list-item]


def test_fused_equals_pytorch_tiles_and_one_process() -> None:
    inputs = _inputs()
    got = run_ranks(len(SIZES), _rank_run, inputs, timeout=120)
    w = len(SIZES)
    for loss in LOSSES:
        for dtype, tol in ((torch.float32, F32), (torch.bfloat16, BF16)):
            ref = _reference(inputs, loss, dtype)
            gx, gy = ref[1].split(SIZES), ref[2].split(SIZES)
            key = f"{loss} {dtype}"
            for r, per_rank in enumerate(got):
                fused_r, torch_r = per_rank[f"{key} triton"], per_rank[f"{key} torch"]
                for i, (a, b) in enumerate(zip(fused_r, torch_r, strict=True)):
                    torch.testing.assert_close(
                        a.float(), b.float(), **tol,
                        msg=lambda m, r=r, i=i, key=key: f"{key} rank {r} [{i}]: {m}",
                    )  # fmt: skip
                torch.testing.assert_close(fused_r[0].double(), ref[0], **tol)
                torch.testing.assert_close(fused_r[1].double(), w * gx[r], **tol)
                torch.testing.assert_close(fused_r[2].double(), w * gy[r], **tol)
            for i in range(3, len(ref)):  # DDP's mean of the scalars' gradients
                mean = sum(p[f"{key} triton"][i].double() for p in got) / w
                torch.testing.assert_close(mean, ref[i], **tol)
