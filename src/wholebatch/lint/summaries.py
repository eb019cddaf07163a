"""What a function does, as its callers see it: the summaries that let the rules follow
a gathered tensor, a `zero_grad` or a backward across functions and files.

A `Facts` summary says, in terms the rules care about, what calling a function does:

- `effects`: the training calls it makes (backward, zero_grad, optimizer.step, ...),
  in order, each marked `certain` when it happens on every call;
- `collective`: a collective it calls on every call (so calling it under `if rank == 0:`
  hangs the other ranks, WB104/WB105);
- `reduces` / `gathers`: it calls a collective at all / a c10d all-gather whose output
  has no gradient (WB102 looks at an autograd.Function's forward and backward);
- `returns`: the dataflow tags of its return value (see `dataflow`), in the callee's
  terms: `a:NAME` for "derived from parameter NAME", `g:ID` for a no-gradient gather.

`Resolver` resolves a call to the function it runs, when it can tell statically: a
function of the same file (`f()`), a method through `self.`/`cls.`/`super()` (the
class, then its bases), or a function of another file of the tree being linted, found
through the imports (`from .loss import gather_features`, `import pkg.loss as L`).
Everything else is unknown, and an unknown call adds nothing: no finding rather than a
false one. Recursion is cut the same way: a function already being summarised counts
as unknown.

Nothing here imports or runs the code it reads.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

from wholebatch.lint.facts import Effect, Facts, ModuleFacts, Origins, Program
from wholebatch.lint.frameworks import loss_kwargs_attr, masks_labels, uncounted_model
from wholebatch.lint.names import (
    counts_items,
    dotted,
    is_count_expr,
    is_on_replica_group,
    is_on_subgroup,
    is_step_count_name,
    last_name,
    masking_param,
    position,
    uncast,
)
from wholebatch.lint.rules import Hop
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
)

__all__ = [
    "DEFAULT_IGNORING",
    "Resolver",
    "count_unless",
    "none_default",
    "unconditional",
    "writes_default_ignored",
    "writes_masked_labels",
]

_Def = ast.FunctionDef | ast.AsyncFunctionDef
_KINDS = frozenset({BACKWARD, ZERO, STEP, SETGRAD, UNSCALE, CLIP})
_KIND_NOTE = {
    BACKWARD: "backward",
    ZERO: "zeroes gradients",
    STEP: "steps",
    SETGRAD: "sets .grad",
    UNSCALE: "unscales",
    CLIP: "clips gradients",
}
# The tags of a mean over a micro-batch's items (`dataflow`): what dispatch and a module
# called through a name add to what a call returns.
_MEAN_TAGS = frozenset({"V", "v", "L"})
# Call chains followed at most this deep (each level is a few Python frames).
_MAX_DEPTH = 40
# Bases that add no method the linter could follow (so a miss there is a real "none").
_KNOWN_BASES = ("object", "torch.", "nn.", "typing.", "abc.", "Generic", "Protocol", "ABC")


def unconditional(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of `body` that run on every call: not inside an `if`, `try`
    handler, `match` case, or after a `return`/`raise` (loops and `with` blocks count)."""
    for st in body:
        if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        yield st
        if isinstance(st, ast.For | ast.AsyncFor | ast.While | ast.With | ast.AsyncWith):
            yield from unconditional(st.body)
        elif isinstance(st, ast.Try | ast.TryStar):
            yield from unconditional(st.body)
            yield from unconditional(st.finalbody)
        if isinstance(st, ast.Return | ast.Raise):
            return


def _note(call: ast.AST) -> str:
    text = ast.unparse(call)
    return text if len(text) <= 60 else text[:57] + "..."


