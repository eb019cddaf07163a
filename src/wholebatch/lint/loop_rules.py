"""Rules about the order of training calls (backward, zero_grad, step, unscale_, clip):

- WB201 a loop that calls backward and step but never zeroes gradients;
- WB202 zero_grad between backward and step;
- WB203 optimizer.step() where a loss is computed but never backpropagated;
- WB302 `no_sync()` around the backward but not the forward;
- WB303 clipping before `scaler.unscale_`;
- WB304 zeroing every micro-batch while stepping only every k.

Correct gradient accumulation (`if (i + 1) % k == 0: step(); zero_grad()`) zeroes
inside the loop, so it is never reported as "never zeroed"; a loop that hands its
micro-batches to `wholebatch.Accumulator.step` has no explicit backward, step or
zero_grad, so none of these rules apply to it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

from wholebatch.lint.frameworks import scaled_grads_hook
from wholebatch.lint.names import dotted, last_name, names_in, position, walk_local
from wholebatch.lint.rules import Finding, format_trace
from wholebatch.lint.scope import (
    BACKWARD,
    CLIP,
    SETGRAD,
    STEP,
    UNSCALE,
    ZERO,
    Event,
    FileContext,
    Scope,
    exclusive,
    finding as _finding,
)

__all__ = ["check_loops"]

# Calls that may run backward (or set .grad) where we cannot see it.
_HANDOFF_RE = re.compile(r"backward|train_|_train|fit|closure|grad|step", re.IGNORECASE)
_NOT_HANDOFF = frozenset(
    {"no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "requires_grad_"}
)
# Methods applied to a loss on its way to backward that are not a forward pass.
_LOSS_METHODS = frozenset(
    {"scale", "sum", "mean", "float", "double", "squeeze", "view", "reshape", "to", "div", "mul"}
)
_NOT_COMPUTE = frozenset({"item", "detach", "float", "cpu", "tolist", "numpy", "clone"})


def _in(loop: ast.stmt, ev: Event) -> bool:
    return any(outer is loop for outer in ev.loops)


def _line(ev: Event) -> int:
    return position(ev.node)[0]


def check_loops(ctx: FileContext) -> Iterator[Finding]:
    """Run the training-call-order rules (those of them `ctx.runs`) over every scope."""
    on_events = [check for code, check in _ON_EVENTS.items() if ctx.runs(code)]
    no_sync = ctx.runs("WB302")
    for scope in ctx.scopes:
        if scope.events:
            for check in on_events:
                yield from ctx.guarded(scope, partial(_listed, check, ctx, scope))
        if no_sync and scope.withs:
            yield from ctx.guarded(scope, partial(_listed, _no_sync_without_forward, ctx, scope))


def _listed(check: _ScopeCheck, ctx: FileContext, scope: Scope) -> list[Finding]:
    return list(check(ctx, scope))


_LOOPS_AND_DEFS = (
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.Lambda,
)


# -- WB201 ------------------------------------------------------------------------------


def _what(ev: Event) -> str:
    """How a message names the actor of an event: "`opt`" or "`helper()`"."""
    if not ev.synthetic:
        return f"`{ev.recv}`" if ev.recv else "the call"
    return f"`{_callee(ev)}()`"


def _path(ev: Event, ctx: FileContext) -> str:
    return f"; path: {format_trace(ev.via, ctx.path)}" if ev.synthetic else ""


def _never_zeroed(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    seen: set[int] = set()
    for step in scope.events:
        if step.kind != STEP or not step.certain or id(step.node) in seen:
            continue
        seen.add(id(step.node))
        for loop in reversed(step.loops):
            inside = [e for e in scope.events if _in(loop, e)]
            backs = [e for e in inside if e.kind == BACKWARD]
            if not backs:
                continue
            # A step inside a helper: the backward must be this scope's own (or a certain
            # one), else the helper may be a whole training step with its own zeroing.
            if step.synthetic and not any(e.certain for e in backs):
                break
            zeroed = any(e.kind in (ZERO, SETGRAD) for e in inside)
            if not zeroed and loop is not step.loops[0] and _on_last_iteration(step, loop):
                continue  # one step per pass of the enclosing loop: is it zeroed there?
            if not zeroed and _leaves_after_step(loop, step) and _zeroed_before(scope, loop, step):
                break  # zeroed, then one step, then out: each entry of the loop starts clean
            if not zeroed and not _fresh_each_iteration(scope, loop, step.recv):
                own = [e for e in backs if not e.synthetic]
                back = (
                    "calls backward"
                    if own
                    else f"backpropagates in `{_callee(backs[0])}()` (line {_line(backs[0])})"
                )
                trace = step.via or (() if own else backs[0].via)
                f = _finding(
                    ctx,
                    step.node,
                    "WB201",
                    f"{_what(step)} steps in a loop (line {loop.lineno}) that {back} but never "
                    "zeroes gradients: every step adds all earlier steps' gradients"
                    f"{_path(step, ctx) or (_path(backs[0], ctx) if not own else '')}",
                )
                yield replace(f, trace=trace)
                break
            break


def _leaves_after_step(loop: ast.stmt, step: Event) -> bool:
    """Does `loop` end once `step` has run: the step's block sets a flag (`complete =
    True`) that the loop tests later to leave it (`if complete: break`)? A loop that
    accumulates until its one step and then stops (GLM's `train_step`)."""
    flags: set[str] = set()
    for block in _blocks(loop):
        at = next((i for i, st in enumerate(block) if _holds(st, step.node)), None)
        if at is None:
            continue
        for st in block[at + 1 :]:
            if (
                isinstance(st, ast.Assign)
                and isinstance(st.value, ast.Constant)
                and st.value.value is True
            ):
                flags |= {t.id for t in st.targets if isinstance(t, ast.Name)}
    if not flags:
        return False
    return any(
        isinstance(n, ast.If)
        and isinstance(n.test, ast.Name)
        and n.test.id in flags
        and n.lineno > _line(step)
        and bool(n.body)
        and isinstance(n.body[0], ast.Break)
        for n in _own_nodes(loop)
    )


def _blocks(loop: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists of `loop`'s body and of the compound statements in it, not
    those of nested loops or functions."""
    for n in [loop, *_own_nodes(loop)]:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(n, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                if n is loop and name != "body":
                    continue
                yield block


def _own_nodes(loop: ast.stmt) -> Iterator[ast.AST]:
    """The nodes inside `loop`'s body, not inside a nested loop or function."""
    stack: list[ast.AST] = list(getattr(loop, "body", []))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, _LOOPS_AND_DEFS):
            stack.extend(ast.iter_child_nodes(n))


def _holds(st: ast.stmt, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(st))


def _zeroed_before(scope: Scope, loop: ast.stmt, step: Event) -> bool:
    """Is the gradient zeroed in this scope before `loop`, outside it, in the loops that
    hold the step (the same pass of them)?"""
    return any(
        e.kind in (ZERO, SETGRAD)
        and loop not in e.loops
        and all(outer in step.loops for outer in e.loops)
        and _line(e) < loop.lineno
        for e in scope.events
    )


def _loop_index_bound(loop: ast.stmt) -> tuple[str, str] | None:
    """The index of `loop` and its end (as `ast.dump` text, to find it in a test): `for
    i in range(a, n, k)` -> ("i", n); `for i, x in enumerate(xs)` -> ("i", len(xs))."""
    if not isinstance(loop, ast.For) or not isinstance(loop.iter, ast.Call):
        return None
    it, target = loop.iter, loop.target
    name = last_name(it.func)
    if name == "range" and it.args and isinstance(target, ast.Name):
        return target.id, ast.dump(it.args[1] if len(it.args) > 1 else it.args[0])
    if (
        name == "enumerate"
        and it.args
        and isinstance(target, ast.Tuple)
        and target.elts
        and isinstance(target.elts[0], ast.Name)
    ):
        length = ast.parse(f"len({ast.unparse(it.args[0])})", mode="eval").body
        return target.elts[0].id, ast.dump(length)
    return None


# `i == end`, `i >= end`, `i > end` hold at the end of the loop (the `if` branch);
# `i < end`, `i <= end`, `i != end` hold before it (the `else` branch is the end).
_AT_END = {ast.Eq: 0, ast.GtE: 0, ast.Gt: 0, ast.Lt: 1, ast.LtE: 1, ast.NotEq: 1}
_FLIPPED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}


def _on_last_iteration(ev: Event, loop: ast.stmt) -> bool:
    """Is `ev` (in `loop`, its innermost loop) under an `if` that compares the loop's
    index with the loop's end, on the side that holds at the end: `for j in range(0, n,
    m): ... if j + m < n: ... else: step()`, or `if i == len(xs) - 1: step()`? Then it
    runs once per pass of the loop, on its last micro-batch (simplescaling/s1's
    gpt-accelera finetune.py). A test joined with others (`or`) is no such test."""
    if not ev.loops or ev.loops[-1] is not loop:
        return False
    found = _loop_index_bound(loop)
    if found is None:
        return False
    index, end = found
    branch = dict(ev.path)
    for cond in ev.conds:
        test = cond.test if isinstance(cond, ast.If) else None
        if not isinstance(test, ast.Compare) or len(test.ops) != 1:
            continue
        left, right, op = test.left, test.comparators[0], type(test.ops[0])
        if index in names_in(right) and index not in names_in(left):
            left, right, op = right, left, _FLIPPED.get(op, op)
        side = _AT_END.get(op)
        if (
            side is not None
            and index in names_in(left)
            and any(ast.dump(x) == end for x in ast.walk(right))
            and branch.get(id(cond)) == side
        ):
            return True
    return False


def _fresh_each_iteration(scope: Scope, loop: ast.stmt, recv: str) -> bool:
    """Is optimizer `recv` built inside `loop`, over tensors also made inside it
    (`x = latents.detach().requires_grad_(); opt = SGD([x])`)? Then every iteration
    starts from new leaves with no gradient: nothing piles up."""
    if not recv:
        return False
    made: set[str] = set()
    params: set[str] | None = None
    for st in scope.stmts:
        if not any(outer is loop for outer in st.loops):
            continue
        node = st.node
        if isinstance(node, ast.Assign):
            targets = {d for t in node.targets if (d := dotted(t)) is not None}
            if recv in targets and isinstance(node.value, ast.Call) and node.value.args:
                params = {x.id for x in ast.walk(node.value.args[0]) if isinstance(x, ast.Name)}
            made |= {x.id for t in node.targets for x in ast.walk(t) if isinstance(x, ast.Name)}
    return bool(params) and params is not None and params <= made


# -- WB202 ------------------------------------------------------------------------------


def _zero_between(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    # Events of a called function count when it does them on every call (`certain`);
    # one it may or may not do ends the search (no finding rather than a false one).
    seq = [e for e in scope.events if not e.jumpy]
    stepped = {e.recv for e in seq if e.kind == STEP and e.certain}
    for i, zero in enumerate(seq):
        if zero.kind != ZERO or not zero.certain or _selective(zero):
            continue
        before = next(
            (
                e
                for e in reversed(seq[:i])
                if (e.kind in (BACKWARD, STEP) or not e.certain) and not exclusive(e, zero)
            ),
            None,
        )
        if before is None or before.kind != BACKWARD or not before.certain:
            continue
        if before.synthetic and before.node is zero.node:
            continue  # one helper that backprops then zeroes: its own business (WB202 there)
        after = next(
            (
                e
                for e in seq[i + 1 :]
                if (e.kind in (BACKWARD, STEP, SETGRAD) or not e.certain) and not exclusive(e, zero)
            ),
            None,
        )
        if after is None or after.kind != STEP or not after.certain or after.node is zero.node:
            continue
        if _zeroes_a_part(ctx, scope, zero, after.recv):
            continue
        same = zero.recv == after.recv or (
            not (zero.recv and _is_optimizer_text(ctx, zero.recv)) and len(stepped) == 1
        )
        if not same:
            continue
        what = f"`{_callee(zero)}()` zeroes gradients" if zero.synthetic else "gradients are zeroed"
        back = f"the backward at line {_line(before)}"
        if before.synthetic:
            back = f"the backward in `{_callee(before)}()` (line {_line(before)})"
        step = f"`{after.recv}` steps" if after.recv else f"`{_callee(after)}()` steps"
        f = _finding(
            ctx,
            zero.node,
            "WB202",
            f"{what} after {back} and before {step} at line {_line(after)}: the step sees "
            f"zero gradients{_path(zero, ctx)}",
        )
        yield replace(f, trace=zero.via)


def _selective(ev: Event) -> bool:
    """`p.grad = None` under an `if` inside its loop over the parameters (SwAV's
    `if "prototypes" in name: p.grad = None`): some parameters are held still for this
    step, the others keep their gradients; that is not zeroing before the step."""
    return not isinstance(ev.node, ast.Call) and bool(ev.loops) and bool(ev.conds)


def _zeroes_a_part(ctx: FileContext, scope: Scope, zero: Event, opt: str) -> bool:
    """`for p in part: p.grad = None` where `part` may be less than what optimizer `opt`
    steps (RL4LMs' TRPO drops the actor's gradients, the critic's stay for the step):
    only a loop over the optimised parameters as a whole zeroes before the step, that is
    over `opt.param_groups`, or over `m.parameters()` of the model `opt` was built on
    (any model, where its construction is not in the file)."""
    node = zero.node
    loop = zero.loops[-1] if zero.loops else None
    if not isinstance(node, ast.Assign | ast.Delete) or not isinstance(loop, ast.For):
        return False
    store = node.targets[0]
    if not (
        isinstance(store, ast.Attribute)
        and isinstance(store.value, ast.Name)
        and store.value.id in names_in(loop.target)
    ):
        return False
    params = _bound_value(scope, loop.iter, loop.lineno)
    if params is None:
        return True  # a parameter of the function, unpacked, built by appends: a part
    if any(
        (isinstance(x, ast.Attribute) and x.attr == "param_groups")
        or (isinstance(x, ast.Constant) and x.value == "params")
        for x in ast.walk(params)
    ):
        return False
    if not (isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute)):
        return True
    if params.func.attr not in ("parameters", "named_parameters"):
        return True
    built = _built_on(ctx, opt)
    return built is not None and last_name(params.func.value) != built


def _bound_value(scope: Scope, expr: ast.expr, line: int) -> ast.expr | None:
    """`expr` without `list(...)`/`tuple(...)`, through the last `name = value` before
    `line` where it is a name; None where that name has no such binding here."""
    for _ in range(3):
        if isinstance(expr, ast.Call) and last_name(expr.func) in ("list", "tuple") and expr.args:
            expr = expr.args[0]
        elif isinstance(expr, ast.Name):
            where = scope.last_assignment(expr.id, line)
            if where is None:
                return None
            expr = where.value
        else:
            break
    return expr


def _built_on(ctx: FileContext, opt: str) -> str | None:
    """The model (its last name) whose `.parameters()` optimizer `opt` was built on in
    this file (`self.opt = Adam(self.policy.parameters())` -> "policy"); None where that
    is not seen."""
    if not opt:
        return None
    for n in ast.walk(ctx.tree):
        if not (
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and any(dotted(t) == opt for t in n.targets)
        ):
            continue
        call = n.value
        first = call.args[0] if call.args else None
        first = next((k.value for k in call.keywords if k.arg == "params"), first)
        if (
            isinstance(first, ast.Call)
            and isinstance(first.func, ast.Attribute)
            and first.func.attr == "parameters"
        ):
            return last_name(first.func.value)
    return None


def _callee(ev: Event) -> str:
    call = ev.node
    if isinstance(call, ast.Call):
        return dotted(call.func) or last_name(call.func)
    return "?"


def _is_optimizer_text(ctx: FileContext, text: str) -> bool:
    try:
        return ctx.is_optimizer(ast.parse(text, mode="eval").body)
    except SyntaxError:
        return False


# -- WB203 ------------------------------------------------------------------------------


def _step_without_backward(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    steps = [e for e in scope.events if e.kind == STEP and not e.synthetic and e.bare]
    if not steps or any(e.kind == BACKWARD for e in scope.events):
        return
    if any(e.kind == SETGRAD for e in scope.events):
        return  # `p.grad = ...`: gradients set by hand
    classified = {id(e.node) for e in scope.events}
    for st in scope.stmts:
        for n in st.walk():
            if not isinstance(n, ast.Call) or id(n) in classified:
                continue
            name = last_name(n.func)
            recv = n.func.value if isinstance(n.func, ast.Attribute) else None
            if recv is not None and "sched" in last_name(recv).lower():
                continue
            if name not in _NOT_HANDOFF and _HANDOFF_RE.search(name):
                return  # a helper (or a wrapper's step) may run backward
    for step in steps:
        where = step.loops[-1] if step.loops else None
        loss = _computed_loss(scope, where)
        if loss is not None:
            yield _finding(
                ctx,
                step.node,
                "WB203",
                f"`{step.recv}.step()` but no backward: `{loss}` is computed here and never "
                "backpropagated, so the step uses stale (or no) gradients",
            )


def _computed_loss(scope: Scope, loop: ast.stmt | None) -> str | None:
    """A `*loss*` name assigned from a computation inside `loop` (or the scope)."""
    for st in scope.stmts:
        if loop is not None and not any(outer is loop for outer in st.loops):
            continue
        node = st.node
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            computed = any(
                isinstance(c, ast.Call) and last_name(c.func) not in _NOT_COMPUTE
                for c in ast.walk(node.value)
            )
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        computed
                        and isinstance(sub, ast.Name | ast.Attribute)
                        and "loss" in last_name(sub).lower()
                    ):
                        return dotted(sub) or last_name(sub)
    return None


# -- WB303 ------------------------------------------------------------------------------


def _clip_before_unscale(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    seq = scope.events
    fact = scaled_grads_hook(scope.cls, scope.name, ctx.evidence)
    if fact is not None:
        # A framework hook that runs before the framework unscales (Lightning's
        # `on_after_backward` under 16-bit mixed precision): every clip here is early.
        for clip in seq:
            if clip.kind == CLIP and clip.certain:
                yield _finding(
                    ctx,
                    clip.node,
                    "WB303",
                    f"gradients are clipped in `{scope.qual}`, but {fact.says}: the threshold "
                    "applies to gradients multiplied by the loss scale; clip in "
                    "`configure_gradient_clipping` (or `on_before_optimizer_step`), or set "
                    "`Trainer(gradient_clip_val=...)`",
                )
        return
    ifs = {id(i): i for i in scope.ifs}
    for i, clip in enumerate(seq):
        if clip.kind != CLIP or clip.synthetic:
            continue
        # The scaler's step on a path the clip may be on: not in a branch the clip's `if`
        # excludes, nor under the opposite answer to a test the clip's branch also asks
        # (`if fp16 and native: unscale_; clip` / `else: clip`, later `if fp16 and native:
        # scaler.step(opt)`; princeton-nlp/MeZO's trainer.py): the `else` clip never
        # meets a scaled gradient.
        if not any(
            e.kind == STEP and e.scaler and not _never_together(e.path, clip.path, ifs, scope)
            for e in seq[i + 1 :]
        ):
            continue
        if _scaled_at(seq, i):
            yield _finding(
                ctx,
                clip.node,
                "WB303",
                "gradients are clipped while still multiplied by the AMP loss scale "
                "(no scaler.unscale_ before this clip): the threshold means nothing and "
                "clipping is almost always on",
            )


