"""Whole-batch contrastive losses: CLIP, SigLIP and NT-Xent over every rank's rows, memory-linear.

Each loss returns the loss of the WHOLE batch (every rank's rows, in rank order),
the same value on every rank, and is built so that, after DDP's mean over ranks
(or, with ``grad_reduction="sum"``, a sum), every parameter's gradient equals the
gradient one process would get on the concatenated batch: encoders, and the
replicated scalars (`logit_scale`, `logit_bias`, `temperature`) that every rank
holds a copy of. See docs/contrastive.md.

Each is its spec (`specs.SPECS`), one reference formula (`clip_formula`, `siglip_formula`,
`nt_xent_formula`: what the small path evaluates, `small.evaluate`) and its row terms on
a kernel family (`_clip_share`, ...: this rank's share of L on the tiled paths).
The call path is `call.validate` → `Call.choose` → run (docs/contrastive.md).

How the tiled paths split the work: rank r computes only its own rows against the
global batch, a share l_r with sum_r l_r = L, and returns L = all_reduce(l_r)
(sum). That all-reduce's backward hands every l_r the sum of every rank's upstream
gradient, W when each rank back-propagates its L: each rank's gradients are
W·dl_r, and DDP's 1/W turns their sum into exactly dL. Gradient to remote rows
flows back through the collectives' adjoints (all-gather -> reduce-scatter,
ring_shift(1) -> ring_shift(-1)). Logits are never materialised (`tiles`).

Legend: W ranks, B this rank's rows, N global rows (sum of B), D embedding dim,
T tile size.

    .venv/bin/python -m benchmarks.bench_losses --quick     # memory and time vs naive
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather, apply
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import Call, documented, shared, validate
from wholebatch.losses.lse import PositiveLSE, gathered_ids
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.sigmoid import SigmoidRing
from wholebatch.losses.small import evaluate, eye, lse_rows
from wholebatch.losses.specs import SPECS, Strategy
from wholebatch.losses.symmetric import two_view_formula, two_view_terms
from wholebatch.losses.tiles import softplus

__all__ = [
    "clip_formula",
    "clip_loss",
    "nt_xent_formula",
    "nt_xent_loss",
    "siglip_formula",
    "siglip_loss",
]

CLIP, SIGLIP, NT_XENT = SPECS["clip"], SPECS["siglip"], SPECS["nt_xent"]


# ---------------------------------------------------------------------------
# CLIP
# ---------------------------------------------------------------------------


@documented(CLIP)
def clip_loss(
    image_BD: Tensor,
    text_BD: Tensor,
    logit_scale: Tensor | float,
    *,
    logit_bias: Tensor | float | None = None,
    ids_B: Tensor | None = None,
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
    checked like the scale, and gets the exact gradient 0. With `ids_B` (an
    integer id per row), image i's logit against text j is dropped from both
    softmaxes when ids i and j are equal and j ≠ i: duplicates (the same
    caption twice, on any rank) are never each other's negatives.

    Every rank of `group` must call it; each gets L. Rank r computes its rows'
    log-sum-exps against all N texts (row direction) and the statistics of
    every text column its rows touch: O(B·N·D) work, one B x N sweep in the
    forward, one in the backward. ``strategy="gather"`` (default) all-gathers
    the texts and combines the column statistics across ranks (2 all-reduces
    of N floats, or one all-gather of the pairs while small); ``"ring"``
    passes each rank's text block around the ring with its columns'
    statistics (`wholebatch.losses.ring.PositiveRing`), keeping nothing
    N-sized; ``"auto"`` rings when the gathered texts would pass
    `wholebatch.losses.sizing.AUTO_RING_BYTES` (1 GiB) per rank. A small whole
    batch takes the small path (`wholebatch.losses.small`) unless "ring" is
    asked for. Each row's loss is computed as softplus(lse over its negatives −
    its positive logit): float32 error relative to the loss, also near saturation.

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
        ids_B: an optional integer id per row (B,), given on every rank or on none.
        {common}
    """
    call = validate(
        CLIP,
        {"image_BD": image_BD, "text_BD": text_BD},
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        options=[ids_B is not None],
        labels={"ids_B": ids_B},
        **shared(locals()),
    ).choose(key_elements=image_BD.shape[-1])
    if call.path == "small":
        rows = {"image_BD": image_BD, "text_BD": text_BD, "ids_B": ids_B}
        return evaluate(call, rows, clip_formula)
    return call.whole(_clip_share(call, image_BD, text_BD, ids_B))


def clip_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """CLIP's formula on the whole batch: Σ over rows and over columns of softplus(lse over the
    negatives − the positive), / 2N; the negatives leave out each pair's own and equal ids."""
    i_ND, t_ND = rows["image_BD"], rows["text_BD"]
    n = i_ND.shape[0]
    z_NN = scalars["logit_scale"] * (i_ND @ t_ND.T)
    pos_N = z_NN.diagonal()
    not_negative = _same_id(rows.get("ids_B"), eye(n, z_NN.device))
    rows_N, cols_N = lse_rows(z_NN, not_negative, 1), lse_rows(z_NN, not_negative, 0)
    loss = (softplus(rows_N - pos_N).sum() + softplus(cols_N - pos_N).sum()) / (2 * n)
    if "logit_bias" in scalars:
        loss = loss + 0.0 * scalars["logit_bias"]  # in the graph, gradient exactly 0
    return loss


