"""What WB105 takes as rank-local beyond a rank test or a NaN check, and as a collective
beyond a c10d call (issue 33, round 5):

- a per-rank part: a value the function itself hands to a collective that combines
  every rank's contribution (`t[2] = sk_l1; dist.all_reduce(t)`) differs between ranks
  until that collective has run (a D-Adaptation step summing its own gradient shards);
- a backward through a model the file wraps in DDP or FSDP: DDP's reducer all-reduces
  the gradients during it (FSDP reduce-scatters them), so every rank must run it
  (fact `ddp-backward`), unless it runs inside `no_sync()`.

Both are answered once per scope (the scope's statements are read once).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from wholebatch.lint.frameworks import deepspeed_engines
from wholebatch.lint.names import dotted, last_name, walk_local
from wholebatch.lint.scope import BACKWARD, FileContext, Scope

__all__ = [
    "backward_collectives",
    "engine_collectives",
    "exit_of",
    "partial_names",
    "reads_partial",
]

# Collectives whose result combines every rank's own input (a broadcast's or scatter's
# input matters on the source only, so a value handed to one is no per-rank part).
_COMBINING = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_coalesced",
        "all_gather_object",
        "gather",
        "gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "all_gather_tensor",
        "any_rank",
        "all_ranks_agree",
    }
)
# Where a combining collective takes this rank's input, when not first (the output
# list or tensor comes first: `all_gather(out_list, x)`, `reduce_scatter(out, parts)`).
_INPUT_SECOND = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_coalesced",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
    }
)
# Calls that pack their first argument into a tensor as it is (`torch.tensor([a, b])`).
_PACKERS = frozenset(
    {"tensor", "as_tensor", "stack", "cat", "Tensor", "FloatTensor", "DoubleTensor", "float"}
)
# Wrappers whose backward runs a collective on every rank (DDP's reducer, FSDP's hooks).
_SYNCING_WRAPPERS = frozenset(
    {"DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP"}
)
_MAX_HOPS = 6  # assignments followed back from a backpropagated loss to the model


def _packed(node: ast.expr) -> Iterator[str]:
    """The names whose values `node` puts into a tensor as they are: `x`, `[a, b]`,
    `torch.tensor([a, b], device=d).cuda()` (arithmetic on them is not followed)."""
    d = dotted(node)
    if d is not None:
        yield d
    elif isinstance(node, ast.List | ast.Tuple):
        for e in node.elts:
            if (d := dotted(e)) is not None:
                yield d
    elif isinstance(node, ast.Call):
        if last_name(node.func) in _PACKERS and node.args:
            yield from _packed(node.args[0])
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call):
            yield from _packed(node.func.value)  # `.cuda()`, `.to(device)` on the packing


def partial_names(ctx: FileContext, scope: Scope) -> list[tuple[int, str]]:
    """(line of the collective, name) for each name whose value a combining collective
    of the scope takes as this rank's part: its argument itself (`dist.all_reduce(n)`),
    packed there (`all_reduce(torch.tensor([a, b]))`), or written into the buffer it
    reduces (`t[2] = sk_l1`, `t = torch.tensor([a, b])`)."""
    out: list[tuple[int, str]] = []
    buffers: dict[str, list[int]] = {}
    for q, call in scope.collectives(ctx.imports):
        op = q.rpartition(".")[2]
        if op not in _COMBINING:
            continue
        at = 1 if op in _INPUT_SECOND else 0
        for a in call.args[at : at + 1]:
            for name in _packed(a):
                out.append((call.lineno, name))
                buffers.setdefault(name, []).append(call.lineno)
    if not buffers:
        return out
    for st in scope.stmts:
        n = st.node
        if not isinstance(n, ast.Assign):
            continue
        for t in n.targets:
            if isinstance(t, ast.Subscript):
                b = dotted(t.value)  # `t[2] = sk_l1`
            elif isinstance(n.value, ast.Call):
                b = dotted(t)  # `t = torch.tensor([a, b])`
            else:
                continue
            if b is not None and b in buffers:
                names = [name for name in _packed(n.value) if name != b]
                out += [(line, name) for line in buffers[b] for name in names]
    return out


# Tests of what a value is, not of its values: every rank's argument has the same type
# and attributes (`isinstance(t, Tensor)` in a helper that gathers tensors and passes
# the rest through).
_KIND_TESTS = frozenset({"isinstance", "type", "hasattr", "callable", "is_tensor"})


def reads_partial(test: ast.expr, partial: set[str]) -> bool:
    """Does `test` read one of `partial`'s names other than by `is None` or by a test
    of its type (`isinstance`, `hasattr`, `torch.is_tensor`)?"""
    stack: list[ast.AST] = [test]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Compare) and all(
            isinstance(op, ast.Is | ast.IsNot) for op in node.ops
        ):
            continue
        if isinstance(node, ast.Call) and last_name(node.func) in _KIND_TESTS:
            continue
        if isinstance(node, ast.Name | ast.Attribute) and dotted(node) in partial:
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def exit_of(block: list[ast.stmt]) -> ast.stmt | None:
    """The `return`/`continue`/`break` by which `block` leaves, where every path through
    it leaves: its last statement, or an `if` at its end each of whose branches leaves
    (`if raise_on_error: raise ... else: return`; a `raise` ends that process, the
    others' collectives then fail too, and nobody waits)."""
    if not block:
        return None
    last = block[-1]
    if isinstance(last, ast.Return | ast.Continue | ast.Break):
        return last
    if isinstance(last, ast.If) and last.orelse:
        found = [exit_of(b) for b in (last.body, last.orelse)]
        leaves = [
            f is not None or (bool(b) and isinstance(b[-1], ast.Raise))
            for f, b in zip(found, (last.body, last.orelse), strict=True)
        ]
        if all(leaves):
            return next((f for f in found if f is not None), None)
    return None


def _syncing_models(ctx: FileContext) -> set[str]:
    """The names the file assigns a DDP- or FSDP-wrapped model (`self.model = DDP(m)`)."""
    key = "<syncing-models>"
    found = ctx.framework_names.get(key)
    if found is None:
        found = {
            d
            for call, targets in ctx.assign_calls
            if last_name(call.func) in _SYNCING_WRAPPERS
            for t in targets
            if (d := dotted(t)) is not None
        }
        ctx.framework_names[key] = found
    return found


def _under_no_sync(scope: Scope, call: ast.Call) -> bool:
    for w in scope.withs:
        if any(
            isinstance(it.context_expr, ast.Call) and last_name(it.context_expr.func) == "no_sync"
            for it in w.items
        ) and any(n is call for s in w.body for n in walk_local(s)):
            return True
    return False


def backward_collectives(ctx: FileContext, scope: Scope) -> dict[int, str]:
    """id(backward call) -> the DDP- or FSDP-wrapped model it backpropagates through:
    a backward in the scope (not inside `no_sync()`) of a loss assigned, through at most
    `_MAX_HOPS` assignments of the scope, from a call of that model or one given it
    (`loss_dict = self._step(batch, self.model)`)."""
    if not any(ev.kind == BACKWARD and not ev.synthetic for ev in scope.events):
        return {}
    models = _syncing_models(ctx)
    if not models:
        return {}
    sources: dict[str, list[ast.expr]] = {}  # name -> the values assigned to it
    for st in scope.stmts:
        n = st.node
        if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple | ast.List) else [t]:
                    d = dotted(e.value if isinstance(e, ast.Subscript) else e)
                    if d is not None:
                        sources.setdefault(d, []).append(n.value)
    out: dict[int, str] = {}
    for ev in scope.events:
        if ev.kind != BACKWARD or ev.synthetic or not isinstance(ev.node, ast.Call):
            continue
        model = _reaches(ev.losses, sources, models)
        if model and not _under_no_sync(scope, ev.node):
            out[id(ev.node)] = model
    return out