class Resolver:
    """Resolves the calls of one file and summarises its functions (module docstring).

    Args:
        ctx: the file.
        program: the summaries of the other files of the tree (None: this file only).
        module: the file's dotted module name in the tree ("" when unknown).
        is_package: the file is a package's `__init__.py`.
        origins: the tag registry (default: the program's, else a new one).
    """

    def __init__(
        self,
        ctx: FileContext,
        program: Program | None = None,
        module: str = "",
        *,
        is_package: bool = False,
        origins: Origins | None = None,
    ) -> None:
        self.ctx = ctx
        self.program = program
        self.module = module
        self.is_package = is_package
        self.origins = origins or (program.origins if program is not None else Origins())
        # Set by flow_rules: the tags a gathering function's return value carries.
        self.returns_fn: Callable[[Scope], frozenset[str]] | None = None
        self.cross = False  # some call resolved to another file's function
        self._facts: dict[int, Facts] = {}
        self._busy: set[int] = set()
        self._resolved: dict[int, tuple[Facts, bool] | None] = {}
        self._forward: dict[int, frozenset[str]] = {}
        self._masks: bool | None = None
        self._masks_default: bool | None = None
        self._sites: dict[int, list[tuple[Scope, ast.Call, Facts, bool]]] = {}
        self._subclasses: dict[int, list[ast.ClassDef]] | None = None
        # Which kinds of mean the file's text can hold at all (`_may_return_mean`), read
        # once per file: per function, the substring tests cost a fifth of a run on torch.
        src = ctx.source
        self._hints = _MeanHints(
            counts=not src or any(w in src for w in _COUNT_WORDS),
            ignore_index=not src or "ignore_index" in src,
            loss=not src or "loss" in src,
            selects=not src or "mask]" in src or _CAST_MASK_RE.search(src) is not None,
            default_ignore=not src or "cross_entropy" in src or "nll_loss" in src,
        )
        ctx.resolver = self

    # -- names across files ---------------------------------------------------------------

    def absolute(self, local: str) -> str | None:
        """The absolute dotted name an imported local name refers to (None: not imported)."""
        imports = self.ctx.imports
        rel = imports.relative.get(local)
        if rel is not None:
            level, rest = rel
            parts = self.module.split(".") if self.module else []
            if not self.is_package:
                parts = parts[:-1]
            if level - 1 > len(parts):
                return None
            parts = parts[: len(parts) - (level - 1)]
            return ".".join([*parts, rest]) if parts else rest
        return imports.aliases.get(local)

    def global_name(self, name: str) -> str | None:
        """The absolute name of the class of the run that `name` (as this file writes
        it, imported) refers to; None for another name."""
        target = self._global(name)
        return target if isinstance(target, str) else None

    def _global(self, name: str) -> Facts | str | None:
        if self.program is None:
            return None
        root, _, rest = name.partition(".")
        full = self.absolute(root)
        if full is None:
            # a name a star import of the run may bind (`from llava.model import *`):
            # the first such module of the run that defines or re-exports it
            if root in self.ctx.class_by_name or root in self.ctx.module_functions:
                return None
            for star in self.ctx.imports.stars:
                hit = self.program.lookup(f"{star}.{name}")
                if hit is not None:
                    return hit
            return None
        return self.program.lookup(f"{full}.{rest}" if rest else full)

    # -- resolving a call -----------------------------------------------------------------

    def resolve(self, call: ast.Call, scope: Scope) -> tuple[Facts, bool] | None:
        """(facts, bound) of the function `call` runs, if known; `bound` when the first
        parameter (`self`/`cls`) is not among the call's arguments."""
        key = id(call)
        if key in self._resolved:
            return self._resolved[key]
        out = self._resolve(call, scope)
        self._resolved[key] = out
        return out

    def _resolve(self, call: ast.Call, scope: Scope) -> tuple[Facts, bool] | None:
        ctx = self.ctx
        func = call.func
        if isinstance(func, ast.Name):
            name = func.id
            d = ctx.module_functions.get(name)
            if d is None:
                defs = [
                    x for x in ctx.defs_by_name.get(name, ()) if ctx.scope_of[id(x)].cls is None
                ]
                d = defs[0] if len(defs) == 1 else None
            if d is not None:
                return self.facts(d), False
            if name in ctx.class_by_name:
                return None
            return self._cross(self._global(name), bound=False) or self._object_call(func)
        if not isinstance(func, ast.Attribute):
            return None
        value, attr = func.value, func.attr
        if isinstance(value, ast.Name) and value.id in ("self", "cls") and scope.cls is not None:
            found = self._method(scope.cls, attr, include_self=True)
            if found is not None:
                return self._with_overrides(scope.cls, attr, found)
            return self._object_call(func)
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "super"
            and scope.cls is not None
        ):
            return self._method(scope.cls, attr, include_self=False)
        if isinstance(value, ast.Name) and value.id in ctx.class_by_name:
            found = self._method(ctx.class_by_name[value.id], attr, include_self=True)
            if found is None:
                return None
            f = found[0]  # `Cls.m(obj, x)` passes the instance; `Cls.static(x)` does not
            return f, bool(f.params) and f.params[0] == ""
        if self.program is None:
            return None
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name) or not (
            root.id in ctx.imports.relative
            or ctx.imports.aliases.get(root.id, "").split(".")[0] in self.program.roots
        ):
            return None  # not through an import of the tree: `x.append`, `torch.cat`
        full = dotted(func)
        if full is None or self.program is None:
            return None
        return self._cross(self._global(full), bound=False)

    def _object_call(self, func: ast.expr) -> tuple[Facts, bool] | None:
        """A call of an object (`self.gc(...)` after `self.gc = GradCache(...)`): its
        class's `__call__`, in this file or another of the tree."""
        d = dotted(func)
        ctor = self.ctx.constructed.get(d) if d is not None else None
        if ctor is None:
            return None
        local = self.ctx.class_by_name.get(ctor)
        if local is not None:
            return self._method(local, "__call__", include_self=True)
        target = self._global(ctor)
        if isinstance(target, str) and self.program is not None:
            f = self.program.method(target, "__call__")
            if f is not None:
                self.cross = True
                return f, True
        return None

    def _cross(self, target: Facts | str | None, *, bound: bool) -> tuple[Facts, bool] | None:
        if isinstance(target, Facts):
            self.cross = True
            return target, bound
        return None

    def _method(
        self, cls: ast.ClassDef, name: str, *, include_self: bool
    ) -> tuple[Facts, bool] | None:
        unknown_base = False
        seen: set[int] = set()
        todo = [cls]
        first = True
        while todo:
            c = todo.pop(0)
            if id(c) in seen:
                continue
            seen.add(id(c))
            if include_self or not first:
                for st in c.body:
                    if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef) and st.name == name:
                        return self.facts(st), True
            first = False
            for base in c.bases:
                bn = dotted(base)
                if bn is None:
                    unknown_base = True
                    continue
                local = self.ctx.class_by_name.get(bn)
                if local is not None:
                    todo.append(local)
                    continue
                target = self._global(bn)
                if isinstance(target, str) and self.program is not None:
                    f = self.program.method(target, name)
                    if f is not None:
                        self.cross = True
                        return f, True
                elif not bn.startswith(_KNOWN_BASES) and bn not in ("Module", "Function"):
                    unknown_base = True
        if unknown_base:
            # A mixin the linter cannot see: fall back to the one method of that name in
            # this file, if there is exactly one (the pre-summary behaviour).
            defs = [x for x in self.ctx.defs_by_name.get(name, ()) if self.ctx.scope_of[id(x)].cls]
            if len(defs) == 1:
                return self.facts(defs[0]), True
        return None

    # -- dynamic dispatch, call sites, modules called through a name ------------------------

    def _with_overrides(
        self, cls: ast.ClassDef, name: str, found: tuple[Facts, bool]
    ) -> tuple[Facts, bool]:
        """`self.m()` in class `cls` may run the override of any subclass of the file (a
        base-class loop calling `self.get_batch_metrics()`): the mean tags its overrides
        return (`V`, `v`, `L`) are added to what the method found returns. Only those:
        its training calls and collectives stay the method's own."""
        extra: set[str] = set()
        for sub in self._subclasses_of(cls):
            for st in sub.body:
                if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef) and st.name == name:
                    extra |= self.facts(st).returns or frozenset()
        extra &= _MEAN_TAGS
        f, bound = found
        if not extra or extra <= (f.returns or frozenset()):
            return found
        return replace(f, returns=(f.returns or frozenset()) | extra), bound

    def _subclasses_of(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        """The classes of this file derived from `cls` (by the names of their bases)."""
        if self._subclasses is None:
            direct: dict[int, list[ast.ClassDef]] = {}
            for c in self.ctx.classes:
                for b in c.bases:
                    base = self.ctx.class_by_name.get(dotted(b) or "")
                    if base is not None and base is not c:
                        direct.setdefault(id(base), []).append(c)
            self._subclasses = direct
        out: list[ast.ClassDef] = []
        todo = list(self._subclasses.get(id(cls), ()))
        while todo:
            c = todo.pop()
            if c not in out and c is not cls:
                out.append(c)
                todo.extend(self._subclasses.get(id(c), ()))
        return out

    def call_sites(self, scope: Scope) -> list[tuple[Scope, ast.Call, Facts, bool]]:
        """The calls in this file that run `scope`'s function (`f(x)`, `self.m(x)`), each
        with its scope and (facts, bound) for `Facts.bind`."""
        key = id(scope)
        hit = self._sites.get(key)
        if hit is not None:
            return hit
        out: list[tuple[Scope, ast.Call, Facts, bool]] = []
        self._sites[key] = out
        name = scope.name
        if name:
            for caller in self.ctx.scopes:
                if caller is scope:
                    continue
                for call, _ in caller.local_calls:
                    if last_name(call.func) != name:
                        continue
                    # not cached: `scope` may be half summarised (a shell) just now
                    r = self._resolve(call, caller)
                    if r is not None and r[0].path == self.ctx.path and r[0].line == scope.line:
                        out.append((caller, call, r[0], r[1]))
        return out

    def own(self, call: ast.Call, scope: Scope) -> bool:
        """Is `call` one of a function of the run (of this file, or imported from the run's
        modules)? Then its own body says what it returns (its summary), not the arguments
        it is given: fairseq's `label_smoothed_nll_loss(..., ignore_index=pad)` sums."""
        if self.resolve(call, scope) is not None:
            return True
        func = call.func
        if not isinstance(func, ast.Name) or func.id in self.ctx.class_by_name:
            return False
        name = func.id
        if name in self.ctx.imports.relative:
            return True
        root = self.ctx.imports.aliases.get(name, "").split(".")[0]
        return (
            self.program is not None and root != "" and root in self.program.roots
        ) or name in self.ctx.module_functions

    def masks_labels(self) -> bool:
        """Are masked label values written in this file, or in a file imported alongside
        it (`writes_masked_labels`)? Read once."""
        if self._masks is None:
            p = self.program
            self._masks = (
                self.ctx.path in p.masked_values
                if p is not None
                else writes_masked_labels(self.ctx.source)
            )
        return self._masks

    def masks_default(self) -> bool:
        """Is -100 (the `ignore_index` of PyTorch's losses by default) written into
        labels in this file, or in a file imported alongside it
        (`writes_default_ignored`)? Read once."""
        if self._masks_default is None:
            p = self.program
            self._masks_default = (
                self.ctx.path in p.masked_default
                if p is not None
                else writes_default_ignored(self.ctx.source)
            )
        return self._masks_default

    def forward_tags(
        self, call: ast.Call, scope: Scope, *, by_target: bool = False
    ) -> frozenset[str]:
        """The mean tags (`V`, `v`) of what a module of the run returns, called through a
        name: `net(x)` after `net = Net(...)` (or `DDP(Net(...))`), `self.model(x)`, or a
        parameter (`model(x)` in `train(model, ...)`) given such an instance where this
        file calls the function. nn.Module's `__call__` runs `forward`. `by_target`: the
        call names no labels, so the forward's mean counts only where its
        sentinel-ignoring loss takes its target from a parameter the call binds (`t:`
        tags, `dataflow`) and labels are masked in the run (`masks_labels`), or where its
        mean is over items a mask selects (`loss[mask].mean()`, `S`): a count that varies
        whatever the call passes."""
        key = id(call)
        hit = self._forward.get(key)
        if hit is None:
            self._forward[key] = frozenset()  # recursion: nothing
            hit = self._forward[key] = self._forward_tags(call, scope, by_target)
        return hit

    def _forward_tags(self, call: ast.Call, scope: Scope, by_target: bool) -> frozenset[str]:
        d = dotted(call.func)
        if d is None:
            return frozenset()
        classes: set[str] = set()
        ctor = self.ctx.constructed.get(d)
        if ctor is not None:
            classes.add(ctor)
        elif isinstance(call.func, ast.Name) and not isinstance(scope.node, ast.Module):
            a = scope.node.args
            if d in {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}:
                for _, site, f, bound in self.call_sites(scope):
                    for p, v in f.bind(site, bound):
                        c = self.ctx.constructed.get(dotted(v) or "") if p == d else None
                        if c is not None:
                            classes.add(c)
        out: set[str] = set()
        for c in sorted(classes):
            fw = self.forward_of(c)
            if fw is None or not fw.returns:
                continue
            if fw.unmasked(call, True):
                out.add("v")  # it masks no labels itself: a model's plain mean
                continue
            binds = {p for p, _ in fw.bind(call, True)} if by_target else set()
            masks = by_target and (self.masks_labels() or self.ctx.writes_ignored_labels())
            out |= self.forward_means(fw, binds, by_target=by_target, masks=masks)
        return frozenset(out)

    @staticmethod
    def forward_means(
        fw: Facts,
        binds: set[str],
        *,
        by_target: bool,
        masks: bool,
        written: frozenset[int] = frozenset(),
    ) -> frozenset[str]:
        """The mean tags (`V`, `v`, and a tuple's element-wise `@` ones: `return logits,
        loss`) a call of the forward `fw` gets back. `by_target` (the call names no
        labels): only where the forward's mean is over items it selects itself (`S`), or
        where its sentinel-ignoring loss takes its target from a parameter the call binds
        (`binds`, `t:` tags) and labels are masked in the run (`masks`), or its loss
        ignoring one of the label values `written` at masked places does (`u:` tags)."""
        returns = fw.returns or frozenset()
        if by_target:
            own = any(t == "S" or t.endswith(":S") for t in returns)
            if not (
                own
                or (masks and any(t[:2] == "t:" and t[2:] in binds for t in returns))
                or any(_ignores_written(t, binds, written) for t in returns)
            ):
                return frozenset()
        return frozenset(t for t in returns if t in ("V", "v") or t[:1] == "@")

    def unsummarised_class(self, call: ast.Call) -> str | None:
        """The absolute name of the class whose instance `call` calls (`self.model(x)`
        after `self.model = model` of a parameter annotated `CFM`), where that name
        leads into the run's modules but no summary of it is known yet: the file
        imports it through its package's `__init__`, which imports the file back, so is
        linted after it (F5-TTS's `from f5_tts.model import CFM` in
        `f5_tts/model/trainer.py`). None otherwise."""
        d = dotted(call.func)
        ctor = self.ctx.constructed.get(d) if d is not None else None
        if ctor is None or ctor in self.ctx.class_by_name or self.program is None:
            return None
        root, _, rest = ctor.partition(".")
        full = self.absolute(root)
        if full is None or full.split(".")[0] not in self.program.roots:
            return None
        name = f"{full}.{rest}" if rest else full
        return name if self.program.lookup(name) is None else None

    def forward_of(self, cls: str) -> Facts | None:
        """The summary of the `forward` of the class `cls` (as this file writes its name:
        one of this file, or one imported from the run), or its bases'."""
        local = self.ctx.class_by_name.get(cls)
        if local is not None:
            found = self._method(local, "forward", include_self=True)
            return found[0] if found is not None else None
        target = self._global(cls)
        if isinstance(target, str) and self.program is not None:
            return self.program.method(target, "forward")
        return None

    def derives_from(self, cls: ast.ClassDef, names: tuple[str, ...], depth: int = 0) -> bool:
        """Is `cls` derived, through bases of this file or of the run, from a class whose
        last name is one of `names` (`LightningModule`)?"""
        for b in cls.bases:
            bn = dotted(b)
            if bn is None or depth > 6:
                continue
            if last_name(b) in names:
                return True
            local = self.ctx.class_by_name.get(bn)
            if local is not None and local is not cls:
                if self.derives_from(local, names, depth + 1):
                    return True
                continue
            target = self._global(bn)
            if (
                isinstance(target, str)
                and self.program is not None
                and self.program.derives_from(target, names)
            ):
                return True
        return False

    # -- summaries ------------------------------------------------------------------------

    def _returns_of(self, d: _Def) -> frozenset[str] | None:
        """The return tags of `d`'s summary (asked for only where needed)."""
        return self.facts(d).returns

    def facts(self, d: _Def) -> Facts:
        """The summary of a function of this file (computed once; recursion counts as unknown)."""
        key = id(d)
        done = self._facts.get(key)
        if done is not None:
            return done
        scope = self.ctx.scope_of[key]
        a = d.args
        shell = Facts(
            qual=scope.qual,
            path=self.ctx.path,
            line=d.lineno,
            # a staticmethod gets an empty first name, so that `self.m(x)` (bound: the
            # first parameter is not among the arguments) pairs `x` with its first one
            params=(("",) if _is_static(d) else ())
            + tuple(x.arg for x in (*a.posonlyargs, *a.args)),
            kwonly=tuple(x.arg for x in a.kwonlyargs),
            star=a.vararg is not None or a.kwarg is not None,
        )
        if key in self._busy or len(self._busy) >= _MAX_DEPTH:
            return shell  # recursion (or a call chain deeper than any real one): unknown
        self._busy.add(key)
        try:
            # An internal error here leaves the function unknown to its callers (WB001).
            out = self.ctx.failures.run(
                scope.qual, d.lineno, lambda: self._summarise(scope, d, shell), shell
            )
        finally:
            self._busy.discard(key)
        self._facts[key] = out
        return out

    def _summarise(self, scope: Scope, d: _Def, shell: Facts) -> Facts:
        self.link_scope(scope)
        ctx = self.ctx
        effects: list[Effect] = []
        for ev in scope.events:
            if ev.kind not in _KINDS:
                continue
            certain = ev.certain and not ev.path and not ev.jumpy
            line, col = position(ev.node)
            if ev.synthetic:
                hop = Hop(path=ctx.path, line=line, col=col, function=scope.qual, note="")
                hop = replace(hop, note=f"calls `{_callee_text(ev.node)}`")
                trace = (hop, *ev.via)
            else:
                note = f"{_KIND_NOTE[ev.kind]}: {_note(ev.node)}"
                trace = (Hop(path=ctx.path, line=line, col=col, function=scope.qual, note=note),)
            effects.append(Effect(kind=ev.kind, certain=certain, recv=ev.recv, trace=trace))
        collective: tuple[str, tuple[Hop, ...]] | None = None
        reduces = False
        gathers = bool(scope.plain_gathers)
        nograd_gathers = scope.value_gathers
        # all of its gathers (its own and its callees') over tensor/model-parallel groups
        replicated = all(is_on_replica_group(c) for c in scope.plain_gathers)
        colls = scope.collectives(ctx.imports) if _may_call_collective(ctx) else []
        if colls:
            reduces = True
            on_path = {id(n) for st in unconditional(d.body) for n in _calls_of(st)}
            for q, c in colls:
                if id(c) in on_path and not is_on_subgroup(c):
                    note = f"calls {_note(c)}"
                    hop = Hop(
                        path=ctx.path,
                        line=c.lineno,
                        col=c.col_offset + 1,
                        function=scope.qual,
                        note=note,
                    )
                    collective = (q, (hop,))
                    break
        on_path_calls: set[int] | None = None
        calls_mean = False  # it calls a function that returns a mean (`masked_mean(...)`)
        for call, _ in scope.local_calls:
            r = self.resolve(call, scope)
            if r is None:
                continue
            f = r[0]
            calls_mean = calls_mean or (f.returns is not None and _returns_mean(f.returns))
            reduces = reduces or f.reduces
            gathers = gathers or f.gathers
            nograd_gathers = nograd_gathers or f.nograd_gathers
            replicated = replicated and (f.replicated or not f.gathers)
            if collective is None and f.collective is not None:
                if on_path_calls is None:
                    on_path_calls = {id(n) for st in unconditional(d.body) for n in _calls_of(st)}
                if id(call) in on_path_calls and not is_on_subgroup(call):
                    hop = Hop(
                        path=ctx.path,
                        line=call.lineno,
                        col=call.col_offset + 1,
                        function=scope.qual,
                        note=f"calls `{_callee_text(call)}`",
                    )
                    collective = (f.collective[0], (hop, *f.collective[1]))
        tagged = gathers or nograd_gathers  # its return value may carry a gather's tags
        mean = not tagged and (
            (calls_mean and _returns_value(scope))
            or _may_return_mean(scope, self._hints)
            or _calls_ignoring_loss(scope, ctx.ignoring)
            or self._calls_default_ignoring(scope)
        )
        steps = _returns_step_count(scope)
        if not (effects or collective or reduces or tagged or mean or steps):
            return shell
        out = replace(
            shell,
            effects=tuple(effects),
            collective=collective,
            reduces=reduces,
            gathers=gathers,
            nograd_gathers=nograd_gathers,
            replicated=gathers and replicated,
            steps=steps,
            scaled=any(_by_steps(d) for d in scope.divs),
        )
        if (tagged or mean) and self.returns_fn is not None:
            self._facts[id(d)] = out  # a recursive call back into d sees no return tags
            out = replace(out, returns=self.returns_fn(scope))
            if out.returns and ("V" in out.returns or "S" in out.returns):
                out = replace(out, masks_if=masking_param(d))
        return out

    def _calls_default_ignoring(self, scope: Scope) -> bool:
        """Does the scope return a value and call `F.cross_entropy` or `F.nll_loss` (or a
        module of theirs, `FileContext.default_ignoring`) without `ignore_index=` where
        labels are masked with -100 (`masks_labels`)? Their
        default `ignore_index=-100` makes it a mean over the labels kept (`dataflow`)."""
        defaults = self.ctx.default_ignoring
        return (
            (self._hints.default_ignore or bool(defaults))
            and any(
                (last_name(c.func) in DEFAULT_IGNORING or dotted(c.func) in defaults)
                and not any(k.arg == "ignore_index" for k in c.keywords)
                for c in scope.calls
            )
            and _returns_value(scope)
            and self.masks_default()
        )

    def scope_gathers(self, scope: Scope) -> bool:
        """Does this scope gather without a gradient (a c10d all-gather, or a gather that
        returns its output and may have none here), itself or through a call?"""
        if not isinstance(scope.node, ast.Module):
            f = self.facts(scope.node)
            return f.gathers or f.nograd_gathers
        if scope.plain_gathers or scope.value_gathers:
            return True
        return any(
            (r := self.resolve(c, scope)) is not None and (r[0].gathers or r[0].nograd_gathers)
            for c, _ in scope.local_calls
        )

    # -- synthetic events -----------------------------------------------------------------

    def link(self) -> None:
        """Add to every scope the events of the functions it calls (synthetic events)."""
        for scope in self.ctx.scopes:
            self.ctx.failures.run(scope.qual, scope.line, partial(self.link_scope, scope), None)

    def link_scope(self, scope: Scope) -> None:
        """Add the synthetic events of one scope (once)."""
        if scope.linked:
            return
        scope.linked = True
        extra: list[Event] = []
        for call, where in scope.local_calls:
            r = self.resolve(call, scope)
            if r is None or not r[0].effects:
                continue
            f, bound = r
            args = dict(f.bind(call, bound))
            for eff in f.effects:
                extra.append(
                    Event(
                        kind=eff.kind,
                        node=call,
                        recv=_map_recv(eff.recv, args),
                        synthetic=True,
                        certain=eff.certain,
                        via=eff.trace,
                        **where,
                    )
                )
        if extra:
            scope.events.extend(extra)
            scope.events.sort(key=lambda e: position(e.node))

    # -- collectives through calls (WB104, WB105) -----------------------------------------

    def collective_calls(
        self, nodes: list[ast.stmt], scope: Scope
    ) -> Iterator[tuple[str, ast.Call, tuple[Hop, ...]]]:
        """Calls in `nodes` (not entering nested defs) to functions that call a collective
        on every call: (collective's qualified name, the call, the path to it)."""
        calls = {id(c) for c, _ in scope.local_calls}
        if not calls:
            return
        stack: list[ast.AST] = list(reversed(nodes))
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                continue
            if isinstance(node, ast.Call) and id(node) in calls and not is_on_subgroup(node):
                r = self.resolve(node, scope)
                if r is not None and r[0].collective is not None:
                    q, trace = r[0].collective
                    yield q, node, trace
            stack.extend(reversed(list(ast.iter_child_nodes(node))))

    def close(self) -> None:
        """Drop the links between this resolver, its file and the flow results (a cycle)."""
        self.ctx.resolver = None
        self.ctx.flow_results = None
        self.returns_fn = None
        self._facts.clear()
        self._resolved.clear()

    # -- what other files see ---------------------------------------------------------------

    def export(self) -> ModuleFacts:
        """This file's summaries for the files that import it."""
        ctx = self.ctx
        out = ModuleFacts(path=ctx.path)
        for local in (*ctx.imports.aliases, *ctx.imports.relative):
            full = self.absolute(local)
            if full is not None and full != local:
                out.names[local] = full
        for name, d in ctx.module_functions.items():
            f = self._with_deferred(d)
            if f.interesting:
                out.functions[name] = f
        out.trainers = dict(ctx.default_trainers)
        for cls in ctx.classes:
            bases: list[str] = []
            for b in cls.bases:
                bn = dotted(b)
                if bn is None:
                    continue
                if bn in ctx.class_by_name:
                    bases.append(f"{self.module}.{bn}" if self.module else bn)
                else:
                    root, _, rest = bn.partition(".")
                    full = self.absolute(root)
                    bases.append((f"{full}.{rest}" if rest else full) if full else bn)
            out.classes.setdefault(cls.name, tuple(bases))
            if loss_kwargs_attr(cls) is False:
                out.counting_off.add(cls.name)
            for st in cls.body:
                if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
                    if st.name == "forward":
                        returns = partial(self._returns_of, st)
                        out.forwards.setdefault(cls.name, uncounted_model(cls, st, returns))
                    f = self._with_deferred(st)
                    if f.interesting:
                        out.functions.setdefault(f"{cls.name}.{st.name}", f)
        return out

    def _with_deferred(self, d: _Def) -> Facts:
        """The summary of `d` for other files, with the divisions its callers may
        complete (`facts.Deferred`, kept by `deferred.defer` while the rules ran)."""
        f = self.facts(d)
        kept = self.ctx.deferred.get(self.ctx.scope_of[id(d)].qual)
        if not kept:
            return f
        if self.program is not None:
            self.program.deferred = True
        return replace(f, deferred=tuple(kept))


@dataclass(frozen=True)
class _MeanHints:
    """Which kinds of mean a file's text can hold (substring tests, once per file)."""

    counts: bool  # an item count to divide by (`names.counts_items`)
    ignore_index: bool
    loss: bool  # a `loss` field
    selects: bool  # a boolean-mask selection (`loss[mask]`)
    default_ignore: bool  # a loss that ignores -100 labels by default (`F.cross_entropy`)


# A mask cast where it indexes (`values[mask.bool()]`, `x[mask.to(torch.bool)]`).
_CAST_MASK_RE = re.compile(r"mask\.(?:bool|to|type)\([^\]\n]*\)\]")

# PyTorch's losses that default to `ignore_index=-100` (also `dataflow`).
DEFAULT_IGNORING = frozenset({"cross_entropy", "nll_loss"})


def _calls_ignoring_loss(scope: Scope, ignoring: set[str]) -> bool:
    """Does the scope call a loss module built with `ignore_index` (`self.criterion(...)`
    after `self.criterion = nn.CrossEntropyLoss(ignore_index=0)`) and return a value? It
    may return that module's mean over the labels it keeps."""
    return (
        bool(ignoring)
        and any(dotted(c.func) in ignoring for c in scope.calls)
        and _returns_value(scope)
    )


def _may_return_mean(scope: Scope, hints: _MeanHints) -> bool:
    """May the scope return a mean over a micro-batch's items, which its callers' WB301
    needs to know: a `return` that reads a `loss` field (`out["loss"]`, `outputs.loss`),
    or a scope that computes one (`ignore_index=`, a division by `mask.sum()` or
    `num_tokens`)? (The dataflow then says what the return value holds.) `hints`, from
    the file's text, rule out most functions at once."""
    if (
        hints.counts
        and scope.divs
        and (
            any(
                isinstance(d, ast.BinOp)
                and (counts_items(d.right) or count_unless(d.right, scope) is not None)
                for d in scope.divs
            )
            or any(
                isinstance(st.node, ast.Assign) and is_count_expr(st.node.value)
                for st in scope.stmts
            )
        )
    ):
        return True
    if (
        hints.ignore_index
        and any(kw.arg == "ignore_index" for c in scope.calls for kw in c.keywords)
        and _returns_value(scope)
    ):
        return True
    if hints.selects and _returns_value(scope) and _selects_by_mask(scope):
        return True
    if not hints.loss or not _returns_value(scope):
        return False
    returned = {
        x.id
        for st in scope.stmts
        if isinstance(st.node, ast.Return) and st.node.value is not None
        for x in ast.walk(st.node.value)
        if isinstance(x, ast.Name)
    }
    for st in scope.stmts:
        n = st.node
        # a `loss` field read anywhere (`loss = out["loss"]`, then `return loss`), or a
        # first element returned (`return outputs[0]`, or `loss = outputs[0]` then
        # `return loss`: a model's loss, given labels)
        first = isinstance(n, ast.Return) or (
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in returned for t in n.targets)
        )
        for x in st.walk():
            if (isinstance(x, ast.Attribute) and x.attr == "loss") or (
                isinstance(x, ast.Subscript)
                and isinstance(x.slice, ast.Constant)
                and (x.slice.value == "loss" or (x.slice.value == 0 and first))
            ):
                return True
    return False