def _same_id(ids_N: Tensor | None, base_NN: Tensor) -> Tensor:
    """`base_NN` or (where ids are given) the pairs of rows with equal ids."""
    if ids_N is None:
        return base_NN
    return base_NN | (ids_N[:, None] == ids_N[None, :])


def _clip_share(call: Call, image_BD: Tensor, text_BD: Tensor, ids_B: Tensor | None) -> Tensor:
    """This rank's share of CLIP on the tiled paths: its rows' and its text columns' terms."""
    s, n, b = call.scalars["logit_scale"], call.n, call.b
    if call.path == "ring":
        tile = call.tile(b, max(call.sizes))
        # the positives s·Iᵢ·Tᵢ are the ring's own (pos_B=None): their gradient added in place
        row_B, col_B = apply(
            PositiveRing,
            image_BD,
            text_BD,
            s,
            None,
            1,
            (0,),
            True,
            call.sizes,
            tile,
            call.group,
            ids_B,
        )
    else:
        pos_B = s * (image_BD.to(call.acc) * text_BD.to(call.acc)).sum(1)  # s·Iᵢ·Tᵢ
        all_text_ND = all_gather(text_BD, sizes=list(call.sizes), group=call.group, check=False)
        row_B, col_B = apply(
            PositiveLSE,
            image_BD,
            all_text_ND,
            s,
            pos_B,
            call.offset,
            (0,),
            n,
            call.sizes,
            call.tile(b, n),
            call.group,
            gathered_ids(ids_B, call.sizes, call.group),
        )
    share = (softplus(row_B).sum() + softplus(col_B).sum()) / (2 * n)
    if "logit_bias" in call.scalars:
        share = share + 0.0 * call.scalars["logit_bias"]  # in the graph, gradient exactly 0
    return share


# ---------------------------------------------------------------------------
# SigLIP
# ---------------------------------------------------------------------------


@documented(SIGLIP)
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
    strategy: Strategy = "ring",
) -> Tensor:
    """Sigmoid loss (SigLIP) over the whole batch: −Σᵢⱼ log σ(yᵢⱼ·(s·IᵢTⱼ + b)) / N.

    yᵢᵢ = 1 and yᵢⱼ = −1 otherwise; I, T are every rank's rows in rank order;
    s = `logit_scale` (the multiplier itself), b = `logit_bias` (added).

    Every rank of `group` must call it; each gets the same value. Remote text
    blocks arrive one at a time by `ring_shift` (W − 1 shifts), never a full
    all-gather; the backward re-exchanges them rather than keeping them, and
    sends each block's gradient home along the same ring. The positive pairs'
    terms softplus(−zᵢᵢ) are computed on their own (never as a difference):
    float32 error relative to the loss. A small whole batch takes the small
    path (`wholebatch.losses.small`).

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
        {common}
    """
    tensors = {"image_BD": image_BD, "text_BD": text_BD}
    call = validate(
        SIGLIP,
        tensors,
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        **shared(locals()),
    ).choose(key_elements=image_BD.shape[-1])
    if call.path == "small":
        return evaluate(call, tensors, siglip_formula)
    s, b = call.scalars["logit_scale"], call.scalars["logit_bias"]
    tile = call.tile(call.b, max(call.sizes))
    negatives = apply(SigmoidRing, image_BD, text_BD, s, b, call.sizes, tile, call.group)
    z_pos_B = s * (image_BD.to(call.acc) * text_BD.to(call.acc)).sum(1) + b
    return call.whole((negatives + softplus(-z_pos_B).sum()) / call.n)


def siglip_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """SigLIP's formula on the whole batch: (Σ_{i≠j} softplus(zᵢⱼ) + Σᵢ softplus(−zᵢᵢ)) / N,
    z = s·I·Tᵀ + b (the positives apart: never a difference)."""
    i_ND, t_ND = rows["image_BD"], rows["text_BD"]
    n = i_ND.shape[0]
    z_NN = scalars["logit_scale"] * (i_ND @ t_ND.T) + scalars["logit_bias"]
    off = ~eye(n, z_NN.device)
    return (softplus(z_NN[off]).sum() + softplus(-z_NN.diagonal()).sum()) / n


# ---------------------------------------------------------------------------
# NT-Xent (DCL, `losses.dcl`, shares its kernels: only the row term differs)
# ---------------------------------------------------------------------------


@documented(NT_XENT)
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
    strategy: Strategy = "gather",
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
    partial statistics are combined across ranks (2 all-reduces of 2N floats,
    or one all-gather of the pairs while small). Each row's loss is
    softplus(lse over its negatives − its positive logit). A small whole batch
    takes the small path (`wholebatch.losses.small`).

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
        {common}
    """
    tensors = {"z1_BD": z1_BD, "z2_BD": z2_BD}
    call = validate(
        NT_XENT,
        tensors,
        {"temperature": temperature},
        **shared(locals()),
    ).choose(key_elements=2 * z1_BD.shape[-1])
    if call.path == "small":
        return evaluate(call, tensors, nt_xent_formula)
    inv_tau = 1.0 / call.scalars["temperature"]
    return call.whole(softplus(two_view_terms(call, z1_BD, z2_BD, inv_tau)).sum() / (2 * call.n))


def nt_xent_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """NT-Xent's formula on the whole batch: mean over the 2N views of softplus(a)."""
    return softplus(
        two_view_formula(rows["z1_BD"], rows["z2_BD"], 1 / scalars["temperature"])
    ).mean()
