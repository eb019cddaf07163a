"""Whole-batch contrastive losses against plain single-process formulas, on real gloo ranks.

Each rank r holds different rows (seeded per rank, uneven counts, a rank with 0
rows at W = 3) and back-propagates the loss it gets. The reference builds the
whole batch (rows in rank order) in ONE process and differentiates the formula
from the issue directly (N x N logits, `F.cross_entropy`, `F.logsigmoid`).

Each check runs on both paths: the tiled forms ("tiled", the small path off)
and the small-batch path every rank computing the whole loss ("small",
losses/small.py, what these sizes take by default).

What must hold (DESIGN.md, gradient conventions):
- every rank's value equals the reference loss;
- grad_reduction="mean": each rank's embedding gradient is W x the reference's
  (so DDP's mean over ranks of the encoder gradients is the reference's), and the
  MEAN over ranks of a replicated scalar's gradient is the reference's;
- grad_reduction="sum": the embedding gradients are the reference's and the SUM
  over ranks of a scalar's gradient is the reference's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import wholebatch.comm.collectives as comm
from tests.support.harness import run_ranks, run_ranks_outcomes
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.errors import WholebatchError
from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.losses.sizing import using_small_rows

# float64, a few hundred terms of magnitude <= ~10 per value: round-off ~1e-13;
# 1e-10 leaves room and still rejects every mutation (they are off by factors >= 1.5).
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)

# Sizes per rank: uneven everywhere, and a rank with 0 rows at W = 3.
SIZES = {1: [5], 2: [4, 1], 3: [2, 0, 3]}
D = 3
TILE = 2  # several tiles per rank, a partial last one: the tiling is exercised
SCALARS = {"clip": [2.5], "siglip": [1.7, -0.8], "nt_xent": [0.6]}
# The small-batch row limit per path: the tiled forms (off) and the small path (the default).
PATHS: dict[str, int | None] = {"tiled": 0, "small": None}


# ---------------------------------------------------------------------------
# Plain references, written from the formulas
# ---------------------------------------------------------------------------


def ref_clip(i_ND: Tensor, t_ND: Tensor, s: Tensor) -> Tensor:
    logits_NN = s * i_ND @ t_ND.T
    labels = torch.arange(i_ND.shape[0])
    return (F.cross_entropy(logits_NN, labels) + F.cross_entropy(logits_NN.T, labels)) / 2


def ref_siglip(i_ND: Tensor, t_ND: Tensor, s: Tensor, b: Tensor) -> Tensor:
    n = i_ND.shape[0]
    y_NN = 2 * torch.eye(n, dtype=i_ND.dtype) - 1
    return -F.logsigmoid(y_NN * (s * i_ND @ t_ND.T + b)).sum() / n


def ref_nt_xent(z1_ND: Tensor, z2_ND: Tensor, tau: Tensor) -> Tensor:
    n = z1_ND.shape[0]
    z_2ND = torch.cat([z1_ND, z2_ND])
    logits = (z_2ND @ z_2ND.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(n) + n, torch.arange(n)])
    return F.cross_entropy(logits, positives)


REFS: dict[str, Callable[..., Tensor]] = {
    "clip": ref_clip,
    "siglip": ref_siglip,
    "nt_xent": ref_nt_xent,
}


def _clip_gather_without_grad(image_BD: Tensor, text_BD: Tensor, s: Tensor, **_: Any) -> Tensor:
    """MUTATION: open_clip's default gather (no gradient; the local slice put back)."""
    r = get_rank()
    with torch.no_grad():
        all_i, all_t = comm.all_gather(image_BD), comm.all_gather(text_BD)
    sizes = [int(x) for x in comm.all_gather(torch.tensor([image_BD.shape[0]])).tolist()]
    o, b = sum(sizes[:r]), sizes[r]
    all_i = torch.cat([all_i[:o], image_BD, all_i[o + b :]])
    all_t = torch.cat([all_t[:o], text_BD, all_t[o + b :]])
    return ref_clip(all_i, all_t, s)


