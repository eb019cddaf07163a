"""Name the likely mistake from the runs' patterns (docs/cli.md lists every cause).

Evidence first (any of it fails a step whose gradients match): how often the step
called `optimizer.step()`, parameters it changed itself, a reference with no
gradient or with randomness verify cannot replay. Then the gradients:

- where it breaks, from re-runs of the same step at (W, 1), (1, K), (1, 1), with
  dropout off and on `equal_batch`: "only across ranks", "only across
  micro-batches", "even unsplit", "only with dropout", "only with ragged items";
- the ratio of each parameter's gradient to the reference's: a fixed multiple
  (1/W, W, K, or any c) or not;
- which collectives without gradient the step called on tensors needing it;
- the weight each micro-batch gets in the split gradient against its share of
  the items in the whole batch (`Fit`): equal weights are a mean of means, the
  right proportions times c a wrong count.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from wholebatch.verify.report import (
    Comparison,
    Diagnosis,
    Evidence,
    Fit,
    Floor,
    ParamError,
    VerifyReport,
    error_report,
)

__all__ = ["CAUSES", "diagnose", "error_report", "locate"]

# A fitted ratio counts as "1/W", "K", "W", "c" when within this relative distance, and
# the gradient is "that multiple of the reference" when the rest is within _FIT.
_RATIO_TOL = 1e-3
_FIT = 1e-3
# A failure whose error is within this many times the round-off floor is called round-off.
_NEAR_FLOOR = 100.0

CAUSES: dict[str, str] = {
    "optimizer-steps": "optimizer.step() called more than once, differently across ranks, "
    "or (a trainer) never on the optimizer verify gave it",
    "params-changed": "the step changed the parameters itself (another optimizer)",
    "no-reference-gradient": "reference_loss gives no gradient: nothing could be judged",
    "unreplayable-randomness": "the reference differs between seeds: randomness outside nn.Dropout",
    "ranks-differ": "ranks hold different gradients: nothing reduced them",
    "no-rng-replay": "exact with dropout off: a second forward drew new masks",
    "mean-of-means": "micro-batches (or ranks) weighted equally instead of by their items",
    "gather-no-grad": "a torch.distributed collective without gradient on features",
    "uncompensated-mean": "exactly 1/W and no gather: DDP's mean not compensated",
    "double-compensated": "exactly W: the 1/W compensated twice",
    "replicated-K": "only replicated scalars differ, at K times",
    "wrong-count": "a constant factor with the right proportions: a wrong item count",
    "scaled": "a constant factor",
    "no-gradient": "parameters that receive nothing",
    "round-off": "within the round-off floor of the model's own dtypes",
    "breaks-unsplit": "differs even at W=1, K=1: the step's loss is not reference_loss",
    "breaks-across-ranks": "exact on one rank, differs across ranks",
    "breaks-across-micro-batches": "exact with K=1, differs across micro-batches",
    "breaks-split-both-ways": "exact split either way alone, differs split both ways",
    "breaks-each-way": "differs across ranks alone and across micro-batches alone",
    "step-raised": "the step raised (traceback in the report)",
    "step-hung": "a rank did not finish in time",
    "reference-raised": "reference_loss raised on the whole batch (traceback in the report)",
    "unknown": "no pattern and no re-runs to localise it",
}


def _near(x: float, target: float) -> bool:
    return math.isfinite(x) and abs(x - target) <= _RATIO_TOL * abs(target)


def _multiple(p: ParamError, target: float) -> bool:
    return _near(p.ratio, target) and p.fit_err <= _FIT


def _names(params: Sequence[ParamError], limit: int = 4) -> str:
    shown = ", ".join(p.name for p in params[:limit])
    return shown + (f" and {len(params) - limit} more" if len(params) > limit else "")


def _common_ratio(c: Comparison) -> float | None:
    """The c with every differing parameter at c times the reference, if there is one."""
    live = [p for p in c.params if not p.ok and p.ref_max > 0]
    if len(live) < sum(not p.ok for p in c.params):
        return None
    if not live or any(not math.isfinite(p.ratio) or p.fit_err > _FIT for p in live):
        return None
    first = live[0].ratio
    return first if all(_near(p.ratio, first) for p in live) else None


def _find(
    comparisons: Sequence[Comparison], w: int, k: int, dropout: bool, equal: bool = False
) -> Comparison | None:
    for c in comparisons:
        key = (c.world_size, c.micro_batches, c.dropout, c.equal)
        if key == (w, k, dropout, equal):
            return c
    return None


def locate(comparisons: Sequence[Comparison]) -> tuple[str | None, str | None]:
    """(a sentence saying where the step breaks, a scope code) from the re-runs; (None, None) if unknown."""
    main = comparisons[0]
    if main.ok:
        return None, None
    w, k, drop = main.world_size, main.micro_batches, main.dropout
    one = _find(comparisons, 1, 1, drop) if (w, k) != (1, 1) else main
    w1 = _find(comparisons, w, 1, drop) if k > 1 else main
    k1 = _find(comparisons, 1, k, drop) if w > 1 else main

    def ok(c: Comparison | None) -> str:
        return "exact" if c is not None and c.ok else "differs"

    parts: list[str] = []
    scope: str | None = None
    if one is not None and not one.ok:
        parts.append("differs even unsplit (W=1, K=1)")
        scope = "unsplit"
    elif w > 1 and k > 1 and w1 is not None and k1 is not None:
        cells = f"W=1, K={k}: {ok(k1)}; W={w}, K=1: {ok(w1)}; W={w}, K={k}: differs"
        if w1.ok and k1.ok:
            parts.append(f"breaks only when split both ways ({cells})")
            scope = "both-ways"
        elif k1.ok:
            parts.append(f"breaks only across ranks ({cells})")
            scope = "ranks"
        elif w1.ok:
            parts.append(f"breaks only across micro-batches ({cells})")
            scope = "micro-batches"
        else:
            parts.append(f"breaks across ranks alone and across micro-batches alone ({cells})")
            scope = "each"
    elif one is not None and one.ok:
        if w > 1 and k == 1:
            parts.append(f"breaks only across ranks (W=1: exact; W={w}: differs)")
            scope = "ranks"
        elif k > 1 and w == 1:
            parts.append(f"breaks only across micro-batches (K=1: exact; K={k}: differs)")
            scope = "micro-batches"
    off = _find(comparisons, w, k, False) if drop else None
    if off is not None and off is not main:
        parts.append(
            "only with dropout (exact with dropout off)" if off.ok else "also with dropout off"
        )
    equal = _find(comparisons, w, k, False, equal=True)
    if equal is not None:
        parts.append(
            "only with ragged items (exact on equal_batch)" if equal.ok else "also on equal_batch"
        )
    return ("; ".join(parts) or None), scope


def _matching_rule(fit: Fit) -> str | None:
    """The counting rule whose per-micro-batch shares are the reference's weights."""
    for rule, counts in fit.counts.items():
        total = sum(counts)
        if total > 0 and all(
            abs(n / total - b) <= 1e-4 * max(abs(b), 1e-12) + 1e-9
            for n, b in zip(counts, fit.reference, strict=True)
        ):
            return rule
    return None


