"""Every cause `wholebatch verify` can name: one `Cause` per code, read as a table (`CAUSES`).

A cause holds its code, a one-line summary (docs/cli.md's table has one row per
code), its test (a predicate on the step's `Case`), its message (what was
seen and what it means), its fix, and its precedence: causes are tried in
precedence order, and a cause whose `excluded_by` codes were already found
does not hold.

A per-group cause is tried on each group of differing parameters that share
one ratio to the reference (the towers at 1/W, `logit_scale` at K), so one
report names every cause that holds, each with the parameters it concerns.

Stages: "evidence" causes are read from what the step did besides its
gradients and fail a step whose gradients match; "gradient" causes are read
from a failing step's gradients (all that hold are named); "fallback" causes
are tried only when no gradient cause holds, first match only (round-off, then
where it breaks, then `unknown`); "error" causes name a step that gave no
gradients at all (the runner sets them).

To add a cause: one entry in `_CAUSES` below (and, if it reads something new, a
property on `wholebatch.verify.case.Case`), and its row in docs/cli.md.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

from wholebatch.train.normalize import mismatch_text
from wholebatch.verify.case import (
    FIT,
    NEAR_FLOOR,
    RATIO_TOL,
    ROUND_OFF_CEILING,
    Case,
    find,
    fmt,
    multiple,
    named,
    names,
    near,
    wrong_count_text,
)
from wholebatch.verify.report import Comparison

__all__ = ["CAUSES", "REGISTRY", "Cause", "Stage"]

Stage = Literal["evidence", "gradient", "fallback", "error"]


def _never(case: Case) -> bool:
    return False


def _nothing(case: Case) -> str:
    return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cause:
    """One named cause: how verify tells it, and what it tells the user."""

    code: str
    """Short id (docs/cli.md lists every one)."""

    summary: str
    """One line: what the code means."""

    precedence: int
    """Tried in increasing order; earlier causes are named first."""

    stage: Stage
    """When it is tried (see the module docstring)."""

    test: Callable[[Case], bool] = _never
    """Whether the cause holds for this step."""

    message: Callable[[Case], str] = _nothing
    """What was seen and what it means (the fix is appended)."""

    fix: str = ""
    """What to change."""

    located: bool = True
    """The message starts with where the step breaks ("Where: ... .")."""

    excluded_by: tuple[str, ...] = ()
    """Codes that, when found first (for the same group, for a per-group cause), mean this
    cause does not hold."""

    per_group: bool = False
    """Tried on each group of differing parameters that share one multiple of the reference
    (`Case.group`); named once, for every group it holds for."""

    def text(self, case: Case) -> str:
        """The full message for this step."""
        body = self.message(case) + (f" {self.fix}" if self.fix else "")
        return (case.at if self.located else "") + body


# ---------------------------------------------------------------------------
# Evidence: what the step did besides its gradients
# ---------------------------------------------------------------------------


def _steps_wrong(case: Case) -> bool:
    calls, ev = case.ev.step_calls, case.ev
    return bool(calls) and (
        max(calls) > 1 or len(set(calls)) > 1 or (ev.kind == "trainer" and min(calls) == 0)
    )


def _steps_message(case: Case) -> str:
    calls = case.ev.step_calls
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
    return f"optimizer.step() was called ({shown}) where one step is one call: {what}"


def _changed(case: Case) -> list[str]:
    return sorted({n for names_ in case.ev.changed for n in names_})


def _changed_message(case: Case) -> str:
    return (
        f"the step changed {names([named(n) for n in _changed(case)])} itself: it steps an "
        "optimizer other than the one verify passes (which records and changes nothing), so "
        "verify cannot see the gradient it stepped with."
    )


def _unreplayable_message(case: Case) -> str:
    return (
        f"the whole-batch reference itself changes with the seed (by "
        f"{case.ev.reference_spread:.1e}, relative): the model draws random numbers verify "
        "cannot record and replay (F.dropout, an attention kernel's dropout_p, stochastic "
        "depth; verify replays nn.Dropout modules only), so the gradients cannot be judged."
    )


# ---------------------------------------------------------------------------
# Gradients: how a failing step's gradients differ
# ---------------------------------------------------------------------------


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
    return (equal is not None and equal.ok and not case.clean.ok) or (
        reading is not None and reading[0] in ("per-micro-batch", "per-rank")
    )


def _mean_of_means_message(case: Case) -> str:
    reading, fit, w = case.reading, case.fit, case.w
    if reading is not None and reading[0] == "per-rank":
        how = (
            f"each rank divides by its own item count and DDP averages the {w} ranks' means "
            f"(implied weights per micro-batch {fmt(fit.split) if fit else ''}; the whole batch "
            f"weights them {fmt(fit.reference) if fit else ''}{case.counts})"
        )
    elif reading is not None and fit is not None:
        how = (
            f"each of the {len(fit.split)} micro-batches gets the same weight 1/{len(fit.split)} "
            f"in the split gradient, while the whole batch weights them by their items "
            f"({fmt(fit.reference)}{case.counts}): each micro-batch divides by its own item count "
            "and the results are averaged"
        )
    else:
        how = (
            "the gradients match when every row holds the same number of items (equal_batch) "
            "and differ on the ragged batch: each micro-batch (or rank) divides by its own item "
            "count and the results are averaged"
        )
    return f"{how}. That over-weights micro-batches with few items."


def _at(case: Case, target: float) -> bool:
    """The group is exactly `target` times the reference."""
    ratio = case.g.ratio
    return ratio is not None and near(ratio, target)


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


def _one_over_w(case: Case) -> bool:
    return case.w > 1 and _at(case, 1.0 / case.w)


def _gather_no_grad(case: Case) -> bool:
    if not case.gathers:
        return False
    return _one_over_w(case) or (case.g.ratio is None and case.scope in ("ranks", "each"))


def _gather_message(case: Case) -> str:
    g = case.g
    if _one_over_w(case):
        return (
            f"{g.subject()} exactly 1/W = 1/{case.w} of the whole-batch gradient and the step "
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
    return _one_over_w(case) or (case.g.ratio is None and case.scope in ("ranks", "each"))


def _local_slice_message(case: Case) -> str:
    g, fns = case.g, case.local_slice_functions
    shown = "; ".join(f"{fn}.forward: {ops}" for fn, ops in fns.items())
    what = (
        f"exactly 1/W = 1/{case.w} of the whole-batch gradient"
        if _one_over_w(case)
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
    return g.whole and _one_over_w(case) and not case.gathers and not case.local_slice_functions


def _exact_unsharded(case: Case) -> str:
    """', exact at W=1' when the re-run on one rank says so (nothing when it did not run)."""
    one = find(case.comparisons, 1, case.k, case.main.dropout)
    if one is None or case.w == 1:
        return ""
    return ", exact at W=1" if one.ok else ", and differs at W=1 too"


def _at_w(case: Case) -> bool:
    return case.g.whole and case.w > 1 and _at(case, float(case.w))


def _constant(case: Case) -> bool:
    """Every gradient the same multiple c (not 1, 1/W or W) of the reference."""
    ratio = case.g.ratio
    return (
        ratio is not None
        and case.g.whole
        and all(not p.ok for p in case.clean.params if p.ref_max > 0)
        and not near(ratio, 1.0)
        and not (case.w > 1 and (near(ratio, 1.0 / case.w) or near(ratio, float(case.w))))
        and not _mesh_factor(case)
    )


def _count_named(case: Case) -> bool:
    ratio = case.g.ratio
    assert ratio is not None
    proportional = case.reading is not None and case.reading[0] == "uniform"
    return bool(wrong_count_text(ratio, case.ev.item_counts, case.fit)) or proportional


def _wrong_count_message(case: Case) -> str:
    ratio = case.g.ratio or 1.0
    return (
        f"every gradient is {ratio:.4g} x the whole-batch gradient, with the micro-batches in "
        "the right proportions: the step divides the loss sum by a wrong item count "
        f"({1 / ratio:.4g} x the right one).{wrong_count_text(ratio, case.ev.item_counts, case.fit)}"
        " A causal LM predicts labels[..., 1:]: counting labels before the shift adds one item "
        "per row (the HF Trainer does this for a model whose loss_type it does not know to be "
        "causal, e.g. GPT2LMHeadModel)."
    )


def _no_gradient(case: Case) -> bool:
    bad = case.bad
    return bool(bad) and all(
        p.missing
        or (p.ref_max > 0 and abs(p.ratio) < RATIO_TOL and p.abs_err >= p.ref_max * (1 - FIT))
        for p in bad
    )


# ---------------------------------------------------------------------------
# Fallbacks: round-off, where it breaks, nothing known
# ---------------------------------------------------------------------------


def _round_off(case: Case) -> bool:
    main, floor = case.main, case.floor
    return (
        floor is not None
        and math.isfinite(main.max_rel_err)
        and main.max_rel_err <= min(NEAR_FLOOR * floor.value, ROUND_OFF_CEILING)
    )


def _round_off_message(case: Case) -> str:
    floor, main = case.floor, case.main
    assert floor is not None
    measured = (
        ""
        if floor.measured is None
        else f"; the same batch in reversed row order differs by {floor.measured:.1e}"
    )
    return (
        f"the largest error {main.max_rel_err:.1e} is within {NEAR_FLOOR:g}x the "
        f"round-off floor ~{floor.value:.1e} of the model's own arithmetic (it computes in "
        f"{', '.join(floor.dtypes)}; eps {floor.unit_roundoff:.1e}{measured}), while rtol is "
        f"{floor.rtol:g} ({floor.rtol_from}): this is round-off, not a split mistake. Leave "
        "rtol unset (verify derives it from the dtypes) or set it above "
        f"{min(NEAR_FLOOR * floor.value, ROUND_OFF_CEILING):.0e}."
    )


def _detail(case: Case) -> str:
    worst = case.worst()
    return f"worst parameter {worst.name} (rel err {worst.rel_err:.2e}, ratio {worst.ratio:.4g})"


def _ask(case: Case) -> str:
    """Ask for an equal_batch when neither it nor the fit could tell normalisation apart."""
    fit = case.fit
    if find(case.comparisons, case.w, case.k, False, equal=True) is not None or (
        fit is not None and fit.usable
    ):
        return ""
    why = (
        f" (the weights could not be read from the gradient: {fit.note})"
        if fit is not None and fit.note
        else ""
    )
    return (
        " If the loss is a mean over items (tokens), give the spec an equal_batch (every row "
        f"the same item count) so verify can tell a normalisation mistake apart{why}."
    )


def _scoped(scope: str, what: str) -> Callable[[Case], str]:
    def message(case: Case) -> str:
        return f"Where: {case.where}. {what} ({_detail(case)}).{_ask(case)}"

    message.__doc__ = f"The {scope!r} fallback's message."
    return message


def _in_scope(scope: str) -> Callable[[Case], bool]:
    def test(case: Case) -> bool:
        return case.scope == scope

    return test


def _unknown_message(case: Case) -> str:
    return (
        f"no known pattern; {_detail(case)}. Check that the split step and reference_loss "
        f"compute the same loss.{_ask(case)}"
    )


_WHERE_IT_BREAKS = (
    (
        "unsplit", "breaks-unsplit",
        "differs even at W=1, K=1: the step's loss is not reference_loss",
        "the split step differs from reference_loss even on one rank with one micro-batch: "
        "they compute different losses (a different normalisation, a term only one of them "
        "has, clipping, a frozen or detached part). Compare the step's loss with "
        "reference_loss on the whole batch.",
    ),
    (
        "ranks", "breaks-across-ranks", "exact on one rank, differs across ranks",
        "exact on one rank, wrong across ranks: a cross-rank term has the wrong gradient or "
        "weight (a gather without gradient, a per-rank normalisation, a rank-dependent label "
        "offset, a parameter outside DDP).",
    ),
    (
        "micro-batches", "breaks-across-micro-batches",
        "exact with K=1, differs across micro-batches",
        "exact with one micro-batch, wrong across micro-batches: accumulation weighs or "
        "connects them wrongly (a per-micro-batch mean, a loss over only the live "
        "micro-batch, a missing no_sync/sync, a second pass that differs).",
    ),
    (
        "both-ways", "breaks-split-both-ways",
        "exact split either way alone, differs split both ways",
        "exact split across ranks alone and across micro-batches alone, wrong when split both "
        "ways: the step combines ranks and micro-batches wrongly (a count agreed per rank but "
        "not across micro-batches, or the reverse).",
    ),
    (
        "each", "breaks-each-way", "differs across ranks alone and across micro-batches alone",
        "wrong across ranks alone and across micro-batches alone: look for a normalisation or "
        "a gather that depends on how the batch is cut.",
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------
# A device mesh (--mesh): counts over the wrong dims, replicas fed different data
# ---------------------------------------------------------------------------


def _mesh_sizes(case: Case) -> tuple[int, int]:
    """(R, C): the tensor-parallel replicas (product of the replica dims), the cp size."""
    from wholebatch.verify.mesh import replica_dims

    shape = case.ev.mesh
    if not shape:
        return 1, 1
    r = math.prod(shape[d] for d in replica_dims(shape, case.ev.row_dims))
    return r, shape.get("cp", 1)


def _unreplicated(case: Case) -> Comparison | None:
    """The re-run with the tp and cp dims of size 1 ("dp=2,tp=1"), if verify made it."""
    from wholebatch.verify.mesh import REPLICAS_ONE

    return next((c for c in case.comparisons if c.variant.startswith(REPLICAS_ONE)), None)


def _mesh_at(case: Case, factor: float) -> bool:
    """The group is `factor` x the reference on a mesh, and exact (if re-run) without tp/cp."""
    if not case.ev.mesh or factor == 1.0 or not _at(case, factor):
        return False
    again = _unreplicated(case)
    return again is None or again.ok


def _counted_replicas(case: Case) -> bool:
    r, _ = _mesh_sizes(case)
    return r > 1 and _mesh_at(case, 1.0 / r)


def _cp_twice(case: Case) -> bool:
    _, c = _mesh_sizes(case)
    return c > 1 and _mesh_at(case, 1.0 / c)


def _mesh_factor(case: Case) -> bool:
    """A constant factor one of the mesh causes explains (not also named `scaled`)."""
    if not case.ev.mesh or case.group is None:
        return False
    return _counted_replicas(case) or _cp_twice(case)


def _mesh_shown(case: Case) -> str:
    return ",".join(f"{d}={s}" for d, s in case.ev.mesh.items())


def _rerun_text(case: Case) -> str:
    again = _unreplicated(case)
    if again is None:
        return ""
    shape = again.variant.partition("(")[2].rstrip(")")
    return f", and exact on the same step at {shape}"


def _counted_replicas_message(case: Case) -> str:
    from wholebatch.verify.mesh import replica_dims

    r, _ = _mesh_sizes(case)
    dims = " x ".join(d for d in replica_dims(case.ev.mesh, case.ev.row_dims))
    return (
        f"{case.g.subject()} exactly 1/{r} of the whole-batch gradient on the mesh "
        f"{_mesh_shown(case)}{_rerun_text(case)}: {r} = the {dims} ranks that replicate each "
        f"row shard. The step counts items over them too (the count all-reduced over the "
        f"world, or over {' x '.join((*case.ev.row_dims, dims))}), so N is {r}x the batch's: "
        f"{dims} ranks see the same tokens and must be counted once."
    )


def _cp_twice_message(case: Case) -> str:
    _, c = _mesh_sizes(case)
    return (
        f"{case.g.subject()} exactly 1/cp = 1/{c} of the whole-batch gradient on the mesh "
        f"{_mesh_shown(case)}{_rerun_text(case)}: every context-parallel rank counts the "
        f"items of the whole rows it shares (not of its own tokens) and the counts are summed "
        f"over dp x cp, so each row's items are counted {c} times (prime-rl PR #2562)."
    )


def _replica_split(case: Case) -> list[tuple[int, int, int]]:
    """(rank, rank, forward) for the replicas whose model received different inputs."""
    from wholebatch.verify.mesh import replica_groups

    ev = case.ev
    if not ev.mesh or len(ev.inputs) != math.prod(ev.mesh.values()):
        return []
    out = []
    for group in replica_groups(ev.mesh, ev.row_dims):
        first = ev.inputs[group[0]]
        for r in group[1:]:
            mine = ev.inputs[r]
            if len(mine) != len(first):
                out.append((group[0], r, min(len(mine), len(first))))
                continue
            for i, (a, b) in enumerate(zip(first, mine, strict=True)):
                if abs(a - b) > 1e-9 * max(1.0, abs(a)):
                    out.append((group[0], r, i))
                    break
    return out


def _replica_data_message(case: Case) -> str:
    from wholebatch.verify.mesh import replica_dims

    dims = "/".join(replica_dims(case.ev.mesh, case.ev.row_dims))
    shown = "; ".join(
        f"ranks {a} and {b} at forward call {i + 1}" for a, b, i in _replica_split(case)[:4]
    )
    return (
        f"ranks that replicate a row shard on the mesh {_mesh_shown(case)} (the same "
        f"coordinates on the batch dims {case.ev.row_dims}, they differ only on {dims}) fed "
        f"their model different inputs ({shown}): verify gave them the same rows, so the step "
        "(or its data loader) picks rows by the global rank. Tensor-parallel ranks compute one "
        "loss together on the same tokens; fed different rows, their gradients mix rows of "
        "different batches."
    )


def _cp_factors(case: Case) -> dict[int, float]:
    """On a mesh with cp: each cp coordinate's factor, when every rank's shards are one
    multiple of the reference, the ranks of one cp coordinate agree, and sum(1/f) = 1."""
    from wholebatch.verify.mesh import coordinate

    ev, (_, c) = case.ev, _mesh_sizes(case)
    if c < 2 or not ev.rank_factors or any(f is None or f <= 0 for f in ev.rank_factors):
        return {}
    by_cp: dict[int, float] = {}
    for rank, f in enumerate(ev.rank_factors):
        assert f is not None
        at = coordinate(ev.mesh, rank)["cp"]
        if at in by_cp and not near(by_cp[at], f):
            return {}
        by_cp.setdefault(at, f)
    if len(by_cp) != c or all(near(f, 1.0) for f in by_cp.values()):
        return {}
    return by_cp if abs(math.fsum(1.0 / f for f in by_cp.values()) - 1.0) <= 1e-6 else {}


def _cp_missing_message(case: Case) -> str:
    factors = _cp_factors(case)
    shown = ", ".join(f"cp rank {r}: {f:.4g}" for r, f in sorted(factors.items()))
    inverse = " + ".join(f"1/{f:.4g}" for _, f in sorted(factors.items()))
    return (
        f"on the mesh {_mesh_shown(case)} each rank's shard of the gradient is its own "
        f"multiple of the whole-batch gradient ({shown}), and {inverse} = 1: each cp rank "
        "divides by the items of its own tokens (N_c, agreed over dp only) where the whole "
        "batch has N = the sum over cp of N_c, so the other context-parallel ranks' items are "
        "missing from its count (x cp when every cp rank holds as many; Megatron-LM PR #7513)."
    )


def _stages(case: Case) -> dict[int, set[str]]:
    """On a pipeline mesh: each pp stage's parameters (those its ranks gave a gradient)."""
    from wholebatch.verify.mesh import coordinate

    ev = case.ev
    if ev.mesh.get("pp", 1) < 2 or len(ev.owned) != math.prod(ev.mesh.values()):
        return {}
    out: dict[int, set[str]] = {}
    for rank, names_ in enumerate(ev.owned):
        out.setdefault(coordinate(ev.mesh, rank)["pp"], set()).update(names_)
    return out


