"""The gradient causes: how a failing step's gradients differ from the whole batch's.

Each is read from the runs' gradients (all that hold are named): ranks holding
different gradients, dropout redrawn, a normalisation other than the
reference's, a mean of per-micro-batch (or per-rank) means with the factor it
carries, replicated scalars at K times, gathers that drop gradient, DDP's mean
compensated too little or too much, a wrong count, a constant factor,
parameters left without gradient. Per-group causes are tried on each group of
differing parameters that share one ratio to the reference (`Case.groups`).

Legend: W ranks, K micro-batches per rank, B data-parallel ranks (W on a flat
world), J = B x K micro-batches, N items of the step.
"""

from __future__ import annotations

import math

from wholebatch.train.normalize import mismatch_text
from wholebatch.verify.case import (
    FIT,
    RATIO_TOL,
    Case,
    fmt,
    multiple,
    named,
    names,
    near,
    wrong_count_text,
)
from wholebatch.verify.causes.base import Cause, at, exact_unsharded, one_over_b
from wholebatch.verify.causes.mesh import dp_count_factors, dp_count_text, mesh_factor

__all__ = ["GRADIENT_CAUSES"]


def _spread(case: Case) -> list[str]:
    return [p.name for p in case.main.params if p.rank_spread > case.main.rtol]


def _ranks_differ_message(case: Case) -> str:
    spread = [p for p in case.main.params if p.rank_spread > case.main.rtol]
    return (
        f"ranks hold different gradients for {names(spread)}: nothing reduced them "
        "across ranks, so each rank would step on its own gradient. This happens when the "
        "step trains a plain module in a W>1 world (an Accumulator given ddp.module; "
        "Accelerate on CPU without Accelerator(cpu=True), which silently skips its DDP "
        "wrap) or keeps a trained parameter outside the DDP module."
    )


def _no_rng_replay(case: Case) -> bool:
    off = case.off
    if case.main.ok:
        return False
    return (off is not None and off.ok) or bool(case.redrawn)


def _no_rng_replay_message(case: Case) -> str:
    off, redrawn = case.off, case.redrawn
    seen = (
        f"dropout {names([named(n) for n in redrawn])} drew new masks when the step passed "
        "rows through it again (a second forward, or a recomputation in backward) instead of "
        "the first pass's masks"
        if redrawn
        else "a second forward of the same micro-batch (gradient caching, activation "
        "recomputation) drew new dropout masks"
    )
    if off is not None and off.ok:
        return (
            f"the gradients match with dropout off and differ with it on: {seen}, so the "
            "gradient is back-propagated through a different network than the forward's."
        )
    return (
        f"{seen}, so the gradient is back-propagated through a different network than the "
        "forward's. With dropout off the step still differs: see the other causes."
    )


# A step that takes token means per micro-batch where the reference takes one token mean
# is the classic mean of means: `mean-of-means` names it (with the micro-batch weights
# and the item counts), not `normalization-mode`.
_MEAN_OF_MEANS = (("token", "micro_batch"), ("token", "step"))


def _norm_mismatch(case: Case) -> bool:
    norm = case.norm
    return (
        norm is not None
        and norm.found is not None
        and norm.expected is not None
        and norm.found != norm.expected
        and (norm.found, norm.expected) != _MEAN_OF_MEANS
    )


def _norm_message(case: Case) -> str:
    norm = case.norm
    assert norm is not None and norm.found is not None and norm.expected is not None
    declared = (
        ""
        if norm.expected == (norm.declared, "step")
        else f" (the spec declares normalize mode {norm.declared!r}; reference_loss measures "
        f"as {norm.expected[0]!r} {'over the whole step' if norm.expected[1] == 'step' else 'per micro-batch'})"
    )
    mode = norm.expected[0]
    return (
        f"{mismatch_text(norm.found, norm.expected)}{declared}: read from the weight the split "
        f"gradient gives every item (its gradient written as a sum over {norm.cells} "
        "(micro-batch, sequence, group) cells of item losses). "
        + (
            "Each micro-batch normalised on its own weights a sequence or group by the "
            "micro-batch it lands in (and splits one that spans micro-batches), so the "
            "step depends on how the batch is cut."
            if norm.found[1] == "micro_batch"
            else "The step normalises over the whole batch, but by another mode."
        )
        + f" Fix: give every item its whole-batch {mode!r} weight, known before any "
        f"backward: Accumulator.step(..., normalize=wholebatch.Normalize({mode!r}, items=...))."
    )


