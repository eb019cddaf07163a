"""Arguments that must agree across ranks, the metadata exchange, host syncs, and the tile size.

Issue 14: every argument that must agree across ranks (sizes, scale,
temperature, bias, reduction, tile size) is either agreed or the same error on
every rank; no `.item()` (a device-to-host sync on CUDA) in the loss path; the
metadata exchange skipped when the caller passes the per-rank sizes with the
checks off. Issue 10: the tile size comes from the device and a memory budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import wholebatch.losses.call as call_path
import wholebatch.losses.tiles as tiles
from tests.distributed.test_losses import F64, REFS, SCALARS, _inputs
from tests.support.harness import run_ranks, run_ranks_outcomes
from wholebatch import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss
from wholebatch.comm.groups import get_rank
from wholebatch.errors import WholebatchError
from wholebatch.losses import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss, tile_size_for
from wholebatch.losses.tiles import ACCEL_TILE_BUDGET, CPU_TILE, TILE_BUFFERS

FUNCS: dict[str, Callable[..., Tensor]] = {
    "clip": clip_loss,
    "siglip": siglip_loss,
    "nt_xent": nt_xent_loss,
    "info_nce": info_nce_loss,
}


class _CountItems(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value by the host (`.item()`, `float(t)`, `bool(t)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _all_losses(x: Tensor, y: Tensor, **kw: Any) -> list[Tensor]:
    sc = [torch.tensor(v, dtype=x.dtype, device=x.device, requires_grad=True) for v in (2.0, -1.0)]
    h = torch.randn(x.shape[0], 2, x.shape[1], dtype=x.dtype, device=x.device)
    return [
        clip_loss(x, y, sc[0], logit_bias=sc[1], **kw),
        siglip_loss(x, y, sc[0], sc[1], **kw),
        nt_xent_loss(x, y, sc[0], **kw),
        info_nce_loss(
            x, y, sc[0], negatives_BKD=h, directions=("query_to_doc", "doc_to_query"), **kw
        ),
        info_nce_loss(
            x,
            y,
            3.0,
            directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            **kw,
        ),
    ]


def _all_modules(x: Tensor, y: Tensor) -> list[Tensor]:
    dev = {"device": x.device, "dtype": x.dtype}
    return [
        ClipLoss(normalize=True, logit_scale=10.0, learn_scale=True).to(**dev)(x, y),
        SigLipLoss(normalize=True, logit_scale=10.0, logit_bias=-10.0, learn_bias=True).to(**dev)(
            x, y
        ),
        NTXentLoss(normalize=True, temperature=0.1, learn_temperature=True).to(**dev)(x, y),
        InfoNCELoss(normalize=True, learn_scale=True).to(**dev)(x, y),
    ]


def _no_host_reads(device: str, sizes: list[int] | None) -> int:
    r = get_rank()
    gen = torch.Generator().manual_seed(r)
    b = sizes[r] if sizes else 5
    x = torch.randn(b, 8, generator=gen).to(device).requires_grad_()
    y = torch.randn(b, 8, generator=gen).to(device).requires_grad_()
    kw: dict[str, Any] = dict(tile_size=2)
    if sizes:
        kw.update(sizes=sizes, check=False)
    with _CountItems() as mode:
        losses = _all_losses(x, y, **kw) + ([] if sizes else _all_modules(x, y))
        torch.stack(losses).sum().backward()
    return mode.count


def test_scalars_stay_tensors_one_process() -> None:
    # The old `_prepare` read every scalar with `.item()` (a device sync on CUDA).
    assert _no_host_reads("cpu", None) == 0


def test_scalars_stay_tensors_with_sizes_given() -> None:
    # Two ranks, sizes given, checks off: no exchange, and nothing read by the host.
    assert run_ranks(2, _no_host_reads, "cpu", [3, 4]) == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_losses_never_sync_cuda() -> None:
    # Every loss and module, forward and backward, on one GPU: any device-to-host
    # sync (an `.item()`, a D2H copy, a nonzero) raises under sync debug mode.
    x = torch.randn(300, 64, device="cuda", requires_grad=True)
    y = torch.randn(300, 64, device="cuda", requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        xd, yd = x.to(dtype), y.to(dtype)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses = _all_losses(xd, yd, tile_size=128) + _all_modules(xd, yd)
            torch.stack([v.float() for v in losses]).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert x.grad is not None and torch.isfinite(x.grad).all()
        x.grad = y.grad = None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_cuda() -> None:
    # The CUDA path (16-bit products with float32 results) against the CPU one.
    gen = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(700, 64, generator=gen), dim=1)
    y = torch.nn.functional.normalize(torch.randn(700, 64, generator=gen), dim=1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        want = [
            v.double() for v in _all_losses(x.to(dtype).float(), y.to(dtype).float(), tile_size=256)
        ]
        got = [
            v.double().cpu()
            for v in _all_losses(x.to("cuda", dtype), y.to("cuda", dtype), tile_size=256)
        ]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def _values_and_grads(x: Tensor, y: Tensor) -> list[Tensor]:
    xs, ys = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    torch.manual_seed(0)  # the same hard negatives for both paths
    losses = _all_losses(xs, ys, tile_size=64)
    torch.stack([v.float() for v in losses]).sum().backward()
    assert xs.grad is not None and ys.grad is not None
    return [*(v.detach().double() for v in losses), xs.grad.double(), ys.grad.double()]


def test_accelerator_path_forced_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU in CI: the accelerator path's logic (16-bit rows kept, the scale applied
    # per float32 tile, 16-bit gradient tiles, SigLIP's 16-bit ring blocks) runs here
    # with `mm(out_dtype=)` falling back to upcasting, against the CPU path.
    gen = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(300, 32, generator=gen), dim=1)
    y = torch.nn.functional.normalize(torch.randn(300, 32, generator=gen), dim=1)
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    want = _values_and_grads(x, y)
    monkeypatch.setattr(tiles, "ACCELERATED_ON_CPU", True)
    monkeypatch.setattr(tiles, "_MM_OUT_DTYPE", True)
    got = _values_and_grads(x, y)
    assert not tiles._MM_OUT_DTYPE  # the CPU has no mm(out_dtype=): it fell back
    assert any(not torch.equal(g, w) for g, w in zip(got, want, strict=True))  # another path ran
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


def _both_paths_on_a_rank(sizes: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    r = get_rank()
    gen = torch.Generator().manual_seed(r)
    x = torch.nn.functional.normalize(torch.randn(sizes[r], 32, generator=gen), dim=1)
    y = torch.nn.functional.normalize(torch.randn(sizes[r], 32, generator=gen), dim=1)
    x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    want = _values_and_grads(x, y)
    saved = tiles.ACCELERATED_ON_CPU, tiles._MM_OUT_DTYPE
    tiles.ACCELERATED_ON_CPU = True
    try:  # (the worker process is reused by later tests: always restored)
        got = _values_and_grads(x, y)
    finally:
        tiles.ACCELERATED_ON_CPU, tiles._MM_OUT_DTYPE = saved
    return got, want


def test_accelerator_path_forced_on_cpu_across_ranks() -> None:
    # The same on 3 uneven ranks with an empty one: SigLIP's ring sends 16-bit
    # blocks beside float32 gradients, CLIP's column statistics cross ranks.
    for r, (got, want) in enumerate(run_ranks(3, _both_paths_on_a_rank, [70, 0, 45])):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(
                g, w, rtol=2e-2, atol=2e-3, msg=lambda m, r=r: f"rank {r}: {m}"
            )


# ---------------------------------------------------------------------------
# sizes= and check=: the exchange skipped, the answer unchanged
# ---------------------------------------------------------------------------


def _no_exchange(*_: Any, **__: Any) -> Any:
    raise AssertionError("the metadata exchange ran")


def _rank_sizes(name: str, sizes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    saved = call_path.agree_rows
    call_path.agree_rows = _no_exchange  # type: ignore[assignment]  # this worker, this call only
    xs, ys = _inputs(sizes)
    r = get_rank()
    x, y = xs[r].clone().requires_grad_(), ys[r].clone().requires_grad_()
    s = torch.tensor(SCALARS[name][0], dtype=torch.float64, requires_grad=True)
    extra = SCALARS[name][1:]
    try:
        loss = FUNCS[name](x, y, s, *extra, sizes=sizes, check=False, tile_size=2)
        loss.backward()
    finally:
        call_path.agree_rows = saved  # type: ignore[assignment]
    assert x.grad is not None and y.grad is not None and s.grad is not None
    return loss.detach(), x.grad, y.grad, s.grad


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_sizes_given_skip_the_exchange(name: str) -> None:
    sizes = [2, 0, 3]
    got = run_ranks(3, _rank_sizes, name, sizes)
    xs, ys = _inputs(sizes)
    x, y = torch.cat(xs).requires_grad_(), torch.cat(ys).requires_grad_()
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in SCALARS[name]]
    ref = REFS[name](x, y, *sc)
    gx, gy, gs = torch.autograd.grad(ref, [x, y, sc[0]])
    for r, (value, grad_x, grad_y, grad_s) in enumerate(got):
        torch.testing.assert_close(value, ref.detach(), **F64)
        torch.testing.assert_close(grad_x, 3 * gx.split(sizes)[r], **F64)
        torch.testing.assert_close(grad_y, 3 * gy.split(sizes)[r], **F64)
        torch.testing.assert_close(grad_s, gs, **F64)  # every rank's copy: dL/ds itself


def _rank_disagree(case: str, check: bool) -> Tensor:
    r = get_rank()
    xs, ys = _inputs([2, 3])
    x, y = xs[r], ys[r]
    kw: dict[str, Any] = dict(sizes=[2, 3], check=check)
    if case == "scale":  # a number that differs
        return clip_loss(x, y, 2.0 + r, **kw)
    if case == "tensor_scale":  # a replicated parameter that diverged
        return clip_loss(x, y, torch.tensor(2.0 + r, dtype=torch.float64), **kw)
    if case == "reduction":
        return siglip_loss(x, y, 2.0, -1.0, grad_reduction="sum" if r else "mean", **kw)
    if case == "temperature":
        return nt_xent_loss(x, y, 0.5 if r else 0.6, **kw)
    assert case == "sizes"
    return clip_loss(x, y, 2.0, sizes=[2, 3] if r else [2, 4], check=check)


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("scale", "logit_scale differs across ranks {0: 2.0, 1: 3.0}"),
        ("tensor_scale", "logit_scale differs across ranks {0: 2.0, 1: 3.0}"),
        ("reduction", "grad_reduction differs across ranks {0: mean, 1: sum}"),
        ("temperature", "temperature differs across ranks {0: 0.6, 1: 0.5}"),
        (
            "sizes",
            "the sizes= passed on ranks [0] differ from the rows the ranks pass {0: 2, 1: 3}",
        ),
    ],
)
def test_disagreement_is_the_same_error_on_every_rank(case: str, text: str) -> None:
    outcomes = run_ranks_outcomes(2, _rank_disagree, case, True)
    msgs = {o.message for o in outcomes}
    assert len(msgs) == 1, msgs
    assert text in msgs.pop()


@pytest.mark.parametrize("case", ["scale", "tensor_scale", "temperature"])
def test_with_checks_off_scalars_are_agreed(case: str) -> None:
    # No exchange, so no error: but never a different loss per rank. Both ranks
    # compute with the agreed (largest) value.
    values = run_ranks(2, _rank_disagree, case, False)
    assert values[0].item() == values[1].item()
    xs, ys = _inputs([2, 3])
    x, y = torch.cat(xs), torch.cat(ys)
    want = (
        REFS["nt_xent"](x, y, torch.tensor(0.6, dtype=torch.float64))
        if case == "temperature"
        else REFS["clip"](x, y, 3.0)
    )
    torch.testing.assert_close(values[0], want, **F64)


# ---------------------------------------------------------------------------
# The tile size from the device and a memory budget
# ---------------------------------------------------------------------------


def test_tile_size_for_cpu_is_unchanged() -> None:
    assert tile_size_for("cpu", 100_000, 100_000) == CPU_TILE == 512
    assert tile_size_for("cpu", 10, 10) == 512  # partial tiles cost nothing extra on CPU
    # a budget smaller than 512² x the buffers shrinks the tile
    assert tile_size_for("cpu", 4096, 4096, budget_bytes=4 * TILE_BUFFERS * 100**2) == 100


@pytest.mark.parametrize("n", [1_000, 65_536, 262_144, 1_000_000])
def test_tile_size_for_accelerators(n: int) -> None:
    t = tile_size_for("cuda", n, n)
    assert t % 256 == 0 and t >= 256
    assert TILE_BUFFERS * 4 * t * t <= ACCEL_TILE_BUDGET  # the buffers fit the budget
    assert t <= -(-n // 256) * 256  # never larger than the sweep
    tiles = -((-n // t) ** 2)
    if n <= 262_144:
        assert tiles <= 1024, tiles  # at N = 65,536: 64 tiles; at 262,144: 841
    if n >= 65_536:
        assert t == 9216  # the budget decides, not the sweep


def test_tile_size_for_budget() -> None:
    assert tile_size_for("cuda", 10**6, 10**6, budget_bytes=2**32) == 18_688
    assert tile_size_for("cuda", 10**6, 10**6, budget_bytes=1) == 256  # never below one quantum
    assert tile_size_for("xpu", 300, 70_000) == 9216  # the longer side decides the cap


class _ThreadsAtMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Records torch's intra-op thread count at every matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.mm.default:
            self.seen.add(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("env", "expected"), [(None, 1), ("1", 1), ("2", 2), ("0", 2)])
def test_tile_threads_default_and_knob(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: int
) -> None:
    # The CPU tile loops (forward and backward) run on one intra-op thread by default,
    # WHOLEBATCH_TILE_THREADS=N on N, =0 on torch's own setting; torch's setting is
    # restored after, and the answer is the same.
    xs, ys = _inputs([9])
    x, y = xs[0].requires_grad_(), ys[0].requires_grad_()
    monkeypatch.setenv("WHOLEBATCH_TILE_THREADS", "0")
    want = clip_loss(x, y, 2.0, tile_size=4)
    (gx,) = torch.autograd.grad(want, [x])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if env is None:
            monkeypatch.delenv("WHOLEBATCH_TILE_THREADS")
        else:
            monkeypatch.setenv("WHOLEBATCH_TILE_THREADS", env)
        with _ThreadsAtMM() as mode:
            got = clip_loss(x, y, 2.0, tile_size=4)
            (g,) = torch.autograd.grad(got, [x])
        assert mode.seen == {expected}, mode.seen
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, **F64)
    torch.testing.assert_close(g, gx, **F64)


def test_tile_threads_bad_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    xs, ys = _inputs([5])
    monkeypatch.setenv("WHOLEBATCH_TILE_THREADS", "many")
    with pytest.raises(WholebatchError, match="WHOLEBATCH_TILE_THREADS='many'"):
        clip_loss(xs[0], ys[0], 2.0)


def test_sizes_fingerprint_tells_lists_apart() -> None:
    # The exchange carries one fingerprint of `sizes=` instead of W numbers.
    from wholebatch.losses.sizing import sizes_fingerprint

    seen = {sizes_fingerprint([a, b, c]) for a in range(12) for b in range(12) for c in range(12)}
    assert len(seen) == 12**3  # no collision among these 1,728 lists
    assert sizes_fingerprint([3, 0]) != sizes_fingerprint([0, 3])  # order matters
    assert sizes_fingerprint([0]) != sizes_fingerprint([0, 0])  # so does the length
    assert all(float(int(f)) == f and f < 2**52 for f in seen)  # exact in float64
