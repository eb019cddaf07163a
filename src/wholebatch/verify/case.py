"""What a verify cause reads: one failing step's runs and evidence, read once (`Case`).

`wholebatch.verify.causes` holds the causes; each one's test and message read a
`Case`: the comparison as given, the same step with dropout off and on
`equal_batch`, where it breaks (`locate`), the collectives it called, the
weights each micro-batch gets in the wrong gradient (`Fit`) and, when the spec
gives the items' ids, the normalisation each side applies to them (`NormFit`), the ratio every
differing parameter's gradient has to the reference's. The helpers below turn
those numbers into the words the messages use.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

from wholebatch.verify.report import Comparison, Evidence, Fit, Floor, NormFit, ParamError

__all__ = [
    "FIT",
    "NEAR_FLOOR",
    "RATIO_TOL",
    "ROUND_OFF_CEILING",
    "AuxReading",
    "Case",
    "Group",
    "find",
    "fmt",
    "multiple",
    "named",
    "names",
    "near",
]

# A fitted ratio counts as "1/W", "K", "W", "c" when within this relative distance, and
# the gradient is "that multiple of the reference" when the rest is within FIT.
RATIO_TOL = 1e-3
FIT = 1e-3
# A failure whose error is within this many times the round-off floor is called round-off,
# but never one above ROUND_OFF_CEILING: no arithmetic here loses 5% of a gradient to
# round-off (100 x bfloat16's eps would be 78%), while a split mistake often does.
NEAR_FLOOR = 100.0
ROUND_OFF_CEILING = 0.05


def near(x: float, target: float) -> bool:
    """`x` is `target` to RATIO_TOL (relative)."""
    return math.isfinite(x) and abs(x - target) <= RATIO_TOL * abs(target)


def multiple(p: ParamError, target: float) -> bool:
    """`p`'s gradient is `target` times the reference's (to FIT)."""
    return near(p.ratio, target) and p.fit_err <= FIT


def names(params: Sequence[ParamError], limit: int = 4) -> str:
    """'a, b, c, d and 3 more'."""
    shown = ", ".join(p.name for p in params[:limit])
    return shown + (f" and {len(params) - limit} more" if len(params) > limit else "")


def named(name: str) -> ParamError:
    """A placeholder ParamError that carries only a name (for `names`)."""
    return ParamError(
        name=name,
        shape=(),
        ref_max=0.0,
        abs_err=0.0,
        rel_err=0.0,
        ratio=math.nan,
        fit_err=0.0,
        rank_spread=0.0,
        missing=False,
        ok=True,
    )


def fmt(xs: Sequence[float]) -> str:
    """Up to 12 numbers, 3 significant digits."""
    shown = " ".join(f"{x:.3g}" for x in xs[:12])
    return shown + (" ..." if len(xs) > 12 else "")


def find(
    comparisons: Sequence[Comparison], w: int, k: int, dropout: bool, equal: bool = False
) -> Comparison | None:
    """The run at (w, k) under (dropout, equal), if verify made it."""
    for c in comparisons:
        key = (c.world_size, c.micro_batches, c.dropout, c.equal)
        if key == (w, k, dropout, equal):
            return c
    return None


def common_ratio(c: Comparison) -> float | None:
    """The c with every differing parameter at c times the reference, if there is one."""
    live = [p for p in c.params if not p.ok and p.live]
    if len(live) < sum(not p.ok for p in c.params):
        return None
    if not live or any(not math.isfinite(p.ratio) or p.fit_err > FIT for p in live):
        return None
    first = live[0].ratio
    return first if all(near(p.ratio, first) for p in live) else None


def matching_rule(fit: Fit) -> str | None:
    """The counting rule whose per-micro-batch shares are the reference's weights."""
    for rule, counts in fit.counts.items():
        total = sum(counts)
        if total > 0 and all(
            abs(n / total - b) <= 1e-4 * max(abs(b), 1e-12) + 1e-9
            for n, b in zip(counts, fit.reference, strict=True)
        ):
            return rule
    return None


