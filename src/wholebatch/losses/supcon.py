"""Supervised contrastive loss (SupCon) over the whole batch: every row of the same label is a positive.

Khosla et al., "Supervised Contrastive Learning" (NeurIPS 2020, arXiv:2004.11362),
its L_out form, with z the rows of the whole batch (every rank's, rank order), y
their labels and s the logit multiplier (1 / temperature): for anchor i with
positives P(i) = {p ≠ i : y_p = y_i} anywhere in the whole batch,

    ℓ_i = (1 / |P(i)|) Σ_{p ∈ P(i)} −log( exp(s·zᵢ·z_p) / Σ_{a ≠ i} exp(s·zᵢ·z_a) )
        = lse_{a ≠ i}(s·zᵢ·z_a) − s·zᵢ·(Σ_{p ∈ P(i)} z_p) / |P(i)|,

and L is the mean of ℓ_i over the anchors that have a positive (A); anchors
without one contribute nothing; L = 0 when no anchor has one. The labels are
agreed rows like any other (one all-gather of N integers): positives on other
ranks count. GradCache issue #32's ask.

How: the log-sum-exp is the softmax-rows kernel with only each row itself left
out (`lse.PositiveLSE` over the gathered rows, or `ring.PositiveRing` around the
ring); the positives' sum Σ_{p ∈ P(i)} z_p = S_{y_i} − zᵢ comes from the label
sums S_y = Σ_{j : y_j = y} z_j of the labels that have a positive, summed over
ranks by `all_reduce` (differentiable: backward all-reduce, sum), in chunks of at
most max(B) labels so that no rank holds more than a block of them.

Memory: gather O(N·D + T²); ring O(B·D + T²) + 8 bytes per row for the labels.

Legend: W ranks, B this rank's rows, N global rows, D dim, U labels with a positive.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather, all_reduce, apply
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import Call, documented, shared, validate
from wholebatch.losses.lse import PositiveLSE
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.small import evaluate, eye, lse_rows
from wholebatch.losses.specs import SPECS, Strategy

__all__ = ["supcon_formula", "supcon_loss"]

SPEC = SPECS["supcon"]


@documented(SPEC)
def supcon_loss(
    features_BD: Tensor,
    labels_B: Tensor,
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
    """SupCon over the whole batch (the module docstring): the same value on every rank.

    Every rank of `group` must call it. ``strategy="gather"`` (default) all-gathers
    the rows; ``"ring"`` passes each rank's block around the ring (memory
    independent of N but for the labels); ``"auto"`` rings past 1 GiB of gathered
    rows. A small whole batch takes the small path (`wholebatch.losses.small`)
    unless "ring" is asked for. One view per row: stack a sample's views as rows
    of one label to use several.

    Backward (gradient contract): with ``grad_reduction="mean"``, after DDP
    averages over W ranks, the gradients of the encoder and of `logit_scale` (every
    rank's copy gets dL/ds) equal one process's on the concatenated batch; with
    ``"sum"``, after a sum over ranks. The labels get no gradient.

    Args:
        features_BD: this rank's rows (B x D), normalised by the caller.
        labels_B: their integer labels (B,); equal labels on any rank are positives.
        logit_scale: s, the logit multiplier (1 / temperature), a 1-element tensor or a
            number, the same on every rank.
        {common}
    """
    call = validate(
        SPEC,
        {"features_BD": features_BD},
        {"logit_scale": logit_scale},
        labels={"labels_B": labels_B},
        **shared(locals()),
    ).choose(key_elements=features_BD.shape[-1])
    if call.path == "small":
        return evaluate(call, {"features_BD": features_BD, "labels_B": labels_B}, supcon_formula)
    return call.whole(_share(call, features_BD, labels_B))


def supcon_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """SupCon's reference formula on the whole batch (the module docstring), densely."""
    z_ND, y_N = rows["features_BD"], rows["labels_B"]
    n = z_ND.shape[0]
    self_NN = eye(n, z_ND.device)
    logits_NN = scalars["logit_scale"] * (z_ND @ z_ND.T)
    positive_NN = (y_N[:, None] == y_N[None, :]) & ~self_NN
    count_N = positive_NN.sum(1)
    anchor_N = count_N > 0
    mean_pos_N = (logits_NN * positive_NN).sum(1) / count_N.clamp_min(1)
    terms_N = (lse_rows(logits_NN, self_NN) - mean_pos_N) * anchor_N
    return terms_N.sum() / anchor_N.sum().clamp_min(1)


def _share(call: Call, z_BD: Tensor, labels_B: Tensor) -> Tensor:
    """This rank's anchors' share: Σ over its anchors of ℓ_i, / |A| (agreed)."""
    s, b, sizes, group = call.scalars["logit_scale"], call.b, call.sizes, call.group
    y_N = all_gather(labels_B, sizes=list(sizes), group=group, check=False)
    classes, index_N = torch.unique(y_N, return_inverse=True)
    count_U = torch.bincount(index_N, minlength=classes.numel())
    count_B = count_U[index_N[call.offset : call.offset + b]] - 1  # |P(i)| of this rank's rows
    anchors = int((count_U[index_N] > 1).sum())  # |A|, the same on every rank (agreed labels)
    none = torch.zeros(b, dtype=call.acc, device=z_BD.device)  # no positive in the softmax
    if call.path == "ring":
        tile = call.tile(b, max(sizes))
        lse_B, _ = apply(
            PositiveRing, z_BD, z_BD, s, none, 1, (0,), False, sizes, tile, group, None
        )
    else:
        all_z_ND = all_gather(z_BD, sizes=list(sizes), group=group, check=False)
        lse_B, _ = apply(
            PositiveLSE,
            z_BD,
            all_z_ND,
            s,
            none,
            call.offset,
            (0,),
            0,
            sizes,
            call.tile(b, call.n),
            group,
            None,
        )
    sum_BD = _positive_sums(call, z_BD, index_N, count_U)  # Σ over each row's positives
    anchor_B = count_B > 0
    mean_pos_B = s * (z_BD.to(call.acc) * sum_BD).sum(1) / count_B.clamp_min(1)
    terms_B = torch.where(anchor_B, lse_B - mean_pos_B, torch.zeros_like(lse_B))
    return terms_B.sum() / max(anchors, 1)


def _positive_sums(call: Call, z_BD: Tensor, index_N: Tensor, count_U: Tensor) -> Tensor:
    """Σ_{p ∈ P(i)} z_p for this rank's rows (B x D, compute dtype): S_{y_i} − z_i, the label
    sums S over every rank by all-reduce, max(B) labels (those with a positive) at a time."""
    b, acc = call.b, call.acc
    mine = index_N[call.offset : call.offset + b]
    shared = torch.nonzero(count_U > 1).flatten()  # the labels with a positive, U of them
    slot_U = torch.full_like(count_U, -1)
    slot_U[shared] = torch.arange(shared.numel(), device=count_U.device)
    slot_B = slot_U[mine]  # each row's label among the U, or -1
    z = z_BD.to(acc)
    out_BD = -z * (slot_B >= 0)[:, None]  # − z_i for rows with a positive
    chunk = max(1, max(call.sizes))
    for c0 in range(0, shared.numel(), chunk):  # the same chunks on every rank (agreed labels)
        c1 = min(c0 + chunk, shared.numel())
        inside = (slot_B >= c0) & (slot_B < c1)
        local_CD = torch.zeros((c1 - c0, z.shape[1]), dtype=acc, device=z.device)
        local_CD = local_CD.index_add(0, (slot_B[inside] - c0), z[inside])
        sums_CD = all_reduce(local_CD, "sum", group=call.group, check=False)
        out_BD = out_BD + torch.zeros_like(out_BD).index_add(
            0, torch.nonzero(inside).flatten(), sums_CD[slot_B[inside] - c0]
        )
    return out_BD