def _by_steps(d: ast.BinOp | ast.AugAssign) -> bool:
    """Is `d` a division by a name of a number of accumulation steps (`x / args.accum`,
    `x /= grad_accum_steps`)?"""
    right = d.right if isinstance(d, ast.BinOp) else d.value
    return isinstance(d.op, ast.Div) and is_step_count_name(last_name(right) or "")


def _selects_by_mask(scope: Scope) -> bool:
    """Does the scope select items by a mask (`loss[rand_span_mask]`), whose `.mean()`
    is a mean over a varying count (`M`, `dataflow`)?"""
    return any(
        isinstance(x, ast.Subscript) and _mask_slice(x.slice)
        for st in scope.stmts
        for x in st.walk()
    )


def _mask_slice(s: ast.expr) -> bool:
    """A mask's name as an index (`loss[loss_mask]`), cast or not (`mask.bool()`)."""
    s = uncast(s)
    return isinstance(s, ast.Name | ast.Attribute) and "mask" in last_name(s).lower()


def writes_masked_labels(text: str) -> bool:
    """Does this source write masked label values (`masked_fill(~m, -100)`, a collator
    that pads labels, `IGNORE_INDEX = -100`), not only name one in a loss's
    `ignore_index=` (a language model's own file, which pre-training on packed blocks
    never uses)? `frameworks.masks_labels` over the text without its `ignore_index=`s."""
    if "ignore_index" in text:
        text = _IGNORE_KW_RE.sub("", text)
    return masks_labels(text)


