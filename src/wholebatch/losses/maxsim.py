"""Late-interaction (MaxSim, ColBERT) InfoNCE over the whole batch: queries and documents as token sets.

Khattab and Zaharia, "ColBERT" (SIGIR 2020, arXiv:2004.12832): with query i's
valid tokens q_it and document j's valid tokens d_ju,

    score(i, j) = Σ_t max_u q_it·d_ju,

and each query's cross-entropy over the whole batch's documents (every rank's,
rank order), its own document the positive, s = `logit_scale` the multiplier:

    L = (1/N) Σ_i −log( exp(s·score(i, i)) / Σ_j exp(s·score(i, j)) ).

Token sets are ragged: each row has its own valid tokens (the masks), and each
rank may pad to its own Q and T (the exchange agrees every rank's; the blocks
are padded to the largest). colpali PR #412 and pylate PR #212 ask for this loss
with memory that does not grow with the batch: the kernels (`late`) hold one
tile of token similarities at a time, never N x Q x T x ... .

Memory: gather O(N·T·D + tile) (the gathered documents, their gradient); ring
O(B·T·D + tile) whatever N and W. The small path (`wholebatch.losses.small`)
runs only while its dense N x N x Q x T similarities fit its 16 MiB.

Legend: W ranks, B this rank's rows, N global rows, Q query tokens, T document
tokens (per row, padded), D dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather, apply
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import Call, documented, shared, validate
from wholebatch.losses.late import MaxSimLSE, MaxSimRing, maxsim_pairs, maxsim_scores
from wholebatch.losses.small import evaluate, eye, lse_rows
from wholebatch.losses.specs import SPECS, Strategy
from wholebatch.losses.tiles import softplus

__all__ = ["maxsim_formula", "maxsim_loss"]

SPEC = SPECS["maxsim"]


def _check_masks(q: object, qm: object, d: object, dm: object) -> str | None:
    """Why the masks are unusable (shapes, dtype, a document without a valid token), or None."""
    for name, mask, x in (("query_mask_BQ", qm, q), ("doc_mask_BT", dm, d)):
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            return f"{name} must be a bool tensor (True: a valid token), got {got}"
        if isinstance(x, Tensor) and x.dim() == 3 and mask.shape != x.shape[:2]:
            return f"{name} has shape {tuple(mask.shape)}, its tokens {tuple(x.shape[:2])}"
    empty = (~cast(Tensor, dm).any(1)).nonzero().flatten().tolist()  # a bool tensor: checked
    if empty:
        return f"documents {empty[:8]} have no valid token; give every document one"
    return None


@documented(SPEC)
def maxsim_loss(
    queries_BQD: Tensor,
    query_mask_BQ: Tensor,
    docs_BTD: Tensor,
    doc_mask_BT: Tensor,
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
    """MaxSim InfoNCE over the whole batch (the module docstring): the same on every rank.

    Every rank of `group` must call it. ``strategy="gather"`` (default) all-gathers
    the documents (padded to the largest rank's T) and sweeps this rank's queries
    against them in tiles; ``"ring"`` passes each rank's document block around the
    ring instead; ``"auto"`` rings past 1 GiB of gathered documents. Each row's loss is
    softplus(lse over the other documents − its positive), float32 for 16-bit inputs.
    With `sizes=` and `check=False` (no exchange) every rank must pad to the same Q and T.

    Backward (gradient contract): with ``grad_reduction="mean"``, after DDP averages
    over W ranks, the gradients of both encoders and of `logit_scale` (every rank's
    copy gets dL/ds) equal one process's on the concatenated batch; with ``"sum"``,
    after a sum over ranks. A max's gradient goes to the document token attaining it.

    Args:
        queries_BQD: this rank's query token embeddings (B x Q x D).
        query_mask_BQ: which query tokens are valid (bool, B x Q).
        docs_BTD: this rank's document token embeddings (B x T x D); row i is query i's
            positive.
        doc_mask_BT: which document tokens are valid (bool, B x T; every row at least one).
        logit_scale: s, the multiplier of the scores, a 1-element tensor or a number, the
            same on every rank.
        {common}
    """
    err = _check_masks(queries_BQD, query_mask_BQ, docs_BTD, doc_mask_BT)
    tokens = [
        x.shape[1] if isinstance(x, Tensor) and x.dim() == 3 else 0 for x in (queries_BQD, docs_BTD)
    ]
    call = validate(
        SPEC,
        {"queries_BQD": queries_BQD, "docs_BTD": docs_BTD},
        {"logit_scale": logit_scale},
        per_rank=tokens,
        error=err,
        **shared(locals()),
    )
    q_max, t_max = (max(call.per_rank[f]) for f in SPEC.per_rank)
    d = queries_BQD.shape[-1]
    # the small path holds the gathered rows and the dense N x N x Q x T similarities
    dense = max((q_max + t_max) * d, call.n * q_max * t_max)
    call = call.choose(key_elements=t_max * d, row_elements=dense)
    docs, doc_mask = _pad(docs_BTD, doc_mask_BT, t_max)
    if call.path == "small":
        queries, query_mask = _pad(queries_BQD, query_mask_BQ, q_max)
        rows = {
            "queries_BQD": queries,
            "query_mask_BQ": query_mask,
            "docs_BTD": docs,
            "doc_mask_BT": doc_mask,
        }
        return evaluate(call, rows, maxsim_formula)
    return call.whole(_share(call, queries_BQD, query_mask_BQ, docs, doc_mask))


def maxsim_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    """MaxSim InfoNCE's reference formula on the whole batch, densely (N x N x Q x T)."""
    scores_NN = maxsim_scores(
        rows["queries_BQD"], rows["query_mask_BQ"], rows["docs_BTD"], rows["doc_mask_BT"]
    )
    z_NN = scalars["logit_scale"] * scores_NN
    own = eye(z_NN.shape[0], z_NN.device)
    return softplus(lse_rows(z_NN, own) - z_NN.diagonal()).mean()


def _pad(x_BXD: Tensor, mask_BX: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """Tokens padded to `tokens` (zeros, not valid): every rank's blocks one shape."""
    extra = tokens - x_BXD.shape[1]
    if extra <= 0:
        return x_BXD, mask_BX
    return F.pad(x_BXD, (0, 0, 0, extra)), F.pad(mask_BX, (0, extra), value=False)


def _share(call: Call, q_BQD: Tensor, qm_BQ: Tensor, d_BTD: Tensor, dm_BT: Tensor) -> Tensor:
    """This rank's queries' share: Σ softplus(a_i) / N, documents gathered or around the ring."""
    s, acc = call.scalars["logit_scale"], call.acc
    pos_B = s * maxsim_pairs(q_BQD.to(acc), qm_BQ, d_BTD.to(acc), dm_BT)
    tile = call.tile(call.b, max(call.sizes))
    if call.path == "ring":
        a_B = apply(
            MaxSimRing,
            q_BQD,
            qm_BQ,
            d_BTD,
            dm_BT.to(torch.uint8),
            s,
            pos_B,
            call.sizes,
            tile,
            call.group,
        )
    else:
        sizes, group = list(call.sizes), call.group
        all_d = all_gather(d_BTD, sizes=sizes, group=group, check=False)
        all_m = all_gather(dm_BT.to(torch.uint8), sizes=sizes, group=group, check=False)
        a_B = apply(MaxSimLSE, q_BQD, qm_BQ, all_d, all_m, s, pos_B, call.offset, tile)
    return softplus(a_B).sum() / call.n