def _read_fit(fit: Fit | None, w: int) -> tuple[str, float] | None:
    """("uniform", c) | ("per-micro-batch", 0) | ("per-rank", 0) | ("weights", 0) from a usable fit."""
    if fit is None or not fit.usable:
        return None
    a, b = fit.split, fit.reference
    n = len(a)
    if n == 0:
        return None
    if all(x > 0 for x in b):
        rho = [x / y for x, y in zip(a, b, strict=True)]
        mean = sum(rho) / n
        if mean != 0 and all(abs(r - mean) <= _RATIO_TOL * abs(mean) for r in rho):
            return "uniform", mean
    b_equal = max(b) - min(b) <= _RATIO_TOL * max(abs(max(b)), 1e-12)
    if not b_equal and all(abs(x - 1.0 / n) <= _RATIO_TOL / n for x in a):
        return "per-micro-batch", 0.0
    per_rank: dict[int, list[int]] = {}
    for j, r in enumerate(fit.ranks):
        per_rank.setdefault(r, []).append(j)
    if len(per_rank) == w and w > 1:
        sums = {r: sum(a[j] for j in js) for r, js in per_rank.items()}
        within = all(
            b[js[0]] > 0
            and all(
                abs(a[j] / b[j] - a[js[0]] / b[js[0]]) <= _RATIO_TOL * abs(a[js[0]] / b[js[0]])
                for j in js
            )
            for js in per_rank.values()
        )
        if within and all(abs(s - 1.0 / w) <= _RATIO_TOL / w for s in sums.values()):
            return "per-rank", 0.0
    return "weights", 0.0


