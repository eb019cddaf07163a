"""The catalogue of `wholebatch lint` rules: stable codes, one-line summaries, fixes.

Codes never change meaning once published; a retired rule keeps its number.

- `WB0xx` — the linter itself (a file that does not parse, an internal error).
- `WB1xx` — distributed: collectives, gradients across ranks, hangs.
- `WB2xx` — the optimisation loop: backward, zero_grad, step, hand-written updates.
- `WB3xx` — gradient accumulation and mixed precision (AMP).

Every rule has a section with a wrong and a right example in `docs/lint.md`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OWN", "RULES", "Finding", "Hop", "Rule", "format_trace", "rule"]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One lint rule.

    Attributes:
        code: stable identifier, e.g. ``"WB101"``.
        name: short kebab-case name, e.g. ``"loss-on-all-gather"``.
        summary: the one-line message shown in the rule table.
        fix: one line saying what to write instead.
        check: the family of checks that runs it (``"dist"``, ``"flow"``, ``"loops"``;
            ``""`` for the linter's own WB000 and WB001), one of `engine`'s checkers.
        words: its gate: the rule can fire in a file only if one of these occurs in the
            file's text (or a call of the file is followed into another file, which
            brings that file's events); ``()`` means no gate, it always runs. Every
            snippet that triggers the rule must contain one of them
            (tests/unit/test_lint_rules.py checks it on every wrong example).
    """

    code: str
    name: str
    summary: str
    fix: str
    check: str = ""
    words: tuple[str, ...] = ()

    def gate_open(self, source: str) -> bool:
        """Can this rule fire in a file with this text (ignoring calls followed out)?"""
        return not self.words or any(w in source for w in self.words)


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One step of the path a finding followed, from where the value (or call) starts to
    where the mistake shows.

    Attributes:
        path: the file of this step.
        line: 1-based line.
        col: 1-based column.
        function: the function (``Class.method`` for a method; ``""`` for module level).
        note: what happens here, e.g. ``"torch.distributed.all_gather fills `parts`"``.
    """

    path: str
    line: int
    col: int
    function: str
    note: str


def format_trace(trace: tuple[Hop, ...], here: str = "") -> str:
    """`a()` line 8 (note) -> `b` line 15 (note): the path as one line of text.

    Args:
        trace: the steps, first to last.
        here: the finding's own file; a step in another file names its file.
    """
    parts = []
    for h in trace:
        where = f"line {h.line}" if h.path == here else f"{h.path}:{h.line}"
        fn = f"`{h.function}` " if h.function else "module level "
        parts.append(f"{fn}{where} ({h.note})" if h.note else f"{fn}{where}")
    return " -> ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem found at one place.

    Attributes:
        path: the file, as given on the command line (or ``"<string>"``).
        line: 1-based line of the offending node.
        col: 1-based column of the offending node (ruff's convention).
        code: the rule code.
        message: what is wrong here, naming the names involved.
        fix: what to write instead (the rule's fix).
        trace: the path the rule followed, first step first: for a value (WB101, WB103)
            from where it starts to where it does harm, for a call into the functions
            it runs (and their files); empty when there is nothing beyond the reported
            line. The message names the path when it crosses functions.
        tier: ``"code"`` (training code) or ``"test"`` (a test file, reported only when
            asked: `wholebatch lint --tests`, `files.tier_of`).
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str
    trace: tuple[Hop, ...] = ()
    tier: str = "code"


# Gate words shared by a family of rules. A collective needs torch.distributed (imported,
# or the conventional `dist.`) or wholebatch; a value rule needs a gather, a gradient or
# a loss; a loop rule needs one of the training calls it orders.
_DIST = ("distributed", "dist.", "wholebatch")
_FLOW = ("all_gather", ".grad", "loss")
_LOOPS = ("backward(", ".step(", "zero_grad", "no_sync", "clip_grad")

_ALL = (
    Rule(
        code="WB000",
        name="syntax-error",
        summary="file could not be parsed, so it was not checked",
        fix="fix the syntax error (or run lint with the Python version the file targets)",
    ),
    Rule(
        code="WB001",
        name="internal-error",
        summary="the linter failed on this function, so it was not fully checked (the rest "
        "of the run was)",
        fix="report it (the message names the exception and where the linter raised it); "
        "`--ignore WB001` hides it",
    ),
    Rule(
        code="WB101",
        name="loss-on-all-gather",
        summary="loss depends on torch.distributed.all_gather output, which carries no gradient",
        fix="use wholebatch.all_gather (backward: reduce-scatter, sum), or "
        "torch.distributed.nn.functional.all_gather",
        check="flow",
        words=_FLOW,
    ),
    Rule(
        code="WB102",
        name="gather-layer-backward-not-reduced",
        summary="autograd.Function all-gathers in forward but its backward never sums across ranks",
        fix="the backward of all_gather is reduce-scatter (sum): use wholebatch.all_gather, or "
        "all_reduce the stacked grads before taking this rank's slice",
        check="dist",
        words=("all_gather",),
    ),
    Rule(
        code="WB103",
        name="all-gather-of-gradients",
        summary="gradients are all-gathered (concatenated) where a sum across ranks was meant",
        fix="use torch.distributed.all_reduce(grad) (then divide by the world size for a mean)",
        check="flow",
        words=_FLOW,
    ),
    Rule(
        code="WB104",
        name="collective-under-rank-condition",
        summary="collective called under a rank-dependent condition: the other ranks never join, "
        "and hang",
        fix="call the collective on every rank (outside the `if`); keep only printing or saving "
        "under `if rank == 0:`",
        check="dist",
        words=_DIST,
    ),
    Rule(
        code="WB105",
        name="rank-local-exit-before-collective",
        summary="rank-local early return/continue/break skips a later collective: the other "
        "ranks hang",
        fix="agree on the condition first (wholebatch.all_ranks_agree / any_rank, or an "
        "all_reduce of a flag) so every rank takes the same path",
        check="dist",
        words=_DIST,
    ),
    Rule(
        code="WB201",
        name="gradients-never-zeroed",
        summary="training loop calls backward and optimizer.step but never zeroes gradients",
        fix="call optimizer.zero_grad() after each optimizer.step() (or before each step's "
        "first backward)",
        check="loops",
        words=_LOOPS,
    ),
    Rule(
        code="WB202",
        name="zero-grad-between-backward-and-step",
        summary="zero_grad between backward and step: the step sees zero gradients",
        fix="order the step as zero_grad(), backward(), step() (or backward(), step(), "
        "zero_grad())",
        check="loops",
        words=_LOOPS,
    ),
    Rule(
        code="WB203",
        name="step-without-backward",
        summary="optimizer.step() with no backward: a loss is computed but never backpropagated",
        fix="call loss.backward() (or scaler.scale(loss).backward()) before optimizer.step()",
        check="loops",
        words=_LOOPS,
    ),
    Rule(
        code="WB204",
        name="manual-update-outside-no-grad",
        summary="parameter updated in place by hand outside torch.no_grad()",
        fix="wrap the update in `with torch.no_grad():` (or use a torch.optim optimizer)",
        check="flow",
        words=_FLOW,
    ),
    Rule(
        code="WB205",
        name="manual-update-through-data",
        summary="parameter updated through .data, which hides the update from autograd",
        fix="update the parameter itself inside `with torch.no_grad():` instead of through .data",
        check="flow",
        words=_FLOW,
    ),
    Rule(
        code="WB301",
        name="mean-loss-divided-by-steps",
        summary="mean loss divided by the number of accumulation steps while the item count per "
        "micro-batch varies",
        fix="sum the item losses and divide by the global item count agreed before backward "
        "(wholebatch.Accumulator does this)",
        check="flow",
        # a Trainer subclass (`class T(Trainer):`) whose loss is the model's, or the
        # Trainer itself (`Trainer(model=model, ...)`), under a transformers pinned below
        # 4.46 (`frameworks.FACTS["hf-trainer-before-4-46"]`)
        words=(*_FLOW, "Trainer)", "Trainer("),
    ),
    Rule(
        code="WB302",
        name="no-sync-without-forward",
        summary="no_sync() wraps the backward but not the forward, so gradients are still "
        "all-reduced",
        fix="put the forward inside the context too: `with model.no_sync(): loss = "
        "loss_fn(model(x)); loss.backward()`",
        check="loops",
        words=("no_sync",),
    ),
    Rule(
        code="WB303",
        name="clip-before-unscale",
        summary="gradients clipped before scaler.unscale_: the threshold applies to scaled "
        "gradients",
        fix="call scaler.unscale_(optimizer) after backward and before clip_grad_norm_",
        check="loops",
        words=_LOOPS,
    ),
    Rule(
        code="WB304",
        name="zero-grad-every-micro-batch",
        summary="gradients zeroed every micro-batch while the optimizer steps only every k: "
        "accumulation is lost",
        fix="zero the gradients only right after optimizer.step() (inside the same `if`)",
        check="loops",
        words=_LOOPS,
    ),
)

RULES: dict[str, Rule] = {r.code: r for r in _ALL}
# The linter's own codes (no checker runs them): a file that does not parse, an internal error.
OWN = frozenset(c for c, r in RULES.items() if not r.check)


def rule(code: str) -> Rule:
    """The rule with this code (KeyError naming the known codes if there is none)."""
    try:
        return RULES[code]
    except KeyError:
        raise KeyError(f"unknown rule {code!r}; known: {', '.join(RULES)}") from None
