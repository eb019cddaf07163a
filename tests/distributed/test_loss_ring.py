"""Ring CLIP and InfoNCE (`strategy="ring"`): the same loss and gradients as the gather and as one process.

Every case runs on W = 4 gloo ranks with rows [5, 0, 3, 8] (uneven, one empty
rank), float64, inputs different on every rank, both strategies in the same
call; each is compared with one process computing the formula on the
concatenated batch (loss, every rank's input gradients times W: DDP's mean
then gives dL, and the mean of the scalars' gradients). Then: what the ring
saves for backward does not grow with N at fixed B (W = 2 vs 4), "auto"
picks by the documented budget, a mutation of the ring is caught, and a
strategy that differs across ranks is the same error on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import wholebatch.losses.ring as ring
from tests.distributed.test_info_nce import ref_info_nce
from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank
from wholebatch.errors import WholebatchError
from wholebatch.losses import ClipLoss, InfoNCELoss, clip_loss, info_nce_loss
from wholebatch.losses.sizing import AUTO_RING_BYTES, auto_strategy

# float64; each value is a sum of at most a few hundred terms of size <= ~10, so
# round-off is ~1e-14; 1e-12 is the bar, and every mutation misses it by far.
TOL: dict[str, float] = dict(rtol=1e-12, atol=1e-12)
SIZES = [5, 0, 3, 8]
D = 4
SCALE = 2.5
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# (name, loss, k hard negatives, keyword arguments)
CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("clip", "clip", 0, {}),
    ("clip logit_bias", "clip", 0, {"logit_bias": 0.3}),
    ("clip grad_reduction=sum", "clip", 0, {"grad_reduction": "sum"}),
    ("clip module", "clip_module", 0, {}),
    ("info_nce q2d", "info_nce", 0, {}),
    ("info_nce q2d k2", "info_nce", 2, {}),
    ("info_nce q2d+d2q joint k1", "info_nce", 1, {"directions": ALL[:1] + ALL[2:3]}),
    (
        "info_nce q2d+d2q per_direction k2",
        "info_nce",
        2,
        {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    ),
    ("info_nce all four k2", "info_nce", 2, {"directions": ALL}),
    ("info_nce all four k0", "info_nce", 0, {"directions": ALL}),
    ("info_nce module k1", "info_nce_module", 1, {"directions": ALL}),
]


def _inputs(sizes: list[int], k: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    out = []
    for r, n in enumerate(sizes):
        g = torch.Generator().manual_seed(100 + r)
        out.append(
            tuple(
                torch.randn(*shape, generator=g, dtype=torch.float64) * 0.7
                for shape in ((n, D), (n, D), (n, k, D))
            )
        )
    return out  # type: ignore[return-value]


def _call(
    loss: str, strategy: str, q: Tensor, d: Tensor, h: Tensor, s: Tensor, **kw: Any
) -> Tensor:
    negs = h if h.shape[1] else None
    if loss == "clip":
        return clip_loss(q, d, s, strategy=strategy, tile_size=3, **kw)  # type: ignore[arg-type]
    if loss == "clip_module":
        return ClipLoss(normalize=False, strategy=strategy, tile_size=3)(q, d, s)  # type: ignore[arg-type]
    if loss == "info_nce_module":
        fn = InfoNCELoss(normalize=False, logit_scale=None, strategy=strategy, tile_size=3, **kw)  # type: ignore[arg-type]
        return fn(q, d, negs, s)
    return info_nce_loss(q, d, s, negatives_BKD=negs, strategy=strategy, tile_size=3, **kw)  # type: ignore[arg-type]


def _rank_cases(cases: list[tuple[str, str, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Both strategies of every case on this rank: the loss and every gradient."""
    r = get_rank()
    out = []
    for _, loss, k, kw in cases:
        q0, d0, h0 = _inputs(SIZES, k)[r]
        row: dict[str, Any] = {}
        for strategy in ("gather", "ring"):
            q, d, h = (x.clone().requires_grad_() for x in (q0, d0, h0))
            s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
            value = _call(loss, strategy, q, d, h, s, **kw)
            value.backward()
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (q, d, h, s)]
            row[strategy] = (value.detach(), *grads)
        out.append(row)
    return out


def _reference(loss: str, k: int, kw: dict[str, Any]) -> tuple[Tensor, ...]:
    q, d, h = (torch.cat(x).requires_grad_() for x in zip(*_inputs(SIZES, k), strict=True))
    s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    if loss.startswith("clip"):
        logits = s * q @ d.T
        y = torch.arange(q.shape[0])
        ref = (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y)) / 2
    else:
        directions = kw.get("directions", ("query_to_doc",))
        ref = ref_info_nce(q, d, h, s, directions, kw.get("partition_mode", "joint"))
    grads = torch.autograd.grad(ref, [q, d, h, s], materialize_grads=True)
    return (ref.detach(), *grads)


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    """Every case, both strategies, on every rank: one call on the shared world of 4."""
    return run_ranks(4, _rank_cases, CASES, timeout=240)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_ring_equals_gather_equals_one_process(
    index: int, results: list[list[dict[str, Any]]]
) -> None:
    name, loss, k, kw = CASES[index]
    ref, gq, gd, gh, gs = _reference(loss, k, kw)
    w = len(SIZES)
    factor = 1.0 if kw.get("grad_reduction") == "sum" else float(w)
    for strategy in ("ring", "gather"):
        per_rank = [results[r][index][strategy] for r in range(w)]
        for r, (value, q_g, d_g, h_g, _) in enumerate(per_rank):
            torch.testing.assert_close(value, ref, **TOL, msg=f"{name} {strategy} rank {r} loss")
            for what, mine, full in (("q", q_g, gq), ("d", d_g, gd), ("h", h_g, gh)):
                want = factor * full.split(SIZES)[r]
                torch.testing.assert_close(
                    mine,
                    want,
                    **TOL,
                    msg=lambda m, r=r, s=strategy, x=what: f"{name} {s} {r} {x} {m}",
                )
        scale_grad = sum(g[4] for g in per_rank) / w * (w if factor == 1.0 else 1.0)
        torch.testing.assert_close(scale_grad, gs, **TOL, msg=f"{name} {strategy} scale grad")