_IGNORE_KW_RE = re.compile(r"\bignore_index\s*=\s*[-\w.]*")

# -100 written, not read: assigned (`IGNORE_INDEX = -100`, `labels[pad] = -100`,
# `label_pad_token_id=-100`) or filled in (`masked_fill(pad, -100)`, `full_like(x, -100)`);
# not compared (`labels.eq(-100)`, `!= -100`). A padding collator writes it too, and so
# does a list of them (`labels = [-100] * len(prompt) + target`).
_WRITES_100_RE = re.compile(
    r"(?<![=!<>])=\s*-100(?![\d.])|\b\w*(?:fill_?|full(?:_like)?)\([^\n]*?,\s*-100(?![\d.])"
    r"|\blabel_pad_token_id\b|DataCollatorFor(?:Seq2Seq|LanguageModeling|CompletionOnlyLM)"
    # a list of -100s built to pad or mask labels (`[-100] * n + y`, `ids + [-100]`)
    r"|\[\s*-100\s*(?:\]\s*[*+]|for\b)|\+\s*\[\s*-100\s*\]"
)


def writes_default_ignored(text: str) -> bool:
    """Does this source write -100 into labels (`_WRITES_100_RE`), the value PyTorch's
    `cross_entropy`/`nll_loss` ignore when given no `ignore_index`? A mask read from
    -100 labels (`labels.eq(-100)`) shows none written."""
    return ("-100" in text or "DataCollatorFor" in text or "label_pad" in text) and (
        _WRITES_100_RE.search(text) is not None
    )


