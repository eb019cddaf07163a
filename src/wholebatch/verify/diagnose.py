"""Compare split-step gradients with the whole-batch reference, and name the likely mistake.

Used by `wholebatch verify` (see `wholebatch.verify`). Per parameter: the
largest absolute error over ranks, that error relative to the reference's
largest entry, and the ratio <g, g_ref> / <g_ref, g_ref> (g: rank 0's gradient),
which reads "the split gradient is this multiple of the right one".

The patterns (docs/verify.md):

| code | what verify sees | the mistake |
|---|---|---|
| `scaled-1/W` | every differing parameter at ratio 1/W | gather without gradient, local slice put back (or a local-slice backward) |
| `replicated-K` | only scalar parameters differ, at ratio K | the loss (and its `logit_scale`) evaluated once per micro-batch |
| `scaled-W` | every differing parameter at ratio W | the 1/W compensated twice (or summed where DDP averages) |
| `no-gradient` | differing parameters get zero | the loss saw the features only through a collective without gradient |
| `no-rng-replay` | differs with dropout, matches with dropout off | a second forward pass drew new dropout masks |
| `mean-of-means` | differs on ragged items, matches on equal ones | each micro-batch (or rank) normalised by its own item count |
| `ranks-differ` | ranks hold different gradients | no data-parallel reduction of some parameters |
| `optimizer-steps` | `optimizer.step()` called more than once | stepping per micro-batch instead of accumulating |
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Comparison",
    "Diagnosis",
    "ParamError",
    "VerifyReport",
    "compare",
    "diagnose",
    "error_report",
]

# A fitted ratio counts as "1/W", "K", "W" when within this relative distance, and
# the gradient is "that multiple of the reference" when the rest is within _FIT.
_RATIO_TOL = 1e-3
_FIT = 1e-3


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
    """abs_err / ref_max (abs_err itself when the reference is zero)."""

    ratio: float
    """<g, g_ref> / <g_ref, g_ref> with g rank 0's gradient (NaN when the reference is zero)."""

    fit_err: float
    """Largest |g - ratio·g_ref| / ref_max: small when g is just a multiple of the reference."""

    rank_spread: float
    """Largest |g_r - g_0| / ref_max over ranks: nonzero when ranks hold different gradients."""

    missing: bool
    """True when some rank's step left this parameter with no gradient at all."""

    ok: bool
    """rel_err <= rtol and a gradient on every rank."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Every parameter of one variant (the batch as given, dropout off, equal items)."""

    variant: str
    """Which run: "as given", "dropout off", "equal items, dropout off"."""

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
        """The worst parameter's relative error."""
        return max((p.rel_err for p in self.params), default=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """One named likely cause."""

    code: str
    """Short id (see the module docstring's table)."""

    message: str
    """What was seen, what it means, and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """The result of `wholebatch verify`."""

    target: str
    """The TARGET checked."""

    world_size: int
    """W."""

    micro_batches: int
    """K."""

    rows: int
    """Rows of the whole batch."""

    wrap: str
    """"ddp" or "none"."""

    comparisons: tuple[Comparison, ...]
    """The batch as given first, then the variants."""

    diagnoses: tuple[Diagnosis, ...]
    """Likely causes, most specific first; empty when passed."""

    error: str | None = None
    """Why the split step could not be compared (it raised), with the traceback; None if it ran."""

    @property
    def passed(self) -> bool:
        """The step as given produces the whole-batch gradient."""
        return self.error is None and self.comparisons[0].ok

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN and infinities as null)."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "target": self.target,
            "passed": self.passed,
            "world_size": self.world_size,
            "micro_batches": self.micro_batches,
            "rows": self.rows,
            "wrap": self.wrap,
            "error": self.error,
            "variants": [
                {
                    "variant": c.variant,
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
            "diagnoses": [{"code": d.code, "message": d.message} for d in self.diagnoses],
        }

    def to_json_text(self) -> str:
        """`to_json()` as indented text."""
        return json.dumps(self.to_json(), indent=2)

    def format(self) -> str:
        """The human table: per parameter errors, the variants, the verdict and causes."""
        lines = [
            f"wholebatch verify {self.target}",
            f"  whole batch of {self.rows} rows = {self.world_size} ranks x {self.micro_batches} "
            f"micro-batches ({'DDP' if self.wrap == 'ddp' else 'no wrapper'}) vs one process",
            "",
        ]
        if self.error is not None:
            return "\n".join([*lines, f"ERROR: {self.error}"])
        main = self.comparisons[0]
        width = max([len("parameter"), *(len(p.name) for p in main.params)])
        lines.append(
            f"  {'parameter':<{width}}  {'shape':<12} {'max|ref|':>9} {'max abs err':>11} "
            f"{'max rel err':>11} {'ratio':>8}  "
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
            lines.append(
                f"  {c.variant:<26} {'ok' if c.ok else 'DIFFERS':<8} max rel err {c.max_rel_err:.2e}"
                f"  (rtol {c.rtol:g})"
            )
        lines.append("")
        bad = sum(not p.ok for p in main.params)
        if self.passed:
            lines.append(
                f"PASS: every gradient ({len(main.params)} parameters, every rank) equals the "
                f"whole-batch gradient (max rel err {main.max_rel_err:.1e})."
            )
        else:
            lines.append(
                f"FAIL: {bad} of {len(main.params)} parameters differ from the whole-batch gradient."
            )
            for d in self.diagnoses:
                lines.append(f"Likely cause [{d.code}]: {d.message}")
        return "\n".join(lines)


def _param_error(name: str, ref: Tensor, grads: Sequence[Tensor | None], rtol: float) -> ParamError:
    ref = ref.double()
    present = [g.double() if g is not None else torch.zeros_like(ref) for g in grads]
    missing = any(g is None for g in grads)
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    scale = ref_max if ref_max > 0 else 1.0
    abs_err = max(float((g - ref).abs().max()) if ref.numel() else 0.0 for g in present)
    rel = abs_err / scale
    g0 = present[0]
    denom = float((ref * ref).sum())
    ratio = float((g0 * ref).sum()) / denom if denom > 0 else math.nan
    fit = float((g0 - ratio * ref).abs().max()) / scale if denom > 0 and ref.numel() else math.inf
    spread = max(float((g - g0).abs().max()) / scale if ref.numel() else 0.0 for g in present)
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
    )


def compare(
    variant: str,
    reference: Mapping[str, Tensor],
    per_rank: Sequence[Mapping[str, Tensor | None]],
    *,
    rtol: float,
    step_calls: Sequence[int],
) -> Comparison:
    """Every parameter of every rank against the reference gradient."""
    params = tuple(
        _param_error(name, ref, [g.get(name) for g in per_rank], rtol)
        for name, ref in reference.items()
    )
    return Comparison(variant=variant, params=params, rtol=rtol, step_calls=tuple(step_calls))


def _near(x: float, target: float) -> bool:
    return math.isfinite(x) and abs(x - target) <= _RATIO_TOL * abs(target)


def _multiple(p: ParamError, target: float) -> bool:
    return _near(p.ratio, target) and p.fit_err <= _FIT


def _names(params: Sequence[ParamError], limit: int = 4) -> str:
    shown = ", ".join(p.name for p in params[:limit])
    return shown + (f" and {len(params) - limit} more" if len(params) > limit else "")


def _patterns(main: Comparison, w: int, k: int) -> list[Diagnosis]:
    bad = [p for p in main.params if not p.ok]
    out: list[Diagnosis] = []
    calls = set(main.step_calls)
    if max(calls, default=0) > 1:
        out.append(Diagnosis(
            code="optimizer-steps",
            message=f"the step called optimizer.step() {max(calls)} times on a rank; one "
            "whole-batch step accumulates every micro-batch's gradient and steps once.",
        ))  # fmt: skip
    if not bad:
        return out
    if any(p.rank_spread > main.rtol for p in main.params):
        spread = [p for p in main.params if p.rank_spread > main.rtol]
        out.append(Diagnosis(
            code="ranks-differ",
            message=f"ranks hold different gradients for {_names(spread)}: nothing reduced them "
            "across ranks. Keep every trained parameter inside the DDP module (or all-reduce "
            "its gradient yourself, matching DDP's mean).",
        ))  # fmt: skip
    if w > 1 and all(_multiple(p, 1.0 / w) for p in bad):
        out.append(Diagnosis(
            code="scaled-1/W",
            message=f"every differing gradient ({_names(bad)}) is exactly 1/W = 1/{w} of the "
            "whole-batch gradient: features are gathered without gradient and the local slice "
            "put back (torch.distributed.all_gather; open_clip's gather_with_grad=False), or a "
            "gather's backward returns only the local slice, so each rank trains only through "
            "its own rows. Fix: wholebatch.all_gather (backward: reduce-scatter), or a "
            "wholebatch loss (clip_loss, siglip_loss, nt_xent_loss).",
        ))  # fmt: skip
    elif k > 1 and all(
        p.ref_max > 0 and math.prod(p.shape) == 1 and _multiple(p, float(k)) for p in bad
    ):
        out.append(Diagnosis(
            code="replicated-K",
            message=f"only the replicated scalar(s) {_names(bad)} differ, each at K = {k} times "
            "its gradient, while every encoder gradient is right: the loss is evaluated once per "
            "micro-batch (open_clip's accum_freq), so the scalar's gradient is counted K times. "
            "Fix: take the loss's gradient once on the cached embeddings "
            "(wholebatch.CachedStep).",
        ))  # fmt: skip
    elif w > 1 and all(_multiple(p, float(w)) for p in bad):
        out.append(Diagnosis(
            code="scaled-W",
            message=f"every differing gradient ({_names(bad)}) is W = {w} times the whole-batch "
            "gradient: DDP's 1/W is compensated twice (the loss multiplied by W on top of a "
            "wholebatch loss), or gradients are summed where the loss expected DDP's mean. Pass "
            "the same grad_reduction everywhere.",
        ))  # fmt: skip
    elif all(
        p.missing
        or (p.ref_max > 0 and abs(p.ratio) < _RATIO_TOL and p.abs_err >= p.ref_max * (1 - _FIT))
        for p in bad
    ):
        out.append(Diagnosis(
            code="no-gradient",
            message=f"{_names(bad)} received no gradient: the loss reaches them only through "
            "a collective that carries none (torch.distributed.all_gather). Fix: "
            "wholebatch.all_gather.",
        ))  # fmt: skip
    return out


def diagnose(
    *,
    target: str,
    world_size: int,
    micro_batches: int,
    rows: int,
    wrap: str,
    comparisons: Sequence[Comparison],
) -> VerifyReport:
    """Read the comparisons' patterns into likely causes (none when the step passed)."""
    main = comparisons[0]
    by_name = {c.variant: c for c in comparisons}
    found = _patterns(main, world_size, micro_batches)
    codes = {d.code for d in found}
    for other in comparisons[1:]:
        # With dropout (or ragged items) on, a second mistake may hide a pattern
        # that the cleaner variant shows.
        if main.ok or other.ok or codes - {"optimizer-steps"}:
            break
        for d in _patterns(other, world_size, micro_batches):
            if d.code not in codes:
                found.append(Diagnosis(code=d.code, message=f"(with {other.variant}) {d.message}"))
                codes.add(d.code)
    if not main.ok:
        no_dropout = by_name.get("dropout off")
        equal = by_name.get("equal items, dropout off")
        if no_dropout is not None and no_dropout.ok:
            found.append(Diagnosis(
                code="no-rng-replay",
                message="the gradients match with dropout off and differ with it on: a second "
                "forward of the same micro-batch (gradient caching, recomputation) drew new "
                "dropout masks, so the cached gradient is back-propagated through a different "
                "network. Fix: save the RNG state before the first pass and restore it for the "
                "second (wholebatch.CachedStep does), or torch.utils.checkpoint with "
                "preserve_rng_state=True.",
            ))  # fmt: skip
        elif equal is not None and equal.ok:
            found.append(Diagnosis(
                code="mean-of-means",
                message="the gradients match when every row holds the same number of items "
                "and differ on the ragged batch: each micro-batch (or rank) divides by its own "
                "item count and the results are averaged, which over-weights short micro-batches. "
                "Fix: sum item losses and divide once by the global item count, agreed across "
                "ranks before backward (wholebatch.Accumulator).",
            ))  # fmt: skip
        if not [d for d in found if d.code != "optimizer-steps"]:
            worst = max(main.params, key=lambda p: p.rel_err)
            found.append(Diagnosis(
                code="unknown",
                message=f"no known pattern; the worst parameter is {worst.name} (rel err "
                f"{worst.rel_err:.2e}, ratio {worst.ratio:.4g}). Check that the split step and "
                "reference_loss compute the same loss, and try --micro-batches 1 and --nproc 1 "
                "to see which split breaks it.",
            ))  # fmt: skip
    return VerifyReport(
        target=target,
        world_size=world_size,
        micro_batches=micro_batches,
        rows=rows,
        wrap=wrap,
        comparisons=tuple(comparisons),
        diagnoses=tuple(found),
    )


def error_report(
    *, target: str, world_size: int, micro_batches: int, rows: int, wrap: str, error: str
) -> VerifyReport:
    """The report of a step that raised instead of producing gradients."""
    return VerifyReport(
        target=target,
        world_size=world_size,
        micro_batches=micro_batches,
        rows=rows,
        wrap=wrap,
        comparisons=(),
        diagnoses=(Diagnosis(code="step-raised", message=error.splitlines()[0]),),
        error=error,
    )
