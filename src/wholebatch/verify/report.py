"""What `wholebatch verify` found: per-parameter comparisons, the evidence, the report.

`compare` puts one run's gradients (every rank) next to the whole-batch
reference. Per parameter: the largest absolute error over ranks, that error
relative to the parameter's scale (`param_scales`), and the ratio
<g, g_ref> / <g_ref, g_ref> (g: rank 0's gradient), which reads "the split
gradient is this multiple of the right one". `VerifyReport` holds the runs, the
evidence about the step, the round-off floor and the diagnoses
(`wholebatch.verify.diagnose`), and prints them.

A parameter's scale is the largest reference entry of its module (the
parameters whose names share its prefix: `attn.k_proj.weight` and
`attn.k_proj.bias`), and at least `MODEL_FLOOR` of the largest over the model.
Its own largest entry is not enough: an attention key bias has an exact gradient
of zero (softmax is shift-invariant), so both sides hold round-off of the size
of the key weight's gradient times eps, and their difference relative to that
round-off is O(1) whatever the precision. Its module's gradient is what its
computation produces; a parameter that should move and does not is still off by
its whole gradient, which is that module's scale unless it is a thousand times
smaller than the model's largest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from wholebatch.train.normalize import Mode, Scope

__all__ = [
    "MODEL_FLOOR",
    "AuxFit",
    "Comparison",
    "Diagnosis",
    "Evidence",
    "Fit",
    "Floor",
    "NormFit",
    "ParamError",
    "VerifyReport",
    "compare",
    "error_report",
    "param_scales",
]

MODEL_FLOOR = 1e-3
"""A parameter's scale is at least this fraction of the model's largest reference entry
(for a module whose whole gradient is round-off)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamError:
    """One parameter's gradient against the reference."""

    name: str
    """Parameter name, as `model.named_parameters()` gives it."""

    shape: tuple[int, ...]
    """Parameter shape."""

    ref_max: float
    """Largest |entry| of the reference gradient."""

    abs_err: float
    """Largest |split - reference| over entries and ranks."""

    rel_err: float
    """abs_err / scale (abs_err itself when the whole reference is zero)."""

    ratio: float
    """<g, g_ref> / <g_ref, g_ref> with g rank 0's gradient (NaN when the reference is zero)."""

    fit_err: float
    """Largest |g - ratio·g_ref| / scale: small when g is just a multiple of the reference."""

    rank_spread: float
    """Largest |g_r - g_0| / scale over ranks: nonzero when ranks hold different gradients."""

    missing: bool
    """True when the reference has a gradient above round-off and some rank's step left none."""

    ok: bool
    """rel_err <= rtol and a gradient on every rank where the reference has one."""

    scale: float = 1.0
    """What the error is relative to (`param_scales`): its module's largest reference entry,
    at least MODEL_FLOOR of the model's."""

    rtol: float = 0.0
    """The tolerance it was judged at."""

    ref_norm: float = 0.0
    """||g_ref||: with `ratio`, the whole model's ratio is sum(ratio ref_norm^2) / sum(ref_norm^2)."""

    @property
    def live(self) -> bool:
        """The reference gradient stands above round-off at the tolerance (its largest entry
        over rtol x scale): a gradient that should move the parameter."""
        return self.ref_max > self.rtol * self.scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Every parameter of one run: a split (W, K) under a condition (dropout, equal items)."""

    variant: str
    """The run's name: "as given", "dropout off", "equal items, dropout off", "W=1, K=3" ..."""

    world_size: int
    """W of this run."""

    micro_batches: int
    """K of this run."""

    dropout: bool
    """Dropout as the model has it (recorded and replayed) rather than off."""

    equal: bool
    """Ran on `equal_batch`."""

    params: tuple[ParamError, ...]
    """Per parameter, in model order."""

    rtol: float
    """The tolerance applied."""

    step_calls: tuple[int, ...]
    """How often each rank's step called `optimizer.step()`."""

    @property
    def ok(self) -> bool:
        """Every parameter within tolerance."""
        return all(p.ok for p in self.params)

    @property
    def max_rel_err(self) -> float:
        """The worst parameter's relative error (NaN if any is NaN)."""
        errs = [p.rel_err for p in self.params]
        if any(math.isnan(e) for e in errs):
            return math.nan
        return max(errs, default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evidence:
    """What the step did besides its gradients (any of it can fail a step)."""

    kind: str
    """"step" (a VerifySpec) or "trainer" (a TrainerSpec)."""

    step_calls: tuple[int, ...]
    """`optimizer.step()` calls per rank."""

    changed: tuple[tuple[str, ...], ...]
    """Per rank, the parameters the step changed itself (it stepped another optimizer)."""

    collectives: tuple[Mapping[str, int], ...]
    """Per rank, torch.distributed collectives called on tensors that need gradient."""

    reference_zero: bool
    """The reference gradient is zero (or absent) for every parameter."""

    reference_spread: float
    """How far two reference runs with different seeds differ (relative): randomness
    verify cannot replay (not `nn.Dropout`) when it exceeds the tolerance."""

    item_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Items in the whole batch by counting rule ("count_items", "labels != -100",
    "labels[..., 1:] != -100"), where verify can count them."""

    in_functions: tuple[Mapping[str, int], ...] = ()
    """Per rank, collectives called inside custom autograd Functions:
    "Function.forward: torch.distributed.all_gather" -> calls (a GatherLayer)."""

    redrawn: tuple[tuple[str, ...], ...] = ()
    """Per rank, the dropout modules that drew new masks in a second pass over rows they
    had seen (a second forward, or a recomputation in backward): RNG not replayed."""

    rows_note: str = ""
    """Why the rows each micro-batch held could not be told (a trainer's forwards that
    verify could not match to the batch's rows), when they could not."""

    mesh: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """On a device mesh: its dims and sizes ({"dp": 2, "tp": 2}); empty for a flat world."""

    row_dims: tuple[str, ...] = ()
    """On a mesh: the dims whose ranks got different rows (the others replicate them)."""

    shards: tuple[int, ...] = ()
    """On a mesh: per rank, the row shard it held."""

    inputs: tuple[tuple[float, ...], ...] = ()
    """On a mesh: per rank, a fingerprint of each forward's arguments."""

    owned: tuple[tuple[str, ...], ...] = ()
    """On a mesh: per rank, the parameters its step gave a gradient (a pipeline stage's)."""

    rank_factors: tuple[float | None, ...] = ()
    """On a mesh: per rank, the one factor its shards of the gradient are of the
    reference's (None where they are not one multiple)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Floor:
    """The round-off the model's own arithmetic implies, next to the tolerance."""

    dtypes: tuple[str, ...]
    """Floating dtypes the reference forward computed in."""

    unit_roundoff: float
    """Machine epsilon of the least precise of them."""

    measured: float | None
    """Relative difference of the reference on the same batch with its rows reversed (the
    round-off of summing in another order), if measured."""

    rtol: float
    """The tolerance applied."""

    rtol_from: str
    """Where `rtol` came from ("the spec", or the dtypes)."""

    autocast: tuple[str, ...] = ()
    """The autocasts the step or the reference ran under ("cpu:bfloat16", "cuda:float16")."""

    autocast_measured: float | None = None
    """Relative difference of the reference under the step's autocast from the reference
    without it (the round-off of computing in that dtype), if measured."""

    @property
    def value(self) -> float:
        """The floor: the largest of the measured errors and the unit round-off."""
        return max(self.measured or 0.0, self.autocast_measured or 0.0, self.unit_roundoff)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fit:
    """The weight each micro-batch gets in the split gradient (a) and in the reference (b).

    Both gradients are written as sums of the gradients of `reference_loss` on each
    micro-batch alone (least squares over every parameter entry). For a loss that is
    a mean over items, b_j is micro-batch j's share of the items.
    """

    ranks: tuple[int, ...]
    """The rank each micro-batch ran on."""

    split: tuple[float, ...]
    """a_j: implied weights of the split gradient."""

    reference: tuple[float, ...]
    """b_j: weights of the reference gradient."""

    split_residual: float
    """||g - sum a_j g_j|| / ||g||: small when the split gradient is such a sum."""

    reference_residual: float
    """The same for the reference: small when the loss is additive over micro-batches."""

    counts: Mapping[str, tuple[int, ...]]
    """Item counts of each micro-batch by a counting rule ("count_items", "labels != -100",
    "labels[..., 1:] != -100"), where known."""

    note: str = ""
    """Why the weights could not be read, when they could not."""

    tolerance: float = 1e-5
    """How far the split gradient may be from a weighted sum (relative) and its weights
    from a reading: the tolerance of the comparison, at least 1e-5 (a step under bf16
    autocast rounds its gradient far above float32's)."""

    norm: NormFit | None = None
    """The normalisation each side applies to the items, when the spec gives
    `normalize` and `item_losses`."""

    aux: AuxFit | None = None
    """With the spec's `aux_loss`: the weights of its whole-batch and per-micro-batch
    values. `split` and `reference` are then the weights of the main term
    (`reference_loss` - `aux_loss`) on each micro-batch, and the residuals those of the
    joint fit."""

    @property
    def usable(self) -> bool:
        """Both gradients are (to round-off) weighted sums of the micro-batch gradients."""
        return self.split_residual < self.tolerance and self.reference_residual < 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuxFit:
    """How the split gradient and the reference weight the spec's `aux_loss`.

    Both gradients are written as sum_j a_j grad main(micro-batch j) + x grad aux(whole
    batch) + sum_j y_j grad aux(micro-batch j), main = reference_loss - aux_loss (least
    squares over every parameter entry, with `Fit`'s micro-batch columns). A right step
    has x = 1 and every y_j = 0; an aux loss taken per micro-batch from its own
    statistics has x = 0 and every y_j alike (1/J for a mean over the J micro-batches).
    """

    split_whole: float
    """x of the split gradient."""

    split_parts: tuple[float, ...]
    """y_j of the split gradient, one per micro-batch (in `Fit.ranks` order)."""

    reference_whole: float
    """x of the reference (1 for a reference that adds aux_loss once over the batch)."""

    reference_parts: tuple[float, ...]
    """y_j of the reference (0 for such a reference)."""

    condition: float
    """The fit's condition number: its weights are known to about condition x the
    gradients' round-off."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "split_whole": num(self.split_whole),
            "split_parts": [num(y) for y in self.split_parts],
            "reference_whole": num(self.reference_whole),
            "reference_parts": [num(y) for y in self.reference_parts],
            "condition": num(self.condition),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormFit:
    """Which normalisation the split gradient and the reference apply to the items.

    Both gradients are written as sums of the gradients of the item-loss sums of
    cells: the items of one micro-batch that share a (sequence, group) id pair (least
    squares over every parameter entry). Every mode, over the whole step or per
    micro-batch, weights the items of a cell alike, so the cell weights give every
    item's weight, which `wholebatch.train.normalize.mode_weights` then names.
    """

    declared: str
    """The spec's `Normalize` mode."""

    found: tuple[Mode, Scope] | None
    """(mode, scope) the split gradient's item weights match; None: none matches."""

    expected: tuple[Mode, Scope] | None
    """(mode, scope) the reference's item weights match (scope "step" for a right
    reference); None: none matches."""

    cells: int
    """Unknowns of the fit: (micro-batch, sequence, group) cells with items in the mask."""

    split_residual: float
    """||g - sum_c a_c g_c|| / ||g|| of the split gradient."""

    reference_residual: float
    """The same for the reference."""

    note: str = ""
    """Why a side could not be read, when it could not."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "declared": self.declared,
            "found": None if self.found is None else list(self.found),
            "expected": None if self.expected is None else list(self.expected),
            "cells": self.cells,
            "split_residual": num(self.split_residual),
            "reference_residual": num(self.reference_residual),
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """One named likely cause."""

    code: str
    """Short id (docs/cli.md lists them all)."""

    message: str
    """What was seen, what it means, and the fix."""

    params: tuple[str, ...] = ()
    """The parameters it concerns, when it concerns a group of them (empty: the step)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """The result of `wholebatch verify` for one TARGET."""

    target: str
    """The TARGET checked."""

    world_size: int
    """W."""

    micro_batches: int
    """K."""

    rows: int
    """Rows of the whole batch."""

    wrap: str
    """"ddp", "none", or "trainer" (the trainer wraps the model itself)."""

    comparisons: tuple[Comparison, ...]
    """The batch as given at (W, K) first, then the variants and re-runs."""

    diagnoses: tuple[Diagnosis, ...]
    """Likely causes, most specific first; empty when passed."""

    error: str | None = None
    """Why the step could not be compared (it raised or hung), with the traceback."""

    where: str | None = None
    """Where the step breaks, from the re-runs ("only across ranks", ...)."""

    floor: Floor | None = None
    """The tolerance next to the round-off floor of the model's dtypes."""

    evidence: Evidence | None = None
    """What the step did besides its gradients."""

    fit: Fit | None = None
    """Implied micro-batch weights, when verify computed them."""

    notes: tuple[str, ...] = ()
    """What this run could not test (they do not fail it), e.g. micro-batches of equal size."""

    @property
    def passed(self) -> bool:
        """The step is one optimizer step with the whole-batch gradient (nothing says otherwise)."""
        return self.error is None and bool(self.comparisons) and not self.diagnoses

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN and infinities as null)."""

        def num(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        ev = self.evidence
        return {
            "target": self.target,
            "passed": self.passed,
            "world_size": self.world_size,
            "micro_batches": self.micro_batches,
            "rows": self.rows,
            "wrap": self.wrap,
            "error": self.error,
            "where": self.where,
            "floor": None
            if self.floor is None
            else {
                "dtypes": list(self.floor.dtypes),
                "unit_roundoff": self.floor.unit_roundoff,
                "measured": num(self.floor.measured),
                "rtol": self.floor.rtol,
                "rtol_from": self.floor.rtol_from,
                "autocast": list(self.floor.autocast),
                "autocast_measured": num(self.floor.autocast_measured),
            },
            "evidence": None
            if ev is None
            else {
                "step_calls": list(ev.step_calls),
                "changed_parameters": [list(c) for c in ev.changed],
                "collectives_without_gradient": [dict(c) for c in ev.collectives],
                "reference_spread": num(ev.reference_spread),
                "item_counts": dict(ev.item_counts),
                "collectives_in_functions": [dict(c) for c in ev.in_functions],
                "redrawn_dropout": [list(r) for r in ev.redrawn],
                "rows_note": ev.rows_note,
                "mesh": dict(ev.mesh),
                "row_dims": list(ev.row_dims),
                "shards": list(ev.shards),
                "owned_parameters": [list(o) for o in ev.owned],
                "rank_factors": [num(f) for f in ev.rank_factors],
            },
            "fit": None
            if self.fit is None
            else {
                "ranks": list(self.fit.ranks),
                "split_weights": [num(x) for x in self.fit.split],
                "reference_weights": [num(x) for x in self.fit.reference],
                "split_residual": num(self.fit.split_residual),
                "reference_residual": num(self.fit.reference_residual),
                "counts": {k: list(v) for k, v in self.fit.counts.items()},
                "note": self.fit.note,
                "normalization": None if self.fit.norm is None else self.fit.norm.to_json(),
                "aux": None if self.fit.aux is None else self.fit.aux.to_json(),
            },
            "variants": [
                {
                    "variant": c.variant,
                    "world_size": c.world_size,
                    "micro_batches": c.micro_batches,
                    "dropout": c.dropout,
                    "equal_items": c.equal,
                    "passed": c.ok,
                    "rtol": c.rtol,
                    "max_rel_err": num(c.max_rel_err),
                    "step_calls": list(c.step_calls),
                    "parameters": [
                        {
                            "name": p.name,
                            "shape": list(p.shape),
                            "passed": p.ok,
                            "max_abs_ref": num(p.ref_max),
                            "scale": num(p.scale),
                            "max_abs_err": num(p.abs_err),
                            "max_rel_err": num(p.rel_err),
                            "ratio": num(p.ratio),
                            "missing": p.missing,
                        }
                        for p in c.params
                    ],
                }
                for c in self.comparisons
            ],
            "diagnoses": [
                {"code": d.code, "message": d.message, "parameters": list(d.params)}
                for d in self.diagnoses
            ],
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """The human report: per parameter errors, the runs, the floor, the verdict and causes."""
        how = {
            "ddp": "DDP",
            "none": "no wrapper",
            "trainer": "the trainer's own split",
            "replay": "the trainer's own split, its batch recorded",
        }
        lines = [
            f"wholebatch verify {self.target}",
            f"  whole batch of {self.rows} rows = {self.world_size} ranks x {self.micro_batches} "
            f"micro-batches ({how.get(self.wrap, self.wrap)}) vs one process",
            "",
        ]
        if self.error is not None:
            lines.append(f"ERROR: {self.error}")
            lines += [f"Cause [{d.code}]: {d.message}" for d in self.diagnoses[1:]]
            return "\n".join(lines)
        main = self.comparisons[0]
        width = max([len("parameter"), *(len(p.name) for p in main.params)])
        lines.append(
            f"  {'parameter':<{width}}  {'shape':<12} {'max|ref|':>9} {'max abs err':>11} "
            f"{'max rel err':>11} {'ratio':>8}"
        )
        for p in main.params:
            ratio = "-" if math.isnan(p.ratio) else f"{p.ratio:.4g}"
            verdict = "ok" if p.ok else ("NO GRAD" if p.missing else "DIFFERS")
            lines.append(
                f"  {p.name:<{width}}  {p.shape!s:<12} {p.ref_max:9.2e} {p.abs_err:11.2e} "
                f"{p.rel_err:11.2e} {ratio:>8}  {verdict}"
            )
        lines.append("")
        for c in self.comparisons:
            label = (
                c.variant
                if c.variant.startswith("re-run")
                else f"{c.variant} (W={c.world_size}, K={c.micro_batches})"
            )
            lines.append(
                f"  {label:<40} {'ok' if c.ok else 'DIFFERS':<8} max rel err {c.max_rel_err:.2e}"
            )
        if self.floor is not None:
            f = self.floor
            measured = "" if f.measured is None else f", rows reversed: {f.measured:.1e}"
            if f.autocast:
                measured += f"; autocast {', '.join(f.autocast)}" + (
                    ""
                    if f.autocast_measured is None
                    else f": the reference under it differs by {f.autocast_measured:.1e}"
                )
            lines.append(
                f"  tolerance rtol {f.rtol:g} ({f.rtol_from}); round-off floor ~{f.value:.1e} "
                f"(computes in {', '.join(f.dtypes) or '?'}: eps {f.unit_roundoff:.1e}{measured})"
            )
        if self.where:
            lines.append(f"  where: {self.where}")
        lines.append("")
        bad = sum(not p.ok for p in main.params)
        if self.passed:
            lines.append(
                f"PASS: one optimizer step, and every gradient ({len(main.params)} parameters, "
                f"every rank) equals the whole-batch gradient (max rel err {main.max_rel_err:.1e})."
            )
        else:
            lines.append(
                f"FAIL: {bad} of {len(main.params)} parameters differ from the whole-batch gradient."
                if bad
                else "FAIL: the gradients match, but the step is not one whole-batch step."
            )
            for d in self.diagnoses:
                lines.append(f"Likely cause [{d.code}]: {d.message}")
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def param_scales(reference: Mapping[str, Tensor | None]) -> dict[str, float]:
    """Each parameter's scale: the largest reference entry of its module, at least MODEL_FLOOR
    of the model's (1.0 where the model's whole reference gradient is zero)."""
    largest = {
        name: float(g.abs().max()) if g is not None and g.numel() else 0.0
        for name, g in reference.items()
    }
    model = max(largest.values(), default=0.0)
    module: dict[str, float] = {}
    for name, m in largest.items():
        key = name.rpartition(".")[0]
        module[key] = max(module.get(key, 0.0), m)
    if model == 0.0:
        return dict.fromkeys(largest, 1.0)
    return {name: max(module[name.rpartition(".")[0]], MODEL_FLOOR * model) for name in largest}


def _param_error(
    name: str, ref: Tensor | None, grads: Sequence[Tensor | None], rtol: float, scale: float
) -> ParamError:
    has_ref = ref is not None
    base = grads[0] if grads and grads[0] is not None else None
    if ref is None:
        like = base if base is not None else next((g for g in grads if g is not None), None)
        ref = torch.zeros_like(like, dtype=torch.float64) if like is not None else torch.zeros(())
    ref = ref.double()
    present = [g.double() if g is not None else torch.zeros_like(ref) for g in grads]
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    abs_err = max(float((g - ref).abs().max()) if ref.numel() else 0.0 for g in present)
    rel = abs_err / scale
    g0 = present[0]
    denom = float((ref * ref).sum())
    ratio = float((g0 * ref).sum()) / denom if denom > 0 else math.nan
    fit = float((g0 - ratio * ref).abs().max()) / scale if denom > 0 and ref.numel() else math.inf
    spread = max(float((g - g0).abs().max()) / scale if ref.numel() else 0.0 for g in present)
    # No gradient where the reference holds only round-off is no gradient to miss.
    missing = has_ref and any(g is None for g in grads) and ref_max > rtol * scale
    return ParamError(
        name=name,
        shape=tuple(ref.shape),
        ref_max=ref_max,
        abs_err=abs_err,
        rel_err=rel,
        ratio=ratio,
        fit_err=fit,
        rank_spread=spread,
        missing=missing,
        ok=rel <= rtol and not missing,
        scale=scale,
        rtol=rtol,
        ref_norm=math.sqrt(denom),
    )


def compare(
    variant: str,
    reference: Mapping[str, Tensor | None],
    per_rank: Sequence[Mapping[str, Tensor | None]],
    *,
    rtol: float,
    step_calls: Sequence[int],
    world_size: int | None = None,
    micro_batches: int = 0,
    dropout: bool = True,
    equal: bool = False,
) -> Comparison:
    """Every parameter of every rank against the reference gradient (None: no gradient),
    each judged at `rtol` relative to its scale (`param_scales`)."""
    scales = param_scales(reference)
    params = tuple(
        _param_error(name, ref, [g.get(name) for g in per_rank], rtol, scales[name])
        for name, ref in reference.items()
    )
    return Comparison(
        variant=variant,
        world_size=len(per_rank) if world_size is None else world_size,
        micro_batches=micro_batches,
        dropout=dropout,
        equal=equal,
        params=params,
        rtol=rtol,
        step_calls=tuple(step_calls),
    )


def error_report(
    *,
    target: str,
    world_size: int,
    micro_batches: int,
    rows: int,
    wrap: str,
    error: str,
    code: str = "step-raised",
) -> VerifyReport:
    """The report of a step that raised (or hung) instead of producing gradients."""
    return VerifyReport(
        target=target,
        world_size=world_size,
        micro_batches=micro_batches,
        rows=rows,
        wrap=wrap,
        comparisons=(),
        diagnoses=(Diagnosis(code=code, message=error.splitlines()[0]),),
        error=error,
    )