def _unscaled_stage(case: Case) -> int | None:
    """The one stage whose parameters are this group, at one factor, the others exact."""
    stages, g = _stages(case), case.g
    if not stages or g.ratio is None or near(g.ratio, 1.0):
        return None
    group = set(g.names)
    hit = [s for s, owned in stages.items() if group <= owned]
    if len(hit) != 1:
        return None
    others = {n for s, owned in stages.items() if s != hit[0] for n in owned}
    exact = all(p.ok for p in case.main.params if p.name in others)
    return hit[0] if exact and others else None


def _stage_message(case: Case) -> str:
    stage = _unscaled_stage(case)
    return (
        f"{case.g.subject()} {case.g.ratio:.4g} x the whole-batch gradient, and they are the "
        f"parameters of pipeline stage {stage} on the mesh {_mesh_shown(case)}, while every "
        "other stage's gradient is exact: that stage's gradients were not rescaled by the "
        "step's factor (the agreed 1/N, times the wrapper's divisor). Only the last stage "
        "computes the loss, but every stage's gradient is part of the same step."
    )


_MESH_CAUSES: tuple[Cause, ...] = (
    Cause(
        code="replicas-fed-different-data",
        summary="on a mesh, ranks that replicate a row shard (tp) fed the model different inputs",
        precedence=45,
        stage="evidence",
        located=False,
        test=lambda case: bool(_replica_split(case)),
        message=_replica_data_message,
        fix="Fix: shard the data by the batch dims only (DistributedSampler(num_replicas=<product "
        "of the batch dims' sizes>, rank=<the batch index>)); wholebatch.Accumulator(mesh=, "
        "batch_dims=) checks this at every step.",
    ),
    Cause(
        code="counted-over-tp",
        summary="on a mesh, exactly 1/tp: items counted over the tensor-parallel replicas too",
        precedence=142,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=_counted_replicas,
        message=_counted_replicas_message,
        fix="Fix: all-reduce the item count over the batch dims' group only "
        "(MeshSplit(mesh=mesh, batch_dims=('dp',)).batch_group(), not the world), or "
        "wholebatch.Accumulator(model, opt, mesh=mesh, batch_dims=('dp',)).",
    ),
    Cause(
        code="cp-counted-twice",
        summary="on a mesh, exactly 1/cp: each row's items counted on every context-parallel rank",
        precedence=144,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=_cp_twice,
        message=_cp_twice_message,
        fix="Fix: each cp rank counts the items of its own tokens only, summed over dp x cp "
        "(Accumulator(mesh=mesh, batch_dims=('dp', 'cp')) with a loss_fn over the rank's "
        "slice).",
    ),
    Cause(
        code="cp-items-missing",
        summary="on a mesh with cp, each rank's shard at N / N_c: cp's items left out of the count",
        precedence=147,
        stage="gradient",
        test=lambda case: bool(_cp_factors(case)),
        message=_cp_missing_message,
        fix="Fix: count over dp x cp (Accumulator(mesh=mesh, batch_dims=('dp', 'cp'))), the "
        "count all-reduced over the flattened dp_cp group.",
    ),
    Cause(
        code="stage-not-rescaled",
        summary="on a pipeline mesh, one stage's parameters at a factor, the other stages exact",
        precedence=146,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=lambda case: _unscaled_stage(case) is not None,
        message=_stage_message,
        fix="Fix: after the schedule, agree N over the mesh and rescale every stage by the "
        "same factor (wholebatch.train.pipeline.PipelineAccumulator does).",
    ),
)