def _clip_small_unscaled(image_BD: Tensor, text_BD: Tensor, s: Tensor, **kw: Any) -> Tensor:
    """MUTATION: the small path without the gradient convention's scaling (own rows get dL/dx)."""
    import dataclasses

    import wholebatch.losses.small as small

    real = small._gather

    def unscaled(*args: Any) -> Any:
        got = real(*args)
        return dataclasses.replace(got, row_factor=1.0)

    small._gather = unscaled  # the forward captures the factor; the backward runs later
    try:
        return clip_loss(image_BD, text_BD, s, **kw)
    finally:
        small._gather = real


LOSSES: dict[str, Callable[..., Tensor]] = {
    "clip": clip_loss,
    "siglip": siglip_loss,
    "nt_xent": nt_xent_loss,
    "clip_gather_without_grad": _clip_gather_without_grad,
    "clip_small_unscaled": _clip_small_unscaled,
}


# ---------------------------------------------------------------------------
# The per-rank step and the check
# ---------------------------------------------------------------------------


def _inputs(sizes: Sequence[int], seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """Rank r's rows: seeded per rank, so every rank's data differs."""
    a, b = [], []
    for r, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(1000 * seed + r)
        a.append(torch.randn(n, D, generator=gen, dtype=torch.float64) * 0.7)
        b.append(torch.randn(n, D, generator=gen, dtype=torch.float64) * 0.7)
    return a, b


def _rank_loss(
    name: str,
    xs: list[Tensor],
    ys: list[Tensor],
    scalars: list[float],
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    r = get_rank()
    x, y = xs[r].clone().requires_grad_(), ys[r].clone().requires_grad_()
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in scalars]
    kwargs = dict(kwargs)
    if "tile_per_rank" in kwargs:
        kwargs["tile_size"] = kwargs.pop("tile_per_rank")[r]
    with using_small_rows(kwargs.pop("small_rows", None)):
        loss = LOSSES[name](x, y, *sc, **kwargs)
        loss.backward()
    assert x.grad is not None and y.grad is not None
    return loss.detach(), x.grad, y.grad, [s.grad for s in sc]  # type: ignore[misc]


def check_loss(
    name: str,
    ref: str,
    sizes: Sequence[int],
    reduction: str = "mean",
    tile: int = TILE,
    assume: str | None = None,
    tile_per_rank: Sequence[int] | None = None,
    path: str = "small",
    known_sizes: bool = False,
    **extra: Any,
) -> None:
    """Run `name` on len(sizes) ranks; assert value and gradients match the reference `ref`.

    `assume` is the parameter-gradient reduction the assertions model (default:
    `reduction`); `tile_per_rank` gives each rank its own tile size; `path`
    is a `PATHS` key; `known_sizes` passes `sizes=` with `check=False`; `extra`
    goes to the loss as keyword arguments.
    """
    assume = assume or reduction
    w = len(sizes)
    xs, ys = _inputs(sizes)
    scalars = SCALARS[ref]
    kwargs: dict[str, Any] = dict(grad_reduction=reduction, tile_size=tile, **extra)
    kwargs["small_rows"] = PATHS[path]
    if known_sizes:
        kwargs.update(sizes=list(sizes), check=False)
    if tile_per_rank is not None:
        kwargs["tile_per_rank"] = list(tile_per_rank)
    got = run_ranks(w, _rank_loss, name, xs, ys, scalars, kwargs)

    x_all = torch.cat(xs).requires_grad_()
    y_all = torch.cat(ys).requires_grad_()
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in scalars]
    ref_loss = REFS[ref](x_all, y_all, *sc)
    grads = torch.autograd.grad(ref_loss, [x_all, y_all, *sc])
    gx, gy = grads[0].split(list(sizes)), grads[1].split(list(sizes))
    per_rank_factor = w if assume == "mean" else 1  # DDP's mean divides by W
    for r, (value, grad_x, grad_y, _) in enumerate(got):
        torch.testing.assert_close(
            value, ref_loss.detach(), **F64, msg=lambda m, r=r: f"rank {r} value: {m}"
        )
        torch.testing.assert_close(
            grad_x, per_rank_factor * gx[r], **F64, msg=lambda m, r=r: f"rank {r} grad 1: {m}"
        )
        torch.testing.assert_close(
            grad_y, per_rank_factor * gy[r], **F64, msg=lambda m, r=r: f"rank {r} grad 2: {m}"
        )
    for i, g_ref in enumerate(grads[2:]):
        reduced = sum(g[3][i] for g in got)
        if assume == "mean":
            reduced = reduced / w
        torch.testing.assert_close(
            reduced, g_ref, **F64, msg=lambda m, i=i: f"scalar {i} grad: {m}"
        )


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_loss_matches_single_process(name: str, world: int, path: str) -> None:
    check_loss(name, name, SIZES[world], path=path)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_known_sizes_without_checks(name: str, reduction: str, path: str) -> None:
    # sizes= with check=False: no exchange; the small path carries the agreement's
    # row (the scalars, the reduction) in its one all-gather.
    sizes = [2, 0, 3]
    check_loss(name, name, sizes, reduction=reduction, path=path, known_sizes=True)


