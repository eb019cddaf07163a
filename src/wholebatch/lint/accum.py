"""The accumulation a scope's own loops do, for WB301: which loops backpropagate
micro-batch after micro-batch with no optimizer step inside (their trip counts are
numbers of micro-batches), and a division of a summed loss by an item count and a number
of micro-batches in one expression (`pg.sum() / (num_valid * num_passes * examples)`),
and a function that asserts one accumulation step (`asserts_one_step`).

    for example in range(examples_per_rank):          # backward inside, no step: K1
        for p in range(num_passes):                   # backward inside, no step: K2
            num_valid = (targets >= 0).sum()          # this micro-batch's item count
            loss = pg.sum() / (num_valid * num_passes * examples_per_rank)
            loss.backward()                           # a mean of K1*K2 micro-batch means
    optimizer.step()
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

from wholebatch.lint.names import counts_items, dotted, is_step_count_name, last_name
from wholebatch.lint.scope import BACKWARD, STEP, Scope, Stmt

__all__ = ["accumulation_trips", "assigned_in_loop", "count_over_steps", "factors"]


def accumulation_trips(scope: Scope) -> set[str]:
    """The trip counts (`n` of `for _ in range(n)`, as source text) of the scope's loops
    that call backward and never step: each iteration is one micro-batch of one step."""
    loops: dict[int, ast.stmt] = {}
    for ev in scope.events:
        if ev.kind == BACKWARD:
            for loop in ev.loops:
                loops.setdefault(id(loop), loop)
    out: set[str] = set()
    for key, loop in loops.items():
        if any(e.kind == STEP and any(id(x) == key for x in e.loops) for e in scope.events):
            continue
        bound = _range_bound(loop)
        if bound is not None:
            out.add(bound)
    return out


def _range_bound(loop: ast.stmt) -> str | None:
    """`n` of `for _ in range(n)` or `range(0, n)`, as source text."""
    if not isinstance(loop, ast.For | ast.AsyncFor):
        return None
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
        return None
    args = it.args
    if len(args) == 2 and isinstance(args[0], ast.Constant) and args[0].value == 0:
        args = args[1:]
    if len(args) != 1 or isinstance(args[0], ast.Constant):
        return None
    return dotted(args[0]) or ast.unparse(args[0])


def factors(node: ast.expr) -> Iterator[ast.expr]:
    """The factors of a product (`a * (b * c)` -> a, b, c); any other node is its own."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        yield from factors(node.left)
        yield from factors(node.right)
    else:
        yield node


def count_over_steps(
    scope: Scope,
    st: Stmt,
    div: ast.BinOp,
    is_steps: Callable[[ast.expr], bool],
    is_count: Callable[[ast.expr], bool],
) -> tuple[ast.expr, ast.expr] | None:
    """(the item count, the number of micro-batches) when `div` divides by a product of
    both: a count of this micro-batch's items (`counts_items`, or a name `is_count`
    says holds one, assigned inside the loop the division runs in) and a number of
    micro-batches (`is_steps`). The quotient is this micro-batch's mean divided by the
    steps: the mean of micro-batch means, whatever the count of each."""
    if not (isinstance(div.right, ast.BinOp) and isinstance(div.right.op, ast.Mult)):
        return None
    parts = list(factors(div.right))
    steps = next((f for f in parts if is_steps(f)), None)
    if steps is None:
        return None
    for f in parts:
        if f is steps:
            continue
        if isinstance(f, ast.Name):
            if (counts_items(f) or is_count(f)) and assigned_in_loop(scope, st, f.id):
                return f, steps
        elif st.loops and counts_items(f):
            return f, steps  # `mask.sum()` in the division itself, in the loop
    return None


def assigned_in_loop(scope: Scope, st: Stmt, name: str) -> bool:
    """Is `name` assigned (a count expression, or any value for a count-like name) inside
    the innermost loop of `st`, so it counts this micro-batch's items only?"""
    if not st.loops:
        return False
    loop = st.loops[-1]
    for other in scope.stmts:
        node = other.node
        if not isinstance(node, ast.Assign) or not any(x is loop for x in other.loops):
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def asserts_one_step(scope: Scope) -> bool:
    """Does the function assert one accumulation step (`assert
    self.accelerator.gradient_accumulation_steps == 1`, a trainer that accumulates by its
    own loop)? Then what a framework divides by the steps it divides by 1."""
    for n in ast.walk(scope.node):
        if isinstance(n, ast.Assert) and isinstance(n.test, ast.Compare):
            t = n.test
            sides = [t.left, *t.comparators]
            if (
                len(t.ops) == 1
                and isinstance(t.ops[0], ast.Eq)
                and any(isinstance(s, ast.Constant) and s.value == 1 for s in sides)
                and any(is_step_count_name(last_name(s) or "") for s in sides)
            ):
                return True
    return False
