"""The summaries themselves, and the tables that carry them between files: what calling
a function does (`Facts`, its training calls as `Effect`s), where a tagged value started
(`Origin`, registered in `Origins`), what one file leaves for the others
(`ModuleFacts`), and every file's summaries by module name (`Program`).

None of these holds a syntax tree, so the summaries of a whole package stay small while
its files are linted one at a time. `summaries.Resolver` computes them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from wholebatch.lint.frameworks import Evidence
from wholebatch.lint.rules import Hop

__all__ = ["Deferred", "Effect", "Facts", "ModuleFacts", "Origin", "Origins", "Program"]


@dataclass(frozen=True, kw_only=True)
class Effect:
    """A training call a function makes, as seen from its callers.

    Attributes:
        kind: BACKWARD, ZERO, STEP, SETGRAD, UNSCALE or CLIP.
        certain: it happens on every call (not under an `if`/`try` of the function).
        recv: the optimizer it acts on, in the function's own terms ("" if unknown).
        trace: from the function down to the call that does it, one `Hop` per function.
    """

    kind: str
    certain: bool
    recv: str
    trace: tuple[Hop, ...]


@dataclass(frozen=True, kw_only=True)
class Deferred:
    """WB301 evidence that waits for a caller: a function divides by the accumulation
    steps (or backpropagates under a framework that does) what a call of one of its
    parameters returns (`c_loss, aux = model(x, y)`, `loss /= accum_iter`), and only a
    caller shows whose `forward` that is. Files are linted in import order, so the
    script that builds the model is read after the loop; its call of the function, given
    an instance whose class's `forward` returns a mean over a data-dependent item count,
    completes the finding, reported here (`flow_rules.deferred_findings`).

    Attributes:
        param: the parameter called (`model`).
        elements: the elements of the call's returned tuple the divided value holds
            (`c_loss`, element 0 of `c_loss, aux = model(...)`); () for the whole value.
        nargs: the call's positional arguments (`model(x, y)`: 2), for the binding.
        keywords: the call's keyword names (`images=` of `model(x, y, images=i)`).
        labelled: the call gives labels or a loss mask by name (`labels=`, `**batch`);
            otherwise the forward's mean counts only where its target is a parameter the
            call binds (`Resolver.forward_tags`' `by_target`).
        masks: labels are masked out of a loss in the function's file or one imported
            alongside it (`Resolver.masks_labels`).
        line: the division (or backward), 1-based.
        col: its column, 1-based.
        loss: the divided value's text (`loss`).
        divided: how the message says it is divided (`divided by `accum_iter``).
        cls: the absolute name of the called instance's class, where the call is not of
            a parameter but of an instance of a class of the run not summarised yet
            (an import cycle through its package's `__init__`): completed once every
            file is read (`deferred.pending_findings`); "" for a parameter's call.
        path: the file of the division, for `cls`'s completion.
        function: the function that divides, for `cls`'s completion.
    """

    param: str
    elements: tuple[int, ...]
    nargs: int
    keywords: tuple[str, ...]
    labelled: bool
    masks: bool
    line: int
    col: int
    loss: str
    divided: str
    cls: str = ""
    path: str = ""
    function: str = ""


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What calling one function does (module docstring). Holds no syntax tree, so the
    summaries of a whole package stay small.

    Attributes:
        qual: `function` or `Class.method`.
        path: its file.
        line: the line of its `def`.
        params: positional parameter names, `self`/`cls` included.
        kwonly: keyword-only parameter names.
        star: it takes `*args` or `**kwargs` (arguments cannot be matched one to one).
        effects: training calls, in order.
        collective: (qualified name, trace) of a collective it calls on every call.
        reduces: it calls a collective somewhere (itself or through a call).
        gathers: it (or a function it calls) fills a tensor by c10d all-gather.
        nograd_gathers: it (or a function it calls) may gather a value without a
            gradient by a gather that returns its output (Horovod's under no_grad,
            accelerate's, Lightning's; `scope.FileContext.value_gather`).
        replicated: every such gather is over a tensor/model-parallel group, whose ranks
            replicate the computation after it (`names.is_on_replica_group`).
        returns: the tags of its return value; None when not computed (no gather).
        steps: it returns a count of accumulation steps (`return self.accum_steps`), so
            a division by its value is a division by the steps (WB301).
        deferred: divisions of what it gets from a call of a parameter, whose mean
            its callers may show (`Deferred`, WB301).
        masks_if: the optional parameter every write of its loss's ignore value into
            the labels is conditioned on (`names.masking_param`), or "": a call that
            does not pass it gets a model's plain mean (`v`) for the mean its `V`/`S`
            tags describe (WB301).
        scaled: it divides a value by a number of accumulation steps (a name for one:
            `loss / args.accum`), so what it returns is already divided: a caller that
            backpropagates it every micro-batch does not sum undivided means (WB301's
            own finding, if any, is the callee's).
    """

    qual: str
    path: str
    line: int
    params: tuple[str, ...] = ()
    kwonly: tuple[str, ...] = ()
    star: bool = False
    effects: tuple[Effect, ...] = ()
    collective: tuple[str, tuple[Hop, ...]] | None = None
    reduces: bool = False
    gathers: bool = False
    nograd_gathers: bool = False
    replicated: bool = False
    returns: frozenset[str] | None = None
    steps: bool = False
    deferred: tuple[Deferred, ...] = ()
    masks_if: str = ""
    scaled: bool = False

    @property
    def interesting(self) -> bool:
        """Worth keeping for other files: it does something a rule follows."""
        return bool(
            self.effects
            or self.collective
            or self.gathers
            or self.nograd_gathers
            or self.reduces
            or self.returns
            or self.steps
            or self.deferred
        )

    def unmasked(self, call: ast.Call, bound: bool) -> bool:
        """Does `call` leave `masks_if` unset (not by keyword, position or `**kwargs`)?
        Then the function writes no ignore value into the labels it is given."""
        p = self.masks_if
        if not p or any(k.arg is None or k.arg == p for k in call.keywords):
            return False
        params = self.params[1:] if bound else self.params
        if p not in params:
            return True
        starred = any(isinstance(a, ast.Starred) for a in call.args)
        return not starred and len(call.args) <= params.index(p)

    def bind(self, call: ast.Call, bound: bool) -> Iterator[tuple[str, ast.expr]]:
        """(parameter name, argument) pairs of `call`; with `*args`/`**kwargs` on either
        side every argument is paired with every parameter (over-approximation)."""
        params = self.params[1:] if bound else self.params
        starred = any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords
        )
        if self.star or starred:
            values = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
            values += [k.value for k in call.keywords]
            for p in (*params, *self.kwonly):
                for v in values:
                    yield p, v
            return
        for p, a in zip(params, call.args, strict=False):
            yield p, a
        for k in call.keywords:
            if k.arg is not None:
                yield k.arg, k.value


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where a tagged value started (a c10d all-gather) and the path it took since.

    Attributes:
        path: the file of the gather.
        line: 1-based line of the gather call.
        col: 1-based column.
        name: the name the gather wrote into.
        what: how a message says where the value lost its gradient (default: "`name` is
            filled by torch.distributed.all_gather, which carries no gradient").
        trace: the steps so far, the gather first.
        partial: why a `gathered[rank] = local` did not count (it runs only under a
            condition), or "".
    """

    path: str
    line: int
    col: int
    name: str
    trace: tuple[Hop, ...]
    partial: str = ""
    what: str = ""

    @property
    def clause(self) -> str:
        """The start of a WB101 message: what has no gradient, and why."""
        return self.what or (
            f"`{self.name}` is filled by torch.distributed.all_gather, which carries no gradient"
        )


class Origins:
    """The registry behind `g:ID` and `q:ID` tags (one per lint run, shared by files)."""

    def __init__(self) -> None:
        self.items: list[Origin] = []
        self._moved: dict[tuple[str, int], str] = {}

    def new(self, kind: str, origin: Origin) -> str:
        """A fresh tag of `kind` ("g" or "q") for `origin`."""
        self.items.append(origin)
        return f"{kind}:{len(self.items) - 1}"

    def get(self, tag: str) -> Origin:
        """The origin of a `g:ID`/`q:ID` tag (or the ID part of a `qa:NAME:ID` tag)."""
        return self.items[int(tag.rsplit(":", 1)[1])]

    def moved(self, tag: str, kind: str, key: int, hop: Hop) -> str:
        """The tag of the same value one step further (`hop`), made once per (tag, key)."""
        memo = (tag, key)
        out = self._moved.get(memo)
        if out is None:
            o = self.get(tag)
            out = self.new(kind, replace(o, trace=(*o.trace, hop)))
            self._moved[memo] = out
        return out


@dataclass
class ModuleFacts:
    """The summaries one file leaves for the others (no syntax tree).

    Attributes:
        path: the file.
        functions: `f` and `Class.method` -> facts, for those worth keeping.
        classes: class name -> its bases as absolute dotted names (or as written).
        names: names bound by imports -> the absolute dotted name they refer to.
        applies: (the autograd.Function's name as this file imports it, absolute;
            whether the use pairs local rows with the gathered ones) for each
            `Layer.apply(x)` of an imported class (WB102, `dist_rules.layer_uses`).
        layers: line of a WB102 finding -> its class name, for the findings that no
            use in their own file settles (the uses in other files may).
        apply_aliases: names bound to an autograd.Function's `apply` (`allgather =
            AllGather.apply`) -> the class name as this file writes it: another file's
            call of an imported `allgather` is a use of the class (WB102).
        forwards: class name -> whether the `forward` it defines is a model's own mean
            loss that no item count reaches (`frameworks.uncounted_forward`), for the
            classes that define one (WB301 through a Trainer).
        trainers: class name -> `class` line of the file's direct subclasses of the HF
            Trainer that keep its loss and step (`flow_rules`): another file that builds
            one with a model the Trainer gives no item count is reported there (WB301).
        counting_off: the classes that set `accepts_loss_kwargs = False` in their body
            (`frameworks.loss_kwargs_attr`): the Trainer gives them no item count.
    """

    path: str
    functions: dict[str, Facts] = field(default_factory=dict)
    classes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    applies: list[tuple[str, bool]] = field(default_factory=list)
    layers: dict[int, str] = field(default_factory=dict)
    apply_aliases: dict[str, str] = field(default_factory=dict)
    forwards: dict[str, bool] = field(default_factory=dict)
    counting_off: set[str] = field(default_factory=set)
    trainers: dict[str, int] = field(default_factory=dict)


class Program:
    """The summaries of every file linted so far, by module name, and the origins
    registry; files are linted in import order so a module's facts exist before the
    files that import it are read (`engine.lint_paths`)."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleFacts] = {}
        self.origins = Origins()
        self.roots: set[str] = set()  # top-level names of the run's modules
        self.open_layers = False  # a WB102 finding waits on uses in other files
        self.deferred = False  # a WB301 finding waits on a caller (`Deferred`)
        # those that wait on a class's summary to come later (`Deferred.cls`)
        self.pending: list[Deferred] = []
        # per file: the label values written at masked places in a file imported
        # alongside it (`scope.FileContext.label_writes`): an `ignore_index=0` ignores them
        self.label_values: dict[str, frozenset[int]] = {}
        self.evidence = Evidence()  # what the text of the whole run shows (frameworks)
        # files imported alongside one that masks labels (`program.co_imported`, WB301)
        self.masked: set[str] = set()
        # the names the modules bind to an autograd.Function's `apply` (`allgather`)
        self.apply_names: set[str] = set()
        # those imported alongside one that writes masked label values, `-100` (not only
        # a loss's `ignore_index=`: `summaries.writes_masked_labels`)
        self.masked_values: set[str] = set()
        # of those, alongside one that writes -100 itself, the label PyTorch's losses
        # ignore by default (`summaries.writes_default_ignored`)
        self.masked_default: set[str] = set()
        # files imported alongside one that wraps a model in FSDP, and in DDP (WB302)
        self.fsdp_built: set[str] = set()
        self.ddp_built: set[str] = set()
        # `masked` and the files of a folder of the same package without `__init__.py`
        # (`llava/train/`), for `Evidence.package_masks_labels`
        self.masked_wide: set[str] = set()
        # files whose project pins transformers below 4.46 (`Evidence.hf_before_446`)
        self.hf_old: set[str] = set()
        # the run's functions that return a DeepSpeed engine, and per class the
        # attributes bound to one (`frameworks.deepspeed_run_engines`)
        self.engine_makers: frozenset[str] = frozenset()
        self.engine_attrs: dict[str, frozenset[str]] = {}

    def add(self, module: str, facts: ModuleFacts) -> None:
        """Keep one module's summaries."""
        self.modules[module] = facts

    def followed(self, name: str) -> bool:
        """Does the absolute dotted `name` that a file imports (a module, a function, a
        class) lead to a summary worth following? Then the file is worth a look even if
        none of the rules' words occur in it."""
        mod = self.modules.get(name)
        if mod is not None:
            return bool(mod.functions)
        hit = self.lookup(name)
        if isinstance(hit, Facts):
            return True
        if isinstance(hit, str):  # a class: one of its methods does something
            mod_name, _, cls = hit.rpartition(".")
            owner = self.modules.get(mod_name)
            return owner is not None and any(k.startswith(f"{cls}.") for k in owner.functions)
        return False

    def canonical(self, name: str, depth: int = 0) -> str:
        """`name` with re-exports followed (`pkg.Layer`, bound in `pkg/__init__.py` by
        `from .gather import Layer`, is `pkg.gather.Layer`)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            mod = self.modules.get(".".join(parts[:i]))
            if mod is None:
                continue
            head = parts[i]
            if head in mod.names and depth < 6:
                return self.canonical(".".join([mod.names[head], *parts[i + 1 :]]), depth + 1)
            return name
        return name

    def applied(self, name: str) -> str | None:
        """The absolute name of the autograd.Function whose `apply` the absolute dotted
        `name` is (`pkg.utils.allgather` after `allgather = AllGather.apply` there);
        None for another name."""
        mod_name, _, alias = self.canonical(name).rpartition(".")
        mod = self.modules.get(mod_name)
        cls = mod.apply_aliases.get(alias) if mod is not None else None
        return self.canonical(f"{mod_name}.{cls}") if cls is not None else None

    def lookup(self, name: str, depth: int = 0) -> Facts | str | None:
        """The facts of the function an absolute dotted name refers to; a class gives its
        absolute name as a string; None when unknown (not in the tree, or uninteresting)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            mod = self.modules.get(".".join(parts[:i]))
            if mod is None:
                continue
            rest = parts[i:]
            head = rest[0]
            if len(rest) == 1:
                if head in mod.functions:
                    return mod.functions[head]
                if head in mod.classes:
                    return ".".join(parts)
            elif len(rest) == 2 and head in mod.classes:
                return mod.functions.get(f"{head}.{rest[1]}")
            if head in mod.names and depth < 6:
                return self.lookup(".".join([mod.names[head], *rest[1:]]), depth + 1)
            return None
        return None

    def derives_from(self, cls: str, names: tuple[str, ...], depth: int = 0) -> bool:
        """Is the class with absolute name `cls` derived from one whose last name is in
        `names` (by the bases the run's files wrote)?"""
        mod_name, _, cls_name = cls.rpartition(".")
        mod = self.modules.get(mod_name)
        if mod is None or depth > 6:
            return False
        for base in mod.classes.get(cls_name, ()):
            if base.rpartition(".")[2] in names:
                return True
            target = self.lookup(base)
            if isinstance(target, str) and self.derives_from(target, names, depth + 1):
                return True
        return False

    def uncounted(self, cls: str, depth: int = 0) -> bool:
        """Is the `forward` of the class with absolute name `cls` (its own, or the
        nearest base's that the run defines) a mean no item count reaches
        (`ModuleFacts.forwards`)?"""
        mod_name, _, cls_name = cls.rpartition(".")
        mod = self.modules.get(mod_name)
        if mod is None or depth > 6:
            return False
        if cls_name in mod.forwards:
            return mod.forwards[cls_name]
        for base in mod.classes.get(cls_name, ()):
            target = self.lookup(base)
            if isinstance(target, str):
                return self.uncounted(target, depth + 1)
        return False

    def default_trainer(self, cls: str) -> tuple[str, int] | None:
        """(file, `class` line) of the class with absolute name `cls` where it is a
        direct subclass of the HF Trainer keeping its loss and step
        (`ModuleFacts.trainers`); None otherwise."""
        mod_name, _, cls_name = self.canonical(cls).rpartition(".")
        mod = self.modules.get(mod_name)
        line = mod.trainers.get(cls_name) if mod is not None else None
        return (mod.path, line) if mod is not None and line is not None else None

    def counting_off(self, cls: str) -> bool:
        """Does the class with absolute name `cls` set `accepts_loss_kwargs = False`
        (`ModuleFacts.counting_off`)?"""
        mod_name, _, cls_name = cls.rpartition(".")
        mod = self.modules.get(mod_name)
        return mod is not None and cls_name in mod.counting_off

    def method(self, cls: str, name: str, depth: int = 0) -> Facts | None:
        """The facts of method `name` of the class with absolute name `cls`, or its bases."""
        mod_name, _, cls_name = cls.rpartition(".")
        mod = self.modules.get(mod_name)
        if mod is None or depth > 6:
            return None
        f = mod.functions.get(f"{cls_name}.{name}")
        if f is not None:
            return f
        for base in mod.classes.get(cls_name, ()):
            target = self.lookup(base)
            if isinstance(target, str):
                f = self.method(target, name, depth + 1)
                if f is not None:
                    return f
        return None