def _rank_loss_in_subgroup(
    name: str, xs: list[Tensor], ys: list[Tensor], scalars: list[float]
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    import torch.distributed as dist

    r = get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    x, y = xs[r].clone().requires_grad_(), ys[r].clone().requires_grad_()
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in scalars]
    loss = LOSSES[name](x, y, *sc, group=groups[r % 2], tile_size=TILE)
    loss.backward()
    assert x.grad is not None and y.grad is not None
    return loss.detach(), x.grad, y.grad, [s.grad for s in sc]  # type: ignore[misc]


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_two_subgroups_at_once(name: str) -> None:
    # Groups {0, 2} and {1, 3} of a 4-rank world, each its own whole batch: group
    # ranks differ from global ranks (SigLIP's ring peers, the gathers' order).
    sizes = [3, 2, 0, 4]
    xs, ys = _inputs(sizes)
    got = run_ranks(4, _rank_loss_in_subgroup, name, xs, ys, SCALARS[name])
    for members in ([0, 2], [1, 3]):
        x_all = torch.cat([xs[m] for m in members]).requires_grad_()
        y_all = torch.cat([ys[m] for m in members]).requires_grad_()
        sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in SCALARS[name]]
        ref = REFS[name](x_all, y_all, *sc)
        grads = torch.autograd.grad(ref, [x_all, y_all, *sc])
        rows = [sizes[m] for m in members]
        gx, gy = grads[0].split(rows), grads[1].split(rows)
        for i, m in enumerate(members):
            value, grad_x, grad_y, _ = got[m]
            torch.testing.assert_close(value, ref.detach(), **F64)
            torch.testing.assert_close(grad_x, 2 * gx[i], **F64, msg=f"rank {m}")  # DDP: / 2
            torch.testing.assert_close(grad_y, 2 * gy[i], **F64, msg=f"rank {m}")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_grad_reduction_sum(name: str, path: str) -> None:
    check_loss(name, name, [1, 3, 2], reduction="sum", path=path)


@pytest.mark.parametrize("path", list(PATHS))
def test_mutation_wrong_reduction_is_caught_on_both_paths(path: str) -> None:
    with pytest.raises(AssertionError, match="grad"):
        check_loss("clip", "clip", [2, 0, 3], reduction="sum", assume="mean", path=path)


def test_mutation_gather_without_grad_is_caught() -> None:
    # The same assertions reject the classic gather (encoders get 1/W of the gradient).
    with pytest.raises(AssertionError, match="grad"):
        check_loss("clip_gather_without_grad", "clip", [2, 3])


def test_mutation_wrong_reduction_is_caught() -> None:
    # Declaring "sum" while DDP averages leaves every gradient W times too small.
    with pytest.raises(AssertionError, match="grad"):
        check_loss("siglip", "siglip", [2, 3], reduction="sum", assume="mean")


