"""Inf-CL (`inf-cl` 1.2.1, Cheng et al., arXiv:2410.17243) against `clip_loss`: the same CLIP loss.

Inf-CL's `cal_inf_loss(q, k, scale=s)` is one direction of CLIP (each q against
every k); CLIP is the mean of both directions. On CUDA the two must agree in
value and in every gradient (float32, tolerance of float32 sums over N = 256).

It cannot run on the CPU, not even under ``TRITON_INTERPRET=1``: its Triton
kernels' launcher asserts CUDA tensors (`_flash_prob_forward`: ``assert
q.is_cuda and k.is_cuda``). That is checked here too, so the claim cannot go
stale: if a later Inf-CL runs on the CPU, the test says so and must be turned
into the comparison. `benchmarks/gpu_bench.py` times the two side by side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wholebatch.losses import clip_loss

inf_cl = pytest.importorskip("inf_cl", reason="the peers extra pins inf-cl==1.2.1")


def _inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(256, 256, generator=g), dim=-1).to(device).requires_grad_()
    k = F.normalize(torch.randn(256, 256, generator=g), dim=-1).to(device).requires_grad_()
    return q, k, torch.tensor(12.0, device=device, requires_grad=True)


def _inf_cl(q: torch.Tensor, k: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (inf_cl.cal_inf_loss(q, k, scale=s) + inf_cl.cal_inf_loss(k, q, scale=s)) / 2  # type: ignore[no-any-return]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU claim; on CUDA: the comparison")
def test_inf_cl_cannot_run_on_the_cpu_even_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, s = _inputs("cpu")
    with pytest.raises(AssertionError):  # `assert q.is_cuda and k.is_cuda` in its launcher
        _inf_cl(q, k, s)
    clip_loss(q, k, s).backward()  # ours runs on the same inputs
    assert q.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Inf-CL's kernels)")
def test_inf_cl_and_clip_loss_agree_on_cuda() -> None:
    q, k, s = _inputs("cuda")
    theirs = _inf_cl(q, k, s)
    gq, gk, gs = torch.autograd.grad(theirs, [q, k, s])
    ours = clip_loss(q, k, s)
    oq, ok, os_ = torch.autograd.grad(ours, [q, k, s])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    for a, b in ((oq, gq), (ok, gk), (os_, gs)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