def _fmt(xs: Sequence[float]) -> str:
    shown = " ".join(f"{x:.3g}" for x in xs[:12])
    return shown + (" ..." if len(xs) > 12 else "")


def _counts_text(fit: Fit | None) -> str:
    if fit is None:
        return ""
    rule = _matching_rule(fit)
    if rule is None:
        return ""
    return f" (items per micro-batch by {rule}: {' '.join(str(n) for n in fit.counts[rule][:12])})"


def _wrong_count_text(c: float, counts: Mapping[str, int], fit: Fit | None) -> str:
    """Name the counts when one rule's total divided by c is another rule's total."""
    rules = list(counts.items())
    if fit is not None:
        matched = _matching_rule(fit)
        if matched is not None:
            rules.sort(key=lambda kv: kv[0] != matched)
    for rule, total in rules:
        if total <= 0:
            continue
        used = total / c
        for other, other_total in counts.items():
            if other != rule and abs(used - other_total) < 0.5:
                return (
                    f" The step divides by {other_total} items ({other}) where the whole-batch "
                    f"loss averages over {total} ({rule}): {total}/{other_total} = {c:.4g}."
                )
    return ""


def _evidence_causes(ev: Evidence, main: Comparison) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    calls = ev.step_calls
    if calls and (
        max(calls) > 1 or len(set(calls)) > 1 or (ev.kind == "trainer" and min(calls) == 0)
    ):
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(calls))
        if max(calls) == 0:
            what = (
                "the trainer never called step() on the optimizer verify gave it (run.optimizer), "
                "so verify cannot see the gradient it steps with. Pass run.optimizer to the "
                "trainer (HF: optimizers=(run.optimizer, None); Accelerate: prepare it)."
            )
        else:
            what = (
                "one whole-batch step accumulates every micro-batch's gradient and steps the "
                "optimizer once; stepping per micro-batch applies several smaller updates, each on "
                "part of the batch (verify compared the sum of the gradients it was given, which "
                "hides this). Fix: step once after the last micro-batch (wholebatch.Accumulator)."
            )
        out.append(Diagnosis(
            code="optimizer-steps",
            message=f"optimizer.step() was called ({shown}) where one step is one call: {what}",
        ))  # fmt: skip
    changed = sorted({n for names in ev.changed for n in names})
    if changed:
        out.append(Diagnosis(
            code="params-changed",
            message=f"the step changed {_names([_named(n) for n in changed])} itself: it steps an "
            "optimizer other than the one verify passes (which records and changes nothing), so "
            "verify cannot see the gradient it stepped with. Step the optimizer you are given.",
        ))  # fmt: skip
    if ev.reference_zero:
        out.append(Diagnosis(
            code="no-reference-gradient",
            message="reference_loss gives no gradient to any parameter, so nothing was judged. "
            "Check that it computes the loss from the model's output (not detached).",
        ))  # fmt: skip
    if ev.reference_spread > main.rtol:
        out.append(Diagnosis(
            code="unreplayable-randomness",
            message=f"the whole-batch reference itself changes with the seed (by "
            f"{ev.reference_spread:.1e}, relative): the model draws random numbers verify "
            "cannot record and replay (F.dropout, an attention kernel's dropout_p, stochastic "
            "depth; verify replays nn.Dropout modules only), so the gradients cannot be judged. "
            "Build the model with that randomness off (e.g. config.attn_pdrop=0) or as "
            "nn.Dropout modules.",
        ))  # fmt: skip
    return out


def _named(name: str) -> ParamError:
    return ParamError(
        name=name, shape=(), ref_max=0.0, abs_err=0.0, rel_err=0.0, ratio=math.nan,
        fit_err=0.0, rank_spread=0.0, missing=False, ok=True,
    )  # fmt: skip


def _gathers(ev: Evidence) -> str:
    seen: dict[str, int] = {}
    for per_rank in ev.collectives:
        for op, n in per_rank.items():
            if op.endswith(("all_gather", "all_gather_into_tensor", "_all_gather_base")):
                seen[op] = max(seen.get(op, 0), n)
    return ", ".join(f"{op} x{n}" for op, n in sorted(seen.items()))


