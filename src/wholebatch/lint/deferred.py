"""WB301 evidence that waits for a later caller (issue 33): a function divides by the
accumulation steps what a call of one of its parameters returns, and only a caller shows
whose `forward` that call runs.

Files are linted in import order, so a training loop's module (`engine.py`:
`c_loss, aux = model(x, y)`, `loss /= accum_iter`) is read before the script that builds
`model = DDP(Net(...))` and calls `train_one_epoch(model, ...)`. The loop's summary keeps
the division as a `facts.Deferred` (`defer`); the script's call, given an instance whose
class's `forward` returns a mean over a data-dependent item count (`V`), completes the
finding, reported at the division in the loop's file (`deferred_findings`). Either order
of the files on the command line gives the same findings: the import order decides.
"""

from __future__ import annotations

import ast
from pathlib import Path

from wholebatch.lint.dataflow import (
    Flow,
    _element as tuple_element,
    _given_labels as given_labels,
    _given_mask as given_mask,
)
from wholebatch.lint.facts import Deferred, Facts, Program
from wholebatch.lint.names import dotted, last_name, position
from wholebatch.lint.rules import RULES, Finding, Hop
from wholebatch.lint.scope import FileContext, Scope
from wholebatch.lint.summaries import Resolver

__all__ = ["defer", "deferred_findings", "pending_findings"]


def defer(
    ctx: FileContext, flow: Flow, scope: Scope, loss: ast.expr, at: ast.AST, divided: str
) -> None:
    """Keep, for `scope`'s callers, the division (`at`) of `loss` by the steps where
    `loss` holds what a call of a parameter returned (`c:` tags, `dataflow`).

    Args:
        ctx: the file.
        flow: the scope's flow, at the division.
        scope: the function that divides.
        loss: the divided value.
        at: the division (or the backward of a framework that divides).
        divided: how the message says it is divided (`divided by `accum_iter``).
    """
    if isinstance(scope.node, ast.Module) or ctx.resolver is None:
        return
    elements: dict[str, set[int] | None] = {}  # call tag -> elements held (None: whole)
    for t in flow.tags(loss):
        if t[:2] != "c:":
            continue
        call_tag, _, i = t.partition("#")
        held = elements.setdefault(call_tag, set())
        if not i:
            elements[call_tag] = None
        elif held is not None:
            held.add(int(i))
    if not elements:
        return
    resolver = ctx.resolver
    masks = resolver.masks_labels() or ctx.writes_ignored_labels()
    line, col = position(at)
    for call_tag, held in sorted(elements.items(), key=lambda kv: kv[0]):
        call = flow.param_calls.get(call_tag)
        if call is None:
            continue
        param = call.func.id if isinstance(call.func, ast.Name) else ""
        cls = "" if param in flow.params else resolver.unsummarised_class(call) or ""
        if not (param in flow.params or cls):
            continue
        d = Deferred(
            param=param if not cls else _text(call.func),
            elements=tuple(sorted(held)) if held is not None else (),
            nargs=len(call.args),
            keywords=tuple(k.arg for k in call.keywords if k.arg is not None),
            labelled=given_labels(call) or given_mask(call),
            masks=masks,
            line=line,
            col=col,
            loss=_text(loss),
            divided=divided,
            cls=cls,
            path=ctx.path if cls else "",
            function=scope.qual if cls else "",
        )
        program = resolver.program
        kept = program.pending if cls and program is not None else None
        if kept is None:
            kept = ctx.deferred.setdefault(scope.qual, [])
        if d not in kept and not (cls and program is None):
            kept.append(d)


def deferred_findings(ctx: FileContext) -> list[Finding]:
    """WB301 at the divisions other files' functions keep (`facts.Deferred`), where a call
    of this file gives the called parameter an instance whose class's `forward` returns a
    mean over a data-dependent item count, in the elements the division holds."""
    resolver = ctx.resolver
    if resolver is None or resolver.program is None or not resolver.program.deferred:
        return []
    out: list[Finding] = []
    for scope in ctx.scopes:
        for call, _ in scope.local_calls:
            r = resolver.resolve(call, scope)
            if r is None or not r[0].deferred or r[0].path == ctx.path:
                continue
            f, bound = r
            pairs = list(f.bind(call, bound))
            for d in f.deferred:
                for p, v in pairs:
                    if p != d.param:
                        continue
                    hit = _completed(ctx, scope, call, f, d, v)
                    if hit is not None:
                        out.append(hit)
                        break
    return out


