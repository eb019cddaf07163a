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

Each cause is one entry of `wholebatch.verify.causes.REGISTRY` (its test on the
`Case`, message, fix, precedence); `diagnose` tries them in order.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from wholebatch.verify.case import Case, find
from wholebatch.verify.causes import CAUSES, REGISTRY, Stage
from wholebatch.verify.report import (
    Comparison,
    Diagnosis,
    Evidence,
    Fit,
    Floor,
    VerifyReport,
    error_report,
)

__all__ = ["CAUSES", "diagnose", "error_report", "locate"]


def locate(comparisons: Sequence[Comparison]) -> tuple[str | None, str | None]:
    """(a sentence saying where the step breaks, a scope code) from the re-runs; (None, None) if unknown."""
    main = comparisons[0]
    if main.ok:
        return None, None
    w, k, drop = main.world_size, main.micro_batches, main.dropout
    one = find(comparisons, 1, 1, drop) if (w, k) != (1, 1) else main
    w1 = find(comparisons, w, 1, drop) if k > 1 else main
    k1 = find(comparisons, 1, k, drop) if w > 1 else main

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
    off = find(comparisons, w, k, False) if drop else None
    if off is not None and off is not main:
        parts.append(
            "only with dropout (exact with dropout off)" if off.ok else "also with dropout off"
        )
    equal = find(comparisons, w, k, False, equal=True)
    if equal is not None:
        parts.append(
            "only with ragged items (exact on equal_batch)" if equal.ok else "also on equal_batch"
        )
    return ("; ".join(parts) or None), scope


def _capitalised(message: str, prefix: str) -> str:
    """Capitalise the sentence after the "Where: ..." prefix."""
    n = len(prefix) if prefix and message.startswith(prefix) else 0
    return message[:n] + message[n : n + 1].upper() + message[n + 1 :]


def _causes(case: Case, stage: Stage) -> list[Diagnosis]:
    """The causes of `stage` that hold, in precedence order (a fallback: the first only)."""
    out: list[Diagnosis] = []
    by_group: dict[int, list[str]] = {}
    for cause in REGISTRY:
        if cause.stage != stage:
            continue
        if cause.per_group:
            texts: list[str] = []
            params: list[str] = []
            for i, group in enumerate(case.groups):
                case.group = group
                if not any(c in by_group.get(i, []) for c in cause.excluded_by) and cause.test(
                    case
                ):
                    by_group.setdefault(i, []).append(cause.code)
                    texts.append(cause.message(case))
                    params += group.names
            case.group = None
            if not texts:
                continue
            body = " ".join(t[:1].upper() + t[1:] if i else t for i, t in enumerate(texts))
            if case.clean is not case.main:
                # the groups' ratios are those of the run with dropout off: say so
                body = "with dropout off, " + body
            text = (
                (case.at if cause.located else "") + body + (f" {cause.fix}" if cause.fix else "")
            )
        elif any(code in case.found for code in cause.excluded_by) or not cause.test(case):
            continue
        else:
            text, params = cause.text(case), []
        case.found.append(cause.code)
        if stage != "evidence":
            text = _capitalised(text, case.at)
        out.append(Diagnosis(code=cause.code, message=text, params=tuple(params)))
        if stage == "fallback":
            break
    return out


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
    where, scope = locate(comparisons)
    case = Case(comparisons, evidence, floor=floor, fit=fit, where=where, scope=scope)
    found = _causes(case, "evidence")
    if not case.main.ok and "unreplayable-randomness" not in case.found:
        found += _causes(case, "gradient") or _causes(case, "fallback")
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
