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
query, one softmax per direction) is `clip_loss`.

    .venv/bin/python -m benchmarks.bench_losses --only info_nce   # memory and time vs naive

Legend: W ranks, B this rank's queries, N global queries (sum of B), k hard
negatives per query, J = 1 + k key rows per query (its document and its hard
negatives), C = N·J candidate documents, D embedding dim, T tile size.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather
from wholebatch.comm.groups import get_rank
from wholebatch.conventions import GradReduction
from wholebatch.losses import replicated
from wholebatch.losses.common import Prepared, resolve_strategy, resolve_tile, whole
from wholebatch.losses.meshgroup import prepare_on
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.specs import SPECS, Strategy, strategy_code, strategy_problem
from wholebatch.losses.tiles import PositiveLSE, compute_dtype, softplus

__all__ = ["DIRECTIONS", "Direction", "PartitionMode", "info_nce_loss"]

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
PartitionMode = Literal["joint", "per_direction"]
DIRECTIONS: tuple[str, ...] = SPECS["info_nce"].directions
_PARTITIONS: tuple[str, ...] = ("joint", "per_direction")
SPEC = SPECS["info_nce"]


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


def info_nce_loss(
    query_BD: Tensor,
    document_BD: Tensor,
    logit_scale: Tensor | float = 20.0,
    *,
    negatives_BKD: Tensor | None = None,
    directions: Sequence[Direction] = ("query_to_doc",),
    partition_mode: PartitionMode = "joint",
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
        group, mesh, batch_dims: the process group (default: the world), or a `DeviceMesh`
            and its dims that split the batch (`losses.meshgroup`: a replica's gradient).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
            "sum" if they are summed.
        tile_size: rows and columns of one logits tile; None: chosen for the device
            (`wholebatch.losses.tile_size_for`). Ranks may differ.
        sizes: every rank's query count B, if the caller knows them: with the
            cross-rank checks off the call makes no metadata exchange and no host sync.
        check: run the cross-rank checks even when `sizes` is given (default:
            the process setting, on).
        strategy: "gather" (the all-gathers above), "ring" (blocks around the ring, memory
            O(B·(1 + k)·D + T²): `losses.ring`) or "auto"; as for `clip_loss`.
    """
    negs = negatives_BKD
    k = negs.shape[1] if isinstance(negs, Tensor) and negs.dim() == 3 else 0
    prep, group = _prepare(
        query_BD, document_BD, negatives_BKD, logit_scale, k, directions, partition_mode,
        strategy, grad_reduction=grad_reduction, tile_size=tile_size, sizes=sizes, check=check,
        group=group, mesh=mesh, batch_dims=batch_dims,
    )  # fmt: skip
    rows = partial(
        _row_losses, partition_mode=partition_mode, doc_to_query="doc_to_query" in directions
    )
    wanted: set[str] = set(directions)
    args = (query_BD, document_BD, negatives_BKD, wanted, rows)
    if prep.replicated:  # every rank all N rows (losses/replicated.py)
        return replicated.info_nce(*args, prep, group)
    gathered = sum(prep.sizes) * (1 + k) * query_BD.shape[1] * query_BD.element_size()
    return _tiled(*args, resolve_strategy(strategy, gathered) == "ring", prep, tile_size, group)


def _tiled(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    wanted: set[str],
    row_losses: Any,
    ring: bool,
    prep: Prepared,
    tile_size: int | None,
    group: ProcessGroup | None,
) -> Tensor:
    """The gathered or ring forms: each rank its B rows' terms, then the whole-batch sum."""
    s = prep.scalars[0]
    pos_B = s * (query_BD.to(compute_dtype(query_BD.dtype)) * document_BD.to(s.dtype)).sum(1)
    terms = _ring_terms if ring else _direction_terms
    parts = terms(query_BD, document_BD, negatives_BKD, s, pos_B, wanted, prep, tile_size, group)
    return whole(row_losses(parts).sum() / sum(prep.sizes), prep, group)


def _prepare(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    logit_scale: Tensor | float,
    k: int,
    directions: object,
    partition_mode: object,
    strategy: object,
    **common: Any,
) -> tuple[Prepared, ProcessGroup | None]:
    """`prepare_on` (the group, on a mesh the batch dims') with InfoNCE's options (k,
    directions, partition mode, strategy) agreed."""
    mask, err = _check_options(directions, partition_mode)
    partition = _PARTITIONS.index(str(partition_mode)) if err is None else 0
    values = (k, mask, partition, strategy_code(strategy))
    return prepare_on(
        SPEC.function,
        {"query_BD": query_BD, "document_BD": document_BD, "negatives_BKD": negatives_BKD},
        {"logit_scale": logit_scale},
        options={name: (v, fix) for (name, fix), v in zip(SPEC.options, values, strict=True)},
        error=err or strategy_problem(SPEC, strategy),
        small=SPEC.replicable(strategy),
        carry=True,
        **common,
    )


def _row_losses(parts: list[Tensor], partition_mode: str, doc_to_query: bool) -> Tensor:
    """Each row's loss from its directions' a_i: one softmax over all ("joint"), or a mean of CEs."""
    if partition_mode == "per_direction":
        return torch.stack([softplus(a) for a in parts]).mean(0)
    if doc_to_query:
        # doc_to_query's own pair d_i·q_i is the positive logit itself: in the
        # joint softmax it is one more term, exp(0) relative to the positive.
        parts = [*parts, torch.zeros_like(parts[0])]
    return softplus(torch.logsumexp(torch.stack(parts), 0))


def _direction_terms(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    s: Tensor,
    pos_B: Tensor,
    wanted: set[str],
    prep: Prepared,
    tile_size: int | None,
    group: ProcessGroup | None,
) -> list[Tensor]:
    """Each selected direction's a_i = lse over its negatives − the positive, in DIRECTIONS order
    (query_to_doc first), for this rank's B rows."""
    rank, n = get_rank(group), sum(prep.sizes)
    offset, b = sum(prep.sizes[:rank]), prep.sizes[rank]
    d = query_BD.shape[1]
    k = 0 if negatives_BKD is None else negatives_BKD.shape[1]
    # Candidates [all positives; all first negatives; ...; all k-th]: one all-gather of
    # each rank's B x J x D keys [document | negatives], then the negatives of row g
    # sit at t·N + g, t = 1..k.
    keys_BJD = (
        document_BD[:, None]
        if negatives_BKD is None
        else torch.cat([document_BD[:, None], negatives_BKD], 1)
    )
    gathered_NJD = all_gather(
        keys_BJD.reshape(b, (1 + k) * d), sizes=prep.sizes, group=group, check=False
    )
    cand_CD = gathered_NJD.view(n, 1 + k, d).transpose(0, 1).reshape(-1, d)
    tile = resolve_tile(tile_size, query_BD.device, b, cand_CD.shape[0])
    sizes_t = tuple(prep.sizes)
    n_cols = n if "doc_to_query" in wanted else 0
    q2d_B, d2q_B = PositiveLSE.apply(  # type: ignore[no-untyped-call]
        query_BD, cand_CD, s, pos_B, offset, (0,), n_cols, sizes_t, tile, group
    )
    parts = [q2d_B]
    if n_cols:
        parts.append(d2q_B)
    if "query_to_query" in wanted:
        all_q_ND = all_gather(query_BD, sizes=prep.sizes, group=group, check=False)
        q2q_B, _ = PositiveLSE.apply(  # type: ignore[no-untyped-call]
            query_BD, all_q_ND, s, pos_B, offset, (0,), 0, sizes_t, tile, group
        )
        parts.append(q2q_B)
    if "doc_to_doc" in wanted:
        own = tuple(t * n for t in range(1 + k))  # d_i itself and its own hard negatives
        d2d_B, _ = PositiveLSE.apply(  # type: ignore[no-untyped-call]
            document_BD, cand_CD, s, pos_B, offset, own, 0, sizes_t, tile, group
        )
        parts.append(d2d_B)
    return parts


def _ring_terms(
    query_BD: Tensor,
    document_BD: Tensor,
    negatives_BKD: Tensor | None,
    s: Tensor,
    pos_B: Tensor,
    wanted: set[str],
    prep: Prepared,
    tile_size: int | None,
    group: ProcessGroup | None,
) -> list[Tensor]:
    """`_direction_terms` with every rank's keys passed around the ring (`PositiveRing`):
    one ring of [document | negatives] blocks for query_to_doc (its columns: doc_to_query),
    one of query blocks for query_to_query, one more of the key blocks for doc_to_doc."""
    b, d = query_BD.shape
    k = 0 if negatives_BKD is None else negatives_BKD.shape[1]
    keys_BX = (
        document_BD
        if negatives_BKD is None
        else torch.cat([document_BD[:, None], negatives_BKD], 1).reshape(b, (1 + k) * d)
    )
    sizes_t = tuple(prep.sizes)
    tile = resolve_tile(tile_size, query_BD.device, b, max(sizes_t) * (1 + k))
    cols = "doc_to_query" in wanted
    ring = PositiveRing.apply
    # its positives s·qᵢ·dᵢ are the ring's own (None): their gradient added in place
    q2d_B, d2q_B = ring(query_BD, keys_BX, s, None, 1 + k, (0,), cols, sizes_t, tile, group)  # type: ignore[no-untyped-call]
    parts = [q2d_B, d2q_B] if cols else [q2d_B]
    if "query_to_query" in wanted:
        q2q_B, _ = ring(query_BD, query_BD, s, pos_B, 1, (0,), False, sizes_t, tile, group)  # type: ignore[no-untyped-call]
        parts.append(q2q_B)
    if "doc_to_doc" in wanted:
        own = tuple(range(1 + k))  # d_i itself and its own hard negatives
        d2d_B, _ = ring(document_BD, keys_BX, s, pos_B, 1 + k, own, False, sizes_t, tile, group)  # type: ignore[no-untyped-call]
        parts.append(d2d_B)
    return parts