def _reaches(
    roots: tuple[ast.expr, ...], sources: dict[str, list[ast.expr]], models: set[str]
) -> str:
    """The model of `models` that one of `roots` is computed from ("" for none)."""
    seen: set[str] = set()
    frontier = list(roots)
    for _ in range(_MAX_HOPS):
        names: set[str] = set()
        for e in frontier:
            for sub in ast.walk(e):
                if isinstance(sub, ast.Name | ast.Attribute) and (d := dotted(sub)):
                    if d in models:
                        return d
                    names.add(d)
        frontier = [v for d in names - seen for v in sources.get(d, ())]
        seen |= names
        if not frontier:
            break
    return ""


# Methods of the engine `deepspeed.initialize` returns that synchronise every rank
# (`frameworks.FACTS["deepspeed-save-checkpoint"]`).
_ENGINE_SYNCS = frozenset({"save_checkpoint"})


def engine_collectives(ctx: FileContext, scope: Scope) -> dict[int, str]:
    """id(call) -> the engine, for each `engine.save_checkpoint(...)` in the scope on a
    name the file binds to `deepspeed.initialize`'s engine: every rank must call it (a
    barrier, and all-reduces of the tag), so WB104 and WB105 take it for a collective."""
    calls = [
        c for c in scope.calls if isinstance(c.func, ast.Attribute) and c.func.attr in _ENGINE_SYNCS
    ]
    if not calls:
        return {}
    engines = deepspeed_engines(ctx.tree, ctx.imports.qualname)
    out: dict[int, str] = {}
    for c in calls:
        assert isinstance(c.func, ast.Attribute)
        d = dotted(c.func.value)
        if d is not None and d in engines:
            out[id(c)] = f"{d}.{c.func.attr}"
    return out