def _mean_of_means(case: Case) -> bool:
    # The equal_batch run has dropout off: it is compared with the step with dropout off,
    # so a failure only with dropout on is never read as a normalisation mistake.
    equal, reading, norm = case.equal, case.reading, case.norm
    if norm is not None and norm.expected is not None and norm.expected[0] != "token":
        return False  # the reference is measured to weight sequences or groups, not items
    return (
        (equal is not None and equal.ok and not case.clean.ok)
        or (reading is not None and reading[0] in ("equal", "per-rank"))
        or bool(dp_count_factors(case))
    )


def _overall(case: Case) -> str:
    """'the step's gradient is 5.74x the whole batch's' (the whole model's ratio), or ''."""
    params = [p for p in case.clean.params if p.live and math.isfinite(p.ratio)]
    weight = sum(p.ref_norm**2 for p in params)
    if not weight:
        return ""
    ratio = sum(p.ratio * p.ref_norm**2 for p in params) / weight
    return f"the step's gradient is {ratio:.3g}x the whole batch's"


def _why_weight(case: Case, factor: float, c: float) -> str:
    """What a weight c per part (factor = c x the number of parts) says, as a sentence ('' if
    nothing is known about it)."""
    if near(c, 1.0) and not near(factor, 1.0):
        return (
            " Each mean counts in full: neither the accumulation's 1/K nor DDP's 1/W is "
            "applied (the HF Trainer skips its 1/K and multiplies by W for a model it takes to "
            "divide by num_items_in_batch; BART and T5 return a mean instead)."
        )
    if case.b > 1 and near(factor, float(case.b)):
        return f" DDP's 1/W = 1/{case.b} is undone once too often."
    if case.k > 1 and near(factor, float(case.k)):
        return f" The accumulation's 1/K = 1/{case.k} is not applied."
    for rule, total in case.ev.item_counts.items():
        if total > 1 and near(c, 1.0 / total):
            return (
                f" The weight is 1/{total}, one over the step's items ({rule}): each mean is "
                "divided again by the step's count, a mean given where the sum of item losses "
                'was expected (e.g. the "loss" a WholeBatchAccumulation step returns).'
            )
    return ""


def _times_mean(factor: float, of: str) -> str:
    return f"the mean of {of}" if near(factor, 1.0) else f"{factor:.4g} x the mean of {of}"


def _mean_of_means_message(case: Case) -> str:
    reading, fit = case.reading, case.fit
    factors = dp_count_factors(case)
    overall = _overall(case)
    tail = f"; {overall}" if overall else ""
    if factors:
        return f"{dp_count_text(case, factors)}{tail}. That over-weights ranks with few items."
    unit = "micro-batches"
    if reading is not None and fit is not None and reading[0] == "per-rank":
        unit = "ranks"
        c = reading[1]
        how = (
            f"each of the {case.b} data-parallel ranks divides by its own item count: every "
            f"rank's micro-batches weigh {c:.4g} in all (in the right proportions within the "
            f"rank: {fmt(fit.split)}) where the whole batch weighs the ranks by their items "
            f"({fmt(fit.reference)}{case.counts}), so the step is "
            + _times_mean(c * case.b, "the ranks' means")
            + f"{tail}."
            + _why_weight(case, c * case.b, c)
        )
    elif reading is not None and fit is not None:
        c, j = reading[1], len(fit.split)
        how = (
            f"every one of the {j} micro-batches weighs {c:.4g} in the split gradient while "
            f"the whole batch weights them by their items ({fmt(fit.reference)}{case.counts}): "
            f"each micro-batch takes its own mean, and the step is "
            f"{_times_mean(c * j, 'those means')}{tail}." + _why_weight(case, c * j, c)
        )
    else:
        how = (
            "the gradients match when every row holds the same number of items (equal_batch) "
            "and differ on the ragged batch: each micro-batch (or rank) divides by its own item "
            "count and the results are averaged."
        )
    return f"{how} That over-weights {unit} with few items."


def _replicated_k(case: Case) -> bool:
    g = case.g
    return case.k > 1 and g.scalars and all(multiple(p, float(case.k)) for p in g.params)


def _replicated_k_message(case: Case) -> str:
    g = case.g
    rest = ", while every encoder gradient is right" if g.whole else ""
    return (
        f"the replicated scalar(s) {names(g.params)} get exactly K = {case.k} times their "
        f"gradient{rest}: the loss is evaluated once per micro-batch (open_clip's accum_freq), "
        "so the scalar's gradient is counted K times."
    )


def _gather_no_grad(case: Case) -> bool:
    if not case.gathers:
        return False
    return one_over_b(case) or (case.g.ratio is None and case.scope in ("ranks", "each"))