def _completed(
    ctx: FileContext, scope: Scope, call: ast.Call, f: Facts, d: Deferred, value: ast.expr
) -> Finding | None:
    """The finding `d` waits for, where `value` (the argument of `d.param` in `call`) is an
    instance of a class whose forward returns a mean in the elements `d` divides."""
    resolver = ctx.resolver
    assert resolver is not None
    cls = _instance_class(ctx, value)
    if cls is None:
        return None
    fw = resolver.forward_of(cls)
    if fw is None or not fw.returns:
        return None
    binds = {*fw.params[1 : 1 + d.nargs], *d.keywords}
    masks = d.masks or resolver.masks_labels() or ctx.writes_ignored_labels()
    # the label values this file, or a file of its own code imported alongside it (its
    # dataset module), writes at masked places: a forward's `ignore_index=0` ignores them
    # (`labels[~label_mask] = 0`, `facts.Program.label_values`)
    written = ctx.label_writes() | ctx.run_label_writes
    tags = resolver.forward_means(fw, binds, by_target=not d.labelled, masks=masks, written=written)
    held = [tuple_element(set(tags), i) for i in d.elements] if d.elements else [set(tags)]
    if not any("V" in t for t in held):
        return None
    line, col = position(call)
    where = f"{Path(ctx.path).name}:{line}"
    message = (
        f"`{d.loss}` is a mean over a data-dependent number of items (tokens, "
        f"ignore_index) {d.divided}: micro-batches with fewer items weigh more, so the "
        f"sum is not the whole-batch mean; `{d.param}` is a `{_class_name(cls)}` "
        f"(its forward returns the mean), passed in at {where}"
    )
    hop = Hop(
        path=ctx.path,
        line=line,
        col=col,
        function=scope.qual or "<module>",
        note=f"passes a `{_class_name(cls)}` as `{d.param}`",
    )
    return Finding(
        path=f.path,
        line=d.line,
        col=d.col,
        code="WB301",
        message=message,
        fix=RULES["WB301"].fix,
        trace=(hop,),
    )


def pending_findings(program: Program, waiting: list[Deferred]) -> list[Finding]:
    """WB301 at the divisions that waited on a class's summary (`facts.Deferred.cls`,
    `waiting`), once every file of the run is read: where that class's `forward` returns
    a mean over a data-dependent item count in the elements divided."""
    out: list[Finding] = []
    for d in waiting:
        target = program.lookup(program.canonical(d.cls))
        fw = program.method(target, "forward") if isinstance(target, str) else None
        if fw is None or not fw.returns:
            continue
        binds = {*fw.params[1 : 1 + d.nargs], *d.keywords}
        tags = Resolver.forward_means(fw, binds, by_target=not d.labelled, masks=d.masks)
        held = [tuple_element(set(tags), i) for i in d.elements] if d.elements else [set(tags)]
        if not any("V" in t for t in held):
            continue
        name = _class_name(d.cls)
        out.append(
            Finding(
                path=d.path,
                line=d.line,
                col=d.col,
                code="WB301",
                message=f"`{d.loss}` is a mean over a data-dependent number of items "
                f"(tokens, ignore_index) {d.divided}: micro-batches with fewer items weigh "
                f"more, so the sum is not the whole-batch mean; `{d.param}` is a "
                f"`{name}`, whose forward returns the mean ({Path(fw.path).name}:{fw.line})",
                fix=RULES["WB301"].fix,
                trace=(
                    Hop(
                        path=fw.path,
                        line=fw.line,
                        col=1,
                        function=fw.qual,
                        note="returns a mean over a data-dependent item count",
                    ),
                ),
            )
        )
    return out


def _instance_class(ctx: FileContext, value: ast.expr) -> str | None:
    """The class (as written) of the instance `value` names: one assigned to it in this
    file (`model = DDP(Net(...))`, `scope.FileContext.constructed`), or built in place
    (`train(Net(...), ...)`)."""
    if isinstance(value, ast.Call) and last_name(value.func)[:1].isupper():
        return dotted(value.func)
    d = dotted(value)
    return ctx.constructed.get(d) if d is not None else None


def _class_name(cls: str) -> str:
    """`Net` of `model.Net`."""
    return cls.rpartition(".")[2]


def _text(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."
