"""One-directional InfoNCE with hard negatives over the whole batch (MultipleNegativesRankingLoss).

Each query is scored against EVERY document of the whole batch: every rank's
positives and every rank's hard negatives, in one softmax, the query's own
positive the target. This is the loss text-embedding users train with most
(sentence-transformers' `MultipleNegativesRankingLoss`, its default), usually
on (anchor, positive, negative_1, ..., negative_k) tuples. Optional extra
directions (document → query, query → query, document → document) and their
normalisation (`partition_mode`) follow sentence-transformers 6.2.0 exactly,
so its losses (and `CachedMultipleNegativesRankingLoss`, the same objective)
can be expressed with it; the symmetric form (query → document and document →
query, one softmax per direction) is `clip_loss`. Its spec, its one reference
formula (`info_nce_formula`: the small path's) and its row terms on the softmax-rows
kernels (`_gathered_terms`, `_ring_terms`) are all it is (docs/contrastive.md).

    .venv/bin/python -m benchmarks.bench_losses --only info_nce   # memory and time vs naive

Legend: W ranks, B this rank's queries, N global queries (sum of B), k hard
negatives per query, J = 1 + k key rows per query (its document and its hard
negatives), C = N·J candidate documents, D embedding dim, T tile size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather, apply
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import Call, documented, shared, validate
from wholebatch.losses.lse import PositiveLSE, gathered_ids
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.small import evaluate, eye, lse_rows
from wholebatch.losses.specs import SPECS, Strategy
from wholebatch.losses.tiles import softplus

__all__ = ["DIRECTIONS", "Direction", "PartitionMode", "info_nce_formula", "info_nce_loss"]

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
PartitionMode = Literal["joint", "per_direction"]
SPEC = SPECS["info_nce"]
DIRECTIONS: tuple[str, ...] = SPEC.directions
_PARTITIONS: tuple[str, ...] = ("joint", "per_direction")


def _check_options(directions: object, partition_mode: object) -> tuple[int, str | None]:
    """(bit mask of the directions, why the options are unusable or None)."""
    if isinstance(directions, str) or not isinstance(directions, Sequence) or not directions:
        return 0, (
            f"directions={directions!r} must be a non-empty tuple of {DIRECTIONS}, "
            "e.g. ('query_to_doc',)"
        )
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad:
        return 0, f"directions has {bad!r}; each must be one of {DIRECTIONS}"
    if "query_to_doc" not in directions:
        return 0, "directions must hold 'query_to_doc' (it holds the positive pair)"
    if partition_mode not in _PARTITIONS:
        return 0, f"partition_mode={partition_mode!r} must be 'joint' or 'per_direction'"
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        return 0, (
            "partition_mode='per_direction' takes only 'query_to_doc' and 'doc_to_query' "
            "(the other directions hold no positive pair); use partition_mode='joint'"
        )
    return sum(1 << DIRECTIONS.index(d) for d in set(directions)), None


@documented(SPEC)
def info_nce_loss(
    query_BD: Tensor,
    document_BD: Tensor,
    logit_scale: Tensor | float = 20.0,
    *,
    negatives_BKD: Tensor | None = None,
    directions: Sequence[Direction] = ("query_to_doc",),
    partition_mode: PartitionMode = "joint",
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
    """InfoNCE over the whole batch: each query against every document of every rank.

    With q_i, d_i the whole batch's queries and their positive documents (N x D,
    rank order), h_i,t the k hard negatives of query i, s = `logit_scale` (the
    multiplier itself; sentence-transformers' `scale`, default 20, is 1 / its
    temperature) and every logit s·x·y:

    - "query_to_doc" (always): query i against all N positives and all N·k hard
      negatives, its own positive d_i the target;
    - "doc_to_query": document d_i against every query q_j (target q_i);
    - "query_to_query": query i against every other query q_j (j ≠ i);
    - "doc_to_doc": document d_i against every positive and hard negative except
      its own (d_i itself and h_i,·).

    `partition_mode="joint"` (default): one softmax per query over every selected
    direction's logits, the target the positive s·q_i·d_i; "per_direction": one
    cross-entropy per direction (query_to_doc and doc_to_query only), averaged.
    L is the mean over the N queries. With ``directions=("query_to_doc",
    "doc_to_query")``, "per_direction" and no negatives, L is `clip_loss`.
    These are sentence-transformers 6.2.0's `MultipleNegativesRankingLoss`
    semantics (with `gather_across_devices`, cos similarity = normalised
    inputs), computed exactly over every rank's rows, uneven sizes included
    (its `hardness_mode` is not offered).

    With `ids_B`, rows of one id (the same anchor twice, on any rank) are never
    each other's negatives, in every direction; hard negatives stay negatives.

    Every rank of `group` must call it (the same k, directions and
    partition_mode); each gets L. One all-gather of [document | negatives]
    (B x (1 + k)·D per rank; backward: reduce-scatter), one of the queries
    for "query_to_query"; rank r sweeps its B queries against the C = N·(1 + k)
    candidates in T x T tiles: O(B·C·D) work per direction; "doc_to_query"
    rides on the query_to_doc sweep (column statistics, 2 all-reduces of N
    floats). Each row's loss is softplus(lse over its negatives − its positive
    logit): float32 error relative to the loss, also near saturation.

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoders and of
    `logit_scale` (a replicated parameter: every rank's copy gets dL/ds) equal
    those of one process computing L on the concatenated batch; with ``"sum"``,
    after a sum over ranks.

    A small batch takes the small path (`losses.small`) unless "ring" is asked;
    one query without hard negatives has none: loss 0, gradient exactly 0.

    Memory: O(C·D + T²) peak (the gathered candidates, their gradient, a few
    tiles); never the B x C logits.

    Args:
        query_BD: this rank's query (anchor) embeddings (B x D), normalised by the caller
            for cos similarity.
        document_BD: this rank's positive documents (B x D); row i is query i's positive.
        logit_scale: the logit multiplier, a 1-element tensor (may require grad) or a number,
            the same on every rank.
        negatives_BKD: this rank's hard negatives (B x k x D, any k >= 0, the same k on
            every rank); row i holds query i's. None: no hard negatives.
        directions: which directions to include (a tuple holding "query_to_doc").
        partition_mode: "joint" or "per_direction" (see above).
        ids_B: an optional integer id per row (B,), given on every rank or on none.
        {common}
    """
    negs = negatives_BKD
    k, options, err = _options(negs, directions, partition_mode, ids_B)
    tensors = {"query_BD": query_BD, "document_BD": document_BD, "negatives_BKD": negs}
    call = validate(
        SPEC,
        tensors,
        {"logit_scale": logit_scale},
        options=options,
        labels={"ids_B": ids_B},
        error=err,
        **shared(locals()),
    ).choose(key_elements=(1 + k) * query_BD.shape[-1])
    if call.path == "small":
        rows = {**tensors, "ids_B": ids_B}
        return evaluate(call, rows, lambda r, s: info_nce_formula(r, s, directions, partition_mode))
    terms = _ring_terms if call.path == "ring" else _gathered_terms
    wanted: set[str] = set(directions)
    parts = terms(call, query_BD, document_BD, negs, ids_B, call.scalars["logit_scale"], wanted)
    rows_B = _row_losses(parts, partition_mode == "per_direction", "doc_to_query" in wanted)
    return call.whole(rows_B.sum() / call.n)


def _options(
    negs: Tensor | None, directions: object, partition_mode: object, ids_B: object
) -> tuple[int, list[float], str | None]:
    """(k, the codes of the spec's options: k, directions, partition mode, ids; why unusable)."""
    k = negs.shape[1] if isinstance(negs, Tensor) and negs.dim() == 3 else 0
    mask, err = _check_options(directions, partition_mode)
    partition = _PARTITIONS.index(str(partition_mode)) if err is None else 0
    return k, [k, mask, partition, ids_B is not None], err


def _row_losses(parts: list[Tensor], per_direction: bool, doc_to_query: bool) -> Tensor:
    """Each row's loss from its directions' a_i (query_to_doc first, then doc_to_query where
    asked): one softmax over all ("joint"), or a mean of one CE per direction.

    A row with no negative at all (a whole batch of one query, no hard negatives) has
    a_i = -inf: its loss is finite and its gradient exactly 0 (never the NaN of a
    log-sum-exp over nothing).
    """
    if per_direction:
        return torch.stack([softplus(a) for a in parts]).mean(0)
    if doc_to_query:
        # doc_to_query's own pair d_i·q_i is the positive logit itself: in the joint
        # softmax it is one more term, exp(0) relative to the positive.
        parts = [*parts, torch.zeros_like(parts[0])]
    if len(parts) == 1:
        return softplus(parts[0])
    low = torch.finfo(parts[0].dtype).min  # -inf (no negative) counts for nothing, gradient 0
    return softplus(torch.logsumexp(torch.stack([a.clamp_min(low) for a in parts]), 0))


def info_nce_formula(
    rows: dict[str, Tensor],
    scalars: dict[str, Tensor],
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
) -> Tensor:
    """InfoNCE's reference formula on the whole batch: per direction a_i = lse over its
    negatives − s·qᵢ·dᵢ for all N rows, the row losses' mean."""
    wanted, per_direction = set(directions), partition_mode == "per_direction"
    q_ND, d_ND, negs = rows["query_BD"], rows["document_BD"], rows.get("negatives_BKD")
    s, n = scalars["logit_scale"], rows["query_BD"].shape[0]
    # candidates [all documents; all first negatives; ...]: the negatives of row g at t·N + g
    cand_CD = d_ND if negs is None else torch.cat([d_ND, *negs.unbind(1)])
    pos_N = s * (q_ND * d_ND).sum(1)
    own_NN = eye(n, q_ND.device)
    ids = rows.get("ids_B")
    pair_NN = own_NN if ids is None else own_NN | (ids[:, None] == ids[None, :])
    hard_NC = torch.zeros(n, cand_CD.shape[0] - n, dtype=torch.bool, device=q_ND.device)
    q2d_NC = s * (q_ND @ cand_CD.T)
    parts = [lse_rows(q2d_NC, torch.cat([pair_NN, hard_NC], 1)) - pos_N]
    if "doc_to_query" in wanted:
        parts.append(lse_rows(q2d_NC[:, :n], pair_NN, 0) - pos_N)
    if "query_to_query" in wanted:
        parts.append(lse_rows(s * (q_ND @ q_ND.T), pair_NN) - pos_N)
    if "doc_to_doc" in wanted:
        own_hard_NC = own_NN.repeat(1, cand_CD.shape[0] // n - 1)  # its own hard negatives
        parts.append(lse_rows(s * (d_ND @ cand_CD.T), torch.cat([pair_NN, own_hard_NC], 1)) - pos_N)
    return _row_losses(parts, per_direction, "doc_to_query" in wanted).sum() / n


def _gathered_terms(
    call: Call,
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    ids_B: Tensor | None,
    s: Tensor,
    wanted: set[str],
) -> list[Tensor]:
    """Each selected direction's a_i for this rank's B rows, in DIRECTIONS order (query_to_doc
    first), over the all-gathered candidates, the joint softmax's extra term last."""
    n, b, off, sizes, group = call.n, call.b, call.offset, call.sizes, call.group
    d = query_BD.shape[1]
    k = 0 if negatives_BKD is None else negatives_BKD.shape[1]
    pos_B = s * (query_BD.to(call.acc) * document_BD.to(call.acc)).sum(1)
    # Candidates [all positives; all first negatives; ...; all k-th]: one all-gather of
    # each rank's B x J x D keys [document | negatives], then the negatives of row g
    # sit at t·N + g, t = 1..k.
    keys_BJD = (
        document_BD[:, None]
        if negatives_BKD is None
        else torch.cat([document_BD[:, None], negatives_BKD], 1)
    )
    gathered_NJD = all_gather(
        keys_BJD.reshape(b, (1 + k) * d), sizes=list(sizes), group=group, check=False
    )
    cand_CD = gathered_NJD.view(n, 1 + k, d).transpose(0, 1).reshape(-1, d)
    tile = call.tile(b, cand_CD.shape[0])
    ids = gathered_ids(ids_B, sizes, group)
    n_cols = n if "doc_to_query" in wanted else 0
    q2d_B, d2q_B = apply(
        PositiveLSE, query_BD, cand_CD, s, pos_B, off, (0,), n_cols, sizes, tile, group, ids
    )
    parts = [q2d_B, d2q_B] if n_cols else [q2d_B]
    if "query_to_query" in wanted:
        all_q_ND = all_gather(query_BD, sizes=list(sizes), group=group, check=False)
        q2q_B, _ = apply(
            PositiveLSE, query_BD, all_q_ND, s, pos_B, off, (0,), 0, sizes, tile, group, ids
        )
        parts.append(q2q_B)
    if "doc_to_doc" in wanted:
        own = tuple(t * n for t in range(1 + k))  # d_i itself and its own hard negatives
        d2d_B, _ = apply(
            PositiveLSE, document_BD, cand_CD, s, pos_B, off, own, 0, sizes, tile, group, ids
        )
        parts.append(d2d_B)
    return parts


def _ring_terms(
    call: Call,
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    ids_B: Tensor | None,
    s: Tensor,
    wanted: set[str],
) -> list[Tensor]:
    """`_gathered_terms` with every rank's keys passed around the ring (`PositiveRing`): one
    ring of [document | negatives] blocks for query_to_doc (its columns: doc_to_query), one
    of query blocks for query_to_query, one more of the key blocks for doc_to_doc."""
    b, d = query_BD.shape
    k = 0 if negatives_BKD is None else negatives_BKD.shape[1]
    keys_BX = (
        document_BD
        if negatives_BKD is None
        else torch.cat([document_BD[:, None], negatives_BKD], 1).reshape(b, (1 + k) * d)
    )
    sizes, group = call.sizes, call.group
    tile = call.tile(b, max(sizes) * (1 + k))
    cols = "doc_to_query" in wanted
    pos_B = s * (query_BD.to(call.acc) * document_BD.to(call.acc)).sum(1)
    ring = functools.partial(apply, PositiveRing)
    # its positives s·qᵢ·dᵢ are the ring's own (None): their gradient added in place
    q2d_B, d2q_B = ring(query_BD, keys_BX, s, None, 1 + k, (0,), cols, sizes, tile, group, ids_B)
    parts = [q2d_B, d2q_B] if cols else [q2d_B]
    if "query_to_query" in wanted:
        q2q_B, _ = ring(query_BD, query_BD, s, pos_B, 1, (0,), False, sizes, tile, group, ids_B)
        parts.append(q2q_B)
    if "doc_to_doc" in wanted:
        own = tuple(range(1 + k))  # d_i itself and its own hard negatives
        d2d_B, _ = ring(
            document_BD, keys_BX, s, pos_B, 1 + k, own, False, sizes, tile, group, ids_B
        )
        parts.append(d2d_B)
    return parts