def _gather_message(case: Case) -> str:
    g = case.g
    if one_over_b(case):
        return (
            f"{g.subject()} exactly 1/W = 1/{case.b} of the whole-batch gradient and the step "
            "passed features needing gradient to a collective without one "
            f"({case.gathers}): the gathered features are constants but the local slice put "
            "back, so each rank trains only through its own rows (open_clip's "
            "gather_with_grad=False)."
        )
    exact = ", exact on one rank," if case.scope == "ranks" else ""
    return (
        f"{g.subject()} not a fixed multiple of the whole-batch gradient{exact} and the step "
        "passed features needing gradient to torch.distributed "
        f"collectives that carry none ({case.gathers}): the terms that pair this rank's rows "
        "with other ranks' rows lose their gradient (e.g. open_clip's local_loss=True "
        "without gather_with_grad=True; a hand-written gather)."
    )


def _local_slice(case: Case) -> bool:
    if not case.local_slice_functions:
        return False
    return one_over_b(case) or (case.g.ratio is None and case.scope in ("ranks", "each"))


def _local_slice_message(case: Case) -> str:
    g, fns = case.g, case.local_slice_functions
    shown = "; ".join(f"{fn}.forward: {ops}" for fn, ops in fns.items())
    what = (
        f"exactly 1/W = 1/{case.b} of the whole-batch gradient"
        if one_over_b(case)
        else "not a fixed multiple of the whole-batch gradient"
        + (", exact on one rank," if case.scope == "ranks" else "")
    )
    return (
        f"{g.subject()} {what} and the custom autograd Function {', '.join(fns)} gathers in "
        f"its forward ({shown}) while its backward calls no collective: it returns only this "
        "rank's slice of the gathered features' gradient, dropping the terms the other ranks "
        "computed with this rank's rows (the classic GatherLayer)."
    )


def _uncompensated(case: Case) -> bool:
    g = case.g
    return (
        g.whole
        and one_over_b(case)
        and not case.gathers
        and not case.local_slice_functions
        and not mesh_factor(case)
    )


def _at_b(case: Case) -> bool:
    return case.g.whole and case.b > 1 and at(case, float(case.b)) and not mesh_factor(case)


def _constant(case: Case) -> bool:
    """Every gradient the same multiple c (not 1, 1/B or B) of the reference."""
    ratio = case.g.ratio
    return (
        ratio is not None
        and case.g.whole
        and all(not p.ok for p in case.clean.params if p.live)
        and not near(ratio, 1.0)
        and not (case.b > 1 and (near(ratio, 1.0 / case.b) or near(ratio, float(case.b))))
        and not mesh_factor(case)
    )


def _scaled_message(case: Case) -> str:
    ratio = case.g.ratio or 1.0
    said = (
        f"every gradient is {ratio:.4g} x the whole-batch gradient: a constant factor (a loss "
        "divided by a wrong count or number of micro-batches, a loss scale not removed, or "
        "clipped gradients: verify's reference does not clip)."
    )
    for rule, total in case.ev.item_counts.items():
        if total > 1 and near(ratio, 1.0 / total):
            said += (
                f" 1/{ratio:.4g} = {total}, the step's items ({rule}): the loss is divided by "
                "the item count once more than it should be (a mean given where the sum of "
                "item losses was expected)."
            )
            break
    if case.j > 1 and near(ratio, float(case.j)):
        said += (
            f" {ratio:.4g} = J = {case.b} x {case.k}, the micro-batches of the step: each "
            "micro-batch's mean is summed without the 1/K of accumulation and DDP's 1/W."
        )
    return said


def _count_named(case: Case) -> bool:
    ratio = case.g.ratio
    assert ratio is not None
    proportional = case.reading is not None and case.reading[0] == "uniform"
    return bool(wrong_count_text(ratio, case.ev.item_counts, case.fit)) or proportional


def _wrong_count_message(case: Case) -> str:
    ratio = case.g.ratio or 1.0
    causal = (
        " A causal LM predicts labels[..., 1:]: counting labels before the shift adds one item "
        "per row (the HF Trainer does this for a model whose loss_type it does not know to be "
        "causal, e.g. GPT2LMHeadModel)."
        if "labels[..., 1:] != -100" in case.ev.item_counts
        else ""
    )
    return (
        f"every gradient is {ratio:.4g} x the whole-batch gradient, with the micro-batches in "
        "the right proportions: the step divides the loss sum by a wrong item count "
        f"({1 / ratio:.4g} x the right one).{wrong_count_text(ratio, case.ev.item_counts, case.fit)}"
        + causal
    )


