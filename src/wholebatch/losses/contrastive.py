"""Whole-batch contrastive losses: CLIP, SigLIP and NT-Xent over every rank's rows, memory-linear.

Each loss returns the loss of the WHOLE batch (every rank's rows, in rank order),
the same value on every rank, and is built so that, after DDP's mean over ranks
(or, with ``grad_reduction="sum"``, a sum), every parameter's gradient equals the
gradient one process would get on the concatenated batch: encoders, and the
replicated scalars (`logit_scale`, `logit_bias`, `temperature`) that every rank
holds a copy of. See docs/contrastive.md.

How: rank r computes only its own rows against the global batch, a share l_r
with sum_r l_r = L, and returns L = all_reduce(l_r) (sum). That all-reduce's
backward hands every l_r the sum of every rank's upstream gradient, W when each
rank back-propagates its L: each rank's gradients are W·dl_r, and DDP's 1/W
turns their sum into exactly dL. Gradient to remote rows flows back through the
collectives' adjoints (all-gather -> reduce-scatter, ring_shift(1) -> ring_shift(-1)).

On a device mesh (``mesh=``, ``batch_dims=``, docs/mesh.md) W is the batch dims'
size: the loss gathers over their ranks, tensor-parallel replicas are checked to
hold the same rows, and a replica's gradient is its batch-group peers' (never
split over tp): `wholebatch.losses.meshgroup`.

Logits are never materialised: see `wholebatch.losses.tiles` (tiles of T x T,
recomputed in backward from the inputs and the per-row log-sum-exp).

Legend: W ranks, B this rank's rows, N global rows (sum of B), D embedding dim,
T tile size.

    .venv/bin/python -m benchmarks.bench_losses --quick     # memory and time vs naive
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather
from wholebatch.comm.groups import get_rank
from wholebatch.conventions import GradReduction
from wholebatch.losses import replicated
from wholebatch.losses.common import resolve_strategy, resolve_tile, whole
from wholebatch.losses.meshgroup import prepare_on
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.specs import SPECS, Strategy, strategy_code, strategy_problem
from wholebatch.losses.tiles import PositiveLSE, SigmoidRing, SymmetricLSE, compute_dtype, softplus

__all__ = ["clip_loss", "nt_xent_loss", "siglip_loss"]


# ---------------------------------------------------------------------------
# Public losses
# ---------------------------------------------------------------------------


def clip_loss(
    image_BD: Tensor,
    text_BD: Tensor,
    logit_scale: Tensor | float,
    *,
    logit_bias: Tensor | float | None = None,
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    batch_dims: Sequence[str] | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int | None = None,
    sizes: Sequence[int] | None = None,
    check: bool | None = None,
    strategy: Strategy = "gather",
) -> Tensor:
    """Symmetric InfoNCE (CLIP) over the whole batch: every rank's rows, in rank order.

    With I, T the whole-batch embeddings (N x D) and s = `logit_scale` (the
    multiplier itself, already exponentiated):
    L = ( CE(s·I·Tᵀ + b, arange N) + CE(s·T·Iᵀ + b, arange N) ) / 2, CE a mean
    over rows. A `logit_bias` b (open_clip passes one) shifts every logit of a
    row alike, so it changes neither the loss nor any gradient: it is accepted,
    checked like the scale, and gets the exact gradient 0.

    Every rank of `group` must call it; each gets L. Rank r computes its rows'
    log-sum-exps against all N texts (row direction) and the statistics of
    every text column its rows touch: O(B·N·D) work, one B x N sweep in the
    forward, one in the backward. ``strategy="gather"`` (default) all-gathers
    the texts and combines the column statistics across ranks (2 all-reduces
    of N floats, or one all-gather of the pairs while small); ``"ring"`` passes each rank's text block around the ring
    with its columns' statistics (`wholebatch.losses.ring.PositiveRing`),
    keeping nothing N-sized; ``"auto"`` rings when the gathered texts would
    pass `wholebatch.losses.sizing.AUTO_RING_BYTES` (1 GiB) per rank.
    Each row's loss is computed as softplus(lse over its negatives − its
    positive logit): float32 error relative to the loss, also near saturation.

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoders and of
    `logit_scale` (a replicated parameter: every rank's copy gets dL/ds) equal
    those of one process computing L on the concatenated batch; with ``"sum"``,
    after a sum over ranks. Text gradients reach their owners through the
    all-gather's reduce-scatter.

    Memory: gather O(N·D + T²) peak (the gathered texts, their gradient, one
    tile); ring O(B·D + T²), whatever N and W; never O(N²) or O(B·N).

    Args:
        image_BD: this rank's image embeddings (B x D), normalised by the caller.
        text_BD: this rank's text embeddings (B x D); row i pairs with image row i.
        logit_scale: the logit multiplier, a 1-element tensor (may require grad) or a number;
            the same value on every rank.
        logit_bias: an optional logit bias (no effect on the loss; gradient 0).
        group, mesh, batch_dims: the process group (default: the world), or a mesh and batch dims.
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
            "sum" if they are summed.
        tile_size: rows and columns of one logits tile (memory T² per buffer); None:
            `wholebatch.losses.tiles.tile_size_for` the device (512 on CPU). Ranks may differ.
        sizes: every rank's row count B, if the caller knows them: with the
            cross-rank checks off (`check=False` or `wholebatch.set_checks(False)`)
            the call then makes no metadata exchange and no host sync.
        check: run the cross-rank checks even when `sizes` is given (default:
            the process setting, on).
        strategy: "gather", "ring" or "auto" (see above); the same on every rank.
    """
    spec = SPECS["clip"]
    op = spec.function
    scalars: dict[str, object] = {"logit_scale": logit_scale}
    if logit_bias is not None:
        scalars["logit_bias"] = logit_bias
    ((name, fix),) = spec.options
    prep, group = prepare_on(
        op, {"image_BD": image_BD, "text_BD": text_BD}, scalars, grad_reduction=grad_reduction,
        tile_size=tile_size, sizes=sizes, check=check, group=group, mesh=mesh,
        batch_dims=batch_dims, small=spec.replicable(strategy), carry=True,
        options={name: (strategy_code(strategy), fix)}, error=strategy_problem(spec, strategy),
    )  # fmt: skip
    if prep.replicated:
        return replicated.clip(image_BD, text_BD, prep, group)
    rank, n = get_rank(group), sum(prep.sizes)
    offset, b = sum(prep.sizes[:rank]), prep.sizes[rank]
    acc = compute_dtype(image_BD.dtype)
    s = prep.scalars[0]
    sizes_t = tuple(prep.sizes)
    if resolve_strategy(strategy, n * text_BD.shape[1] * text_BD.element_size()) == "ring":
        tile = resolve_tile(tile_size, image_BD.device, b, max(sizes_t))
        # the positives s·Iᵢ·Tᵢ are the ring's own (pos_B=None): their gradient added in place
        row_B, col_B = PositiveRing.apply(  # type: ignore[no-untyped-call]
            image_BD, text_BD, s, None, 1, (0,), True, sizes_t, tile, group
        )
    else:
        pos_B = s * (image_BD.to(acc) * text_BD.to(acc)).sum(1)  # s·Iᵢ·Tᵢ
        tile = resolve_tile(tile_size, image_BD.device, b, n)
        all_text_ND = all_gather(text_BD, sizes=prep.sizes, group=group, check=False)
        row_B, col_B = PositiveLSE.apply(  # type: ignore[no-untyped-call]
            image_BD, all_text_ND, s, pos_B, offset, (0,), n, sizes_t, tile, group
        )
    local = (softplus(row_B).sum() + softplus(col_B).sum()) / (2 * n)
    if logit_bias is not None:
        local = local + 0.0 * prep.scalars[1]  # in the graph, gradient exactly 0
    return whole(local, prep, group)


def siglip_loss(
    image_BD: Tensor,
    text_BD: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    batch_dims: Sequence[str] | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int | None = None,
    sizes: Sequence[int] | None = None,
    check: bool | None = None,
) -> Tensor:
    """Sigmoid loss (SigLIP) over the whole batch: −Σᵢⱼ log σ(yᵢⱼ·(s·IᵢTⱼ + b)) / N.

    yᵢᵢ = 1 and yᵢⱼ = −1 otherwise; I, T are every rank's rows in rank order;
    s = `logit_scale` (the multiplier itself), b = `logit_bias` (added).

    Every rank of `group` must call it; each gets the same value. Remote text
    blocks arrive one at a time by `ring_shift` (W − 1 shifts), never a full
    all-gather; the backward re-exchanges them rather than keeping them, and
    sends each block's gradient home along the same ring. The positive pairs'
    terms softplus(−zᵢᵢ) are computed on their own (never as a difference):
    float32 error relative to the loss.

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoders and of
    `logit_scale` and `logit_bias` equal one process's on the concatenated
    batch; with ``"sum"``, after a sum over ranks.

    Memory: O(B·D + T²) peak, independent of W and of N beyond this rank's rows
    and the one block in flight.

    Args:
        image_BD: this rank's image embeddings (B x D), normalised by the caller.
        text_BD: this rank's text embeddings (B x D); row i pairs with image row i.
        logit_scale: the logit multiplier (a 1-element tensor or a number), the same on every rank.
        logit_bias: the logit bias (a 1-element tensor or a number), the same on every rank.
        group, mesh, batch_dims: the process group (default: the world), or a mesh and batch dims.
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
            "sum" if they are summed.
        tile_size: rows and columns of one logits tile (memory T² per buffer); None:
            `wholebatch.losses.tiles.tile_size_for` the device (512 on CPU). Ranks may differ.
        sizes: every rank's row count B, if the caller knows them: with the
            cross-rank checks off (`check=False` or `wholebatch.set_checks(False)`)
            the call then makes no metadata exchange and no host sync.
        check: run the cross-rank checks even when `sizes` is given (default:
            the process setting, on).
    """
    op = SPECS["siglip"].function
    prep, group = prepare_on(
        op, {"image_BD": image_BD, "text_BD": text_BD},
        {"logit_scale": logit_scale, "logit_bias": logit_bias}, grad_reduction=grad_reduction,
        tile_size=tile_size, sizes=sizes, check=check, group=group, mesh=mesh,
        batch_dims=batch_dims, small=True, carry=True,
    )  # fmt: skip
    if prep.replicated:
        return replicated.siglip(image_BD, text_BD, prep, group)
    n, b_rows = sum(prep.sizes), prep.sizes[get_rank(group)]
    acc = compute_dtype(image_BD.dtype)
    s, b = prep.scalars
    tile = resolve_tile(tile_size, image_BD.device, b_rows, max(prep.sizes))
    negatives = SigmoidRing.apply(image_BD, text_BD, s, b, tuple(prep.sizes), tile, group)  # type: ignore[no-untyped-call]
    z_pos_B = s * (image_BD.to(acc) * text_BD.to(acc)).sum(1) + b
    return whole((negatives + softplus(-z_pos_B).sum()) / n, prep, group)


def nt_xent_loss(
    z1_BD: Tensor,
    z2_BD: Tensor,
    temperature: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    batch_dims: Sequence[str] | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int | None = None,
    sizes: Sequence[int] | None = None,
    check: bool | None = None,
) -> Tensor:
    """SimCLR's NT-Xent over the whole batch of 2N views.

    Z = [Z1; Z2] (2N x D: every rank's first views in rank order, then every
    rank's second views), logits Z·Zᵀ / τ with the diagonal excluded, the
    positive of row i its other view (i ± N); cross-entropy averaged over all
    2N rows. τ = `temperature` divides.

    Every rank of `group` must call it; each gets the same value. One
    all-gather of [z1 | z2]; the logits Z·Zᵀ are symmetric, so only the tiles
    on and above the diagonal are computed (each serves its rows and, mirrored,
    its columns). Panel pairs of the upper triangle are dealt to the ranks from
    N and W alone (ranks may use different tile sizes): O(N²·D / W) work per
    rank, half that of every rank sweeping its 2B rows against all 2N. The
    partial statistics are combined across ranks (2 all-reduces of 2N floats, or one all-gather of the pairs while small).
    Each row's loss is softplus(lse over its negatives − its positive logit).

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoder and of
    `temperature` equal one process's on the concatenated batch; with
    ``"sum"``, after a sum over ranks. Gathered rows' gradients return to their
    owners through the all-gather's reduce-scatter.

    Memory: O(N·D + T²) peak; never O(N²) or O(B·N).

    Args:
        z1_BD: this rank's first-view embeddings (B x D), normalised by the caller.
        z2_BD: this rank's second-view embeddings (B x D); row i is the same sample.
        temperature: τ (a 1-element tensor or a number), the same on every rank.
        group, mesh, batch_dims: the process group (default: the world), or a mesh and batch dims.
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
            "sum" if they are summed.
        tile_size: rows and columns of one logits tile (memory T² per buffer); None:
            `wholebatch.losses.tiles.tile_size_for` the device (512 on CPU). Ranks may differ.
        sizes: every rank's row count B, if the caller knows them: with the
            cross-rank checks off (`check=False` or `wholebatch.set_checks(False)`)
            the call then makes no metadata exchange and no host sync.
        check: run the cross-rank checks even when `sizes` is given (default:
            the process setting, on).
    """
    op = SPECS["nt_xent"].function
    prep, group = prepare_on(
        op, {"z1_BD": z1_BD, "z2_BD": z2_BD}, {"temperature": temperature},
        grad_reduction=grad_reduction, tile_size=tile_size, sizes=sizes, check=check, group=group,
        mesh=mesh, batch_dims=batch_dims, small=True, carry=True,
    )  # fmt: skip
    if prep.replicated:
        return replicated.nt_xent(z1_BD, z2_BD, prep, group)
    rank, n = get_rank(group), sum(prep.sizes)
    offset, b = sum(prep.sizes[:rank]), prep.sizes[rank]
    d = z1_BD.shape[1]
    acc = compute_dtype(z1_BD.dtype)
    inv_tau = 1.0 / prep.scalars[0]
    tile = resolve_tile(tile_size, z1_BD.device, 2 * n, 2 * n)
    all_N2D = all_gather(torch.cat([z1_BD, z2_BD], 1), sizes=prep.sizes, group=group, check=False)
    all_z_2ND = torch.cat([all_N2D[:, :d], all_N2D[:, d:]], 0)
    pos_N = inv_tau * (all_N2D[:, :d].to(acc) * all_N2D[:, d:].to(acc)).sum(1)  # rows i and i + N
    a_2N = SymmetricLSE.apply(all_z_2ND, inv_tau, torch.cat([pos_N, pos_N]), tile, group)  # type: ignore[no-untyped-call]
    mine = (
        softplus(a_2N[offset : offset + b]).sum()
        + softplus(a_2N[n + offset : n + offset + b]).sum()
    )
    return whole(mine / (2 * n), prep, group)