def _gradient_causes(
    comparisons: Sequence[Comparison],
    ev: Evidence,
    floor: Floor | None,
    fit: Fit | None,
    where: str | None,
    scope: str | None,
) -> list[Diagnosis]:
    main = comparisons[0]
    w, k = main.world_size, main.micro_batches
    out: list[Diagnosis] = []
    bad = [p for p in main.params if not p.ok]
    at = f"Where: {where}. " if where else ""

    gathers = _gathers(ev)
    off = _find(comparisons, w, k, False) if main.dropout else None
    clean = off if off is not None and off is not main else main
    equal = _find(comparisons, w, k, False, equal=True)

    if any(p.rank_spread > main.rtol for p in main.params):
        spread = [p for p in main.params if p.rank_spread > main.rtol]
        out.append(Diagnosis(
            code="ranks-differ",
            message=f"ranks hold different gradients for {_names(spread)}: nothing reduced them "
            "across ranks, so each rank would step on its own gradient. This happens when the "
            "step trains a plain module in a W>1 world (an Accumulator given ddp.module; "
            "Accelerate on CPU without Accelerator(cpu=True), which silently skips its DDP "
            "wrap) or keeps a "
            "trained parameter outside the DDP module. Keep every trained parameter inside "
            "the DDP module (or all-reduce its gradient yourself, matching DDP's mean).",
        ))  # fmt: skip
    if off is not None and off.ok and not main.ok:
        out.append(Diagnosis(
            code="no-rng-replay",
            message=f"{at}the gradients match with dropout off and differ with it on: a second "
            "forward of the same micro-batch (gradient caching, activation recomputation) drew "
            "new dropout masks, so the gradient is back-propagated through a different network "
            "than the forward's. Fix: save the RNG state before the first pass and restore it "
            "for the second (wholebatch.CachedStep does), or torch.utils.checkpoint with "
            "preserve_rng_state=True.",
        ))  # fmt: skip
    reading = _read_fit(fit, w)
    counts = _counts_text(fit)
    if (equal is not None and equal.ok and not main.ok) or (
        reading is not None and reading[0] in ("per-micro-batch", "per-rank")
    ):
        if reading is not None and reading[0] == "per-rank":
            how = (
                f"each rank divides by its own item count and DDP averages the {w} ranks' means "
                f"(implied weights per micro-batch {_fmt(fit.split) if fit else ''}; the whole batch "
                f"weights them {_fmt(fit.reference) if fit else ''}{counts})"
            )
        elif reading is not None and fit is not None:
            how = (
                f"each of the {len(fit.split)} micro-batches gets the same weight 1/{len(fit.split)} "
                f"in the split gradient, while the whole batch weights them by their items "
                f"({_fmt(fit.reference)}{counts}): each micro-batch divides by its own item count "
                "and the results are averaged"
            )
        else:
            how = (
                "the gradients match when every row holds the same number of items (equal_batch) "
                "and differ on the ragged batch: each micro-batch (or rank) divides by its own item "
                "count and the results are averaged"
            )
        out.append(Diagnosis(
            code="mean-of-means",
            message=f"{at}{how}. That over-weights micro-batches with few items. Fix: sum item "
            "losses and divide once by the global item count, agreed across ranks before "
            "backward (wholebatch.Accumulator).",
        ))  # fmt: skip
    if (
        k > 1
        and bad
        and all(p.ref_max > 0 and math.prod(p.shape) == 1 and _multiple(p, float(k)) for p in bad)
    ):
        out.append(Diagnosis(
            code="replicated-K",
            message=f"{at}only the replicated scalar(s) {_names(bad)} differ, each at K = {k} "
            "times its gradient, while every encoder gradient is right: the loss is evaluated once "
            "per micro-batch (open_clip's accum_freq), so the scalar's gradient is counted K "
            "times. Fix: take the loss's gradient once on the cached embeddings "
            "(wholebatch.CachedStep).",
        ))  # fmt: skip
    replicated = any(d.code == "replicated-K" for d in out)
    ratio = _common_ratio(clean) if not clean.ok and not replicated else None
    uniform = ratio is not None and all(not p.ok for p in clean.params if p.ref_max > 0)
    if ratio is not None and w > 1 and _near(ratio, 1.0 / w):
        if gathers:
            out.append(Diagnosis(
                code="gather-no-grad",
                message=f"{at}every differing gradient is exactly 1/W = 1/{w} of the whole-batch "
                f"gradient and the step passed features needing gradient to a collective without one "
                f"({gathers}): the gathered features are constants but the local slice put back, "
                "so each rank trains only through its own rows (open_clip's "
                "gather_with_grad=False). Fix: wholebatch.all_gather (backward: reduce-scatter), "
                "or a wholebatch loss (clip_loss, siglip_loss, nt_xent_loss).",
            ))  # fmt: skip
        else:
            out.append(Diagnosis(
                code="uncompensated-mean",
                message=f"{at}every gradient is exactly 1/W = 1/{w} of the whole-batch gradient, "
                "exact at W=1, and the step gathered nothing without gradient (verify watches "
                "torch.distributed's collectives): each rank divides its loss sum by the GLOBAL "
                "item count and DDP then averages over W ranks, so the 1/W is applied twice "
                "(e.g. num_items_in_batch passed without the HF Trainer's x W, or a loss divided "
                "by the world size on top of DDP's mean). Fix: multiply such a loss by W (or use "
                "wholebatch.Accumulator). If the step gathers features by another path (a "
                "process-group call verify cannot see), a gather without gradient gives the same "
                "1/W.",
            ))  # fmt: skip
    elif ratio is not None and w > 1 and _near(ratio, float(w)):
        out.append(Diagnosis(
            code="double-compensated",
            message=f"{at}every differing gradient is exactly W = {w} times the whole-batch "
            "gradient: "
            "DDP's 1/W is compensated twice (the loss multiplied by W on top of a wholebatch loss "
            "or an HF Trainer that already multiplies), or gradients are summed where the loss "
            "expected DDP's mean. Pass the same grad_reduction everywhere.",
        ))  # fmt: skip
    elif ratio is not None and uniform and not _near(ratio, 1.0):
        named = _wrong_count_text(ratio, ev.item_counts, fit)
        proportional = reading is not None and reading[0] == "uniform"
        if named or proportional:
            out.append(Diagnosis(
                code="wrong-count",
                message=f"{at}every gradient is {ratio:.4g} x the whole-batch gradient, with the "
                f"micro-batches in the right proportions: the step divides the loss sum by a wrong "
                f"item count ({1 / ratio:.4g} x the right one).{named} A causal LM predicts "
                "labels[..., 1:]: counting labels before the shift adds one item per row (the HF "
                "Trainer does this for a model whose loss_type it does not know to be causal, e.g. "
                "GPT2LMHeadModel). Fix: count exactly the items the loss averages over, across all "
                "micro-batches and ranks.",
            ))  # fmt: skip
        else:
            out.append(Diagnosis(
                code="scaled",
                message=f"{at}every gradient is {ratio:.4g} x the whole-batch gradient: a constant "
                "factor (a loss divided by a wrong count or number of micro-batches, a loss scale "
                "not removed, or clipped gradients: verify's reference does not clip).",
            ))  # fmt: skip
    if gathers and not any(d.code == "gather-no-grad" for d in out) and scope in ("ranks", "each"):
        out.append(Diagnosis(
            code="gather-no-grad",
            message=f"{at}the step passed features needing gradient to torch.distributed "
            f"collectives that carry none ({gathers}): the terms that pair this rank's rows "
            "with other ranks' rows lose their gradient, so the error is not a fixed multiple "
            "(open_clip's local_loss=True without gather_with_grad=True; a hand-written gather). "
            "Fix: wholebatch.all_gather (backward: reduce-scatter), or a wholebatch loss "
            "(clip_loss, siglip_loss, nt_xent_loss).",
        ))  # fmt: skip
    if bad and all(
        p.missing
        or (p.ref_max > 0 and abs(p.ratio) < _RATIO_TOL and p.abs_err >= p.ref_max * (1 - _FIT))
        for p in bad
    ):
        out.append(Diagnosis(
            code="no-gradient",
            message=f"{at}{_names(bad)} received no gradient: the loss reaches them only through "
            "a collective that carries none (torch.distributed.all_gather), or the step detaches "
            "them. Fix: wholebatch.all_gather.",
        ))  # fmt: skip
    if (
        not out
        and floor is not None
        and math.isfinite(main.max_rel_err)
        and main.max_rel_err <= _NEAR_FLOOR * floor.value
    ):
        out.append(Diagnosis(
            code="round-off",
            message=f"the largest error {main.max_rel_err:.1e} is within {_NEAR_FLOOR:g}x the "
            f"round-off floor ~{floor.value:.1e} of the model's own arithmetic (it computes in "
            f"{', '.join(floor.dtypes)}; eps {floor.unit_roundoff:.1e}"
            + ("" if floor.measured is None else f"; the same batch in reversed row order "
               f"differs by {floor.measured:.1e}")
            + f"), while rtol is {floor.rtol:g} ({floor.rtol_from}): this is round-off, not a "
            "split mistake. Leave rtol unset (verify derives it from the dtypes) or set it "
            f"above {_NEAR_FLOOR * floor.value:.0e}.",
        ))  # fmt: skip
    if not out:
        out.append(_generic(scope, where, fit, comparisons))
    return [Diagnosis(code=d.code, message=_capitalised(d.message, at)) for d in out]


