"""One pass over a file that the rules share: its scopes (module and every function),
the simple statements of each in source order with their enclosing loops and
conditions, and the training-loop events (backward, zero_grad, step, unscale_, clip).

A scope never includes the bodies of functions, lambdas or classes nested in it;
those are scopes of their own. Calls to functions the linter can resolve (same file,
or another file of the tree being linted: see `summaries.Resolver`) add "synthetic"
events for what those functions do, so a loop that calls `self.optimizer_step()` is
known to step (and, if that helper zeroes, to zero).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from wholebatch.lint.frameworks import Evidence
from wholebatch.lint.guard import Failures
from wholebatch.lint.names import (
    DIST_GATHERS,
    Imports,
    dotted,
    is_optimizer_name,
    is_scaler_name,
    is_sum_reduction,
    last_name,
    position,
    walk_local,
)
from wholebatch.lint.rules import RULES, Finding, Hop

if TYPE_CHECKING:
    from wholebatch.lint.facts import Deferred
    from wholebatch.lint.flow_rules import Results
    from wholebatch.lint.summaries import Resolver

__all__ = [
    "BACKWARD",
    "CLIP",
    "SETGRAD",
    "STEP",
    "UNSCALE",
    "ZERO",
    "Event",
    "FileContext",
    "Scope",
    "Stmt",
    "exclusive",
    "finding",
    "label_writes",
]

BACKWARD = "backward"
ZERO = "zero"
SETGRAD = "setgrad"
STEP = "step"
UNSCALE = "unscale"
CLIP = "clip"

_CLIP_FUNCS = frozenset(
    {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}
)
_ZERO_FUNCS = frozenset(
    {"clear_grad", "clear_grads", "zero_grads", "zero_gradients", "reset_grad", "reset_grads"}
)
# Receivers whose `.backward(loss)` takes the loss as an argument (accelerate, fabric, deepspeed).
_BACKWARD_WRAPPERS = frozenset({"accelerator", "fabric", "engine", "model_engine", "trainer"})
_NOT_OPTIMIZER = frozenset({"Accumulator", "CachedStep"})
# Gathers that return their output and carry a gradient (with gradients on): Horovod's,
# torch.distributed.nn's, wholebatch's.
_DIFFERENTIABLE_GATHERS = frozenset(
    {
        "horovod.torch.allgather",
        "horovod.torch.mpi_ops.allgather",
        "torch.distributed.nn.all_gather",
        "torch.distributed.nn.functional.all_gather",
        "wholebatch.all_gather",
        "wholebatch.comm.all_gather",
    }
)
# Framework gathers that never carry one, by method and owner: accelerate's `gather`,
# Lightning's `all_gather` (unless `sync_grads=True`).
_FRAMEWORK_GATHERS = {"gather": ("accelerator",), "all_gather": ("self", "fabric")}
_VALUE_GATHER_NAMES = frozenset({"allgather", "all_gather", "gather"})
# Gathers that return the list torch.distributed.all_gather fills: no gradient, ever
# (`frameworks.FACTS["mmengine-dist-all-gather"]`).
_PLAIN_VALUE_GATHERS = frozenset({"mmengine.dist.all_gather", "mmengine.dist.dist.all_gather"})
_Def = ast.FunctionDef | ast.AsyncFunctionDef
_T = TypeVar("_T")
_Loop = ast.For | ast.AsyncFor | ast.While


@dataclass(frozen=True, kw_only=True)
class Event:
    """A training-loop call at one place.

    Attributes:
        kind: one of BACKWARD, ZERO, SETGRAD, STEP, UNSCALE, CLIP.
        node: the call (or the `.grad` store / `del` for ZERO and SETGRAD).
        recv: the optimizer a STEP/ZERO/UNSCALE acts on, as source text ("" if unknown).
        losses: for BACKWARD, the expressions that may be the loss.
        loops: enclosing loops inside the scope, outermost first.
        conds: enclosing `if`/`try`/`match` statements inside the innermost loop.
        path: (id of if/try/match statement, branch number) from the scope down; two
            events whose paths fork at the same statement never run in the same pass.
        jumpy: inside a branch that ends in return/continue/break/raise.
        synthetic: stands for a call to a resolved function that does `kind`.
        scaler: a STEP done through an AMP scaler (`scaler.step(opt)`).
        bare: a STEP with no arguments (so no closure that might run backward).
        certain: for a synthetic event, the function does `kind` on every call (not
            under a condition of its own); real events are always certain.
        via: for a synthetic event, the path from the called function to the call
            that does `kind` (one `Hop` per function).
    """

    kind: str
    node: ast.AST
    recv: str
    losses: tuple[ast.expr, ...] = ()
    loops: tuple[ast.stmt, ...] = ()
    conds: tuple[ast.stmt, ...] = ()
    path: tuple[tuple[int, int], ...] = ()
    jumpy: bool = False
    synthetic: bool = False
    scaler: bool = False
    bare: bool = True
    certain: bool = True
    via: tuple[Hop, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Stmt:
    """A simple statement (or a `for` header) with where it sits.

    Attributes:
        node: the statement.
        loops: enclosing loops inside the scope, outermost first.
        conds: enclosing conditionals inside the innermost loop.
        nograd: gradient recording is off here (`torch.no_grad()` and friends).
        path: (id of if/try/match statement, branch number) from the scope down.
    """

    node: ast.stmt
    loops: tuple[ast.stmt, ...]
    conds: tuple[ast.stmt, ...]
    nograd: bool
    path: tuple[tuple[int, int], ...] = ()

    def walk(self) -> Iterator[ast.AST]:
        """The nodes of this statement itself (for a `for`: its target and iterable only)."""
        if isinstance(self.node, ast.For | ast.AsyncFor):
            yield from walk_local(self.node.target)
            yield from walk_local(self.node.iter)
        else:
            yield from walk_local(self.node)


def exclusive(a: Event, b: Event) -> bool:
    """Are `a` and `b` in different branches of one `if`/`try`/`match` (never both run)?"""
    for (sa, ba), (sb, bb) in zip(a.path, b.path, strict=False):
        if sa != sb:
            return False
        if ba != bb:
            return True
    return False


@dataclass(frozen=True, kw_only=True)
class _Where:
    """Where the collector is: enclosing loops, conditionals, branch path, grad mode."""

    loops: tuple[ast.stmt, ...] = ()
    conds: tuple[ast.stmt, ...] = ()
    path: tuple[tuple[int, int], ...] = ()
    jumpy: bool = False
    nograd: bool = False

    def enter_loop(self, loop: ast.stmt) -> _Where:
        return replace(self, loops=(*self.loops, loop), conds=())

    def enter_branch(self, st: ast.stmt, k: int, body: list[ast.stmt]) -> _Where:
        return replace(
            self,
            conds=(*self.conds, st),
            path=(*self.path, (id(st), k)),
            jumpy=self.jumpy or _ends_in_jump(body),
        )

    def stmt(self, node: ast.stmt) -> Stmt:
        return Stmt(
            node=node, loops=self.loops, conds=self.conds, nograd=self.nograd, path=self.path
        )

    def event_fields(self) -> dict[str, Any]:
        return {"loops": self.loops, "conds": self.conds, "path": self.path, "jumpy": self.jumpy}


@dataclass
class Scope:
    """The module body or one function body, with what the collector saw in it.

    Attributes:
        node: the module or function.
        cls: the class a method belongs to.
        nograd: the whole body runs with gradient recording off.
        stmts: simple statements and `for` headers, in source order.
        events: training-loop events, in source order.
        calls: every call, in source order per statement.
        ifs: the `if` statements.
        withs: the `with` statements.
        has_exit: a `return`, `continue` or `break` occurs.
        has_grad: a `.grad` attribute occurs.
        divs: the divisions (`a / b` and `a /= b`).
        has_gather: a call named like a c10d all-gather occurs.
        mods: the `a % b` expressions.
        local_calls: calls that may resolve to a function the linter knows (`f()`,
            `self.m()`, `mod.f()`, `super().m()`), each with its place (Event fields).
        plain_gathers: the c10d all-gather calls (no gradient on their output).
        value_gathers: a gather that returns its output may run without a gradient here
            (`FileContext.value_gather`).
        gather_calls: calls named like such a gather, each with whether it runs under
            no_grad.
    """

    node: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef
    cls: ast.ClassDef | None
    nograd: bool
    stmts: list[Stmt] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    calls: list[ast.Call] = field(default_factory=list)
    ifs: list[ast.If] = field(default_factory=list)
    withs: list[ast.With | ast.AsyncWith] = field(default_factory=list)
    has_exit: bool = False
    has_grad: bool = False
    divs: list[ast.BinOp | ast.AugAssign] = field(default_factory=list)
    has_gather: bool = False
    mods: list[ast.BinOp] = field(default_factory=list)
    local_calls: list[tuple[ast.Call, dict[str, Any]]] = field(default_factory=list)
    plain_gathers: list[ast.Call] = field(default_factory=list)
    value_gathers: bool = False
    gather_calls: list[tuple[ast.Call, bool]] = field(default_factory=list)
    raw: list[tuple[ast.AST, dict[str, Any]]] = field(default_factory=list)
    linked: bool = False
    _collectives: list[tuple[str, ast.Call]] | None = None

    @property
    def name(self) -> str:
        """The function's name ("" for the module)."""
        return "" if isinstance(self.node, ast.Module) else self.node.name

    @property
    def qual(self) -> str:
        """`Class.method`, `function`, or "" for the module."""
        return f"{self.cls.name}.{self.name}" if self.cls is not None else self.name

    @property
    def line(self) -> int:
        """The line of the function's `def` (1 for the module)."""
        return 1 if isinstance(self.node, ast.Module) else self.node.lineno

    def last_assignment(self, name: str, line: int) -> ast.Assign | None:
        """The scope's last plain assignment of `name` (`name = value`) on a line before
        `line`, if any."""
        found = self.assignments(name, line)
        return found[-1] if found else None

    def assignments(self, name: str, line: int) -> list[ast.Assign]:
        """The scope's plain assignments of `name` (`name = value`) on lines before
        `line`, in source order."""
        return [
            n
            for n in (st.node for st in self.stmts)
            if isinstance(n, ast.Assign)
            and n.lineno < line
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        ]

    def collectives(self, imports: Imports) -> list[tuple[str, ast.Call]]:
        """(qualified name, call) of every collective called in this scope."""
        if self._collectives is None:
            found = [(imports.collective(c), c) for c in self.calls]
            self._collectives = [(q, c) for q, c in found if q is not None]
        return self._collectives