def _scaled_at(seq: list[Event], i: int) -> bool:
    """Are the gradients still multiplied by the loss scale at the clip `seq[i]` on some
    path that reaches it? Judged per path: each backward that may be the last before the
    clip on its own path (no later backward that can run with it) must be followed by an
    `unscale_` on that path, unless that path never scaled (`_unscaled_path`). With no
    backward in the scope, one `unscale_` before the clip is enough."""
    clip = seq[i]
    before = [e for e in seq[:i] if not exclusive(e, clip)]
    backs = [j for j, e in enumerate(before) if e.kind == BACKWARD]
    if not backs:
        return not any(e.kind == UNSCALE for e in before)
    for j in backs:
        back, later = before[j], before[j + 1 :]
        if any(e.kind in (BACKWARD, UNSCALE) and not exclusive(e, back) for e in later):
            continue  # a later backward on this path is judged instead, or it is unscaled
        if not _unscaled_path(back, seq):
            return True
    return False


def _scales(ev: Event) -> bool:
    """Does this backward run on a loss multiplied by the scaler (`scaler.scale(loss)`)?"""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "scale"
        for loss in ev.losses
        for n in ast.walk(loss)
    )


def _unscaled_path(back: Event, seq: list[Event]) -> bool:
    """Is `back` a plain backward in one branch of the `if` whose other branch scales
    (`if amp: scaler.scale(loss).backward() ... else: loss.backward()`)? Then its path
    never multiplied the gradients by the scale: nothing to unscale before a clip."""
    return not _scales(back) and any(
        e.kind == BACKWARD and _scales(e) and exclusive(e, back) for e in seq
    )


