"""Rules about collectives and control flow across ranks:

- WB102 an autograd.Function whose forward all-gathers but whose backward never
  reduces across ranks (the "GatherLayer" that returns only this rank's slice);
- WB104 a collective under a rank-dependent `if` that the other branch does not match;
- WB105 a rank-local `return`/`continue`/`break` before a collective.

DESIGN.md, "Agree before you branch": a rank that skips a collective hangs every other
rank, so any rank-local condition that changes control flow is agreed first.
"""

from __future__ import annotations

import ast
import builtins
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import partial

from wholebatch.lint.frameworks import FACTS
from wholebatch.lint.names import (
    dotted,
    int_literal,
    is_on_replica_group,
    is_on_subgroup,
    is_rank_local_test,
    is_rank_ref,
    is_rank_test,
    last_name,
    names_in,
    walk_local,
)
from wholebatch.lint.rank_local import (
    backward_collectives,
    engine_collectives,
    exit_of,
    partial_names,
    reads_partial,
)
from wholebatch.lint.rules import Finding, Hop, format_trace
from wholebatch.lint.scope import FileContext, Scope, Stmt, finding as _finding

__all__ = ["check_dist", "layer_uses"]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _short(q: str) -> str:
    return q.replace("torch.distributed.", "dist.")


_Coll = tuple[str, ast.Call, tuple[Hop, ...]]
_Def = ast.FunctionDef | ast.AsyncFunctionDef
_Chain = list[tuple[list[ast.stmt], int, ast.stmt]]