def _text(node: ast.AST) -> str:
    d = dotted(node) if isinstance(node, ast.expr) else None
    return d if d is not None else ast.unparse(node)


def _ends_in_jump(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return | ast.Continue | ast.Break | ast.Raise)


# Wrappers whose call runs the wrapped module's forward.
_WRAPPERS = frozenset(
    {"DistributedDataParallel", "DDP", "DataParallel", "FullyShardedDataParallel", "FSDP"}
)


# An integer written into labels at chosen places: `labels[~mask] = 0`, `tgt_labels[:n] =
# -1`, `labels.masked_fill_(pad, 0)`, `labels = labels.masked_fill(m, 0)`.
_LABEL_WRITE_RE = re.compile(
    r"\b\w*labels?\w*(?:\[[^\]\n]*\]\s*=(?!=)|\.masked_fill_?\([^\n]*?,)\s*(-?\d+)\b(?![.\w])"
)


def label_writes(source: str) -> frozenset[int]:
    """The integer literals `source` writes into labels at masked places
    (`labels[~label_mask] = 0`, `labels.masked_fill_(pad, 0)`)."""
    if "label" not in source:
        return frozenset()
    return frozenset(int(v) for v in _LABEL_WRITE_RE.findall(source))


_IGNORE_LITERAL_RE = re.compile(r"\bignore_index\s*=\s*(-?\d+)\b(?![.\w])")