def read_fit(fit: Fit | None, b: int) -> tuple[str, float] | None:
    """How the split gradient weights the micro-batches, from a usable fit (None: no fit):

    - ("uniform", c): every micro-batch at c times its whole-batch weight (a wrong count);
    - ("equal", c): every micro-batch weighted c where the whole batch weights them
      unequally: each micro-batch's own mean, times c (c = 1/J: a plain mean of means);
    - ("per-rank", c): each rank's micro-batches in the right proportions, every rank's
      share c where the whole batch weights the ranks unequally: each of the B data-
      parallel ranks divides by its own count (c = 1/B under DDP's mean);
    - ("weights", 0): none of these.
    """
    if fit is None or not fit.usable:
        return None
    # A micro-batch without items has a zero gradient: weight 0 exactly on both sides (lstsq).
    kept = [j for j, (x, y) in enumerate(zip(fit.split, fit.reference, strict=True)) if x or y]
    if len(kept) < len(fit.split):
        fit = dataclasses.replace(
            fit,
            split=tuple(fit.split[j] for j in kept),
            reference=tuple(fit.reference[j] for j in kept),
            ranks=tuple(fit.ranks[j] for j in kept),
            counts={k: tuple(v[j] for j in kept) for k, v in fit.counts.items()},
        )
    a, w = fit.split, fit.reference
    n = len(a)
    if n == 0:
        return None
    tol = max(RATIO_TOL, fit.tolerance)
    if all(x > 0 for x in w):
        rho = [x / y for x, y in zip(a, w, strict=True)]
        mean = sum(rho) / n
        if mean != 0 and all(abs(r - mean) <= tol * abs(mean) for r in rho):
            if fit.aux is not None and near(mean, 1.0):
                return None  # the main term is right: only aux_loss can be wrong (read_aux)
            return "uniform", mean
    w_equal = max(w) - min(w) <= tol * max(abs(max(w)), 1e-12)
    c = sum(a) / n
    if not w_equal and c != 0 and all(abs(x - c) <= tol * abs(c) for x in a):
        return "equal", c
    share = _per_rank_share(fit, b, tol)
    if share is not None:
        return "per-rank", share
    return "weights", 0.0


@dataclasses.dataclass(frozen=True)
class AuxReading:
    """How the split gradient weights the spec's `aux_loss` (`read_aux`)."""

    kind: str
    """"per-micro-batch": aux_loss of every micro-batch's own rows at one weight `part`
    (and of the whole batch at `whole`, 0 for the usual mistake); "scaled": aux_loss of
    the whole batch only, at `whole` (not 1); "weights": neither."""

    whole: float
    """x: the weight of aux_loss on the whole batch (the reference's: 1)."""

    part: float
    """The one weight of every micro-batch's own aux_loss ("per-micro-batch"), else 0."""

    parts: tuple[float, ...] = ()
    """Every micro-batch's weight y_j."""


# The aux weights are read to this relative error; beyond it (a fit too ill-conditioned for
# the gradients' round-off) they are not read at all.
_AUX_READABLE = 0.05


def read_aux(fit: Fit | None) -> AuxReading | None:
    """How the split gradient weights `aux_loss`, from a usable fit whose reference adds it
    once over the whole batch (x = 1, every y_j = 0); None when right or not readable."""
    if fit is None or fit.aux is None or not fit.usable:
        return None
    aux = fit.aux
    tol = max(RATIO_TOL, fit.tolerance * aux.condition)
    if tol > _AUX_READABLE:
        return None
    if abs(aux.reference_whole - 1.0) > tol or any(abs(y) > tol for y in aux.reference_parts):
        return None  # the reference does not add aux_loss once over the batch
    x, y = aux.split_whole, aux.split_parts
    if all(abs(v) <= tol for v in y):
        return None if abs(x - 1.0) <= tol else AuxReading("scaled", x, 0.0, y)
    c = sum(y) / len(y)
    if all(abs(v - c) <= tol * abs(c) for v in y):
        return AuxReading("per-micro-batch", 0.0 if abs(x) <= tol else x, c, y)
    return AuxReading("weights", x, 0.0, y)


