"""Decoupled contrastive learning (DCL) over the whole batch: NT-Xent without the positive in the denominator.

Yeh et al., "Decoupled Contrastive Learning" (ECCV 2022, arXiv:2110.06848): with
the 2N views Z = [A; B] of N samples and s the logit multiplier, view i's loss is

    L_i = −s·zᵢ·zᵢ' + log Σ_{k ∉ {i, i'}} exp(s·zᵢ·z_k)

(i' its other view): NT-Xent's negatives, the positive left out of the
denominator, so the positive's gradient no longer shrinks as it is learnt
(the "negative-positive coupling" the paper removes). L is the mean over the 2N
views. That is NT-Xent's row term a_i itself where NT-Xent takes softplus(a_i):
the kernels are NT-Xent's (`symmetric.two_view_terms`, gathered; two
`ring.PositiveRing` sweeps of the [a | b] blocks, ring), only the row term
differs. A view with no negative (a whole batch of one sample) contributes 0,
gradient 0 (its log-sum-exp is over nothing).

Legend: W ranks, B this rank's samples, N global samples, D embedding dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import apply
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import Call, documented, shared, validate
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.small import evaluate
from wholebatch.losses.specs import SPECS, Strategy
from wholebatch.losses.symmetric import two_view_formula, two_view_terms

__all__ = ["dcl_formula", "dcl_loss"]

SPEC = SPECS["dcl"]


@documented(SPEC)
def dcl_loss(
    a_BD: Tensor,
    b_BD: Tensor,
    logit_scale: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    batch_dims: Sequence[str] | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int | None = None,
    sizes: Sequence[int] | None = None,
    check: bool | None = None,
    strategy: Strategy = "gather",
) -> Tensor:
    """DCL over the whole batch of 2N views (the module docstring): the same on every rank.

    Every rank of `group` must call it. ``strategy="gather"`` (default): one
    all-gather of [a | b] and NT-Xent's symmetric tiles (the upper triangle dealt
    to the ranks), memory O(N·D + T²); ``"ring"``: each rank's [a | b] block
    around the ring twice (its a-rows' sweep, its b-rows'), memory O(B·D + T²)
    whatever N and W; ``"auto"`` rings past 1 GiB of gathered views. A small whole
    batch takes the small path (`wholebatch.losses.small`) unless "ring" is asked.

    Backward (gradient contract): with ``grad_reduction="mean"``, after DDP
    averages over W ranks, the gradients of the encoder and of `logit_scale` (every
    rank's copy gets dL/ds) equal one process's on the concatenated batch; with
    ``"sum"``, after a sum over ranks.

    Args:
        a_BD: this rank's first views (B x D), normalised by the caller.
        b_BD: this rank's second views (B x D); row i is the same sample as a_BD's.
        logit_scale: s, the logit multiplier (1 / temperature), a 1-element tensor or a
            number, the same on every rank.
        {common}
    """
    tensors = {"a_BD": a_BD, "b_BD": b_BD}
    call = validate(
        SPEC,
        tensors,
        {"logit_scale": logit_scale},
        **shared(locals()),
    ).choose(key_elements=2 * a_BD.shape[-1])
    if call.path == "small":
        return evaluate(call, tensors, dcl_formula)
    s = call.scalars["logit_scale"]
    terms = (
        _ring_terms(call, a_BD, b_BD, s)
        if call.path == "ring"
        else two_view_terms(call, a_BD, b_BD, s)
    )
    return call.whole(_decoupled(terms).sum() / (2 * call.n))


def dcl_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """DCL's reference formula on the whole batch: the mean over the 2N views of L_i."""
    a_2N = two_view_formula(rows["a_BD"], rows["b_BD"], scalars["logit_scale"])
    n = rows["a_BD"].shape[0]
    return _decoupled(a_2N, n > 1).mean()


def _decoupled(a: Tensor, has_negatives: bool | None = None) -> Tensor:
    """Each view's L_i = a_i, 0 for a view with no negative (a_i = -inf in the tiles)."""
    live = (
        torch.isfinite(a)
        if has_negatives is None
        else torch.full_like(a, has_negatives, dtype=torch.bool)
    )
    return torch.where(live, a, torch.zeros_like(a))


def _ring_terms(call: Call, a_BD: Tensor, b_BD: Tensor, s: Tensor) -> Tensor:
    """a_i for this rank's 2B views (its a-rows, then its b-rows), the [a | b] blocks of every
    rank around the ring: each view's own sample's two keys left out (itself, its pair)."""
    b = call.b
    keys_BX = torch.cat([a_BD, b_BD], 1)  # sample i's two keys: a_i, b_i
    pos_B = s * (a_BD.to(call.acc) * b_BD.to(call.acc)).sum(1)
    tile = call.tile(b, 2 * max(call.sizes))
    rows = []
    for q_BD in (a_BD, b_BD):
        row_B, _ = apply(
            PositiveRing,
            q_BD,
            keys_BX,
            s,
            pos_B,
            2,
            (0, 1),
            False,
            call.sizes,
            tile,
            call.group,
            None,
        )
        rows.append(row_B)
    return torch.cat(rows)