def _collectives(
    ctx: FileContext,
    stmts: list[ast.stmt],
    scope: Scope,
    skip: ast.AST | None = None,
    syncs: Mapping[int, str] | None = None,
) -> list[_Coll]:
    """Collectives called on the world group in `stmts` (sub-group calls are left out),
    directly or through a call to a function that calls one on every call: (qualified
    name, the call in `stmts`, the path through the called functions). `syncs`: the
    other calls that are collectives too, by id, with their names: a backward through a
    DDP/FSDP model (`rank_local.backward_collectives`, `backward:<model>`) and a DeepSpeed
    engine's `save_checkpoint` (`rank_local.engine_collectives`, `engine:<engine>.
    save_checkpoint`)."""
    out: list[_Coll] = []
    stack: list[ast.AST] = list(reversed(stmts))
    while stack:
        node = stack.pop()
        if node is skip or isinstance(node, (*_DEFS, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            q = ctx.imports.collective(node)
            if q is not None and not is_on_subgroup(node):
                out.append((q, node, ()))
            elif syncs and id(node) in syncs:
                out.append((syncs[id(node)], node, ()))
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    if ctx.resolver is not None and scope.local_calls:
        kept = [s for s in stmts if s is not skip]
        out.extend(ctx.resolver.collective_calls(kept, scope))
    return out


def _calls_collective(ctx: FileContext, scope: Scope) -> bool:
    if scope.collectives(ctx.imports):
        return True
    r = ctx.resolver
    return r is not None and any(
        (f := r.resolve(c, scope)) is not None and f[0].collective is not None
        for c, _ in scope.local_calls
    )


_BACKWARD = "backward:"  # a backward through a DDP/FSDP model, by the model's name
_ENGINE = "engine:"  # a DeepSpeed engine's synchronising method, `engine.save_checkpoint`


def _what(q: str, call: ast.Call, trace: tuple[Hop, ...]) -> str:
    """`dist.barrier`, or "`sync()` (which calls `dist.barrier`)"."""
    if q.startswith(_BACKWARD):
        model = q[len(_BACKWARD) :]
        return (
            f"`{ast.unparse(call)}` (a backward through the DDP/FSDP-wrapped `{model}`, "
            "which reduces the gradients across ranks)"
        )
    if q.startswith(_ENGINE):
        return f"`{ast.unparse(call.func)}()` ({FACTS['deepspeed-save-checkpoint'].says})"
    if not trace:
        return f"`{_short(q)}`"
    callee = dotted(call.func) or last_name(call.func)
    return f"`{callee}()` (which calls `{_short(q)}`)"


def _path(trace: tuple[Hop, ...], path: str) -> str:
    return f"; path: {format_trace(trace, path)}" if trace else ""


def check_dist(ctx: FileContext) -> Iterator[Finding]:
    """Run WB102, WB104 and WB105 (those of them `ctx.runs`) over the file."""
    if ctx.runs("WB102"):
        yield from _gather_layers(ctx)
    branches, exits = ctx.runs("WB104"), ctx.runs("WB105")
    if not (branches or exits):
        return
    for scope in ctx.scopes:
        if scope.calls:  # a scope that calls nothing calls no collective
            yield from ctx.guarded(scope, partial(_rank_rules, ctx, scope, branches, exits))


def _rank_rules(ctx: FileContext, scope: Scope, branches: bool, exits: bool) -> list[Finding]:
    out: list[Finding] = []
    backward = backward_collectives(ctx, scope) if exits and scope.has_exit else {}
    # DeepSpeed's save_checkpoint: every rank calls it
    engines = {k: f"{_ENGINE}{e}" for k, e in engine_collectives(ctx, scope).items()}
    syncs = {**{k: f"{_BACKWARD}{m}" for k, m in backward.items()}, **engines}
    if _calls_collective(ctx, scope) or syncs:
        if _in_agreeing_halves(ctx, scope):
            return out
        if branches:
            out += _rank_branches(ctx, scope, engines)
        if exits and scope.has_exit:
            out += _early_exits(ctx, scope, syncs)
            seen = {(f.line, f.col) for f in out if f.code == "WB105"}
            out += [f for f in _exit_between_halves(ctx, scope) if (f.line, f.col) not in seen]
    return out


# -- WB102 ------------------------------------------------------------------------------


def _gather_layers(ctx: FileContext) -> Iterator[Finding]:
    for cls in ctx.classes:
        if any(last_name(b) == "Function" for b in cls.bases):
            found: list[Finding] = []
            yield from ctx.failures.run(cls.name, cls.lineno, partial(_layer, ctx, cls), found)


def _layer(ctx: FileContext, cls: ast.ClassDef) -> list[Finding]:
    """WB102 for one autograd.Function class."""
    text = ctx.mentions("all_gather")  # else only a helper of another file can gather
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
    fwd, bwd = methods.get("forward"), methods.get("backward")
    if fwd is None or bwd is None:
        return []
    if _never_returns(bwd):
        return []  # `raise NotImplementedError`: no gradient at all, never a wrong one
    fwd_scope = ctx.scope_of.get(id(fwd))
    via: tuple[Hop, ...] = ()
    gathers = [
        n for n in walk_local(fwd) if isinstance(n, ast.Call) and ctx.imports.plain_gather(n)
    ]
    if not (text and gathers):
        if fwd_scope is None or _fwd_differentiable(ctx, fwd_scope):
            return []
        via = _gathering_call(ctx, fwd_scope)
        if not via:
            return []
    elif all(is_on_replica_group(n) for n in gathers):
        return []  # tensor parallelism: the ranks after the gather compute alike
    elif all(is_on_subgroup(n) for n in gathers) and not _selects_own_slice(bwd):
        # A group the caller chooses may be a tensor-parallel one (each rank holds a
        # shard of the same rows): then a backward that computes the gradient by hand,
        # rather than cutting this rank's slice out of the incoming one, is no batch
        # gather's backward, and its sum over ranks is not missing.
        return []
    bwd_scope = ctx.scope_of.get(id(bwd))
    for n in walk_local(bwd):
        if isinstance(n, ast.Call):
            name = last_name(n.func).lower()
            if (
                ctx.imports.collective(n) is not None
                or name == "apply"  # another autograd.Function does the collective
                or "reduce" in name
                or "scatter" in name
                or "all_to_all" in name
            ):
                return []
            # a helper that reduces (`_sum_over_ranks(grads)`), or one we cannot see
            if bwd_scope is not None and _helper_reduces(ctx, n, bwd_scope):
                return []
    uses = [local for name, local in _applies(ctx) if name == cls.name]
    if uses and not any(uses):
        # Every use gathers all of its inputs and the loss reads only gathered rows:
        # every rank computes the same whole-batch loss, and its own slice of that
        # loss's gradient is exactly 1/W of the whole (a learning-rate scale), the
        # convention `gathered[rank] = local` is accepted for.
        return []
    f = _finding(
        ctx,
        bwd,
        "WB102",
        f"`{cls.name}.forward` all-gathers but `{cls.name}.backward` never sums across "
        "ranks: each rank keeps only its own loss's gradient for its slice, so the "
        f"other ranks' terms are lost{_local_use(uses)}{_path(via, ctx.path)}",
    )
    if not uses:
        ctx.layers[f.line] = cls.name  # the uses may be in other files
    return [replace(f, trace=via)]


# Calls that cut a slice out of a tensor (`grad.narrow(0, start, n)`).
_SELECTS = frozenset({"narrow", "select", "index_select"})


def _selects_own_slice(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Does a backward cut a slice out of its incoming gradient at a computed position
    (`grads[rank]`, `grad[ctx.start : ctx.end]`, `grad.chunk(W)[r]`, `grad.narrow(...)`),
    as the backward of a batch gather does? Reshapes with constants (`grad[:, None]`) and
    gradients computed from saved tensors are not slices."""
    a = fn.args
    incoming = {x.arg for x in (*a.posonlyargs, *a.args)[1:]}  # after `ctx`
    if a.vararg is not None:
        incoming.add(a.vararg.arg)
    body = list(walk_local(fn))
    # names bound from the incoming gradient (`chunks = grad.chunk(W)`), to a fixed point
    grown = True
    while grown:
        grown = False
        for n in body:
            if (
                isinstance(n, ast.Assign | ast.AnnAssign)
                and n.value is not None
                and names_in(n.value) & incoming
            ):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                new = {x for t in targets for x in names_in(t)} - incoming
                if new:
                    incoming |= new
                    grown = True

    def computed(node: ast.AST) -> bool:
        return any(isinstance(x, ast.Name | ast.Attribute | ast.Call) for x in ast.walk(node))

    for n in body:
        if isinstance(n, ast.Subscript) and computed(n.slice) and names_in(n.value) & incoming:
            return True
        if (
            isinstance(n, ast.Call)
            and last_name(n.func) in _SELECTS
            and any(computed(x) for x in n.args)
            and names_in(n) & incoming
        ):
            return True
    return False


def _never_returns(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Does `fn` always raise (its body ends in `raise`, and it returns nothing)?"""
    body = fn.body
    return (
        bool(body)
        and isinstance(body[-1], ast.Raise)
        and not any(isinstance(n, ast.Return) and n.value is not None for n in walk_local(fn))
    )


def _local_use(uses: list[bool]) -> str:
    if any(uses):
        return " (a use pairs this rank's own rows with the gathered ones)"
    return ""


def _applies(ctx: FileContext) -> list[tuple[str, bool]]:
    """(class name as written, local use) for each `Name.apply(...)` of the file: a use is
    local when a name it passes is read again after the gather without being rebound
    (`all_z = cat(Layer.apply(z)); logits = z @ all_z.T`), so the loss pairs this rank's
    rows with everyone's; when every input is rebound to (or left for) the gathered
    value, every rank computes the same loss of the whole batch."""
    hit = ctx.applies
    if hit is None:
        hit = ctx.applies = []
        aliases = {**ctx.apply_aliases, **_imported_applies(ctx)}
        for scope in ctx.scopes:
            uses: list[tuple[str, Stmt, ast.Call]] = []
            for st in scope.stmts:
                for n in st.walk():
                    if not isinstance(n, ast.Call):
                        continue
                    func = n.func
                    if (
                        isinstance(func, ast.Attribute)
                        and func.attr == "apply"
                        and isinstance(func.value, ast.Name)
                    ):
                        cls: str | None = func.value.id
                    else:
                        # `allgather(x)` after `allgather = AllGather.apply`
                        cls = aliases.get(dotted(func) or "") if aliases else None
                    if cls is not None:
                        uses.append((cls, st, n))
            calls = {id(n) for _, _, n in uses}
            for cls, st, n in uses:
                local = _reads_again(scope, st.node, n, calls) or _local_product(
                    scope, st, calls, ctx.imports.aliases
                )
                hit.append((cls, local))
    return hit


_PRODUCTS = frozenset({"matmul", "mm", "bmm", "einsum", "cosine_similarity", "cdist", "inner"})


def _local_product(scope: Scope, at: Stmt, uses: set[int], modules: Mapping[str, str]) -> bool:
    """After the use in `at`, does a similarity product pair a value that no gather
    produced with one (`text @ all_video.T`, `text` never gathered)? Values assigned
    from a use (any of `uses`, the ids of the scope's use calls) or from a gathered value
    count as gathered (`z = torch.cat((z_i, z_j))`)."""
    gathered: set[str] = set()
    start = at.node.lineno
    for st in scope.stmts:
        node = st.node
        if isinstance(node, ast.Assign):
            reads = {x.id for x in ast.walk(node.value) if isinstance(x, ast.Name)}
            targets = {x.id for t in node.targets for x in ast.walk(t) if isinstance(x, ast.Name)}
            if reads & gathered or any(id(x) in uses for x in ast.walk(node.value)):
                gathered |= targets
            else:
                gathered -= targets  # rebound to something else
        if node.lineno < start:
            continue
        for x in st.walk():
            operands: list[ast.expr] = []
            if isinstance(x, ast.BinOp) and isinstance(x.op, ast.MatMult):
                operands = [x.left, x.right]
            elif isinstance(x, ast.Call) and last_name(x.func) in _PRODUCTS:
                operands = [a for a in x.args if not isinstance(a, ast.Constant)]
            roots = [_roots(o, modules) for o in operands]
            names = [r for rs in roots for r in rs]
            if (
                len(names) >= 2
                and any(r in gathered for r in names)
                and any(r not in gathered for r in names)
            ):
                return True
    return False


# Calls that keep their argument's rows (a view, a cast, a transpose, a row-wise norm):
# `torch.transpose(all_c, 0, 1)` reads `all_c`, not `torch` (issue 33: ICT's loss of
# gathered queries against gathered contexts).
_SAME_ROWS = frozenset(
    {
        "transpose", "t", "permute", "view", "reshape", "contiguous", "float", "half",
        "double", "bfloat16", "to", "type", "flatten", "squeeze", "unsqueeze", "clone",
        "detach", "normalize", "swapaxes", "movedim", "adjoint",
    }
)  # fmt: skip


def _roots(node: ast.expr, modules: Mapping[str, str]) -> list[str]:
    """The variables an operand reads: `all_video.T` -> `all_video`, `x.t()` -> `x`,
    `torch.transpose(x, 0, 1)` and `F.normalize(x)` -> `x`; any other call of an imported
    module or function gives the roots of its arguments, never the module (issue 33:
    `torch.einsum("acd,a->cd", torch.einsum("ac,ad->acd", za, zb), w)` reads `za`, `zb`
    and `w`, not `torch`). `modules`: the file's imported names, which are no variables."""
    while True:
        if isinstance(node, ast.Name):
            return [node.id]
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and (d := dotted(node.func)) is not None
            and d.partition(".")[0] in modules
        ):
            if node.args and last_name(node.func) in _SAME_ROWS:
                node = node.args[0]  # the function form of an imported module: `torch.t(x)`
                continue
            args = [a for a in node.args if not isinstance(a, ast.Constant)]
            return [r for a in args for r in _roots(a, modules)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return []


def _reads_again(scope: Scope, stmt: ast.stmt, call: ast.Call, uses: set[int]) -> bool:
    """Is a name passed to `call` (in `stmt`) read after `stmt`, before it is rebound?
    Passing it to another use (`uses`: the ids of the scope's use calls) is no read: a
    config given to every gather (`allgather(v, args); allgather(t, args)`) pairs no
    local rows with gathered ones."""
    passed = {a.id for a in call.args if isinstance(a, ast.Name)}
    if isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            passed -= names_in(t)
    after = stmt.end_lineno or stmt.lineno
    for st in scope.stmts:
        if not passed:
            return False
        node = st.node
        if node.lineno <= after:
            continue
        reads = list(st.walk() if not isinstance(node, ast.Assign) else ast.walk(node.value))
        given = {id(a) for x in reads if isinstance(x, ast.Call) and id(x) in uses for a in x.args}
        if any(
            isinstance(x, ast.Name)
            and x.id in passed
            and isinstance(x.ctx, ast.Load)
            and id(x) not in given
            for x in reads
        ):
            return True
        if isinstance(node, ast.Assign):
            for t in node.targets:
                passed -= names_in(t)
    return False


def layer_uses(ctx: FileContext) -> list[tuple[str, bool]]:
    """The file's `Layer.apply(...)` uses of imported classes, by absolute name (for
    `facts.ModuleFacts.applies`)."""
    r = ctx.resolver
    imported = set(_imported_applies(ctx).values())
    if r is None or (".apply" not in ctx.source and not imported):
        return []
    out: list[tuple[str, bool]] = []
    for name, local in _applies(ctx):
        if name in imported:
            out.append((name, local))  # `allgather(x)`, imported: already absolute
        elif name not in ctx.class_by_name:
            full = r.absolute(name)
            if full is not None:
                out.append((full, local))
    return out


def _imported_applies(ctx: FileContext) -> dict[str, str]:
    """Imported names that another module of the run binds to an autograd.Function's
    `apply` (`from models.utils import allgather_wgrad`) -> the class's absolute name."""
    r = ctx.resolver
    program = r.program if r is not None else None
    if r is None or program is None or not program.apply_names:
        return {}
    out: dict[str, str] = {}
    for local in (*ctx.imports.aliases, *ctx.imports.relative):
        full = r.absolute(local)
        if full is not None and full.rpartition(".")[2] in program.apply_names:
            cls = program.applied(full)
            if cls is not None:
                out[local] = cls
    return out


def _gathering_call(ctx: FileContext, scope: Scope) -> tuple[Hop, ...]:
    """The path to the c10d all-gather a forward reaches through a helper (empty: none)."""
    r = ctx.resolver
    if r is None:
        return ()
    for call, _ in scope.local_calls:
        found = r.resolve(call, scope)
        if found is not None and found[0].gathers and not found[0].replicated:
            f = found[0]
            name = dotted(call.func) or last_name(call.func)
            return (
                Hop(
                    path=ctx.path,
                    line=call.lineno,
                    col=call.col_offset + 1,
                    function=scope.qual,
                    note=f"calls `{name}()`",
                ),
                Hop(
                    path=f.path, line=f.line, col=1, function=f.qual, note="all-gathers in its body"
                ),
            )
    return ()


# Plain functions that never reduce across ranks (so a call to them in a backward is no
# "maybe" for WB102).
_NOT_REDUCING = frozenset(dir(builtins))


def _helper_reduces(ctx: FileContext, call: ast.Call, scope: Scope) -> bool:
    """Does `call` run a function that reduces across ranks? A call of a plain name that
    cannot be resolved (imported from outside the run) counts as "maybe": no finding
    rather than a false one."""
    r = ctx.resolver
    if r is None:
        return False
    found = r.resolve(call, scope)
    if found is not None:
        return found[0].reduces
    return isinstance(call.func, ast.Name) and call.func.id not in _NOT_REDUCING


def _fwd_differentiable(ctx: FileContext, scope: Scope) -> bool:
    """A forward that also calls a differentiable gather is not a plain-gather layer."""
    return any((q := ctx.imports.collective(c)) is not None and ".nn." in q for c in scope.calls)


# -- WB104 ------------------------------------------------------------------------------


def _rank_branches(
    ctx: FileContext, scope: Scope, syncs: Mapping[int, str] | None = None
) -> Iterator[Finding]:
    ifs = [n for n in scope.ifs if is_rank_test(n.test) or _membership_rank(n.test)]
    if not ifs:
        return
    unmatched: list[tuple[ast.If, str, ast.Call, tuple[Hop, ...]]] = []
    for node in ifs:
        body = _collectives(ctx, node.body, scope, syncs=syncs)
        other = _collectives(ctx, node.orelse, scope, syncs=syncs)
        body_names = {q for q, _, _ in body}
        other_names = {q for q, _, _ in other}
        unmatched += [(node, q, c, t) for q, c, t in body if q not in other_names]
        unmatched += [(node, q, c, t) for q, c, t in other if q not in body_names]
    # `if rank != 0: barrier()` ... `if rank == 0: barrier()` (zero-first): two rank tests
    # that each call the same collective pair up; every rank calls it once.
    holders: dict[str, set[int]] = {}
    for node, q, _, _ in unmatched:
        holders.setdefault(q, set()).add(id(node))
    seen: set[int] = set()
    agree: dict[int, bool] = {}  # id(if) -> every path makes the same collectives
    for node, q, call, trace in unmatched:
        if len(holders[q]) > 1 or id(call) in seen or not is_rank_test(node.test):
            continue
        if id(node) not in agree:
            agree[id(node)] = _one_sequence(ctx, scope, node, syncs=syncs)
        if agree[id(node)] or _served_by_callback(ctx, scope, node, call):
            continue
        seen.add(id(call))
        f = _finding(
            ctx,
            call,
            "WB104",
            f"{_what(q, call, trace)} is called only when `{ast.unparse(node.test)}` "
            f"(line {node.lineno}): the ranks that skip it never join, and the others hang"
            f"{_path(trace, ctx.path)}",
        )
        yield replace(f, trace=trace)


def _served_by_callback(ctx: FileContext, scope: Scope, the_if: ast.If, call: ast.Call) -> bool:
    """Is the branch of `the_if` that makes `call` a worker loop that a callback of the
    other branch's ranks matches (a leader/worker server: rank 0 registers a request
    handler, `button.click(fn=generate)`, whose every call makes the collectives the
    workers wait for in a loop, `while True: barrier(); broadcast_object_list(args)`)?
    Only when the callbacks' collectives are each one sequence and the worker's branch
    (or the one function it calls) makes exactly such a sequence, once or as a loop of
    it, or is one loop each of whose paths (a dispatch on a broadcast command, `if op ==
    TRAIN: self.run_training()`) a callback makes (a path that leaves is the worker's
    way out)."""
    side, other = the_if.body, the_if.orelse
    if not any(n is call for st in side for n in ast.walk(st)):
        side, other = other, side
    wscope, wstmts = _worker_body(ctx, scope, side)
    worker = _one_path(ctx, wscope, wstmts)
    if worker is None or not worker:
        return False
    served = {_one_path(ctx, ctx.scope_of[id(f)], f.body) for f in _callbacks(ctx, scope, other)}
    served -= {None, ()}
    if any(worker in (s, (f"loop({', '.join(s)})",)) for s in served if s is not None):
        return True
    body = [st for st in wstmts if not _is_docstring(st)]
    if len(body) != 1 or not isinstance(body[0], _LOOPS):
        return False
    paths = _Paths(ctx, wscope, True, None).of(body[0].body)
    kept = {p for p in paths or () if not p or p[-1] != _LEAVES}
    return bool(kept) and kept <= served


def _is_docstring(st: ast.stmt) -> bool:
    return isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)


def _worker_body(
    ctx: FileContext, scope: Scope, stmts: list[ast.stmt]
) -> tuple[Scope, list[ast.stmt]]:
    """`stmts`, or the body of the one function of this file they only call
    (`worker_func()`, `self.run_subscriber_loop()`)."""
    if (
        len(stmts) == 1
        and isinstance(st := stmts[0], ast.Expr)
        and isinstance(st.value, ast.Call)
        and (f := _own_function(ctx, scope, st.value.func)) is not None
    ):
        return ctx.scope_of[id(f)], f.body
    return scope, stmts


def _one_path(ctx: FileContext, scope: Scope, stmts: list[ast.stmt]) -> tuple[str, ...] | None:
    """The one sequence of collectives every path through `stmts` makes; None if more."""
    paths = _Paths(ctx, scope, False, None).of(stmts)
    return next(iter(paths)) if paths is not None and len(paths) == 1 else None


def _own_function(ctx: FileContext, scope: Scope, ref: ast.expr) -> _Def | None:
    """The function `ref` names in this file: a module function (`worker_func`), a
    function nested in another whose name no other function of the file has (a handler
    defined where it is registered, `def respond(...)`), or a method of the class
    `scope` belongs to (`self.run_subscriber_loop`), defined in its body."""
    if isinstance(ref, ast.Name):
        if ref.id in ctx.module_functions:
            return ctx.module_functions[ref.id]
        defs = ctx.defs_by_name.get(ref.id, [])
        if len(defs) == 1 and ctx.scope_of[id(defs[0])].cls is None:
            return defs[0]
        return None
    if (
        scope.cls is not None
        and isinstance(ref, ast.Attribute)
        and isinstance(ref.value, ast.Name)
        and ref.value.id == "self"
    ):
        for st in scope.cls.body:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef) and st.name == ref.attr:
                return st
    return None


def _callbacks(ctx: FileContext, scope: Scope, stmts: list[ast.stmt], depth: int = 2) -> list[_Def]:
    """The functions of this file `stmts` hands over as values (`click(fn=generate)`,
    `bind(infer_func=self.infer)`), not calls, there or in the functions they call
    (`depth` calls down)."""
    out: list[_Def] = []
    called: set[int] = set()
    for n in (x for st in stmts for x in ast.walk(st)):
        if isinstance(n, ast.Call):
            called.add(id(n.func))
            f = _own_function(ctx, scope, n.func)
            if f is not None and depth > 0:
                out += _callbacks(ctx, ctx.scope_of[id(f)], f.body, depth - 1)
        elif (
            isinstance(n, ast.Name | ast.Attribute)
            and isinstance(n.ctx, ast.Load)
            and id(n) not in called
            and (f := _own_function(ctx, scope, n)) is not None
        ):
            out.append(f)
    return out


def _membership_rank(test: ast.expr) -> bool:
    return any(
        isinstance(n, ast.Compare)
        and any(isinstance(op, ast.In | ast.NotIn) for op in n.ops)
        and is_rank_test(n.left)
        for n in ast.walk(test)
    )


# -- WB105 ------------------------------------------------------------------------------


def _agreed_names(ctx: FileContext, scope: Scope) -> list[tuple[int, set[str]]]:
    """(line, names) for each collective: after that line those names hold the same value
    on every rank (reduced in place, or assigned the collective's result)."""
    out: list[tuple[int, set[str]]] = []
    for st in scope.stmts:
        for n in st.walk():
            if isinstance(n, ast.Call) and ctx.imports.collective(n) is not None:
                names = {d for d in (dotted(a) for a in n.args) if d is not None}
                if isinstance(st.node, ast.Assign):
                    for t in st.node.targets:
                        names |= names_in(t)
                out.append((n.lineno, names - set(ctx.imports.aliases)))
    return out


def _sub_blocks(st: ast.stmt) -> list[list[ast.stmt]]:
    if isinstance(st, ast.If | ast.For | ast.AsyncFor | ast.While):
        return [st.body, st.orelse]
    if isinstance(st, ast.With | ast.AsyncWith):
        return [st.body]
    if isinstance(st, ast.Try | ast.TryStar):
        return [st.body, *(h.body for h in st.handlers), st.orelse, st.finalbody]
    if isinstance(st, ast.Match):
        return [c.body for c in st.cases]
    return []


def _rank_local(st: ast.If, agreed: set[str], partial: list[tuple[int, str]]) -> bool:
    """Can `st`'s condition differ between ranks: a rank test, a NaN check not agreed,
    or a test of a per-rank part that a later collective combines (`if sk_l1 == 0:`
    before `t[2] = sk_l1; dist.all_reduce(t)`)?"""
    if is_rank_local_test(st.test, agreed) or _picks_ranks(st.test):
        return True
    later = {n for line, n in partial if line > st.lineno} - agreed
    return bool(later) and reads_partial(st.test, later)


def _picks_ranks(test: ast.expr) -> bool:
    """`RANK in {-1, 0}`, `local_rank not in (0, 1)`: the rank tested against a literal
    list of rank numbers names particular ranks, as `rank == 0` does (a test against a
    list a program builds, `rank in tp_ranks`, is a sub-group's, and stays out). A list
    of negative numbers only (`rank in (-1,)`: "not distributed") is the same on every
    rank."""
    for n in ast.walk(test):
        if (
            isinstance(n, ast.Compare)
            and len(n.ops) == 1
            and isinstance(n.ops[0], ast.In | ast.NotIn)
            and is_rank_ref(n.left)
            and isinstance(c := n.comparators[0], ast.Set | ast.Tuple | ast.List)
            and c.elts
        ):
            values = [int_literal(e) for e in c.elts]
            if all(v is not None for v in values) and any(v >= 0 for v in values if v is not None):
                return True
    return False


# Where a rank-local exit is judged from: the statements above the rank-local `if`, its
# block and index there, the `if`, whether the exit is in its body, and what else the
# exiting rank knows (the conditions between that `if` and the exit).
_Owner = tuple[_Chain, list[ast.stmt], int, ast.If, bool, tuple[tuple[str, bool], ...]]


def _rank_owner(
    chain: _Chain,
    here: tuple[list[ast.stmt], ast.If, bool],
    jump: ast.stmt,
    splits: Callable[[ast.If], bool],
) -> _Owner | None:
    """The nearest rank-local `if` (`splits`) above `here` (the block holding the `if` a
    branch of which leaves by `jump`, that `if`, whether the branch is its body) of
    whose branch the exit is part: `if rank == 0: ... if dataset_is_test: continue`
    leaves on rank 0 only, whatever the inner condition, as `if rank == 0 and
    dataset_is_test: continue` does. A `continue`/`break` looks no higher than its loop
    (a rank test around the loop holds the collectives after the exit too)."""
    block, inner, in_body = here
    known = list(_holds(inner.test, in_body))
    below = block
    for k in range(len(chain) - 1, -1, -1):
        outer, j, owner = chain[k]
        if isinstance(owner, _LOOPS):
            if not isinstance(jump, ast.Return):
                return None
        elif isinstance(owner, ast.If):
            body = below is owner.body
            if splits(owner):
                return chain[:k], outer, j, owner, body, tuple(known)
            known += _holds(owner.test, body)
        below = outer
    return None


def _early_exits(ctx: FileContext, scope: Scope, syncs: Mapping[int, str]) -> Iterator[Finding]:
    agreed = _agreed_names(ctx, scope)
    partial = partial_names(ctx, scope)
    body = scope.node.body
    # (block, index in block, statement) from the scope down to the current block
    chain: list[tuple[list[ast.stmt], int, ast.stmt]] = []

    def splits(st: ast.If) -> bool:
        return _rank_local(
            st, {n for line, names in agreed if line <= st.lineno for n in names}, partial
        ) and not any(  # `if not all_ranks_agree(ok):` is the fix itself: agreed there.
            isinstance(n, ast.Call) and ctx.imports.collective(n) is not None
            for n in ast.walk(st.test)
        )

    def visit(block: list[ast.stmt]) -> Iterator[Finding]:
        for i, st in enumerate(block):
            if isinstance(st, _DEFS):
                continue
            if isinstance(st, ast.If):
                exits = [(b, j) for b in (st.body, st.orelse) if (j := exit_of(b)) is not None]
                if len(exits) == 1:
                    branch, jump = exits[0]
                    in_body = branch is st.body
                    at: _Owner | None = (chain, block, i, st, in_body, ())
                    if not splits(st):
                        at = _rank_owner(chain, (block, st, in_body), jump, splits)
                    if at is not None:
                        yield from _exit_finding(ctx, scope, at, (st, in_body), jump, syncs)
            for sub in _sub_blocks(st):
                chain.append((block, i, st))
                yield from visit(sub)
                chain.pop()

    yield from visit(body)


def _exit_finding(
    ctx: FileContext,
    scope: Scope,
    at: _Owner,
    here: tuple[ast.If, bool],
    jump: ast.stmt,
    syncs: Mapping[int, str],
) -> Iterator[Finding]:
    """WB105 for `jump`, leaving by a branch of the `if` of `here` (and whether that
    branch is its body), judged from the rank-local `if` of `at` (that `if` itself, or
    one it sits in)."""
    inner, inner_body = here
    above, block, i, the_if, in_body, known = at
    hit = _first_after(ctx, scope, (block, i, above), jump, the_if, in_body, syncs, known)
    if hit is not None and _one_sequence(ctx, scope, the_if, (above, block, i), syncs):
        hit = None  # it joins the same collectives before it leaves
    if hit is None:
        return
    q, call, trace = hit
    kind = type(jump).__name__.lower()
    test = ast.unparse(inner.test)
    where = f"`{test}`" if inner_body else f"`not ({test})`"
    if inner is not the_if:
        where += f" inside `if {ast.unparse(the_if.test)}` (line {the_if.lineno})"
    f = _finding(
        ctx,
        jump,
        "WB105",
        f"rank-local `{kind}` under {where} skips {_what(q, call, trace)} at line "
        f"{call.lineno}, which the other ranks still call: they hang{_path(trace, ctx.path)}",
    )
    yield replace(f, trace=trace)


def _is_exit(st: ast.stmt) -> bool:
    return isinstance(st, ast.Return | ast.Continue | ast.Break)


def _first_after(
    ctx: FileContext,
    scope: Scope,
    where: tuple[list[ast.stmt], int, _Chain],
    jump: ast.stmt,
    the_if: ast.If,
    in_body: bool,
    syncs: Mapping[int, str],
    known: tuple[tuple[str, bool], ...] = (),
) -> _Coll | None:
    """The first collective the exiting rank skips but the others reach (`where`: the
    block holding `the_if`, its index there, the statements above; `in_body`: the exit
    is in the `if`'s body; `known`: what else the exiting rank knows)."""
    block, i, chain = where
    rest: list[ast.stmt] = list(block[i + 1 :])
    for outer, j, owner in reversed(chain):
        if isinstance(owner, _LOOPS):
            if not isinstance(jump, ast.Return):
                break  # continue/break: only the rest of this iteration is skipped
            rest += owner.body  # later iterations are skipped too
        rest += outer[j + 1 :]
    found = _collectives(ctx, rest, scope, skip=the_if, syncs=syncs)
    if found:
        # What the exiting rank knows on its way out (`if not fsdp and not is_rank0:
        # return`: fsdp is off); a collective guarded by the opposite (`if fsdp:`) is one
        # that no rank reaches on that path, so skipping it hangs nobody.
        exiting = {*_holds(the_if.test, in_body), *known}
        if exiting:
            guards: dict[int, tuple[tuple[str, bool], ...]] = {}
            _guarded(rest, (), guards)
            found = [
                c
                for c in found
                if not any((t, not v) in exiting for t, v in guards.get(id(c[1]), ()))
            ]
    if not found:
        return None
    found.sort(key=lambda qc: (qc[1].lineno, qc[1].col_offset))
    return found[0]


def _holds(test: ast.expr, value: bool) -> list[tuple[str, bool]]:
    """(condition text, truth) pairs that hold when `test` evaluates to `value`."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _holds(test.operand, not value)
    if isinstance(test, ast.BoolOp):
        if isinstance(test.op, ast.And) == value:  # `a and b` true, `a or b` false
            return [h for v in test.values for h in _holds(v, value)]
        return []
    return [(ast.unparse(test), value)]


def _guarded(
    stmts: list[ast.stmt],
    holds: tuple[tuple[str, bool], ...],
    out: dict[int, tuple[tuple[str, bool], ...]],
) -> None:
    """id(node) -> the conditions known to hold where it runs, for the nodes of `stmts`
    (an `if`'s body knows its test true, its `else` false)."""
    for st in stmts:
        if isinstance(st, _DEFS):
            continue
        for n in walk_local(st):
            out[id(n)] = holds
        if isinstance(st, ast.If):
            _guarded(st.body, (*holds, *_holds(st.test, True)), out)
            _guarded(st.orelse, (*holds, *_holds(st.test, False)), out)
        else:
            for sub in _sub_blocks(st):
                _guarded(sub, holds, out)


# -- collectives along each path ---------------------------------------------------------

# Where a path leaves the loop (`break`, `return` in a loop) or raises: the ranks that
# took it make none of the later iterations' collectives, so it never matches a path
# that goes on.
_LEAVES = "<leaves>"
_MAX_PATHS = 64
_MAX_VISITS = 2000


def _one_sequence(
    ctx: FileContext,
    scope: Scope,
    the_if: ast.If,
    where: tuple[_Chain, list[ast.stmt], int] | None = None,
    syncs: Mapping[int, str] | None = None,
) -> bool:
    """Does every path from `the_if` to the end of the iteration (or of the function,
    outside a loop) make the same sequence of collectives? Collectives match by order,
    not by line: a rank that calls `all_gather` and `continue`s past the `all_gather`
    after the `if` pairs with the ranks that reach that one, and nobody hangs. False when
    the paths are too many to compare (then the rules judge as before)."""
    if where is None:
        where = _chain_to(scope.node.body, the_if)
        if where is None:
            return False
    chain, block, i = where
    rest: list[ast.stmt] = [the_if, *block[i + 1 :]]
    in_loop = False
    for outer, j, owner in reversed(chain):
        if isinstance(owner, _LOOPS):
            in_loop = True  # `continue` ends the iteration: the paths end here
            break
        rest += outer[j + 1 :]
    paths = _Paths(ctx, scope, in_loop, syncs).of(rest)
    return paths is not None and len(paths) == 1


def _chain_to(body: list[ast.stmt], target: ast.stmt) -> tuple[_Chain, list[ast.stmt], int] | None:
    """(the compound statements from `body` down to `target`, as `(block, index,
    statement)`; the block that holds `target`; its index there)."""
    for i, st in enumerate(body):
        if st is target:
            return [], body, i
        if isinstance(st, _DEFS):
            continue
        for sub in _sub_blocks(st):
            found = _chain_to(sub, target)
            if found is not None:
                return [(body, i, st), *found[0]], found[1], found[2]
    return None


_Frames = tuple[tuple[list[ast.stmt], int], ...]  # what runs next: (block, from index)
_Seqs = frozenset[tuple[str, ...]]


class _Paths:
    """The sequences of collectives (their qualified names, in order) the paths through
    a list of statements make: every branch of every `if` is taken (the conditions are
    not compared), a loop is one step named by the collectives it makes. The paths from
    one point on are computed once (`if`s in a row join again after each one)."""

    def __init__(
        self, ctx: FileContext, scope: Scope, in_loop: bool, syncs: Mapping[int, str] | None
    ) -> None:
        self.ctx, self.scope, self.in_loop, self.syncs = ctx, scope, in_loop, syncs
        self.visits = 0
        self.memo: dict[tuple[tuple[int, int], ...], _Seqs | None] = {}

    def _names(self, nodes: list[ast.stmt]) -> list[str]:
        found = _collectives(self.ctx, nodes, self.scope, syncs=self.syncs)
        found.sort(key=lambda c: (c[1].lineno, c[1].col_offset))
        return [q for q, _, _ in found]

    def of(self, stmts: list[ast.stmt]) -> _Seqs | None:
        return self._from(((stmts, 0),))

    def _from(self, frames: _Frames) -> _Seqs | None:
        key = tuple((id(b), i) for b, i in frames)
        if key in self.memo:
            return self.memo[key]
        out = self._walk(frames)
        self.memo[key] = out
        return out

    def _walk(self, frames: _Frames) -> _Seqs | None:
        prefix: list[str] = []
        while frames:
            block, i = frames[0]
            if i >= len(block):
                frames = frames[1:]
                continue
            st = block[i]
            rest: _Frames = ((block, i + 1), *frames[1:])
            self.visits += 1
            if self.visits > _MAX_VISITS:
                return None
            branches: list[_Frames] = []
            if isinstance(st, _DEFS):
                frames = rest
                continue
            if isinstance(st, ast.If):
                prefix += self._names([ast.Expr(st.test)])
                branches = [((st.body, 0), *rest), ((st.orelse, 0), *rest)]
            elif isinstance(st, ast.Match):
                prefix += self._names([ast.Expr(st.subject)])
                branches = [((c.body, 0), *rest) for c in st.cases] + [rest]
            elif isinstance(st, ast.With | ast.AsyncWith):
                prefix += self._names([ast.Expr(it.context_expr) for it in st.items])
                frames = ((st.body, 0), *rest)
                continue
            elif isinstance(st, ast.Try | ast.TryStar):
                frames = ((st.body, 0), (st.orelse, 0), (st.finalbody, 0), *rest)
                continue
            elif isinstance(st, ast.Continue):
                return frozenset({tuple(prefix)})
            elif isinstance(st, ast.Break | ast.Raise):
                return frozenset({(*prefix, _LEAVES)})
            elif isinstance(st, ast.Return):
                prefix += self._names([st])
                end = (*prefix, _LEAVES) if self.in_loop else tuple(prefix)
                return frozenset({end})
            elif isinstance(st, _LOOPS):
                inner = self._names([st])
                if inner:
                    prefix.append(f"loop({', '.join(inner)})")
                frames = rest
                continue
            else:
                prefix += self._names([st])
                frames = rest
                continue
            out: set[tuple[str, ...]] = set()
            for b in branches:
                sub = self._from(b)
                if sub is None:
                    return None
                out |= sub
                if len(out) > _MAX_PATHS:
                    return None
            return frozenset((*prefix, *q) for q in out)
        return frozenset({tuple(prefix)})


# -- a context manager's two halves ------------------------------------------------------

_HALVES = ("__enter__", "__exit__")
_RANKS = (0, 1, 2, 3)  # enough to tell `== 0`, `!= 0`, `% 2 == 0` and `< 2` apart
_MAX_ATOMS = 6  # conditions that do not read the rank, each given both values
_MAX_REFS = 2  # rank references (`self.local_rank`, `dist.get_rank()`), by text


class _GiveUp(Exception):
    """A condition or a statement the walk through the two halves cannot judge."""


def _in_agreeing_halves(ctx: FileContext, scope: Scope) -> bool:
    """Is `scope` the `__enter__` or `__exit__` of a context manager through whose two
    halves every rank makes the same collectives (`_halves_agree`)?"""
    node = scope.node
    return (
        scope.cls is not None
        and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name in _HALVES
        and _halves_agree(ctx, scope.cls)
    )


def _halves_agree(ctx: FileContext, cls: ast.ClassDef) -> bool:
    """Does every rank make the same sequence of collectives through `cls.__enter__`
    followed by `cls.__exit__`? A staggered context manager (even ranks barrier on the
    way in, odd ones on the way out, issue 33) pairs its barriers by order across the
    `with` block, and nobody hangs. Each condition that does not read the rank takes
    both values, the same one in both methods; each rank reference (by its text) takes
    the ranks 0..3, the same in both methods. False (judge each method alone, as
    before) when a rank condition is not arithmetic on the rank and constants, or a
    loop, `with`, `try` or `match` holds a collective, or any `raise` occurs."""
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
    halves: list[tuple[list[ast.stmt], Scope]] = []
    atoms: set[str] = set()
    refs: set[str] = set()
    for name in _HALVES:
        m = methods.get(name)
        s = ctx.scope_of.get(id(m)) if m is not None else None
        if m is None or s is None:
            return False
        halves.append((m.body, s))
        for n in walk_local(m):
            if isinstance(n, ast.If):
                for a in _atoms(n.test):
                    found = {ast.unparse(x) for x in ast.walk(a) if is_rank_ref(x)}
                    refs |= found
                    if not found:
                        atoms.add(ast.unparse(a))
    if len(atoms) > _MAX_ATOMS or len(refs) > _MAX_REFS or not refs:
        return False
    names, rank_names = sorted(atoms), sorted(refs)
    try:
        for values in itertools.product((False, True), repeat=len(names)):
            env = dict(zip(names, values, strict=True))
            seqs: set[tuple[str, ...]] = set()
            for ranks in itertools.product(_RANKS, repeat=len(rank_names)):
                rank = dict(zip(rank_names, ranks, strict=True))
                seq: list[str] = []
                for body, s in halves:
                    _run(ctx, s, body, env, rank, seq)
                seqs.add(tuple(seq))
            if len(seqs) > 1:
                return False
    except _GiveUp:
        return False
    return True


def _exit_between_halves(ctx: FileContext, scope: Scope) -> list[Finding]:
    """WB105 for a `return` under a condition that does not read the rank (the same on
    every rank, say) between two halves of a rank-split pair: `if rank != 0: barrier()`
    ... `if dataset is None: return` ... `if rank == 0: barrier()` (main process
    first). Every rank takes the `return`, but only some have made their half of the
    pair by then, so the ranks leave with different collective sequences and hang.

    Judged by walking the function once per rank (0..3) for each value of the
    conditions that do not read the rank, the same on every rank (`_run`): reported
    only where the walks that take no `return` agree on every rank (a matched pair)
    and the ranks that take one same `return` do not. Silent (judged as before) where
    the walk cannot decide (a loop, `with` or `try` holding a collective, a `raise`,
    a rank condition that is not arithmetic on the rank)."""
    node = scope.node
    if isinstance(node, ast.Module):
        return []
    split = [n for n in scope.ifs if is_rank_test(n.test) and _collectives(ctx, n.body, scope)]
    if len(split) < 2:
        return []
    atoms: set[str] = set()
    refs: set[str] = set()
    for n in walk_local(node):
        if isinstance(n, ast.If):
            for a in _atoms(n.test):
                found = {ast.unparse(x) for x in ast.walk(a) if is_rank_ref(x)}
                refs |= found
                if not found:
                    atoms.add(ast.unparse(a))
    if len(atoms) > _MAX_ATOMS or len(refs) > _MAX_REFS or not refs:
        return []
    names, rank_names = sorted(atoms), sorted(refs)
    # `return` -> the `if` (not reading the rank) it is the last statement of a branch of
    owner = {
        id(b[-1]): n
        for n in walk_local(node)
        if isinstance(n, ast.If) and not is_rank_test(n.test)
        for b in (n.body, n.orelse)
        if b and isinstance(b[-1], ast.Return)
    }
    apart: dict[int, tuple[ast.Return, dict[int, tuple[str, ...]]]] = {}
    walks = len(_RANKS) ** len(rank_names)
    try:
        for values in itertools.product((False, True), repeat=len(names)):
            env = dict(zip(names, values, strict=True))
            seqs: dict[tuple[str, ...], int] = {}  # sequence -> a rank (of the first ref)
            took: list[ast.stmt] = []
            for ranks in itertools.product(_RANKS, repeat=len(rank_names)):
                seq: list[str] = []
                rank = dict(zip(rank_names, ranks, strict=True))
                _run(ctx, scope, node.body, env, rank, seq, took)
                seqs.setdefault(tuple(seq), ranks[0])
            if len(seqs) == 1:
                continue
            ret = took[0] if len(took) == walks and all(t is took[0] for t in took) else None
            if not isinstance(ret, ast.Return) or id(ret) not in owner:
                return []  # the ranks differ on another path: WB104's question
            apart.setdefault(id(ret), (ret, {r: q for q, r in seqs.items()}))
    except _GiveUp:
        return []
    out: list[Finding] = []
    for ret, by_rank in apart.values():
        (r0, s0), (r1, s1) = sorted(by_rank.items())[:2]
        made = ", ".join(f"`{_short(q)}`" for q in s0) or "nothing"
        other = ", ".join(f"`{_short(q)}`" for q in s1) or "nothing"
        out.append(
            _finding(
                ctx,
                ret,
                "WB105",
                f"`return` under `{ast.unparse(owner[id(ret)].test)}` leaves between the two "
                f"halves of a rank-split pair: rank {r0} has made {made} by then, rank {r1} "
                f"{other}, so the ranks' collectives no longer pair up and they hang",
            )
        )
    return out


def _atoms(test: ast.expr) -> list[ast.expr]:
    """The operands of `and`, `or` and `not` in a condition."""
    if isinstance(test, ast.BoolOp):
        return [a for v in test.values for a in _atoms(v)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _atoms(test.operand)
    return [test]


def _run(
    ctx: FileContext,
    scope: Scope,
    stmts: list[ast.stmt],
    env: dict[str, bool],
    rank: dict[str, int],
    out: list[str],
    took: list[ast.stmt] | None = None,
) -> bool:
    """Append to `out` the collectives one rank makes through `stmts`, its conditions
    decided by `env` and `rank` (and to `took` the `return` it leaves by); True when it
    returned."""
    for st in stmts:
        if isinstance(st, _DEFS):
            continue
        if isinstance(st, ast.If):
            out += _in_order(ctx, [ast.Expr(st.test)], scope)
            branch = st.body if _truth(st.test, env, rank) else st.orelse
            if _run(ctx, scope, branch, env, rank, out, took):
                return True
        elif isinstance(st, ast.Return):
            out += _in_order(ctx, [st], scope)
            if took is not None:
                took.append(st)
            return True
        elif isinstance(st, ast.Raise):
            raise _GiveUp
        elif isinstance(st, (*_LOOPS, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.Match)):
            if _collectives(ctx, [st], scope):
                raise _GiveUp
        else:
            out += _in_order(ctx, [st], scope)
    return False


def _in_order(ctx: FileContext, nodes: list[ast.stmt], scope: Scope) -> list[str]:
    found = _collectives(ctx, nodes, scope)
    found.sort(key=lambda c: (c[1].lineno, c[1].col_offset))
    return [q for q, _, _ in found]


def _truth(test: ast.expr, env: dict[str, bool], rank: dict[str, int]) -> bool:
    if isinstance(test, ast.BoolOp):
        values = [_truth(v, env, rank) for v in test.values]
        return all(values) if isinstance(test.op, ast.And) else any(values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return not _truth(test.operand, env, rank)
    text = ast.unparse(test)
    if text in env:
        return env[text]
    v = _value(test, rank)
    if v is None:
        raise _GiveUp
    return bool(v)


_ARITH: dict[type[ast.operator], Callable[[int, int], int | None]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Mod: lambda a, b: a % b if b else None,
    ast.FloorDiv: lambda a, b: a // b if b else None,
}
_COMPARE: dict[type[ast.cmpop], Callable[[int, int], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}


def _value(node: ast.expr, rank: dict[str, int]) -> int | None:
    """`node`'s value for the ranks `rank` (rank reference text -> rank): integer
    arithmetic and comparisons on the rank and constants; None for anything else
    (`is_main_process()`, `rank == args.src`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return int(node.value)  # bool is an int
    text = ast.unparse(node)
    if text in rank:
        return rank[text] if "rank" in text.lower() else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand, rank)
        return None if v is None else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _value(node.left, rank), _value(node.right, rank)
        return None if a is None or b is None else _ARITH[type(node.op)](a, b)
    if isinstance(node, ast.Compare):
        left = _value(node.left, rank)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _value(right_node, rank)
            if left is None or right is None or type(op) not in _COMPARE:
                return None
            if not _COMPARE[type(op)](left, right):
                return 0
            left = right
        return 1
    return None
