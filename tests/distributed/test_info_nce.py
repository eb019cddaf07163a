"""`info_nce_loss` (MultipleNegativesRankingLoss over the whole batch) against the whole-batch formula.

Each rank r holds different queries, documents and k hard negatives per query
(seeded per rank, uneven counts, an empty rank at W = 3) and back-propagates the
loss it gets. The reference is sentence-transformers 6.2.0's formula written
out on the concatenated batch in ONE process (candidates: every positive and
every hard negative; directions and partition modes as there), and is itself
checked against the REAL `MultipleNegativesRankingLoss` on one process.

What must hold (DESIGN.md, convention 2): every rank's value is the
reference loss; each rank's input gradients are W x the reference's (DDP's mean
then gives the reference); the mean over ranks of `logit_scale`'s gradient is
the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import wholebatch.comm.collectives as comm
from tests.support.features import requires_peer
from tests.support.harness import run_ranks, run_ranks_outcomes
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.errors import WholebatchError
from wholebatch.losses import clip_loss, info_nce_loss
from wholebatch.losses.sizing import using_small_rows

# float64, sums of a few hundred terms of size <= ~10: round-off ~1e-13; 1e-10 leaves
# room and rejects every mutation (off by factors >= 1.5, or by whole terms).
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
D = 3
SCALE = 2.5
SIZES = {1: [5], 2: [4, 1], 3: [2, 0, 3]}
SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "q2d": (("query_to_doc",), "joint"),
    "q2d+d2q joint": (("query_to_doc", "doc_to_query"), "joint"),
    "q2d+d2q per_direction": (("query_to_doc", "doc_to_query"), "per_direction"),
    "all four joint": (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
}


def ref_info_nce(
    q_ND: Tensor, d_ND: Tensor, h_NKD: Tensor, s: Tensor, directions: Sequence[str], mode: str
) -> Tensor:
    """sentence-transformers 6.2.0's MNRL formula on the whole batch (dot products; s multiplies)."""
    n, k = q_ND.shape[0], h_NKD.shape[1]
    docs = torch.cat([d_ND, *[h_NKD[:, t] for t in range(k)]])  # [positives; negatives_1; ...]
    eye = torch.eye(n, dtype=torch.bool)
    inf = float("-inf")
    # Masked after scaling (the peer masks first, with a constant scale): s·(-inf) would
    # give a learnable s a nan gradient.
    sims = {"query_to_doc": s * q_ND @ docs.T}
    if "query_to_query" in directions:
        sims["query_to_query"] = (s * q_ND @ q_ND.T).masked_fill(eye, inf)
    if "doc_to_query" in directions:
        sims["doc_to_query"] = s * d_ND @ q_ND.T
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = (s * d_ND @ docs.T).masked_fill(eye.repeat(1, k + 1), inf)
    pos = sims["query_to_doc"][torch.arange(n), torch.arange(n)]
    if mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(sims.values()), 1), 1)
    else:
        log_z = sum(torch.logsumexp(v, 1) for v in sims.values()) / len(sims)
    return -(pos - log_z).mean()


# ---------------------------------------------------------------------------
# Mutations: known-wrong distributed implementations the same assertions reject
# ---------------------------------------------------------------------------


def _dropped_w(q: Tensor, d: Tensor, s: Tensor, **kw: Any) -> Tensor:
    """MUTATION: the right value, but each rank's gradient is that of its own share only (no x W)."""
    # Each rank's gradient through L is W·dl_r; without the x W it is dl_r, the gradient of
    # its own share (what a hand-written gather-with-grad loss gives), and DDP's mean dL / W.
    full = info_nce_loss(q, d, s, **kw)
    return full.detach() + (full - full.detach()) / get_world_size()


def _local_negatives(q: Tensor, d: Tensor, s: Tensor, **kw: Any) -> Tensor:
    """MUTATION: each rank's queries against its own documents only (MNRL without gathering)."""
    negs = kw.get("negatives_BKD")
    h = negs if negs is not None else q.new_zeros(q.shape[0], 0, q.shape[1])
    local = ref_info_nce(q, d, h, s, kw["directions"], kw["partition_mode"]) if len(q) else q.sum()
    return comm.all_reduce(local, "mean")


