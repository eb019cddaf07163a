"""A verify cause as a table entry (`Cause`), and the tests several causes share.

A cause holds its code, a one-line summary (docs/cli.md's table has one row per
code), its test (a predicate on the step's `Case`), its message (what was seen
and what it means), its fix, and its precedence: causes are tried in precedence
order, and a cause whose `excluded_by` codes were already found does not hold.

Legend: W ranks, K micro-batches per rank, B data shards (W on a flat world).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from wholebatch.verify.case import Case, find, near

__all__ = ["Cause", "Stage", "at", "exact_unsharded", "one_over_b"]

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
    """When it is tried (see `wholebatch.verify.causes`)."""

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


def at(case: Case, target: float) -> bool:
    """The group being tried is exactly `target` times the reference."""
    ratio = case.g.ratio
    return ratio is not None and near(ratio, target)


def one_over_b(case: Case) -> bool:
    """The group is exactly 1/B: one over the data-parallel ranks (W on a flat world)."""
    return case.b > 1 and at(case, 1.0 / case.b)


def exact_unsharded(case: Case) -> str:
    """', exact at W=1' when the re-run on one rank says so (nothing when it did not run)."""
    one = find(case.comparisons, 1, case.k, case.main.dropout)
    if one is None or case.w == 1:
        return ""
    return ", exact at W=1" if one.ok else ", and differs at W=1 too"