def count_unless(node: ast.expr, scope: Scope) -> str | None:
    """The parameter P when `node` counts a micro-batch's items unless the caller sets P:
    `mask.sum(axis=axis)` (or `dim=`) in a function whose `axis` defaults to None, such as
    `masked_mean(values, mask, axis=None)`, a token mean where it is called without one
    and a per-row mean with one; also with a guard against zero added or clamped on
    (`mask.sum(dim=dim) + eps`, `.clamp(min=1)`: EasyR1's `masked_mean`). None otherwise."""
    node = _unguarded(node)
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sum"
        and not node.args
        and len(node.keywords) == 1
        and node.keywords[0].arg in ("dim", "axis")
        and isinstance(node.keywords[0].value, ast.Name)
    ):
        return None
    name = node.keywords[0].value.id
    return name if none_default(scope, name) else None


def _unguarded(node: ast.expr) -> ast.expr:
    """`x` of `x + eps`, `eps + x` (a constant or a plain name added), `x.clamp(min=c)`,
    `x.clamp_min(c)`: a count kept off zero is still the count."""
    while True:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            small = (ast.Constant, ast.Name, ast.Attribute)
            if isinstance(node.right, small) and isinstance(node.left, ast.Call):
                node = node.left
                continue
            if isinstance(node.left, small) and isinstance(node.right, ast.Call):
                node = node.right
                continue
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("clamp", "clamp_min", "clip")
        ):
            node = node.func.value
            continue
        return node