class FileContext:
    """Everything the rules need to know about one parsed file.

    Built in one walk over the tree: scopes, statements, calls, imports and the names
    assigned optimizers or scalers; calls are classified after the walk, once every
    import and assignment is known.
    """

    def __init__(
        self, tree: ast.Module, path: str, source: str = "", failures: Failures | None = None
    ) -> None:
        # Internal errors while one function is analysed (`guard`): that function is
        # left out, the rest of the file is still checked.
        self.failures = failures if failures is not None else Failures()
        self.tree = tree
        self.path = path
        self.source = source
        self.imports = Imports()
        self.optimizers: set[str] = set()
        self.scalers: set[str] = set()
        self.not_optimizers: set[str] = set()
        self.classes: list[ast.ClassDef] = []
        self.functions: dict[str, _Def] = {}
        self.defs_by_name: dict[str, list[_Def]] = {}
        self.module_functions: dict[str, _Def] = {}
        self.class_by_name: dict[str, ast.ClassDef] = {}
        self.scope_of: dict[int, Scope] = {}
        self.scopes: list[Scope] = []
        self.resolver: Resolver | None = None  # set by summaries.Resolver
        self.flow_results: Results | None = None  # set by flow_rules.attach
        # What the run's text shows (the whole run's, set by `engine`; else this file's).
        self._evidence: Evidence | None = None
        self.may_collective: bool | None = None  # the text names dist/wholebatch (cached)
        # The rules to run here (None: all): the enabled ones whose gate is open, set by
        # `engine` from each rule's words (`rules.Rule.words`).
        self.codes: frozenset[str] | None = None
        self._assign_calls: list[tuple[ast.Call, list[ast.expr]]] = []
        # names (`self.gc`, `gc`) assigned an instance of a class -> the class as written
        # (through a DDP/FSDP wrapper: `model = DDP(Net(...))` -> `Net`)
        self.constructed: dict[str, str] = {}
        # names assigned a loss module built with `ignore_index` (`self.lm_loss =
        # nn.CrossEntropyLoss(ignore_index=-100)`): calling one gives a token mean (WB301)
        self.ignoring: set[str] = set()
        # their `ignore_index=` values as written (`0`, `-100`, `pad_id`)
        self.ignore_values: dict[str, ast.expr] = {}
        # names assigned such a module built without `ignore_index` (`train_fct =
        # CrossEntropyLoss()`, also at module level): PyTorch's default ignores -100
        self.default_ignoring: set[str] = set()
        self._label_writes: frozenset[int] | None = None
        # the label values written at masked places in files imported alongside this one
        # (`facts.Program.label_values`, set by `engine`): the model a script passes in
        # ignores the 0s its dataset module writes where its `ignore_index=0` (`deferred`)
        self.run_label_writes: frozenset[int] = frozenset()
        # WB102 (dist_rules): the `Layer.apply(...)` uses, and the findings left open
        self.applies: list[tuple[str, bool]] | None = None
        # `allgather = AllGather.apply`: name (as written, `self.x` too) -> the class
        self.apply_aliases: dict[str, str] = {}
        self.layers: dict[int, str] = {}
        # WB301 (deferred): function qual -> its divisions of a parameter's call, which
        # a caller in another file may complete (`facts.Deferred`)
        self.deferred: dict[str, list[Deferred]] = {}
        # WB301 (flow_rules): this file's direct subclasses of the HF Trainer that keep
        # its loss and step, class name -> its line, for the files that build them
        self.default_trainers: dict[str, int] = {}
        # what the frameworks' readers (`frameworks.pipeline_losses`, ...) found in the
        # tree, by reader: each walks the whole tree, and rules ask once per scope
        self.framework_names: dict[str, set[str]] = {}
        self._mentions: dict[str, bool] = {}
        self._scope(tree, None, nograd=False)
        self.imports.finish()
        self._known_objects()
        self._annotated_members()
        for scope in self.scopes:
            self._classify_scope(scope)
        # Synthetic events (what called functions do) are added by `summaries.Resolver.link`.

    def guarded(self, scope: Scope, fn: Callable[[], list[_T]]) -> list[_T]:
        """`fn()` for one scope; an internal error there is noted (WB001), giving []."""
        return self.failures.run(scope.qual, scope.line, fn, [])

    @property
    def evidence(self) -> Evidence:
        """What the text of the run shows (`frameworks.Evidence`): the whole run's when
        `engine` lints a tree, else this file's own."""
        if self._evidence is None:
            self._evidence = Evidence.of([self.source])
        return self._evidence

    @evidence.setter
    def evidence(self, value: Evidence) -> None:
        self._evidence = value

    @property
    def assign_calls(self) -> list[tuple[ast.Call, list[ast.expr]]]:
        """Each plain assignment of a call's result in the file (`x = f(...)`): the call
        and the targets."""
        return self._assign_calls

    def mentions(self, word: str) -> bool:
        """Does the file's text hold `word`? Kept per word: rules ask once per scope, and
        each test reads the whole text."""
        hit = self._mentions.get(word)
        if hit is None:
            hit = self._mentions[word] = word in self.source
        return hit

    def runs(self, code: str) -> bool:
        """Is rule `code` to be checked in this file?"""
        return self.codes is None or code in self.codes

    # -- names bound to optimizers / scalers --------------------------------------------

    def _known_objects(self) -> None:
        for call, targets in self._assign_calls:
            func = call.func
            inner = call.args[0] if call.args else None
            if last_name(func) in _WRAPPERS and isinstance(inner, ast.Call):
                func = inner.func  # the wrapper runs the module's forward
            criterion = last_name(func) in ("CrossEntropyLoss", "NLLLoss") and not any(
                k.arg == "reduction" and is_sum_reduction(k.value) for k in call.keywords
            )
            if criterion and not any(k.arg == "ignore_index" for k in call.keywords):
                # only a mean it shows (no `reduction=`, or "mean"), not one chosen elsewhere
                if any(
                    k.arg == "reduction"
                    and not (isinstance(k.value, ast.Constant) and k.value.value == "mean")
                    for k in call.keywords
                ):
                    continue
                self.default_ignoring.update(d for t in targets if (d := dotted(t)) is not None)
            elif criterion:
                value = next(k.value for k in call.keywords if k.arg == "ignore_index")
                for t in targets:
                    if isinstance(t, ast.Attribute) and (d := dotted(t)):
                        self.ignoring.add(d)
                        self.ignore_values[d] = value
            ctor = dotted(func)
            if ctor is not None and last_name(func)[:1].isupper():
                for target in targets:
                    d = dotted(target)
                    if d is not None:
                        # `self.gc = GradCache(...)`: a call of `self.gc` runs __call__
                        self.constructed.setdefault(d, ctor)
            q = self.imports.qualname(func) or ""
            name = last_name(func)
            if name in _NOT_OPTIMIZER or q.startswith("wholebatch.") or "lr_scheduler" in q:
                bucket = self.not_optimizers
            elif name.endswith("GradScaler"):
                bucket = self.scalers
            elif (q.startswith("torch.optim.") and "swa_utils" not in q) or name.endswith(
                ("Optimizer", "Optimiser")
            ):
                bucket = self.optimizers
            else:
                continue
            for target in targets:
                d = dotted(target)
                if d is not None:
                    bucket.add(d)

    def label_writes(self) -> frozenset[int]:
        """The integer literals this file writes into labels at masked places
        (`labels[~label_mask] = 0`, `labels.masked_fill_(pad, 0)`): a loss whose
        `ignore_index` is one of them ignores those places, whatever the value. Read once."""
        if self._label_writes is None:
            self._label_writes = label_writes(self.source)
        return self._label_writes

    def writes_ignored_labels(self) -> bool:
        """Does this file write into labels a value that a loss of it ignores
        (`ignore_index=0` and `labels[~label_mask] = 0`)? Then labels are masked out of
        that loss, as a -100 would show (`frameworks.masks_labels`)."""
        if "ignore_index" not in self.source or not self.label_writes():
            return False
        ignored = {int(v) for v in _IGNORE_LITERAL_RE.findall(self.source)}
        return bool(ignored & self.label_writes())

    def _annotated_members(self) -> None:
        """`self.model = model` in an `__init__` whose parameter is annotated with a class
        (`model: CFM`): a call of `self.model` runs that class's `forward`, as if the
        instance were built here (`constructed`)."""
        for cls in self.classes:
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef) or fn.name != "__init__":
                    continue
                a = fn.args
                typed = {
                    x.arg: d
                    for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                    if x.annotation is not None
                    and (d := dotted(x.annotation)) is not None
                    and last_name(x.annotation)[:1].isupper()
                }
                for st in fn.body if typed else ():
                    if (
                        isinstance(st, ast.Assign)
                        and len(st.targets) == 1
                        and isinstance(st.value, ast.Name)
                        and st.value.id in typed
                        and (d := dotted(st.targets[0])) is not None
                        and d.startswith("self.")
                    ):
                        self.constructed.setdefault(d, typed[st.value.id])

    def is_optimizer(self, node: ast.expr) -> bool:
        """Does `node` name an optimizer (by assignment, else by its name)?"""
        d = dotted(node)
        if d is not None and d in self.optimizers:
            return True
        if d is not None and (d in self.not_optimizers or d in self.scalers):
            return False
        return is_optimizer_name(last_name(node))

    def is_scaler(self, node: ast.expr) -> bool:
        """Does `node` name an AMP GradScaler?"""
        d = dotted(node)
        return (d is not None and d in self.scalers) or is_scaler_name(last_name(node))

    # -- the walk -----------------------------------------------------------------------

    def _scope(
        self,
        node: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef,
        cls: ast.ClassDef | None,
        *,
        nograd: bool,
    ) -> None:
        if not isinstance(node, ast.Module):
            self.functions.setdefault(node.name, node)
            self.defs_by_name.setdefault(node.name, []).append(node)
            # Only the decorator's name matters (imports may come later in the file).
            nograd = nograd or any(
                last_name(d.func if isinstance(d, ast.Call) else d)
                in ("no_grad", "inference_mode", "_use_grad_for_differentiable")
                for d in node.decorator_list
            )
        scope = Scope(node=node, cls=cls, nograd=nograd)
        self.scopes.append(scope)
        self.scope_of[id(node)] = scope
        self._block(scope, node.body, _Where(nograd=nograd))

    def _class(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.class_by_name.setdefault(node.name, node)
        # Methods of an optimizer update parameters by design (torch.optim's own step()
        # runs under no_grad through a decorator).
        opt_cls = any(last_name(b).endswith(("Optimizer", "Optimiser")) for b in node.bases)
        for st in node.body:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
                self._scope(st, node, nograd=opt_cls)
            elif isinstance(st, ast.ClassDef):
                self._class(st)

    def _block(self, scope: Scope, body: list[ast.stmt], at: _Where) -> None:
        for st in body:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
                if isinstance(scope.node, ast.Module):
                    self.module_functions[st.name] = st  # the last definition wins, as at run time
                self._scope(st, None, nograd=False)
            elif isinstance(st, ast.ClassDef):
                self._class(st)
            elif isinstance(st, ast.For | ast.AsyncFor | ast.While):
                if isinstance(st, ast.While):
                    self._events(scope, st.test, at)
                else:
                    self._events(scope, st.target, at)
                    self._events(scope, st.iter, at)
                    scope.stmts.append(at.stmt(st))
                self._block(scope, st.body, at.enter_loop(st))
                self._block(scope, st.orelse, at)
            elif isinstance(st, ast.If):
                scope.ifs.append(st)
                self._events(scope, st.test, at)
                self._block(scope, st.body, at.enter_branch(st, 0, st.body))
                self._block(scope, st.orelse, at.enter_branch(st, 1, st.orelse))
            elif isinstance(st, ast.With | ast.AsyncWith):
                scope.withs.append(st)
                for item in st.items:
                    self._events(scope, item.context_expr, at)
                off = any(self.imports.is_no_grad_call(i.context_expr) for i in st.items)
                on = any(last_name(i.context_expr) == "enable_grad" for i in st.items)
                inner = (at.nograd or off) and not on
                self._block(scope, st.body, replace(at, nograd=inner))
            elif isinstance(st, ast.Try | ast.TryStar):
                self._block(scope, st.body, at)
                for k, h in enumerate(st.handlers):
                    self._block(
                        scope, h.body, replace(at.enter_branch(st, k + 1, h.body), jumpy=True)
                    )
                self._block(scope, st.orelse, at)
                self._block(scope, st.finalbody, at)
            elif isinstance(st, ast.Match):
                self._events(scope, st.subject, at)
                for k, case in enumerate(st.cases):
                    self._block(scope, case.body, at.enter_branch(st, k, case.body))
            elif isinstance(st, ast.Import | ast.ImportFrom):
                self.imports.add(st)
            else:
                if isinstance(st, ast.Return | ast.Continue | ast.Break):
                    scope.has_exit = True
                elif isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                    self._assign_calls.append((st.value, st.targets))
                elif isinstance(st, ast.Assign) and isinstance(st.value, ast.Attribute):
                    self._alias(scope, st.targets, st.value)
                scope.stmts.append(at.stmt(st))
                self._events(scope, st, at)

    def _events(self, scope: Scope, node: ast.AST, at: _Where) -> None:
        where = at.event_fields()
        if isinstance(node, ast.Assign | ast.Delete) and any(
            isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets
        ):
            scope.raw.append((node, where))
        calls: list[ast.Call] = []
        for n in walk_local(node):
            if isinstance(n, ast.Call):
                calls.append(n)
            elif isinstance(n, ast.Attribute):
                if n.attr == "grad":
                    scope.has_grad = True
            elif isinstance(n, ast.BinOp):
                if isinstance(n.op, ast.Div):
                    scope.divs.append(n)
                elif isinstance(n.op, ast.Mod):
                    scope.mods.append(n)
            elif isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Div):
                scope.divs.append(n)
        if len(calls) > 1:
            calls.sort(key=lambda c: (c.lineno, c.col_offset))
        for call in calls:
            scope.calls.append(call)
            scope.raw.append((call, where))
            name = last_name(call.func)
            if name in DIST_GATHERS:
                scope.has_gather = True
            if name in _VALUE_GATHER_NAMES:
                scope.gather_calls.append((call, at.nograd))

    def _alias(self, scope: Scope, targets: list[ast.expr], value: ast.Attribute) -> None:
        """`allgather = AllGather.apply` (or `self.gather = ...`): a call of the name is a
        use of the Function; `gather = dist.all_gather` at module level: another name for
        the collective."""
        if value.attr == "apply" and isinstance(value.value, ast.Name):
            for t in targets:
                d = dotted(t)
                if d is not None:
                    self.apply_aliases[d] = value.value.id
        elif isinstance(scope.node, ast.Module) and len(targets) == 1:
            t = targets[0]
            if isinstance(t, ast.Name):
                self.imports.bind(t.id, value)

    # -- classification -----------------------------------------------------------------

    def _classify_scope(self, scope: Scope) -> None:
        for node, where in scope.raw:
            if not isinstance(node, ast.Call):
                # `p.grad = None` / `del p.grad` zero; `p.grad = g` sets a gradient.
                none = isinstance(node, ast.Delete) or (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Constant)
                    and node.value.value is None
                )
                kind = ZERO if none else SETGRAD
                scope.events.append(Event(kind=kind, node=node, recv="", **where))
                continue
            ev = self._classify(node)
            if ev is not None and ev[0] == BACKWARD and self._context_backward(node):
                # torch.distributed.autograd: each `dist_autograd.context()` holds its own
                # gradients, so every backward starts from zero (a zeroing, then backward).
                scope.events.append(
                    Event(kind=ZERO, node=node, recv="", synthetic=True, certain=True, **where)
                )
            if ev is not None:
                kind, recv, losses, scaler, bare = ev
                scope.events.append(
                    Event(
                        kind=kind,
                        node=node,
                        recv=recv,
                        losses=losses,
                        scaler=scaler,
                        bare=bare,
                        **where,
                    )
                )
            func = node.func
            if ev is None and (
                isinstance(func, ast.Name)
                or (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name | ast.Attribute | ast.Call)
                )
            ):
                scope.local_calls.append((node, where))
        scope.raw = []
        scope.value_gathers = any(
            self.value_gather(c, nograd=off) is not None for c, off in scope.gather_calls
        )
        if not self.source or self.mentions("all_gather"):
            # by qualified name: `from torch.distributed import all_gather as c10d_gather`
            scope.plain_gathers = [c for c in scope.calls if self.imports.plain_gather(c)]
        else:
            scope.plain_gathers = []

    def value_gather(self, call: ast.Call, *, nograd: bool) -> str | None:
        """Why `call`'s output has no gradient here, if it is a gather that returns it
        ("no_grad", or the framework's reason; `nograd`: recording is off where it runs): a
        differentiable gather (Horovod's, torch.distributed.nn's, wholebatch's) under
        no_grad, or a framework gather that never carries one (accelerate's
        `accelerator.gather`, Lightning's `self.all_gather` / `fabric.all_gather`
        without `sync_grads=True`). None for any other call."""
        func = call.func
        if last_name(func) not in _VALUE_GATHER_NAMES:
            return None
        q = self.imports.qualname(func) or ""
        if q in _DIFFERENTIABLE_GATHERS:
            return "no_grad" if nograd else None
        if q in _PLAIN_VALUE_GATHERS:
            return "mmengine's dist.all_gather is not differentiable"
        if not isinstance(func, ast.Attribute):
            return None
        owner = last_name(func.value)
        if owner not in _FRAMEWORK_GATHERS.get(func.attr, ()) or q.startswith("torch."):
            return None
        if func.attr == "all_gather":
            if owner == "self" and not self.is_lightning:
                return None  # a method of the user's own class
            sync = next((k.value for k in call.keywords if k.arg == "sync_grads"), None)
            if sync is not None and not (isinstance(sync, ast.Constant) and not sync.value):
                return None  # `sync_grads=True` (or a flag we cannot read): differentiable
        if func.attr == "gather":
            return "accelerate's gather is not differentiable"
        return "Lightning's all_gather carries one only with sync_grads=True"

    @property
    def is_lightning(self) -> bool:
        """Does the file define a LightningModule (so `self.all_gather` is Lightning's)?"""
        return any(
            last_name(b) in ("LightningModule", "LitModule") for c in self.classes for b in c.bases
        )

    def _context_backward(self, call: ast.Call) -> bool:
        """`dist_autograd.backward(context_id, [loss])` (torch.distributed.autograd)."""
        q = self.imports.qualname(call.func) or ""
        return q == "torch.distributed.autograd.backward"

    def _classify(self, call: ast.Call) -> tuple[str, str, tuple[ast.expr, ...], bool, bool] | None:
        """(kind, recv, losses, scaler, bare) for a training-loop call, else None."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id.endswith("zero_grad") or func.id in _ZERO_FUNCS:
                return ZERO, "", (), False, True
            if func.id in _CLIP_FUNCS:
                return CLIP, "", (), False, True
            q = self.imports.qualname(func)
            if q == "torch.autograd.backward" and call.args:
                return BACKWARD, "", (call.args[0],), False, True
            return None
        if not isinstance(func, ast.Attribute):
            return None
        attr, recv = func.attr, func.value
        if attr in ("backward", "manual_backward"):
            q = self.imports.qualname(recv)
            if q == "torch.distributed.autograd":
                return BACKWARD, "", tuple(call.args[1:2]), False, True
            if (
                q in ("torch.autograd", "torch")
                or attr == "manual_backward"
                or (last_name(recv) in _BACKWARD_WRAPPERS)
            ):
                return BACKWARD, "", tuple(call.args[:1]), False, True
            return BACKWARD, "", (recv,), False, True
        if attr.endswith("zero_grad") or attr in _ZERO_FUNCS:
            return ZERO, _text(recv), (), False, True
        if attr == "zero_" and any(
            isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(recv)
        ):
            return ZERO, "", (), False, True
        if attr == "step":
            if self.is_scaler(recv):
                if call.args:
                    return STEP, _text(call.args[0]), (), True, True
                return None
            if self.is_optimizer(recv):
                bare = not call.args and not call.keywords
                return STEP, _text(recv), (), False, bare
            return None
        if attr == "unscale_":
            return UNSCALE, _text(call.args[0]) if call.args else "", (), False, True
        if attr in _CLIP_FUNCS:
            q = self.imports.qualname(func) or ""
            if q.startswith("torch.nn.utils") or ".utils." in f".{q}":
                return CLIP, "", (), False, True
        if attr == "clip_gradients" and isinstance(recv, ast.Name) and recv.id == "self":
            return CLIP, "", (), False, True  # LightningModule.clip_gradients
        return None


def finding(ctx: FileContext, node: ast.AST, code: str, message: str) -> Finding:
    """A `Finding` of rule `code` at `node` in the file `ctx` reads, with the rule's fix."""
    return Finding(
        path=ctx.path,
        line=position(node)[0],
        col=position(node)[1],
        code=code,
        message=message,
        fix=RULES[code].fix,
    )
