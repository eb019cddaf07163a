"""Every cause `wholebatch verify` can name: one `Cause` per code, read as a table (`REGISTRY`).

Each cause is an entry (`wholebatch.verify.causes.base.Cause`): its code, a
one-line summary (docs/cli.md's table has one row per code), its test (a
predicate on the step's `Case`), its message, its fix, and its precedence:
causes are tried in precedence order, and a cause whose `excluded_by` codes
were already found does not hold. A per-group cause is tried on each group of
differing parameters that share one ratio to the reference (the towers at 1/W,
`logit_scale` at K), so one report names every cause that holds, each with the
parameters it concerns.

Stages, one module each: `evidence` (what the step did besides its gradients:
fails a step whose gradients match), `gradients` (read from a failing step's
gradients: all that hold are named), `mesh` (the same, on a device mesh),
`fallbacks` (tried only when no gradient cause holds, first match only:
round-off, then where it breaks, then `unknown`; and the "error" causes of a
step that gave no gradients, set by the runner).

To add a cause: one entry in its stage's tuple (and, if it reads something new,
a property on `wholebatch.verify.case.Case`), and its row in docs/cli.md.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

from wholebatch.verify.causes.base import Cause, Stage
from wholebatch.verify.causes.evidence import EVIDENCE_CAUSES
from wholebatch.verify.causes.fallbacks import FALLBACK_CAUSES
from wholebatch.verify.causes.gradients import GRADIENT_CAUSES
from wholebatch.verify.causes.mesh import MESH_CAUSES

__all__ = ["CAUSES", "REGISTRY", "Cause", "Stage"]

REGISTRY: tuple[Cause, ...] = tuple(
    sorted(
        (*EVIDENCE_CAUSES, *GRADIENT_CAUSES, *MESH_CAUSES, *FALLBACK_CAUSES),
        key=lambda c: c.precedence,
    )
)
"""Every cause, in precedence order."""

CAUSES: dict[str, str] = {c.code: c.summary for c in REGISTRY}
"""code -> one-line summary, for every cause."""