def none_default(scope: Scope, name: str) -> bool:
    """Is `name` a parameter of the scope's function that defaults to None?"""
    default = param_default(scope, name)
    return isinstance(default, ast.Constant) and default.value is None


def param_default(scope: Scope, name: str) -> ast.expr | None:
    """The default value of parameter `name` of the scope's function, if it has one."""
    if isinstance(scope.node, ast.Module):
        return None
    a = scope.node.args
    positional = (*a.posonlyargs, *a.args)
    pairs = [
        *zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True),
        *((k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None),
    ]
    return next((default for arg, default in pairs if arg.arg == name), None)


# Text without any of these has no item count to divide by (`names.counts_items`).
_COUNT_WORDS = (".sum(", "count_nonzero", "tok", "item", "valid")


def _ignores_written(tag: str, binds: set[str], written: frozenset[int]) -> bool:
    """Is `tag` a `u:VALUE:NAME` (`dataflow.Flow._ignored_targets`) of a VALUE in
    `written` and a NAME in `binds`?"""
    if tag[:2] != "u:" or not written:
        return False
    value, _, name = tag[2:].partition(":")
    return name in binds and value.lstrip("-").isdigit() and int(value) in written


def _returns_mean(tags: frozenset[str]) -> bool:
    """Do a function's return tags hold a mean over a micro-batch's items (perhaps one
    that depends on a `dim` argument, `W:`)?"""
    return any(t in _MEAN_TAGS or t.startswith("W:") for t in tags)


