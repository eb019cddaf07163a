"""The fallback causes: round-off, where the step breaks, nothing known; and the runs with no gradients.

Tried only when no gradient cause holds, first match only: `round-off` (the
error within the floor of the step's own arithmetic), then where the re-runs
say it breaks (`breaks-unsplit`, `-across-ranks`, `-across-micro-batches`,
`-split-both-ways`, `-each-way`), then `unknown`. The "error" causes name a step
that gave no gradients (the runner sets them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from wholebatch.verify.case import NEAR_FLOOR, ROUND_OFF_CEILING, Case, find
from wholebatch.verify.causes.base import Cause

__all__ = ["FALLBACK_CAUSES"]


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


FALLBACK_CAUSES: tuple[Cause, ...] = (
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
    Cause(code="step-raised", summary="the step raised (traceback in the report)",
          precedence=900, stage="error"),
    Cause(code="step-hung", summary="a rank did not finish in time",
          precedence=910, stage="error"),
    Cause(code="reference-raised",
          summary="reference_loss raised on the whole batch (traceback in the report)",
          precedence=920, stage="error"),
)  # fmt: skip
"""The fallback and error causes, in precedence order."""
