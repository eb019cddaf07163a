"""The evidence causes: what a step did besides its gradients (any of it fails a step whose gradients match).

An optimizer stepped more than once (or never, for a trainer), parameters the
step changed itself, a reference with no gradient, a reference that changes
with the seed (randomness verify cannot replay). They are read before any
gradient and fail the step even when every gradient matches.
"""

from __future__ import annotations

from wholebatch.verify.case import Case, named, names
from wholebatch.verify.causes.base import Cause

__all__ = ["EVIDENCE_CAUSES"]


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


EVIDENCE_CAUSES: tuple[Cause, ...] = (
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
)  # fmt: skip
"""The evidence causes, in precedence order."""