def _aux_factor(case: Case, factor: float, what: str) -> str:
    """Why `what` carries `factor`, when a count of the split explains it ('' if none)."""
    b, k, j = case.b, case.k, case.j
    if near(factor, 1.0):
        return ""
    if b > 1 and near(factor, 1.0 / b):
        return (
            f" {factor:.4g} = 1/{b}, one over the {b} data-parallel ranks: their gradient mean "
            f"(DDP's, FSDP's) divides {what} by them and nothing multiplies it back "
            "(Megatron-LM's global aux loss before its PR #3769)."
        )
    if k > 1 and near(factor, float(k)):
        return f" {factor:.4g} = K = {k}: {what} is added in each micro-batch without the 1/K."
    if j > 1 and near(factor, float(j)):
        return (
            f" {factor:.4g} = J = {b} x {k}: {what} is added in each micro-batch without the "
            "1/K of accumulation or DDP's 1/W."
        )
    if k > 1 and near(factor, 1.0 / k):
        return f" {factor:.4g} = 1/K = 1/{k}: {what} is divided by the accumulation's K once too often."
    return ""


def _aux_per_micro_batch(case: Case) -> bool:
    return case.aux is not None and case.aux.kind == "per-micro-batch"


def _aux_per_micro_batch_message(case: Case) -> str:
    aux = case.aux
    assert aux is not None
    j = len(aux.parts)
    factor = aux.part * j
    mean = _times_mean(factor, "the micro-batches' aux losses")
    whole = (
        f", and aux_loss over the whole batch at {aux.whole:.4g}"
        if aux.whole
        else ", and aux_loss over the whole batch not at all"
    )
    return (
        f"the split gradient weighs aux_loss on every one of the {j} micro-batches' own rows "
        f"{aux.part:.4g}{whole}, where the whole batch adds aux_loss once, over its own "
        f"statistics: the step is {mean}."
        + _aux_factor(case, factor, "that mean")
        + " A load-balancing loss's f_e x P_e (or a z-loss's mean) over one micro-batch's "
        "tokens is not a share of the batch's, so the gradient depends on how the batch is "
        "cut (the loss most frameworks compute)."
    )


def _aux_scaled(case: Case) -> bool:
    return case.aux is not None and case.aux.kind in ("scaled", "weights")


def _aux_scaled_message(case: Case) -> str:
    aux = case.aux
    assert aux is not None
    if aux.kind == "scaled":
        return (
            f"the step takes aux_loss over the whole batch's statistics, as the reference does, but "
            f"at {aux.whole:.4g} x its weight there." + _aux_factor(case, aux.whole, "aux_loss")
        )
    return (
        f"the split gradient weighs aux_loss over the whole batch {aux.whole:.4g} (the "
        f"reference: 1) and on each micro-batch's own rows {fmt(aux.parts)} (the reference: 0)."
    )


def _no_gradient(case: Case) -> bool:
    bad = case.bad
    return bool(bad) and all(
        p.missing or (p.live and abs(p.ratio) < RATIO_TOL and p.abs_err >= p.ref_max * (1 - FIT))
        for p in bad
    )


