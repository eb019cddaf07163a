"""One-process float64 references of every whole-batch loss, written from the papers' definitions.

Independent of the library's own reference formulas (`LossSpec.formula`): plain
loops over anchors, positives and candidates, `F.cross_entropy` and
`F.logsigmoid`, so a shared mistake cannot hide. Each takes the whole batch's
rows (name -> (N, ...) tensor, as `wholebatch.losses.examples.whole` builds them)
and the scalars (name -> 0-d tensor) and returns L; gradients by autograd.

`REFERENCES` holds one per spec: `tests/distributed/test_loss_specs.py` fails
for a spec without one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Reference = Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor]


def _not_same(ids: Tensor | None, i: int, j: int) -> bool:
    """Whether candidate j may be row i's negative under `ids_B=` (never its own pair here)."""
    return ids is None or bool(ids[i] != ids[j])


def clip(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """CLIP (Radford et al. 2021): the mean of the image->text and text->image cross-entropies,
    each row's softmax over its own positive and the texts (images) of other ids."""
    img, txt, s = rows["image_BD"], rows["text_BD"], sc["logit_scale"]
    ids = rows.get("ids_B")
    logits = s * img @ txt.T
    n = img.shape[0]
    terms = []
    for i in range(n):
        keep = [j for j in range(n) if j == i or _not_same(ids, i, j)]
        row = logits[i, keep]
        col = logits[keep, i]
        at = keep.index(i)
        terms.append((torch.logsumexp(row, 0) - row[at] + torch.logsumexp(col, 0) - col[at]) / 2)
    loss = torch.stack(terms).mean()
    return loss + 0.0 * sc["logit_bias"] if "logit_bias" in sc else loss


def siglip(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """SigLIP (Zhai et al. 2023): −Σᵢⱼ log σ(yᵢⱼ(s·IᵢTⱼ + b)) / N, y = +1 on the diagonal."""
    img, txt = rows["image_BD"], rows["text_BD"]
    n = img.shape[0]
    y = 2 * torch.eye(n, dtype=img.dtype) - 1
    return -F.logsigmoid(y * (sc["logit_scale"] * img @ txt.T + sc["logit_bias"])).sum() / n


def _two_views(a: Tensor, b: Tensor, s: Tensor, with_positive: bool) -> Tensor:
    """NT-Xent (with_positive) or DCL over the 2N views [a; b]: the mean over views i of
    −s·zᵢ·zᵢ' + log Σ over k ≠ i (and, for DCL, k ≠ i') of exp(s·zᵢ·z_k)."""
    n = a.shape[0]
    z = torch.cat([a, b])
    logits = s * z @ z.T
    terms = []
    for i in range(2 * n):
        pair = (i + n) % (2 * n)
        keep = [k for k in range(2 * n) if k != i and (with_positive or k != pair)]
        if not keep:  # a whole batch of one sample (DCL): no negative, counted as 0
            terms.append(0.0 * logits[i, i])
            continue
        terms.append(torch.logsumexp(logits[i, keep], 0) - logits[i, pair])
    return torch.stack(terms).mean()


def nt_xent(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    return _two_views(rows["z1_BD"], rows["z2_BD"], 1 / sc["temperature"], True)


def dcl(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """DCL (Yeh et al. 2022): NT-Xent with the positive left out of the denominator."""
    return _two_views(rows["a_BD"], rows["b_BD"], sc["logit_scale"], False)


def info_nce(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """InfoNCE / MultipleNegativesRankingLoss (query_to_doc): each query against every document
    and every hard negative; under ids_B the documents of other rows of its id left out."""
    q, d, s = rows["query_BD"], rows["document_BD"], sc["logit_scale"]
    negs, ids = rows.get("negatives_BKD"), rows.get("ids_B")
    n = q.shape[0]
    hard = [] if negs is None else [negs[j, t] for j in range(n) for t in range(negs.shape[1])]
    terms = []
    for i in range(n):
        docs = [d[j] for j in range(n) if j == i or _not_same(ids, i, j)]
        at = [j for j in range(n) if j == i or _not_same(ids, i, j)].index(i)
        cand = torch.stack(docs + hard)
        logits = s * cand @ q[i]
        terms.append(torch.logsumexp(logits, 0) - logits[at])
    return torch.stack(terms).mean()


def supcon(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """SupCon (Khosla et al. 2020, L_out): for each anchor with positives, the mean over them of
    −log(exp(s zᵢ·z_p) / Σ_{a≠i} exp(s zᵢ·z_a)); the mean over those anchors (0 if none)."""
    z, y, s = rows["features_BD"], rows["labels_B"], sc["logit_scale"]
    n = z.shape[0]
    logits = s * z @ z.T
    terms = []
    for i in range(n):
        positives = [p for p in range(n) if p != i and y[p] == y[i]]
        if not positives:
            continue
        log_z = torch.logsumexp(logits[i, [a for a in range(n) if a != i]], 0)
        terms.append(torch.stack([log_z - logits[i, p] for p in positives]).mean())
    return torch.stack(terms).mean() if terms else 0.0 * logits.sum()


def maxsim(rows: dict[str, Tensor], sc: dict[str, Tensor]) -> Tensor:
    """ColBERT's MaxSim (Khattab and Zaharia 2020): score(i, j) = Σ over query i's valid tokens of
    the max over document j's valid tokens of the dot product; each query's cross-entropy over
    every document, its own the target; the mean over queries."""
    q, qm, d, dm = rows["queries_BQD"], rows["query_mask_BQ"], rows["docs_BTD"], rows["doc_mask_BT"]
    n = q.shape[0]
    scores = []
    for i in range(n):
        row = []
        for j in range(n):
            best = [torch.stack([q[i, t] @ d[j, u] for u in range(d.shape[1]) if dm[j, u]]).max()
                    for t in range(q.shape[1]) if qm[i, t]]  # fmt: skip
            row.append(torch.stack(best).sum() if best else 0.0 * q.sum())
        scores.append(torch.stack(row))
    logits = sc["logit_scale"] * torch.stack(scores)
    return F.cross_entropy(logits, torch.arange(n))


REFERENCES: dict[str, Reference] = {
    "clip": clip,
    "siglip": siglip,
    "nt_xent": nt_xent,
    "info_nce": info_nce,
    "dcl": dcl,
    "supcon": supcon,
    "maxsim": maxsim,
}