# ---------------------------------------------------------------------------
# Single process: tiles, dtypes, memory
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
@pytest.mark.parametrize("tile", [1, 3, 64])
def test_tiled_equals_untiled(name: str, tile: int) -> None:
    xs, ys = _inputs([7])
    x, y = xs[0].requires_grad_(), ys[0].requires_grad_()
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in SCALARS[name]]
    got = LOSSES[name](x, y, *sc, tile_size=tile)
    g_got = torch.autograd.grad(got, [x, y, *sc])
    ref = REFS[name](x, y, *sc)
    g_ref = torch.autograd.grad(ref, [x, y, *sc])
    torch.testing.assert_close(got, ref, **F64)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_noncontiguous_and_low_precision(name: str) -> None:
    xs, ys = _inputs([6])
    sc = SCALARS[name]
    ref = REFS[name](xs[0], ys[0], *[torch.tensor(v, dtype=torch.float64) for v in sc])
    # A transposed view (non-contiguous): the same answer to round-off.
    xt = xs[0].T.contiguous().T
    assert not xt.is_contiguous()
    torch.testing.assert_close(LOSSES[name](xt, ys[0], *sc), ref, **F64)
    # bfloat16 inputs are computed in float32: within bf16's rounding of the inputs (2**-8).
    got = LOSSES[name](xs[0].bfloat16(), ys[0].bfloat16(), *sc)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=3e-2, atol=3e-2)


def _saved_bytes(fn: Callable[[], Tensor]) -> int:
    """Bytes of every tensor autograd saves for backward while `fn` runs."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
def test_saved_memory_is_linear_in_n(name: str) -> None:
    # Only the inputs and per-row log-sum-exps are kept: nothing N x N (the naive
    # reference keeps several N x N tensors: at N=256, D=4 that is 2**16 vs 2**10).
    n, d = 256, 4
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    y = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in SCALARS[name]]
    ours = _saved_bytes(lambda: LOSSES[name](x, y, *sc, tile_size=32))
    naive = _saved_bytes(lambda: REFS[name](x, y, *sc))
    assert ours <= 8 * (8 * n * d + 8 * n + 16), ours  # a few (2)N x D and (2)N vectors, float64
    assert naive >= 8 * n * n  # the reference does hold N x N: the bound above can fail


def _siglip_saved(b: int) -> int:
    gen = torch.Generator().manual_seed(get_rank())
    x = torch.randn(b, D, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(b, D, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    with using_small_rows(0):  # the ring (the small path holds the whole batch: by design)
        return _saved_bytes(lambda: siglip_loss(x, y, s, 0.5))


def test_siglip_saved_memory_independent_of_world() -> None:
    # open_clip's neighbour exchange keeps every received block for backward; ours
    # keeps the local rows only, whatever W.
    # (Beyond one rank the agreed scalars save a few bytes: a tie mask and the
    # reduction factor, 11 bytes, whatever W; one received block would be 144.)
    one = run_ranks(1, _siglip_saved, 6)[0]
    two = run_ranks(2, _siglip_saved, 6)
    three = run_ranks(3, _siglip_saved, 6)
    assert len(set(two + three)) == 1, (two, three)
    assert 0 <= three[0] - one < 6 * D * 8, (one, three)


# ---------------------------------------------------------------------------
# Bad input: the same error on every rank
# ---------------------------------------------------------------------------


def _rank_bad(case: str) -> Tensor:
    r, w = get_rank(), get_world_size()
    x = torch.randn(3, 4, dtype=torch.float64)
    y = torch.randn(3, 4, dtype=torch.float64)
    s: Any = 2.0
    if case == "dim" and r == 1:
        x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    if case == "rows" and r == w - 1:
        y = torch.randn(2, 4, dtype=torch.float64)
    if case == "scale" and r == 0:
        s = 3.0
    return clip_loss(x, y, s)


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("dim", "embedding dim differs across ranks {0: 4, 1: 5"),
        ("rows", "text_BD has shape (2, 4) but image_BD has (3, 4)"),
        ("scale", "logit_scale differs across ranks {0: 3.0, 1: 2.0"),
    ],
)
def test_bad_input_same_error_on_every_rank(case: str, text: str) -> None:
    outcomes = run_ranks_outcomes(3, _rank_bad, case)
    msgs = {o.message for o in outcomes}
    assert len(msgs) == 1, msgs
    assert all(o.type_name in ("WholebatchError", "WholebatchTypeError") for o in outcomes)
    assert text in msgs.pop()


def test_bad_input_single_process() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(WholebatchError, match=r"siglip_loss: tile_size=0 must be a positive int"):
        siglip_loss(x, x, 1.0, 0.0, tile_size=0)
    with pytest.raises(WholebatchError, match=r"clip_loss: logit_scale must be a float scalar"):
        clip_loss(x, x, torch.ones(2))
    with pytest.raises(WholebatchError, match="0 rows"):
        nt_xent_loss(x[:0], x[:0], 0.1)
    with pytest.raises(WholebatchError, match="grad_reduction='avg'"):
        clip_loss(x, x, 1.0, grad_reduction="avg")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# NT-Xent: only the tiles on and above the diagonal, shared across ranks
# ---------------------------------------------------------------------------


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts matrix products and the logits entries they produce (rows x cols of each)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.entries = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
            self.count += 1
            self.entries += out.shape[0] * out.shape[1]
        return out


def _nt_xent_products(sizes: Sequence[int], tile: int) -> tuple[int, int, int]:
    """(forward products, backward products, forward logits entries) of this rank's `nt_xent_loss`."""
    xs, ys = _inputs(sizes)
    r = get_rank()
    x, y = xs[r].clone().requires_grad_(), ys[r].clone().requires_grad_()
    with using_small_rows(0), _CountMM() as fwd:  # the tiled form's deal
        loss = nt_xent_loss(x, y, 0.6, tile_size=tile)
    with _CountMM() as bwd:
        loss.backward()
    return fwd.count, bwd.count, fwd.entries