_CAUSES: tuple[Cause, ...] = (
    # -- evidence ----------------------------------------------------------------------
    Cause(
        code="optimizer-steps",
        summary="optimizer.step() called more than once, differently across ranks, "
        "or (a trainer) never on the optimizer verify gave it",
        precedence=10, stage="evidence", located=False,
        test=_steps_wrong, message=_steps_message,
    ),
    Cause(
        code="params-changed",
        summary="the step changed the parameters itself (another optimizer)",
        precedence=20, stage="evidence", located=False,
        test=lambda case: bool(_changed(case)), message=_changed_message,
        fix="Step the optimizer you are given.",
    ),
    Cause(
        code="no-reference-gradient",
        summary="reference_loss gives no gradient: nothing could be judged",
        precedence=30, stage="evidence", located=False,
        test=lambda case: case.ev.reference_zero,
        message=lambda case: "reference_loss gives no gradient to any parameter, so nothing "
        "was judged.",
        fix="Check that it computes the loss from the model's output (not detached).",
    ),
    Cause(
        code="unreplayable-randomness",
        summary="the reference differs between seeds: randomness outside nn.Dropout",
        precedence=40, stage="evidence", located=False,
        test=lambda case: case.ev.reference_spread > case.main.rtol,
        message=_unreplayable_message,
        fix="Build the model with that randomness off (e.g. config.attn_pdrop=0) or as "
        "nn.Dropout modules.",
    ),
    # -- gradients ---------------------------------------------------------------------
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
        summary="micro-batches (or ranks) weighted equally instead of by their items",
        precedence=120, stage="gradient", excluded_by=("normalization-mode",),
        test=_mean_of_means, message=_mean_of_means_message,
        fix="Fix: sum item losses and divide once by the global item count, agreed across "
        "ranks before backward (wholebatch.Accumulator).",
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
        message=lambda case: f"every differing gradient is exactly 1/W = 1/{case.w} of the "
        f"whole-batch gradient{_exact_unsharded(case)}, and the step gathered nothing without "
        "gradient (verify watches torch.distributed's collectives, inside autograd Functions "
        "too): each rank "
        "divides its loss sum by the GLOBAL item count and DDP then averages over W ranks, so "
        "the 1/W is applied twice (e.g. num_items_in_batch passed without the HF Trainer's x "
        "W, or a loss divided by the world size on top of DDP's mean). If the step gathers "
        "features by another path (a process-group call verify cannot see), a gather without "
        "gradient gives the same 1/W.",
        fix="Fix: multiply such a loss by W (or use wholebatch.Accumulator).",
    ),
    Cause(
        code="double-compensated",
        summary="exactly W: the 1/W compensated twice",
        precedence=150, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=_at_w,
        message=lambda case: f"every differing gradient is exactly W = {case.w} times the "
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
        summary="a constant factor",
        precedence=170, stage="gradient", per_group=True, excluded_by=("replicated-K",),
        test=lambda case: _constant(case) and not _count_named(case),
        message=lambda case: f"every gradient is {case.g.ratio:.4g} x the whole-batch "
        "gradient: a constant factor (a loss divided by a wrong count or number of "
        "micro-batches, a loss scale not removed, or clipped gradients: verify's reference "
        "does not clip).",
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
        message=lambda case: f"{names(case.bad)} received no gradient: the loss reaches them "
        "only through a collective that carries none (torch.distributed.all_gather), or the "
        "step detaches them.",
        fix="Fix: wholebatch.all_gather.",
    ),
    # -- fallbacks ---------------------------------------------------------------------
    Cause(
        code="round-off",
        summary="within the round-off floor of the model's own dtypes",
        precedence=300, stage="fallback", located=False,
        test=_round_off, message=_round_off_message,
    ),
    *(
        Cause(
            code=code, summary=summary, precedence=310 + i, stage="fallback", located=False,
            test=_in_scope(scope), message=_scoped(scope, what),
        )
        for i, (scope, code, summary, what) in enumerate(_WHERE_IT_BREAKS)
    ),
    Cause(
        code="unknown",
        summary="no pattern and no re-runs to localise it",
        precedence=399, stage="fallback", located=False,
        test=lambda case: True, message=_unknown_message,
    ),
    # -- no gradients at all (set by the runner) ---------------------------------------
    Cause(code="step-raised", summary="the step raised (traceback in the report)",
          precedence=900, stage="error"),
    Cause(code="step-hung", summary="a rank did not finish in time",
          precedence=910, stage="error"),
    Cause(code="reference-raised",
          summary="reference_loss raised on the whole batch (traceback in the report)",
          precedence=920, stage="error"),
)  # fmt: skip

REGISTRY: tuple[Cause, ...] = tuple(sorted((*_CAUSES, *_MESH_CAUSES), key=lambda c: c.precedence))
"""Every cause, in precedence order."""

CAUSES: dict[str, str] = {c.code: c.summary for c in REGISTRY}
"""code -> one-line summary, for every cause."""