def _per_rank_share(fit: Fit, b: int, tol: float) -> float | None:
    """The one share c of every rank, when each rank's micro-batches are in the right proportions
    (a_j / b_j one value per rank) and the ranks' shares of the whole batch are not all equal."""
    a, w = fit.split, fit.reference
    per_rank: dict[int, list[int]] = {}
    for j, r in enumerate(fit.ranks):
        per_rank.setdefault(r, []).append(j)
    if len(per_rank) != b or b <= 1:
        return None
    within = all(
        w[js[0]] > 0
        and all(
            abs(a[j] / w[j] - a[js[0]] / w[js[0]]) <= tol * abs(a[js[0]] / w[js[0]]) for j in js
        )
        for js in per_rank.values()
    )
    sums = [sum(a[j] for j in js) for js in per_rank.values()]
    whole = [sum(w[j] for j in js) for js in per_rank.values()]
    c = sum(sums) / len(sums)
    if not within or c == 0 or any(abs(x - c) > tol * abs(c) for x in sums):
        return None
    return c if max(whole) - min(whole) > tol * max(whole) else None


def counts_text(fit: Fit | None) -> str:
    """' (items per micro-batch by RULE: 3 5 2 ...)' when a counting rule matches the reference."""
    if fit is None:
        return ""
    rule = matching_rule(fit)
    if rule is None:
        return ""
    return f" (items per micro-batch by {rule}: {' '.join(str(n) for n in fit.counts[rule][:12])})"


def wrong_count_text(c: float, counts: Mapping[str, int], fit: Fit | None) -> str:
    """Name the counts when one rule's total divided by c is another rule's total."""
    rules = list(counts.items())
    if fit is not None:
        matched = matching_rule(fit)
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


def gathers_text(ev: Evidence) -> str:
    """'torch.distributed.all_gather x2, ...': the gathers without gradient the step called."""
    seen: dict[str, int] = {}
    for per_rank in ev.collectives:
        for op, n in per_rank.items():
            if op.endswith(("all_gather", "all_gather_into_tensor", "_all_gather_base")):
                seen[op] = max(seen.get(op, 0), n)
    return ", ".join(f"{op} x{n}" for op, n in sorted(seen.items()))