# -- WB304 ------------------------------------------------------------------------------


def _has_mod(conds: tuple[ast.stmt, ...]) -> bool:
    return any(
        isinstance(c, ast.If)
        and any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(c.test))
        for c in conds
    )


def _reads_grad(loop: ast.stmt) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.ctx, ast.Load)
        for n in walk_local(loop)
    )


def _zero_every_micro_batch(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    events = scope.events
    for zero in events:
        if zero.kind != ZERO or zero.synthetic or not zero.loops or zero.conds:
            continue
        loop = zero.loops[-1]
        top = [e for e in events if e.loops and e.loops[-1] is loop and not e.conds]
        if not any(e.kind == BACKWARD and _line(e) > _line(zero) for e in top):
            continue
        if any(e.kind == STEP for e in top) or _reads_grad(loop):
            continue
        mod_step = next(
            (e for e in events if e.kind == STEP and _in(loop, e) and _has_mod(e.conds)), None
        )
        after = None
        if mod_step is None and not any(e.kind == STEP and _in(loop, e) for e in events):
            end = loop.end_lineno or loop.lineno
            for e in events:
                if e.loops == zero.loops[:-1] and _line(e) > end:
                    if e.kind == STEP:
                        after = e
                    if e.kind in (STEP, ZERO, SETGRAD, BACKWARD):
                        break
        step = mod_step or after
        if step is None or step.synthetic:
            continue
        if _zeroes_another_optimizer(ctx, zero, step):
            continue
        yield _finding(
            ctx,
            zero.node,
            "WB304",
            f"gradients are zeroed every iteration of the loop at line {loop.lineno}, but "
            f"`{step.recv}` steps only at line {_line(step)}: all micro-batches but the last "
            "are thrown away",
        )


def _zeroes_another_optimizer(ctx: FileContext, zero: Event, step: Event) -> bool:
    """Is `zero` the `zero_grad` of an optimizer other than the one `step` steps?"""
    return bool(
        zero.recv
        and step.recv
        and zero.recv != step.recv
        and ctx.is_optimizer(ast.parse(zero.recv, mode="eval").body)
    )


def _mod_if(step: Event) -> ast.If | None:
    """The innermost `if` with a `%` test around `step` (`if (i + 1) % k == 0:`)."""
    for c in reversed(step.conds):
        if isinstance(c, ast.If) and _has_mod((c,)):
            return c
    return None


def _within(node: ast.AST, outer: ast.AST) -> bool:
    line = getattr(node, "lineno", 0)
    start = getattr(outer, "lineno", 0)
    return start <= line <= (getattr(outer, "end_lineno", None) or start)


def _stays_true_after_step(test: ast.expr, loop: ast.stmt, step_ifs: list[ast.If]) -> bool:
    """Does `test` read a count that changes in `loop` only inside the `if`s that step
    (`step_ifs`: a step counter, `global_step`), and nothing else that changes in `loop`?
    Then once true after a step it stays true for every micro-batch until the next one."""
    assigned: dict[str, list[ast.AST]] = {}
    for n in walk_local(loop):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, ast.AugAssign | ast.AnnAssign | ast.For)
            else []
        )
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Name | ast.Attribute) and (d := dotted(x)) is not None:
                    assigned.setdefault(d, []).append(n)
    read = {
        d
        for x in ast.walk(test)
        if isinstance(x, ast.Name | ast.Attribute)
        if (d := dotted(x)) is not None and d in assigned
    }
    return bool(read) and all(
        any(_within(a, s) for s in step_ifs) for d in read for a in assigned[d]
    )