def _capitalised(message: str, prefix: str) -> str:
    """Capitalise the sentence after the "Where: ..." prefix."""
    n = len(prefix) if prefix and message.startswith(prefix) else 0
    return message[:n] + message[n : n + 1].upper() + message[n + 1 :]


def _generic(
    scope: str | None, where: str | None, fit: Fit | None, comparisons: Sequence[Comparison]
) -> Diagnosis:
    main = comparisons[0]
    worst = max(main.params, key=lambda p: p.rel_err if math.isfinite(p.rel_err) else math.inf)
    detail = f"worst parameter {worst.name} (rel err {worst.rel_err:.2e}, ratio {worst.ratio:.4g})"
    ask = ""
    if _find(comparisons, main.world_size, main.micro_batches, False, equal=True) is None and (
        fit is None or not fit.usable
    ):
        ask = (
            " If the loss is a mean over items (tokens), give the spec an equal_batch (every row "
            "the same item count) so verify can tell a normalisation mistake apart"
            + (
                f" (the weights could not be read from the gradient: {fit.note})"
                if fit is not None and fit.note
                else ""
            )
            + "."
        )
    text = {
        "unsplit": (
            "breaks-unsplit",
            "the split step differs from reference_loss even on one "
            "rank with one micro-batch: they compute different losses (a different "
            "normalisation, a term only one of them has, clipping, a frozen or detached "
            "part). Compare the step's loss with reference_loss on the whole batch.",
        ),
        "ranks": (
            "breaks-across-ranks",
            "exact on one rank, wrong across ranks: a cross-rank "
            "term has the wrong gradient or weight (a gather without gradient, a "
            "per-rank normalisation, a rank-dependent label offset, a parameter outside "
            "DDP).",
        ),
        "micro-batches": (
            "breaks-across-micro-batches",
            "exact with one micro-batch, wrong "
            "across micro-batches: accumulation weighs or connects them wrongly "
            "(a per-micro-batch mean, a loss over only the live micro-batch, a "
            "missing no_sync/sync, a second pass that differs).",
        ),
        "both-ways": (
            "breaks-split-both-ways",
            "exact split across ranks alone and across "
            "micro-batches alone, wrong when split both ways: the step combines ranks "
            "and micro-batches wrongly (a count agreed per rank but not across "
            "micro-batches, or the reverse).",
        ),
        "each": (
            "breaks-each-way",
            "wrong across ranks alone and across micro-batches alone: "
            "look for a normalisation or a gather that depends on how the batch is cut.",
        ),
    }
    if scope in text:
        code, what = text[scope]
        return Diagnosis(code=code, message=f"Where: {where}. {what} ({detail}).{ask}")
    return Diagnosis(
        code="unknown",
        message=f"no known pattern; {detail}. Check that the split step and reference_loss "
        f"compute the same loss.{ask}",
    )


def diagnose(
    *,
    target: str,
    world_size: int,
    micro_batches: int,
    rows: int,
    wrap: str,
    comparisons: Sequence[Comparison],
    evidence: Evidence,
    floor: Floor | None = None,
    fit: Fit | None = None,
) -> VerifyReport:
    """Read the evidence and the runs' patterns into likely causes (none when the step passed)."""
    main = comparisons[0]
    found = _evidence_causes(evidence, main)
    where, scope = locate(comparisons)
    if not main.ok and not any(d.code == "unreplayable-randomness" for d in found):
        found += _gradient_causes(comparisons, evidence, floor, fit, where, scope)
    return VerifyReport(
        target=target,
        world_size=world_size,
        micro_batches=micro_batches,
        rows=rows,
        wrap=wrap,
        comparisons=tuple(comparisons),
        diagnoses=tuple(found),
        where=where,
        floor=floor,
        evidence=evidence,
        fit=fit,
    )