def _returns_value(scope: Scope) -> bool:
    return any(isinstance(st.node, ast.Return) and st.node.value is not None for st in scope.stmts)


def _returns_step_count(scope: Scope) -> bool:
    """Does the scope return a number of accumulation steps (`return self.accum_steps`)?"""
    for st in scope.stmts:
        n = st.node
        if (
            isinstance(n, ast.Return)
            and isinstance(n.value, ast.Name | ast.Attribute)
            and is_step_count_name(last_name(n.value))
        ):
            return True
    return False


def _is_static(d: _Def) -> bool:
    return any(isinstance(x, ast.Name) and x.id == "staticmethod" for x in d.decorator_list)


def _may_call_collective(ctx: FileContext) -> bool:
    hit = ctx.may_collective
    if hit is None:
        src = ctx.source
        hit = ctx.may_collective = not src or "dist" in src or "wholebatch" in src
    return hit


def _calls_of(st: ast.stmt) -> Iterator[ast.Call]:
    """Calls of a statement itself (a compound statement's header only)."""
    if isinstance(st, ast.For | ast.AsyncFor):
        parts: list[ast.AST] = [st.target, st.iter]
    elif isinstance(st, ast.While):
        parts = [st.test]
    elif isinstance(st, ast.With | ast.AsyncWith):
        parts = [i.context_expr for i in st.items]
    elif isinstance(st, ast.Try | ast.TryStar):
        parts = []
    elif isinstance(st, ast.If):
        parts = [st.test]
    elif isinstance(st, ast.Match):
        parts = [st.subject]
    else:
        parts = [st]
    for p in parts:
        for n in ast.walk(p):
            if isinstance(n, ast.Call):
                yield n


def _callee_text(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        d = dotted(node.func)
        if d is not None:
            return f"{d}()"
        return f"{last_name(node.func)}()"
    return _note(node)


def _map_recv(recv: str, args: dict[str, ast.expr]) -> str:
    """The callee's `opt` (a parameter) as the caller's argument text: `opt_g`."""
    if not recv:
        return recv
    root, _, rest = recv.partition(".")
    if root in args:
        arg = dotted(args[root])
        if arg is None:
            return ""
        return f"{arg}.{rest}" if rest else arg
    return recv