GRADIENT_CAUSES: tuple[Cause, ...] = (
    Cause(
        code="ranks-differ",
        summary="ranks hold different gradients: nothing reduced them",
        precedence=100, stage="gradient", located=False,
        test=lambda case: bool(_spread(case)), message=_ranks_differ_message,
        fix="Keep every trained parameter inside the DDP module (or all-reduce its gradient "
        "yourself, matching DDP's mean).",
    ),
    Cause(
        code="no-rng-replay",
        summary="a second pass over the same rows drew new dropout masks (or: exact with "
        "dropout off)",
        precedence=110, stage="gradient",
        test=_no_rng_replay, message=_no_rng_replay_message,
        fix="Fix: save the RNG state before the first pass and restore it for the second "
        "(wholebatch.CachedStep does), or torch.utils.checkpoint with preserve_rng_state=True.",
    ),
    Cause(
        code="normalization-mode",
        summary="the items weighted by another normalisation than the reference's (per "
        "micro-batch sequence means; needs the spec's normalize)",
        precedence=115, stage="gradient",
        test=_norm_mismatch, message=_norm_message,
    ),
    Cause(
        code="mean-of-means",
        summary="micro-batches (or ranks) weighted equally instead of by their items, "
        "the weight they get named",
        precedence=120, stage="gradient", excluded_by=("normalization-mode",),
        test=_mean_of_means, message=_mean_of_means_message,
        fix="Fix: sum item losses and divide once by the global item count, agreed across "
        "ranks before backward (wholebatch.Accumulator).",
    ),
    Cause(
        code="aux-per-micro-batch",
        summary="the spec's aux_loss (an MoE load-balancing or z-loss) from each "
        "micro-batch's own statistics, not the whole batch's, with its factor",
        precedence=122, stage="gradient",
        test=_aux_per_micro_batch, message=_aux_per_micro_batch_message,
        fix="Fix: count the routers' statistics (f_e, T) over the whole step before any "
        "backward (a pass without graph, all-reduced) and give each micro-batch its share: "
        "wholebatch.train.LoadBalancingLoss and RouterZLoss under Accumulator.step do.",
    ),
    Cause(
        code="aux-scaled",
        summary="the spec's aux_loss over the whole batch at the wrong weight (1/W: DDP's "
        "mean not compensated), with its factor",
        precedence=124, stage="gradient",
        test=_aux_scaled, message=_aux_scaled_message,
        fix="Fix: scale each rank's aux share by the data-parallel size before the gradient "
        "mean, as its main term's W/N (wholebatch.train.LoadBalancingLoss and RouterZLoss "
        "under Accumulator.step do).",
    ),
    Cause(
        code="replicated-K",
        summary="replicated scalars (logit_scale) at exactly K times",
        precedence=130, stage="gradient", per_group=True,
        test=_replicated_k, message=_replicated_k_message,
        fix="Fix: take the loss's gradient once on the cached embeddings "
        "(wholebatch.CachedStep).",
    ),
    Cause(
        code="local-slice-backward",
        summary="a custom autograd Function gathers in forward, its backward keeps only the "
        "local slice",
        precedence=135, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=_local_slice, message=_local_slice_message,
        fix="Fix: in the backward, all-reduce (sum) the gradient before taking this rank's "
        "slice (that is a reduce-scatter), or use wholebatch.all_gather.",
    ),
    Cause(
        code="uncompensated-mean",
        summary="exactly 1/W and no gather: DDP's mean not compensated",
        precedence=140, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=_uncompensated,
        message=lambda case: f"every differing gradient is exactly 1/W = 1/{case.b} of the "
        f"whole-batch gradient{exact_unsharded(case)}, and the step gathered nothing without "
        "gradient (verify watches torch.distributed's collectives, inside autograd Functions "
        "too): each rank divides its loss sum by the GLOBAL item count and DDP (or FSDP) then "
        "averages over the W data-parallel ranks, so the 1/W is applied twice (e.g. "
        "num_items_in_batch passed without the HF Trainer's x W, or a loss divided by the world "
        "size on top of DDP's mean). If the step gathers features by another path (a "
        "process-group call verify cannot see), a gather without gradient gives the same 1/W.",
        fix="Fix: multiply such a loss by W (or use wholebatch.Accumulator).",
    ),
    Cause(
        code="double-compensated",
        summary="exactly W: the 1/W compensated twice",
        precedence=150, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=_at_b,
        message=lambda case: f"every differing gradient is exactly W = {case.b} times the "
        "whole-batch gradient: DDP's 1/W is compensated twice (the loss multiplied by W on top "
        "of a wholebatch loss or an HF Trainer that already multiplies), or gradients are "
        "summed where the loss expected DDP's mean.",
        fix="Pass the same grad_reduction everywhere.",
    ),
    Cause(
        code="wrong-count",
        summary="a constant factor with the right proportions: a wrong item count",
        precedence=160, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=lambda case: _constant(case) and _count_named(case),
        message=_wrong_count_message,
        fix="Fix: count exactly the items the loss averages over, across all micro-batches and "
        "ranks.",
    ),
    Cause(
        code="scaled",
        summary="a constant factor (named when it is an item count or J)",
        precedence=170, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=lambda case: _constant(case) and not _count_named(case),
        message=_scaled_message,
    ),
    Cause(
        code="gather-no-grad",
        summary="a torch.distributed collective without gradient on features",
        precedence=180, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=_gather_no_grad, message=_gather_message,
        fix="Fix: wholebatch.all_gather (backward: reduce-scatter), or a wholebatch loss "
        "(clip_loss, siglip_loss, nt_xent_loss).",
    ),
    Cause(
        code="no-gradient",
        summary="parameters that receive nothing",
        precedence=190, stage="gradient",
        test=_no_gradient,
        message=lambda case: f"the step left {names(case.bad)} without a gradient where the "
        "whole batch's moves them: the loss reaches them only through a collective that "
        "carries none (torch.distributed.all_gather), or the step detaches them.",
        fix="Fix: wholebatch.all_gather.",
    ),
)  # fmt: skip
"""The gradient causes, in precedence order (one table: a cause per row)."""