def test_nt_xent_computes_each_tile_pair_once() -> None:
    # Z·Zᵀ is symmetric: of the t x t tiles only the t(t+1)/2 on and above the
    # diagonal are computed (once in the forward, recomputed once in the backward,
    # with one product for a diagonal tile's gradient and two for the others'). A
    # kernel sweeping all t² tiles fails these counts.
    t = 7  # 2N = 14 rows at tile_size=2
    pairs = t * (t + 1) // 2
    ((f, b, _),) = run_ranks(1, _nt_xent_products, [7], 2)
    assert f == pairs, f
    assert b == pairs + pairs + (pairs - t), b


@pytest.mark.parametrize("sizes", [[13, 11], [9, 0, 15]])
def test_nt_xent_shares_the_upper_triangle(sizes: list[int]) -> None:
    # On W ranks the panel pairs on and above the diagonal are dealt out: together
    # the ranks compute each upper entry once (plus the lower halves of diagonal
    # tiles), about half of the (2N)² logits, and each rank about 1/W of it. Every
    # rank computing every upper tile, or every row against all 2N, fails this.
    m, tile = 2 * sum(sizes), 4
    got = run_ranks(len(sizes), _nt_xent_products, sizes, tile)
    entries = [e for _, _, e in got]
    upper = m * (m + 1) // 2
    assert upper <= sum(entries) <= upper + m * tile, (entries, upper)
    assert max(entries) <= 1.35 * sum(entries) / len(sizes), entries


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent"])
@pytest.mark.parametrize("tiles", [[4, 3], [2, 5, 1]])
def test_tile_size_may_differ_across_ranks(name: str, tiles: list[int]) -> None:
    # Issue 14: NT-Xent once dealt its tiles by each rank's own tile size, so
    # tile sizes [4, 3] gave 3.7327 instead of 3.7076 with no error. The deal now
    # depends on N and W alone: any per-rank tile sizes give the reference.
    sizes = [7, 5] if len(tiles) == 2 else [4, 0, 5]
    check_loss(name, name, sizes, tile_per_rank=tiles, path="tiled")