def _zero_after_step(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    """WB304 for a zero_grad under a test that stays true for the micro-batches after a
    step (an evaluation block, `if global_step % eval_steps == 0:`, with `global_step`
    counted only at the step): every micro-batch accumulated after such a step is thrown
    away until the next one (issue 33, SGPT's fit)."""
    events = scope.events
    for zero in events:
        if zero.kind != ZERO or zero.synthetic or not zero.loops:
            continue
        for loop in reversed(zero.loops):
            step = next((e for e in events if e.kind == STEP and _in(loop, e) and _mod_if(e)), None)
            if step is not None and any(e.kind == BACKWARD and _in(loop, e) for e in events):
                break
        else:
            continue
        step_ifs = [
            c for e in events if e.kind == STEP and _in(loop, e) and (c := _mod_if(e)) is not None
        ]
        if any(_within(zero.node, c) for c in step_ifs) or _reads_grad(loop):
            continue
        if _zeroes_another_optimizer(ctx, zero, step):
            continue
        test = next(
            (
                n.test
                for n in walk_local(loop)
                if isinstance(n, ast.If)
                and n is not loop
                and _within(zero.node, n)
                and _stays_true_after_step(n.test, loop, step_ifs)
            ),
            None,
        )
        if test is None:
            continue
        yield _finding(
            ctx,
            zero.node,
            "WB304",
            f"gradients are zeroed under `{ast.unparse(test)}`, which stays true for every "
            f"micro-batch after `{step.recv}` steps at line {_line(step)} (its count grows "
            "only at a step): the micro-batches accumulated until the next step are "
            "thrown away",
        )


def _zero_every_or_after(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    yield from _zero_every_micro_batch(ctx, scope)
    yield from _zero_after_step(ctx, scope)


_ScopeCheck = Callable[[FileContext, Scope], Iterator[Finding]]
# Rule code -> its check, for the rules that look at a scope's training events.
_ON_EVENTS: dict[str, _ScopeCheck] = {
    "WB201": _never_zeroed,
    "WB202": _zero_between,
    "WB203": _step_without_backward,
    "WB303": _clip_before_unscale,
    "WB304": _zero_every_or_after,
}


# -- WB302 ------------------------------------------------------------------------------


def _no_sync_without_forward(ctx: FileContext, scope: Scope) -> Iterator[Finding]:
    if ctx.evidence.fsdp_models:
        return  # FSDP's `no_sync()` acts at backward time (fact `fsdp-no-sync`)
    for node in scope.withs:
        model: ast.expr | None = None
        for item in node.items:
            for n in ast.walk(item.context_expr):
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "no_sync"
                ):
                    model = n.func.value
        if model is None:
            continue
        backs = [
            e
            for e in scope.events
            if e.kind == BACKWARD
            and not e.synthetic
            and node.lineno <= _line(e) <= (node.end_lineno or node.lineno)
        ]
        if not backs or _forward_inside(node, model, backs):
            continue
        if all(_forwards_unsynced(scope, model, back) is False for back in backs):
            continue
        yield _finding(
            ctx,
            node,
            "WB302",
            f"`{ast.unparse(model)}.no_sync()` wraps the backward but the forward ran before "
            "it: DDP decides at forward time whether to all-reduce, so gradients are still "
            "synchronised every micro-batch",
        )


def _forward_inside(node: ast.With | ast.AsyncWith, model: ast.expr, backs: list[Event]) -> bool:
    model_text = dotted(model)
    assigned: set[str] = set()
    for st in node.body:
        for n in walk_local(st):
            if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    assigned |= names_in(t)
            elif model_text is not None and _runs_forward(n, model_text):
                return True
    for ev in backs:
        for loss in ev.losses:
            if names_in(loss) & assigned:
                return True
            for n in ast.walk(loss):
                if isinstance(n, ast.Call) and not (
                    isinstance(n.func, ast.Attribute) and n.func.attr in _LOSS_METHODS
                ):
                    return True
    return False


def _forwards_unsynced(scope: Scope, model: ast.expr, back: Event) -> bool | None:
    """Does a forward of `model` on the path of `back` run outside its `no_sync()`?

    The forwards are those earlier in the same loop iteration (or, outside a loop,
    earlier in the scope) that may run in the same pass as `back` (`_never_together`);
    None when there are none to judge by. DDP decided at each forward's time: a backward
    under `no_sync()` skips the all-reduce only if every forward that can feed it did too.
    """
    model_text = dotted(model)
    if model_text is None:
        return None
    line = _line(back)
    spans = [
        (w.lineno, w.end_lineno or w.lineno)
        for w in scope.withs
        if any(_no_sync_of(i.context_expr) == model_text for i in w.items)
    ]
    ifs = {id(i): i for i in scope.ifs}
    seen = False
    for st in scope.stmts:
        at = st.node.lineno
        if at >= line or st.nograd or (back.loops and back.loops[-1] not in st.loops):
            continue
        if not any(_runs_forward(n, model_text) for n in st.walk()):
            continue
        if _never_together(st.path, back.path, ifs, scope):
            continue
        if not any(a <= at <= b for a, b in spans):
            return True
        seen = True
    return False if seen else None


def _no_sync_of(expr: ast.expr) -> str | None:
    """The model (as dotted text) whose `no_sync()` `expr` is, else None.

    Only the call itself: `model.no_sync() if c else nullcontext()` may not skip the
    all-reduce, so a forward in it is not taken as unsynchronised.
    """
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "no_sync"
    ):
        return dotted(expr.func.value)
    return None