@dataclasses.dataclass(frozen=True)
class Group:
    """Differing parameters whose gradients are the same multiple of the reference's."""

    ratio: float | None
    """That multiple (dropout off); None: each is not a fixed multiple."""

    params: tuple[ParamError, ...]
    """The parameters, in model order."""

    whole: bool
    """The group is every differing parameter."""

    @property
    def scalars(self) -> bool:
        """Every parameter in it is a single number (a logit_scale, a bias)."""
        return all(math.prod(p.shape) == 1 for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        """Their names."""
        return tuple(p.name for p in self.params)

    def subject(self) -> str:
        """'every differing gradient is' or 'the gradients of a, b are' (to start a sentence)."""
        if self.whole:
            return "every differing gradient is"
        return f"the gradients of {names(self.params)} are"


def groups_of(c: Comparison) -> tuple[Group, ...]:
    """The differing parameters of `c` grouped by their multiple of the reference."""
    bad = [p for p in c.params if not p.ok]
    live = [p for p in bad if p.live and not p.missing and not abs(p.ratio) < RATIO_TOL]
    clusters: list[tuple[float | None, list[ParamError]]] = []
    for p in live:
        ratio = p.ratio if math.isfinite(p.ratio) and p.fit_err <= FIT else None
        for r, members in clusters:
            if (r is None and ratio is None) or (
                r is not None and ratio is not None and near(ratio, r)
            ):
                members.append(p)
                break
        else:
            clusters.append((ratio, [p]))
    return tuple(
        Group(ratio=r, params=tuple(members), whole=len(members) == len(bad))
        for r, members in clusters
    )


class Case:
    """One step's runs and evidence, read once; `found` grows as causes are found."""

    def __init__(
        self,
        comparisons: Sequence[Comparison],
        evidence: Evidence,
        *,
        floor: Floor | None = None,
        fit: Fit | None = None,
        where: str | None = None,
        scope: str | None = None,
    ) -> None:
        self.comparisons = comparisons
        self.ev = evidence
        self.floor = floor
        self.fit = fit
        self.where = where
        self.scope = scope
        self.found: list[str] = []
        """Codes found so far (in precedence order)."""
        self.group: Group | None = None
        """The group a per-group cause is being tried on."""

    @property
    def main(self) -> Comparison:
        """The step as given at (W, K)."""
        return self.comparisons[0]

    @property
    def w(self) -> int:
        """W."""
        return self.main.world_size

    @property
    def k(self) -> int:
        """K."""
        return self.main.micro_batches

    @property
    def b(self) -> int:
        """B: the data-parallel ranks (the product of the row dims' sizes on a mesh; else W)."""
        mesh = self.ev.mesh
        return math.prod(mesh[d] for d in self.ev.row_dims) if mesh else self.w

    @property
    def j(self) -> int:
        """J: the micro-batches of the step, every data-parallel rank's (B x K)."""
        return self.b * self.k

    @property
    def at(self) -> str:
        """'Where: ... . ' (or '') to start a message with."""
        return f"Where: {self.where}. " if self.where else ""

    @functools.cached_property
    def bad(self) -> list[ParamError]:
        """The parameters that differ, as given."""
        return [p for p in self.main.params if not p.ok]

    @functools.cached_property
    def off(self) -> Comparison | None:
        """The same split with dropout off, when the step has dropout."""
        return find(self.comparisons, self.w, self.k, False) if self.main.dropout else None

    @property
    def clean(self) -> Comparison:
        """The run without dropout: `off` if made, else the step as given."""
        off = self.off
        return off if off is not None and off is not self.main else self.main

    @functools.cached_property
    def equal(self) -> Comparison | None:
        """The same split on `equal_batch` (dropout off), when the spec gives one."""
        return find(self.comparisons, self.w, self.k, False, equal=True)

    @functools.cached_property
    def gathers(self) -> str:
        """The gathers without gradient the step called ('' if none)."""
        return gathers_text(self.ev)

    @functools.cached_property
    def reading(self) -> tuple[str, float] | None:
        """How the fit weights the micro-batches (`read_fit`)."""
        return read_fit(self.fit, self.b)

    @functools.cached_property
    def aux(self) -> AuxReading | None:
        """How the split gradient weights the spec's aux_loss (`read_aux`)."""
        return read_aux(self.fit)

    @property
    def norm(self) -> NormFit | None:
        """The normalisation each side applies to the items, when the spec gives the ids."""
        return None if self.fit is None else self.fit.norm

    @functools.cached_property
    def counts(self) -> str:
        """The matching counting rule's per-micro-batch counts, as text ('' if none)."""
        return counts_text(self.fit)

    @functools.cached_property
    def ratio(self) -> float | None:
        """The one multiple of the reference every differing gradient (dropout off) is, if any."""
        clean = self.clean
        return common_ratio(clean) if not clean.ok else None

    @functools.cached_property
    def uniform(self) -> bool:
        """`ratio` holds for every parameter with a gradient (none of them is right)."""
        return self.ratio is not None and all(not p.ok for p in self.clean.params if p.live)

    @functools.cached_property
    def groups(self) -> tuple[Group, ...]:
        """The differing parameters (dropout off) grouped by their multiple of the reference."""
        clean = self.clean
        return groups_of(clean) if not clean.ok else ()

    @property
    def g(self) -> Group:
        """The group being tried (per-group causes only)."""
        assert self.group is not None, "a per-group cause read the group outside a group"
        return self.group

    @functools.cached_property
    def local_slice_functions(self) -> dict[str, str]:
        """Custom autograd Functions that gather in their forward and call no collective in
        their backward (on every rank): name -> the forward's gathers, as text."""
        forward: dict[str, dict[str, int]] = {}
        backward: set[str] = set()
        for per_rank in self.ev.in_functions:
            for key, n in per_rank.items():
                where, _, op = key.partition(": ")
                fn, _, phase = where.rpartition(".")
                if phase == "backward":
                    backward.add(fn)
                elif op.endswith(("all_gather", "all_gather_into_tensor", "_all_gather_base")):
                    ops = forward.setdefault(fn, {})
                    ops[op] = max(ops.get(op, 0), n)
        return {
            fn: ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))
            for fn, ops in sorted(forward.items())
            if fn not in backward
        }

    @functools.cached_property
    def redrawn(self) -> list[str]:
        """Dropout modules that drew new masks in a second pass on some rank."""
        return sorted({name for per_rank in self.ev.redrawn for name in per_rank})

    def worst(self) -> ParamError:
        """The parameter with the largest relative error, as given."""
        return max(
            self.main.params, key=lambda p: p.rel_err if math.isfinite(p.rel_err) else math.inf
        )