# ---------------------------------------------------------------------------
# Saved for backward: nothing N-sized with the ring
# ---------------------------------------------------------------------------


def _saved_bytes_per_rank(b: int, strategy: str, k: int) -> int:
    """Bytes autograd saves for backward on this rank for one InfoNCE (all directions) and one CLIP call."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    g = torch.Generator().manual_seed(get_rank())
    q, d = (torch.randn(b, 32, generator=g).requires_grad_() for _ in range(2))
    h = torch.randn(b, k, 32, generator=g).requires_grad_()
    s = torch.tensor(10.0, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = clip_loss(q, d, s, strategy=strategy)  # type: ignore[arg-type]
        loss = loss + info_nce_loss(q, d, s, negatives_BKD=h, directions=ALL, strategy=strategy)  # type: ignore[arg-type]
    loss.backward()
    return total


def test_ring_saves_nothing_that_grows_with_n() -> None:
    """Fixed B = 64 rows per rank: W = 2 (N = 128) and W = 4 (N = 256)."""
    ring2 = run_ranks(2, _saved_bytes_per_rank, 64, "ring", 2, timeout=120)
    ring4 = run_ranks(4, _saved_bytes_per_rank, 64, "ring", 2, timeout=120)
    gather2 = run_ranks(2, _saved_bytes_per_rank, 64, "gather", 2, timeout=120)
    gather4 = run_ranks(4, _saved_bytes_per_rank, 64, "gather", 2, timeout=120)
    assert max(ring4) == max(ring2), (ring2, ring4)
    # the check can fail: the gather's saved bytes do grow with N (the gathered keys)
    assert min(gather4) > max(gather2) + 64 * 2 * 3 * 32 * 4, (gather2, gather4)


# ---------------------------------------------------------------------------
# auto, a mutation, and disagreement
# ---------------------------------------------------------------------------


def test_auto_rings_past_the_budget_only() -> None:
    assert auto_strategy(AUTO_RING_BYTES) == "gather"
    assert auto_strategy(AUTO_RING_BYTES + 1) == "ring"
    g = torch.Generator().manual_seed(0)
    q, d = (torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(2))
    for strategy in ("gather", "ring"):
        torch.testing.assert_close(
            clip_loss(q, d, 2.0, strategy="auto"), clip_loss(q, d, 2.0, strategy=strategy), **TOL
        )


def _ring_step(sizes: list[int], mutate: bool) -> Tensor:
    """This rank's ring CLIP loss; `mutate`: a ring that never folds the second block it holds
    (each rank holds three non-empty blocks of SIZES; a block travels in one chunk here)."""
    r = get_rank()
    q, d, _ = _inputs(sizes, 0)[r]
    real, calls = ring._fold, [0]

    def skip_last(*args: Any) -> None:
        calls[0] += 1
        if calls[0] != 2:
            real(*args)

    ring._fold = skip_last if mutate else real  # type: ignore[assignment]
    try:
        return clip_loss(q, d, SCALE, strategy="ring", tile_size=3).detach()
    finally:
        ring._fold = real  # type: ignore[assignment]


def test_a_ring_that_skips_a_block_is_caught() -> None:
    """Mutation: a ring that passes every block but skips folding one misses the reference."""
    ref = _reference("clip", 0, {})[0]
    good = run_ranks(4, _ring_step, SIZES, False, timeout=60)
    bad = run_ranks(4, _ring_step, SIZES, True, timeout=60)
    torch.testing.assert_close(good[0], ref, **TOL)
    assert all(not torch.allclose(v, ref, **TOL) for v in bad), (bad, ref)


def _rank_strategy_disagrees() -> str:
    q = torch.randn(3, 4, dtype=torch.float64)
    strategy = "ring" if get_rank() == 1 else "gather"
    try:
        clip_loss(q, q.clone(), 2.0, strategy=strategy)  # type: ignore[arg-type]
    except WholebatchError as e:
        return str(e)
    return "no error"


def test_strategy_differing_across_ranks_is_the_same_error_everywhere() -> None:
    msgs = run_ranks(3, _rank_strategy_disagrees, timeout=60)
    assert (
        len(set(msgs)) == 1
        and "strategy differs across ranks {0: gather, 1: ring, 2: gather}" in msgs[0]
    )


def test_bad_strategy_is_a_clear_error() -> None:
    q = torch.randn(3, 4)
    with pytest.raises(
        WholebatchError, match=r"strategy='rings' must be one of \['gather', 'ring', 'auto'\]"
    ):
        clip_loss(q, q, 2.0, strategy="rings")  # type: ignore[arg-type]
    with pytest.raises(WholebatchError, match=r"^info_nce_loss: strategy="):
        info_nce_loss(q, q, strategy="ring_")  # type: ignore[arg-type]