IMPLS = {"wholebatch": info_nce_loss, "dropped_w": _dropped_w, "local_negatives": _local_negatives}


# ---------------------------------------------------------------------------
# The per-rank step and the check
# ---------------------------------------------------------------------------


def _inputs(sizes: Sequence[int], k: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    qs, ds, hs = [], [], []
    for r, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(100 + r)
        qs.append(torch.randn(n, D, generator=gen, dtype=torch.float64) * 0.7)
        ds.append(torch.randn(n, D, generator=gen, dtype=torch.float64) * 0.7)
        hs.append(torch.randn(n, k, D, generator=gen, dtype=torch.float64) * 0.7)
    return qs, ds, hs


def _rank_step(
    impl: str, qs: list[Tensor], ds: list[Tensor], hs: list[Tensor], kw: dict[str, Any]
) -> tuple[Tensor, ...]:
    r = get_rank()
    q, d = qs[r].clone().requires_grad_(), ds[r].clone().requires_grad_()
    h = hs[r].clone().requires_grad_()
    s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    negs = h if h.shape[1] else None
    kw = dict(kw)
    with using_small_rows(kw.pop("small_rows", None)):
        loss = IMPLS[impl](q, d, s, negatives_BKD=negs, **kw)
        loss.backward()
    zero = torch.zeros_like
    return (
        loss.detach(),
        q.grad if q.grad is not None else zero(q),
        d.grad if d.grad is not None else zero(d),
        h.grad if h.grad is not None else zero(h),
        s.grad if s.grad is not None else zero(s),
    )


def check(
    sizes: Sequence[int], k: int, setting: str, impl: str = "wholebatch", small: int | None = None
) -> None:
    """`small`: the small-batch row limit (0: the tiled forms; None: the default, the small path)."""
    directions, mode = SETTINGS[setting]
    w = len(sizes)
    qs, ds, hs = _inputs(sizes, k)
    kw: dict[str, Any] = dict(directions=directions, partition_mode=mode, tile_size=2)
    kw["small_rows"] = small
    got = run_ranks(w, _rank_step, impl, qs, ds, hs, kw)

    q, d, h = (torch.cat(x).requires_grad_() for x in (qs, ds, hs))
    s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    ref = ref_info_nce(q, d, h, s, directions, mode)
    gq, gd, gh, gs = torch.autograd.grad(ref, [q, d, h, s], materialize_grads=True)
    split = list(sizes)
    for r, (value, grad_q, grad_d, grad_h, _) in enumerate(got):
        torch.testing.assert_close(
            value, ref.detach(), **F64, msg=lambda m, r=r: f"rank {r} value {m}"
        )
        for name, mine, full in (("q", grad_q, gq), ("d", grad_d, gd), ("h", grad_h, gh)):
            torch.testing.assert_close(
                mine,
                w * full.split(split)[r],
                **F64,
                msg=lambda m, r=r, n=name: f"rank {r} grad {n} {m}",
            )
    mean_gs = sum(g[4] for g in got) / w
    torch.testing.assert_close(mean_gs, gs, **F64, msg=lambda m: f"scale grad {m}")


@pytest.mark.parametrize("small", [0, None], ids=["tiled", "small"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k", [0, 1, 3])
def test_info_nce_matches_whole_batch_w3(k: int, setting: str, small: int | None) -> None:
    check(SIZES[3], k, setting, small=small)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("setting", ["q2d", "all four joint"])
@pytest.mark.parametrize("k", [0, 3])
def test_info_nce_matches_whole_batch(world: int, k: int, setting: str) -> None:
    check(SIZES[world], k, setting)


@pytest.mark.parametrize("small", [0, None], ids=["tiled", "small"])
@pytest.mark.parametrize("impl", ["dropped_w", "local_negatives"])
def test_mutations_are_caught(impl: str, small: int | None) -> None:
    with pytest.raises(AssertionError, match=r"grad|value"):
        check([3, 2], 1, "q2d", impl, small=small)


def test_symmetric_form_is_clip_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    d = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    sym = info_nce_loss(
        q, d, SCALE, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
        tile_size=4,
    )  # fmt: skip
    clip = clip_loss(q, d, SCALE, tile_size=3)
    torch.testing.assert_close(sym, clip, **F64)
    for a, b in zip(
        torch.autograd.grad(sym, [q, d]), torch.autograd.grad(clip, [q, d]), strict=True
    ):
        torch.testing.assert_close(a, b, **F64)


# ---------------------------------------------------------------------------
# The real sentence-transformers loss, one process
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k", [0, 2])
@requires_peer("sentence_transformers")
def test_reference_is_sentence_transformers(k: int, setting: str) -> None:
    # The reference above IS the peer's loss: checked against the installed package
    # (cos similarity there; the inputs here are normalised, so dot = cos).
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    directions, mode = SETTINGS[setting]
    peer = MultipleNegativesRankingLoss(
        nn.Module(),  # type: ignore[arg-type]  # only stored; the loss is fed embeddings
        scale=20.0, directions=directions, partition_mode=mode,  # type: ignore[arg-type]
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    q = F.normalize(torch.randn(6, 5, generator=gen, dtype=torch.float64), dim=1)
    d = F.normalize(torch.randn(6, 5, generator=gen, dtype=torch.float64), dim=1)
    h = F.normalize(torch.randn(6, k, 5, generator=gen, dtype=torch.float64), dim=2)
    theirs = peer.compute_loss_from_embeddings([q, d, *h.unbind(1)], torch.empty(0))
    ours = info_nce_loss(
        q, d, 20.0, negatives_BKD=h if k else None, directions=directions,  # type: ignore[arg-type]
        partition_mode=mode, tile_size=4,  # type: ignore[arg-type]
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs, **F64)
    torch.testing.assert_close(
        ref_info_nce(q, d, h, torch.tensor(20.0), directions, mode), theirs, **F64
    )


# ---------------------------------------------------------------------------
# Bad input: the same error on every rank
# ---------------------------------------------------------------------------


def _rank_bad(case: str) -> Tensor:
    r = get_rank()
    q, d = torch.randn(3, 4), torch.randn(3, 4)
    h: Tensor | None = torch.randn(3, 2, 4)
    directions: Any = ("query_to_doc",)
    if case == "k" and r == 1:
        h = torch.randn(3, 1, 4)
    if case == "directions" and r == 0:
        directions = ("doc_to_query",)
    if case == "directions_differ" and r == 1:
        directions = ("query_to_doc", "doc_to_doc")
    return info_nce_loss(q, d, 20.0, negatives_BKD=h, directions=directions)


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("k", "hard negatives per query (k) differs across ranks {0: 2, 1: 1"),
        ("directions", "directions must hold 'query_to_doc'"),
        ("directions_differ", "directions differs across ranks"),
    ],
)
def test_bad_input_same_error_on_every_rank(case: str, text: str) -> None:
    outcomes = run_ranks_outcomes(2, _rank_bad, case)
    msgs = {o.message for o in outcomes}
    assert len(msgs) == 1, msgs
    assert text in msgs.pop()


def test_bad_input_single_process() -> None:
    q = torch.randn(3, 4)
    with pytest.raises(WholebatchError, match="per_direction' takes only"):
        info_nce_loss(
            q, q, directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction"
        )
    with pytest.raises(WholebatchError, match=r"negatives_BKD must be 3-D"):
        info_nce_loss(q, q, negatives_BKD=q)
    with pytest.raises(WholebatchError, match=r"negatives_BKD has shape \(2, 1, 4\)"):
        info_nce_loss(q, q, negatives_BKD=torch.randn(2, 1, 4))