def _runs_forward(n: ast.AST, model_text: str) -> bool:
    """`model(x)`, `model.forward(x)`, or `loss_fn(model, batch)`."""
    if not isinstance(n, ast.Call):
        return False
    if dotted(n.func) in (model_text, f"{model_text}.forward"):
        return True
    return any(dotted(a) == model_text for a in n.args)


def _never_together(
    a: tuple[tuple[int, int], ...],
    b: tuple[tuple[int, int], ...],
    ifs: dict[int, ast.If],
    scope: Scope,
) -> bool:
    """Can the statements at branch paths `a` and `b` never run in the same pass?

    Either they sit in different branches of one `if`/`try`/`match`, or in opposite
    branches of two `if`s that test the same call-free condition with none of its names
    assigned in between (`if step % k == 0: out = model(x) ... if step % k == 0:
    loss.backward() else: ...`): both tests then take the same branch.
    """
    for (sa, ba), (sb, bb) in zip(a, b, strict=False):
        if sa != sb:
            break
        if ba != bb:
            return True
    return any(
        sa != sb and ba != bb and sa in ifs and sb in ifs and _same_test(ifs[sa], ifs[sb], scope)
        for sa, ba in a
        for sb, bb in b
    )


def _same_test(x: ast.If, y: ast.If, scope: Scope) -> bool:
    """Do `x` and `y` test the same value (same text, no call, nothing reassigned)?"""
    if ast.dump(x.test) != ast.dump(y.test):
        return False
    if any(isinstance(n, ast.Call | ast.NamedExpr | ast.Await) for n in ast.walk(x.test)):
        return False
    read = names_in(x.test)
    first, last = sorted((x.lineno, y.lineno))
    for st in scope.stmts:
        if first <= st.node.lineno <= last and _assigned(st.node) & read:
            return False
    return True


def _assigned(st: ast.stmt) -> set[str]:
    """The names and dotted chains `st` binds (`a`, `self.step`; `x[i]` binds `x`)."""
    if isinstance(st, ast.Assign):
        targets = st.targets
    elif isinstance(st, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        targets = [st.target]
    else:
        return set()
    out: set[str] = set()
    for t in targets:
        for n in ast.walk(t):
            d = dotted(n.value) if isinstance(n, ast.Subscript) else None
            d = d or (dotted(n) if isinstance(n, ast.Name | ast.Attribute) else None)
            if d is not None:
                out.add(d)
    return out
