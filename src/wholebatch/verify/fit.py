"""The weights a failing step gives its micro-batches and items, read from its gradient (`Fit`, `NormFit`).

In the reference process: every micro-batch's own reference gradient is one
column, and the split gradient g and the whole-batch reference gradient are each
written as a weighted sum of the columns (least squares over every parameter
entry, `lstsq`): g = sum_j a_j grad L(micro-batch j). A mean over items gives
b_j = (micro-batch j's share of the items); a mean of per-micro-batch means
gives every a_j the same value; a wrong count scales every a_j alike. With the
spec's `normalize` and `item_losses` the same is done per (micro-batch,
sequence, group) cell of items, and `wholebatch.verify.normfit` names the mode.

Legend: P parameter entries, J micro-batches in all, C cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError
from wholebatch.train.normalize import Mode, Scope
from wholebatch.verify.batches import Batch, select_rows
from wholebatch.verify.normfit import cells_of, item_weights, read_weights
from wholebatch.verify.report import AuxFit, Fit, NormFit

if TYPE_CHECKING:
    from wholebatch.verify.spec import Spec

__all__ = ["fit_weights", "item_counts", "lstsq", "piece_counts"]


def _flat(grads: Mapping[str, Tensor | None], shapes: Mapping[str, torch.Size]) -> Tensor:
    parts = []
    for name, shape in shapes.items():
        g = grads.get(name)
        parts.append(
            g.double().flatten()
            if g is not None
            else torch.zeros(math.prod(shape), dtype=torch.float64)
        )
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


Solved = tuple[list[float], float, str]
"""Weights w minimising ||M w - y||, the relative residual, and why not if M cannot tell."""


def lstsq(m_PJ: Tensor, y_P: Tensor, what: str = "micro-batches") -> Solved:
    """Weights w minimising ||M w - y||, the relative residual, and why not if M cannot tell.

    A zero column (a micro-batch without items: its gradient is zero) takes weight 0
    exactly: any weight fits it, and it adds nothing."""
    return lstsq_sides(m_PJ, [y_P], what)[0][0]


def lstsq_sides(
    m_PJ: Tensor, ys: Sequence[Tensor], what: str = "micro-batches"
) -> tuple[list[Solved], float]:
    """`lstsq` of every y in `ys` on one M (one SVD, one solve), and M's condition number
    over its nonzero columns (inf where M cannot tell its columns apart)."""
    live = [c for c in range(m_PJ.shape[1]) if bool(m_PJ[:, c].any())]
    if 0 < len(live) < m_PJ.shape[1]:
        solved, condition = lstsq_sides(m_PJ[:, live], ys, what)
        out: list[Solved] = []
        for w_live, residual, why in solved:
            w = [0.0] * m_PJ.shape[1]
            for c, x in zip(live, w_live, strict=True):
                w[c] = x
            out.append(([math.nan] * len(w) if why else w, residual, why))
        return out, condition
    p, j = m_PJ.shape
    nan = [math.nan] * j
    if p < j:
        why = f"the model has {p} parameter entries, too few to tell {j} {what} apart"
        return [(nan, math.inf, why) for _ in ys], math.inf
    s = torch.linalg.svdvals(m_PJ)
    dependent = float(s.min()) <= 1e-9 * float(s.max())
    condition = math.inf if dependent else float(s.max() / s.min())
    solution = None if dependent else torch.linalg.lstsq(m_PJ, torch.stack(list(ys), 1)).solution
    out = []
    for i, y_P in enumerate(ys):
        if float(y_P.norm()) == 0:
            out.append((nan, math.inf, "the gradient is zero"))
        elif solution is None:
            why = f"the {what}' gradients are linearly dependent, so their weights are not unique"
            out.append((nan, math.inf, why))
        else:
            w = solution[:, i]
            residual = float((m_PJ @ w - y_P).norm() / y_P.norm())
            out.append(([float(x) for x in w], residual, ""))
    return out, condition


def item_counts(spec: Spec, batch: Batch) -> dict[str, int]:
    """Items in `batch` by each counting rule verify knows for it."""
    out: dict[str, int] = {}
    if spec.count_items is not None:
        out["count_items"] = int(spec.count_items(batch))
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, Tensor):
        out["labels != -100"] = int((labels != -100).sum())
        if labels.dim() >= 2:
            out["labels[..., 1:] != -100"] = int((labels[..., 1:] != -100).sum())
    return out


def piece_counts(spec: Spec, batch: Batch, pieces: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {"rows": [len(p) for p in pieces]}
    for idx in pieces:
        for rule, n in item_counts(spec, select_rows(batch, idx)).items():
            counts.setdefault(rule, []).append(n)
    return counts


def fit_weights(
    spec: Spec,
    batch: Batch,
    pieces: Sequence[Sequence[int]],
    piece_ranks: Sequence[int],
    fit_to: Mapping[str, Tensor | None],
    whole: Mapping[str, Tensor | None],
    build: Callable[[], nn.Module],
    seed: int,
) -> Fit:
    """The weight of each micro-batch (`pieces`: its rows) in the split gradient `fit_to` and in
    the reference gradient `whole` (`Fit`), and, with the spec's `normalize`, of each item.

    `build` gives a fresh model (dropout off); every micro-batch's reference gradient is
    one column of a least-squares fit over every parameter entry.
    """
    model = build()
    shapes = {name: p.shape for name, p in model.named_parameters()}

    def column(fn: Callable[[nn.Module, Batch], Tensor], rows: Batch) -> Tensor:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        torch.autograd.backward(fn(model, rows).reshape(()))
        return _flat({n: p.grad for n, p in model.named_parameters()}, shapes)

    columns = [column(spec.reference_loss, select_rows(batch, idx)) for idx in pieces]
    aux: AuxFit | None = None
    if spec.aux_loss is None:
        m_PJ = torch.stack(columns, dim=1)
        ((a, ra, why_a), (b, rb, why_b)), _ = lstsq_sides(
            m_PJ, [_flat(fit_to, shapes), _flat(whole, shapes)]
        )
    else:
        parts = [column(spec.aux_loss, select_rows(batch, idx)) for idx in pieces]
        a, b, ra, rb, why_a, why_b, aux = _aux_fit(
            columns,
            parts,
            column(spec.aux_loss, batch),
            _flat(fit_to, shapes),
            _flat(whole, shapes),
        )
    note = why_b or why_a
    if not note and rb >= 1e-5:
        note = (
            "reference_loss is not a weighted sum of its values on each micro-batch "
            f"(residual {rb:.1e}), as a mean over items would be"
            + (
                "; a term of the whole batch's statistics, such as an MoE load-balancing "
                "loss, is not: give the spec that term as aux_loss"
                if spec.aux_loss is None
                else ", plus aux_loss over the whole batch"
            )
        )
    counts = piece_counts(spec, batch, pieces)
    del counts["rows"]
    norm = (
        _norm_fit(spec, batch, pieces, piece_ranks, fit_to, whole, build)
        if spec.normalize is not None
        else None
    )
    return Fit(
        ranks=tuple(piece_ranks),
        split=tuple(a),
        reference=tuple(b),
        split_residual=ra,
        reference_residual=rb,
        counts={k: tuple(v) for k, v in counts.items()},
        note=note,
        norm=norm,
        aux=aux,
    )


# A side is read by the first of `_aux_fit`'s models that leaves less than this relative
# residual (round-off: ~1e-12 in float64, ~1e-6 in float32); a wrong model leaves ~1e-2.
_AUX_RESIDUAL = 1e-5


def _aux_fit(
    whole_j: Sequence[Tensor],
    aux_j: Sequence[Tensor],
    aux_all: Tensor,
    split: Tensor,
    reference: Tensor,
) -> tuple[list[float], list[float], float, float, str, str, AuxFit | None]:
    """Both gradients as sum_j a_j main_j + x aux(batch) + sum_j y_j aux_j, main_j = the
    gradient of reference_loss - aux_loss on micro-batch j: (a, b, the residuals, why not
    for each side, and the aux weights), `Fit`'s main weights first.

    Three models, tried in order, the first that fits taken: every y_j = 0 (aux_loss over
    the whole batch only, at x), every y_j = c (each micro-batch's own aux_loss at one
    weight), every y_j free. The first two have J + 1 and J + 2 unknowns, so micro-batches
    whose aux_loss gradients coincide (the same rows) leave them unique.
    """
    j = len(whole_j)
    main = [w - x for w, x in zip(whole_j, aux_j, strict=True)]
    models = (
        ("whole", torch.stack([*main, aux_all], dim=1)),
        ("per-micro-batch", torch.stack([*main, aux_all, torch.stack(list(aux_j)).sum(0)], dim=1)),
        ("free", torch.stack([*main, aux_all, *aux_j], dim=1)),
    )
    what = "terms (the main term and aux_loss on each micro-batch, aux_loss on the batch)"

    # Each side takes the first model that fits it; each model is solved once, for both.
    sides = (split, reference)
    tried: list[list[tuple[float, list[float], float]]] = [[], []]
    why = ["", ""]
    for kind, m_PC in models:
        solved, condition = lstsq_sides(m_PC, sides, what)
        for i, (w, r, why_i) in enumerate(solved):
            if tried[i] and tried[i][-1][0] < _AUX_RESIDUAL:
                continue  # this side has its model
            why[i] = why_i
            if not why_i:
                parts = (
                    [0.0] * j
                    if kind == "whole"
                    else [w[j + 1]] * j
                    if kind == "per-micro-batch"
                    else w[j + 1 :]
                )
                tried[i].append((r, [*w[: j + 1], *parts], condition))
        if all(t and t[-1][0] < _AUX_RESIDUAL for t in tried):
            break

    def side(i: int) -> tuple[list[float], float, str, float]:
        if not tried[i]:
            return [math.nan] * (2 * j + 1), math.inf, why[i], math.inf
        r, w, condition = min(tried[i], key=lambda t: t[0])  # the fitting one, else the closest
        return w, r, "", condition

    a, ra, why_a, condition = side(0)
    b, rb, why_b, _ = side(1)
    if why_a or why_b:
        return a[:j], b[:j], ra, rb, why_a, why_b, None
    aux = AuxFit(
        split_whole=a[j],
        split_parts=tuple(a[j + 1 :]),
        reference_whole=b[j],
        reference_parts=tuple(b[j + 1 :]),
        condition=condition,
    )
    return a[:j], b[:j], ra, rb, "", "", aux


# A side is read as a weighted sum of the cells' gradients below this relative residual
# (round-off: ~1e-12 in float64, ~1e-6 in float32).
_NORM_RESIDUAL = 1e-4


def _unread(mode: str, note: str) -> NormFit:
    """A normalisation that could not be read, and why."""
    return NormFit(
        declared=mode,
        found=None,
        expected=None,
        cells=0,
        split_residual=math.inf,
        reference_residual=math.inf,
        note=note,
    )


def _norm_fit(
    spec: Spec,
    batch: Batch,
    pieces: Sequence[Sequence[int]],
    piece_ranks: Sequence[int],
    fit_to: Mapping[str, Tensor | None],
    whole: Mapping[str, Tensor | None],
    build: Callable[[], nn.Module],
) -> NormFit:
    """The item weights of the split gradient and the reference, named (`wholebatch.verify.normfit`)."""
    norm, item_losses = spec.normalize, spec.item_losses
    assert norm is not None and item_losses is not None
    model = build()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    per_rank: dict[int, list[int]] = {}  # rank -> its micro-batches (indices into pieces)
    all_items: list[dict[str, Tensor]] = []
    cells: list[Tensor] = []
    offsets: list[int] = []
    columns: list[Tensor] = []
    try:
        for j, idx in enumerate(pieces):
            sub = select_rows(batch, idx)
            items, cell_I, n_cells = cells_of(norm, sub, j)
            try:
                losses = item_losses(model, sub)
            except Exception as exc:  # the micro-batch fit and the floor still stand
                raise WholebatchError(
                    f"item_losses(model, micro-batch {j}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(losses, Tensor) or tuple(losses.shape) != tuple(items["mask"].shape):
                got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
                raise WholebatchError(
                    f"item_losses returned {got} where normalize.items gives a mask of shape "
                    f"{tuple(items['mask'].shape)}; it must return one loss per item"
                )
            per_rank.setdefault(piece_ranks[j], []).append(j)
            all_items.append(items)
            offsets.append(len(columns))
            cells.append(cell_I)
            flat_I = losses.reshape(-1)
            for c in range(n_cells):
                grads = torch.autograd.grad(
                    flat_I[cell_I == c].sum(),
                    [p for _, p in named],
                    retain_graph=True,
                    allow_unused=True,
                )
                columns.append(
                    _flat({n: g for (n, _), g in zip(named, grads, strict=True)}, shapes)
                )
    except WholebatchError as exc:
        return _unread(norm.mode, str(exc))
    if not columns:
        return _unread(norm.mode, "no item is in the mask")
    m_PC = torch.stack(columns, dim=1)
    cells_named = "(micro-batch, sequence, group) cells"
    ((a, ra, why_a), (b, rb, why_b)), _ = lstsq_sides(
        m_PC, [_flat(fit_to, shapes), _flat(whole, shapes)], cells_named
    )
    ranks = [per_rank[r] for r in sorted(per_rank)]
    items_rk = [[all_items[j] for j in js] for js in ranks]

    def named_as(weights: Sequence[float], residual: float, why: str) -> tuple[Mode, Scope] | None:
        if why or residual >= _NORM_RESIDUAL:
            return None
        flat = item_weights(cells, offsets, weights)  # [piece] -> [I]
        shaped = [[flat[j] for j in js] for js in ranks]
        return read_weights(items_rk, shaped, first=norm.mode, constant=norm.constant)

    expected = named_as(b, rb, why_b)
    found = named_as(a, ra, why_a)
    note = why_b or why_a
    if not note and rb >= _NORM_RESIDUAL:
        note = f"reference_loss is not a weighted sum of item_losses (residual {rb:.1e})"
    elif not note and ra >= _NORM_RESIDUAL:
        note = f"the split gradient is not a weighted sum of item_losses' cells (residual {ra:.1e})"
    elif not note and (expected is None or found is None):
        side = "reference_loss" if expected is None else "the split step"
        note = f"the item weights of {side} match no normalisation mode"
    return NormFit(
        declared=norm.mode,
        found=found,
        expected=expected,
        cells=len(columns),
        split_residual=ra,
        reference_residual=rb,
        note=note,
    )
