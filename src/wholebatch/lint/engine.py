"""Run the rules: over a source string, a file, or folders of files; with rule selection
(`--select`/`--ignore` prefixes, as in ruff) and `# noqa` suppression.

Pure static analysis: a file is read and parsed with `ast`, never imported or run.
`lint_paths` lints the files in import order (`program.import_order`), keeping each
file's summaries (`summaries.ModuleFacts`, no syntax tree) so that a call into another
file of the tree is followed; a single source (`lint_source`, the flake8 plugin) is
followed within itself.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import tokenize
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from wholebatch.lint.deferred import pending_findings
from wholebatch.lint.dist_rules import check_dist, layer_uses
from wholebatch.lint.facts import ModuleFacts, Program
from wholebatch.lint.files import CODE, UsageError, Walked, iter_python_files, read, walk
from wholebatch.lint.flow_rules import attach, check_flow
from wholebatch.lint.frameworks import (
    Evidence,
    builds_ddp,
    builds_fsdp,
    deepspeed_run_engines,
    hf_pinned_before_446,
    hf_pinned_only_before_446,
    hydra_config_dirs,
    masks_labels,
    names_transformers,
    yaml_accumulates,
)
from wholebatch.lint.guard import MODULE_LEVEL, Failures
from wholebatch.lint.loop_rules import check_loops
from wholebatch.lint.program import (
    ModuleMap,
    co_imported,
    import_base,
    import_order,
    imported_names,
    locate,
    module_name,
)
from wholebatch.lint.rules import RULES, Finding
from wholebatch.lint.scope import FileContext, label_writes
from wholebatch.lint.summaries import Resolver, writes_default_ignored, writes_masked_labels

__all__ = [
    "Report",
    "UsageError",
    "iter_python_files",
    "lint_paths",
    "lint_run",
    "lint_source",
    "lint_tree",
    "selected_codes",
]

_NOQA_RE = re.compile(
    r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.IGNORECASE
)
# Each rule's gate words are its own (`rules.Rule.words`); the engine maps a rule's
# `check` family to the function that runs it.
_Check = Callable[[FileContext], Iterable[Finding]]
_CHECKERS: dict[str, _Check] = {"dist": check_dist, "flow": check_flow, "loops": check_loops}
_ANY_WORD = tuple(dict.fromkeys(w for r in RULES.values() for w in r.words))
# A rule without words is never gated, so a file may hold something for it whatever
# its text says.
_UNGATED = any(r.check and not r.words for r in RULES.values())


def selected_codes(
    select: Sequence[str] | None = None, ignore: Sequence[str] | None = None
) -> frozenset[str]:
    """The rule codes enabled by `select` and `ignore` prefixes (`WB1`, `WB301`, `ALL`).

    Raises:
        UsageError: a prefix that matches no rule, naming the known codes.
    """

    def expand(prefixes: Sequence[str]) -> set[str]:
        out: set[str] = set()
        for raw in prefixes:
            p = raw.strip().upper()
            if not p:
                continue
            hit = set(RULES) if p == "ALL" else {c for c in RULES if c.startswith(p)}
            if not hit:
                raise UsageError(
                    f"unknown rule selector {raw!r}: no rule code starts with it; "
                    f"known codes: {', '.join(RULES)}"
                )
            out |= hit
        return out

    chosen = expand(select) if select else set(RULES)
    # An internal error means a rule did not judge a function: reported whatever is
    # selected, so a run never passes what it did not check (only `--ignore` hides it).
    chosen.add("WB001")
    return frozenset(chosen - expand(ignore or ()))


def _noqa_lines(source: str) -> dict[int, frozenset[str] | None]:
    """line -> codes suppressed there (None: all codes, a bare `# noqa`)."""
    out: dict[int, frozenset[str] | None] = {}
    if "noqa" not in source.lower():
        return out
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = _NOQA_RE.search(tok.string)
        if m is None:
            continue
        codes = m.group("codes")
        out[tok.start[0]] = (
            None if codes is None else frozenset(re.split(r"[\s,]+", codes.upper().strip()))
        )
    return out


def lint_tree(
    tree: ast.Module,
    source: str,
    path: str = "<string>",
    codes: frozenset[str] | None = None,
    *,
    gate: bool = True,
) -> list[Finding]:
    """Run the enabled rules over an already parsed module (no `# noqa` handling); calls
    are followed within the module.

    Args:
        tree: the module, from `ast.parse(source)`.
        source: its text, used only to skip rules whose words do not occur in it.
        path: the name reported in findings.
        codes: the enabled rule codes (default: all).
        gate: skip the rules whose gate words (`Rule.words`) do not occur in `source`;
            False runs every enabled rule, which finds the same when the words are right
            (tests/unit/test_lint_rules.py compares the two).
    """
    return _lint_module(tree, source, path, codes, None, "", False, gate=gate)[0]


def _lint_module(
    tree: ast.Module,
    source: str,
    path: str,
    codes: frozenset[str] | None,
    program: Program | None,
    module: str,
    is_package: bool,
    follows: bool = False,
    *,
    report: bool = True,
    gate: bool = True,
) -> tuple[list[Finding], ModuleFacts | None]:
    """Findings for one module, and its summaries for the files that import it.

    `follows`: it imports a module whose summaries are worth following, so it is read
    even if none of the rules' words occur in it. `report=False`: summaries only."""
    enabled = codes if codes is not None else frozenset(RULES)
    words = not gate or _UNGATED or any(w in source for w in _ANY_WORD)
    if not words and not follows:
        # Most of a large package: parsed (for WB000), nothing more to do but keep what
        # its imports bind, so that a re-export (`from .loss import f` in an
        # `__init__.py`) still leads to the function.
        if program is None or not module:
            return [], None
        return [], ModuleFacts(path=path, names=_import_names(tree, module, is_package))
    failures = Failures()
    out: list[Finding] = []
    facts: ModuleFacts | None = None
    try:
        facts = _analyse(
            FileContext(tree, path, source, failures),
            out,
            enabled,
            program,
            module,
            is_package,
            report=report,
            gate=gate,
        )
    except Exception as err:  # an error outside any one function: the file's own note
        failures.note(MODULE_LEVEL, 1, err)
    if report and "WB001" in enabled:
        out.extend(failures.findings(path))
    return _deduplicated(out, path), facts


def _analyse(
    ctx: FileContext,
    out: list[Finding],
    enabled: frozenset[str],
    program: Program | None,
    module: str,
    is_package: bool,
    *,
    report: bool,
    gate: bool,
) -> ModuleFacts | None:
    """Run the enabled rules over one file into `out`; its summaries for other files."""
    if program is not None:
        ctx.evidence = replace(
            program.evidence,
            masks_labels=program.evidence.masks_labels or ctx.path in program.masked,
            fsdp_models=ctx.path in program.fsdp_built and ctx.path not in program.ddp_built,
            package_masks_labels=ctx.path in program.masked_wide,
            hf_before_446=ctx.path in program.hf_old,
        )
        ctx.run_label_writes = program.label_values.get(ctx.path, frozenset())
    resolver = Resolver(ctx, program, module, is_package=is_package)
    try:
        attach(resolver)
        resolver.link()
        # A call followed into another file brings that file's events with it, so every
        # rule may apply even when this file's own text has none of its words.
        every = not gate or resolver.cross
        ctx.codes = _open_codes(enabled, ctx.source, every) if report else frozenset()
        for name, check in _CHECKERS.items():
            if _family(name) & ctx.codes:
                # Each check guards its functions one by one (a check is a generator: it
                # runs inside `extend`); this catches the rest.
                ctx.failures.run(MODULE_LEVEL, 1, partial(out.extend, check(ctx)), None)
        out[:] = [f for f in out if f.code in enabled]
        if program is None:
            return None
        facts = resolver.export()
        if program.open_layers:
            facts.applies = layer_uses(ctx)  # uses matter only for a finding left open
        facts.layers = dict(ctx.layers)
        facts.apply_aliases = {k: v for k, v in ctx.apply_aliases.items() if "." not in k}
        program.apply_names |= facts.apply_aliases.keys()
        return facts
    finally:
        # The resolver and the file point at each other: cut the cycle so the file's
        # syntax tree is freed now, by reference counting, not by a full garbage
        # collection later (which, over a package, costs a fifth of the run).
        resolver.close()


def _deduplicated(found: list[Finding], path: str) -> list[Finding]:
    """One finding per place and rule, in a fixed order (this file's first, then by
    place); of two with the same place, the shorter path (then message) is kept, so
    the result does not depend on the order a walk met them in (hash seeds)."""
    found.sort(
        key=lambda f: (f.path != path, f.path, f.line, f.col, f.code, len(f.trace), f.message)
    )
    seen: set[tuple[str, int, int, str]] = set()
    out: list[Finding] = []
    for f in found:
        key = (f.path, f.line, f.col, f.code)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _open_codes(enabled: frozenset[str], source: str, every: bool) -> frozenset[str]:
    """The enabled rules whose gate `source` opens (`every`: all enabled rules)."""
    # The rules of one family share their words: each set is tested on the text once.
    gates: dict[tuple[str, ...], bool] = {}
    out: set[str] = set()
    for c in enabled:
        rule = RULES.get(c)
        if rule is None or not rule.check:
            continue
        if not every:
            gate = gates.get(rule.words)
            if gate is None:
                gate = gates[rule.words] = rule.gate_open(source)
            if not gate:
                continue
        out.add(c)
    return frozenset(out)


def _family(name: str) -> frozenset[str]:
    return _FAMILIES.get(name, frozenset())


_FAMILIES: dict[str, frozenset[str]] = {
    name: frozenset(c for c, r in RULES.items() if r.check == name) for name in _CHECKERS
}


def _import_names(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Names bound by the module-level imports of `tree` -> the absolute names they mean."""
    pkg = module.split(".") if is_package else module.split(".")[:-1]
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(pkg):
                    continue
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{mod}.{a.name}" if mod else a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
    return out


def lint_source(
    source: str,
    path: str = "<string>",
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
) -> list[Finding]:
    """Lint Python source text; a syntax error is reported as a WB000 finding.

    Args:
        source: the code.
        path: the name reported in findings.
        select: rule code prefixes to enable (default: all).
        ignore: rule code prefixes to disable.

    Raises:
        UsageError: an unknown rule prefix in `select` or `ignore`.
    """
    codes = selected_codes(select, ignore)
    found, _ = _lint_text(source, path, codes)
    noqa = _noqa_lines(source) if found else {}
    return [f for f in found if not _suppressed(f, noqa)]


def _suppressed(f: Finding, noqa: dict[int, frozenset[str] | None]) -> bool:
    if f.line not in noqa:
        return False
    codes = noqa[f.line]
    return codes is None or f.code in codes


def _lint_text(
    source: str,
    path: str,
    codes: frozenset[str],
    program: Program | None = None,
    module: str = "",
    is_package: bool = False,
    follows: bool = False,
    *,
    report: bool = True,
) -> tuple[list[Finding], ModuleFacts | None]:
    if not report and not follows and not any(w in source for w in _ANY_WORD):
        return [], None  # read for its summaries, and it can have none worth keeping
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError, RecursionError) as err:  # (nested too deep to parse)
        if "WB000" not in codes or not report:
            return [], None
        line = getattr(err, "lineno", None) or 1
        col = getattr(err, "offset", None) or 1
        msg = getattr(err, "msg", None) or str(err) or type(err).__name__
        return [
            Finding(
                path=path,
                line=line,
                col=col,
                code="WB000",
                message=f"cannot parse: {msg}",
                fix=RULES["WB000"].fix,
            )
        ], None
    return _lint_module(
        tree, source, path, codes, program, module, is_package, follows, report=report
    )


# Files read only for their summaries (imported by the files of the run, from their own
# package, or by those files): at most this many, at most this many imports away, so one
# file of a huge package stays quick to lint.
_MAX_CONTEXT = 32
_CONTEXT_DEPTH = 2


def _imports(
    sources: dict[Path, str],
    f: Path,
    names: dict[Path, tuple[str, bool]],
    cache: dict[Path, list[str]],
) -> list[str]:
    """The module names file `f` may import (regex over its import lines), once per file."""
    hit = cache.get(f)
    if hit is None:
        me, is_pkg = names.get(f) or module_name(f)
        hit = cache[f] = imported_names(me or None, is_pkg, sources[f])
    return hit


def _add_context(
    sources: dict[Path, str], names: dict[Path, tuple[str, bool]], cache: dict[Path, list[str]]
) -> None:
    """Add to `sources` the files that the run's files import from their own package tree
    but that are not in the run (`wholebatch lint train.py`, or pre-commit on the changed
    files): their summaries let calls into them be followed; nothing in them is reported.

    Args:
        sources: file -> text; grows.
        names: file -> (module name, is a package) for the files of `sources`; grows.
        cache: file -> the module names it imports; grows.
    """
    todo = [(f, 0) for f in sources]
    known = {n for n, _ in names.values()}
    tried: dict[tuple[str, Path], Path | None] = {}
    added = 0
    while todo and added < _MAX_CONTEXT:
        f, depth = todo.pop(0)
        me, is_pkg = names.get(f, ("", False))
        if depth >= _CONTEXT_DEPTH or not me:
            continue
        top = me.split(".")[0]
        base: Path | None = None
        for name in _imports(sources, f, names, cache):
            if name in known or ("." in me and name != top and not name.startswith(top + ".")):
                continue  # in the run already, or outside this file's package
            if base is None:
                base = import_base(f, me, is_pkg)
            key = (name, base)
            if key not in tried:
                tried[key] = locate(name, me, base)
            hit = tried[key]
            if hit is None or hit in sources or added >= _MAX_CONTEXT:
                continue
            try:
                sources[hit] = read(hit)
            except (OSError, UnicodeDecodeError, SyntaxError):
                continue
            added += 1
            todo.append((hit, depth + 1))
            names[hit] = module_name(hit)
            known.add(names[hit][0])


_RELATIVE_RE = re.compile(r"^[ \t]*from[ \t]+\.", re.MULTILINE)


def _relative(sources: dict[Path, str]) -> set[Path]:
    """The files that import relatively (so they sit in a package)."""
    return {f for f, text in sources.items() if _RELATIVE_RE.search(text)}


class _LayerUses:
    """WB102 across files: a layer whose own-slice backward is only ever used for a loss
    of the whole batch (every use in the run gathers all its inputs) gives each rank
    exactly 1/W of the gradient, the convention accepted for `gathered[rank] = local`;
    its finding, made in its own file before the uses were read, is dropped."""

    def __init__(self) -> None:
        self.uses: dict[str, list[bool]] = {}
        self.open: dict[tuple[str, int], str] = {}

    def note(self, program: Program, module: str, facts: ModuleFacts) -> None:
        for name, local in facts.applies:
            self.uses.setdefault(program.canonical(name), []).append(local)
        if module:
            for line, cls in facts.layers.items():
                self.open[(facts.path, line)] = f"{module}.{cls}"
                program.open_layers = True

    def settled(self, program: Program, f: Finding) -> bool:
        name = self.open.get((f.path, f.line))
        if name is None:
            return False
        uses = self.uses.get(program.canonical(name), [])
        return bool(uses) and not any(uses)


def _resolved(modules: ModuleMap, f: Path, names: list[str]) -> dict[str, Path]:
    """Module name -> file of the run, for the names file `f` imports."""
    return {n: hit for n in names if (hit := modules.resolve(f, n)) is not None}


def _with_theirs(resolved: dict[Path, dict[str, Path]], f: Path) -> dict[str, Path]:
    """The files the names `f` imports mean, and those the names its imports import mean
    (`from .modeling import Model` in the package `__init__` it imports): where two
    sub-projects of the tree hold modules of one name, the ones of `f`'s own project."""
    hits = dict(resolved.get(f, {}))
    for g in list(hits.values()):
        for name, h in resolved.get(g, {}).items():
            hits.setdefault(name, h)
    return hits


@contextlib.contextmanager
def _aliases(
    program: Program, modules: ModuleMap, hits: dict[str, Path], by_file: dict[Path, ModuleFacts]
) -> Iterator[None]:
    """While one file is linted, the names it imports mean the files it imports: a
    sibling `utils.py` rather than another file named `utils`, a module under a folder
    without `__init__.py` by the dotted name the file uses for it."""
    saved: dict[str, ModuleFacts | None] = {}
    for name, g in hits.items():
        facts = by_file.get(g)
        if facts is not None and modules.name.get(g) != name:
            saved[name] = program.modules.get(name)
            program.modules[name] = facts
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                program.modules.pop(name, None)
            else:
                program.modules[name] = old


def _pending(
    program: Program,
    modules: ModuleMap,
    resolved: dict[Path, dict[str, Path]],
    by_file: dict[Path, ModuleFacts],
) -> list[Finding]:
    """WB301 divisions that waited on a class read after them (an import cycle,
    `deferred.pending_findings`), each looked up with the names its own file imports and
    those its imports import (the package `__init__` that re-exports the class,
    `_aliases`)."""
    out: list[Finding] = []
    for path in sorted({d.path for d in program.pending}):
        waiting = [d for d in program.pending if d.path == path]
        hits = dict(resolved.get(Path(path), {}))
        for g in list(hits.values()):
            for name, h in resolved.get(g, {}).items():
                hits.setdefault(name, h)
        with _aliases(program, modules, hits, by_file):
            out.extend(pending_findings(program, waiting))
    return out


def _place(f: Finding) -> tuple[str, int, int, str, int, str]:
    """The order findings are reported in, and which of two at one place is kept."""
    return (f.path, f.line, f.col, f.code, len(f.trace), f.message)


@dataclass(frozen=True, kw_only=True)
class Report:
    """What one lint run found.

    Attributes:
        findings: the findings reported, sorted by file, then place.
        files: how many files were checked.
        hidden: findings in test files that the run did not report (`tests=False`).
    """

    findings: list[Finding]
    files: int
    hidden: int = 0


def lint_paths(
    paths: Iterable[str | os.PathLike[str]],
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    *,
    tests: bool = False,
) -> tuple[list[Finding], int]:
    """Lint every Python file under `paths`; returns (findings, number of files checked).

    `lint_run` with the same arguments, for callers that need only these two.

    Raises:
        UsageError: an unknown rule prefix, or a path that does not exist.
    """
    report = lint_run(paths, select, ignore, tests=tests)
    return report.findings, report.files


def lint_run(
    paths: Iterable[str | os.PathLike[str]],
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    *,
    tests: bool = False,
) -> Report:
    """Lint every Python file under `paths`.

    Calls are followed across the files of the run (module docstring). Findings come
    sorted by file, then line (whatever order `paths` are given in). A file that cannot
    be read or parsed gives a WB000 finding, an internal error a WB001 finding (`guard`),
    never an exception. Findings in test files found under a folder of training code
    (`files.tier_of`) are reported only with `tests=True`; each carries its tier.

    Args:
        paths: files and folders (walked recursively).
        select: rule code prefixes to enable (default: all).
        ignore: rule code prefixes to disable.
        tests: also report the findings of test files found in folders.

    Raises:
        UsageError: an unknown rule prefix, or a path that does not exist.
    """
    codes = selected_codes(select, ignore)
    # One order whatever order the paths were given in: the findings, and which call a
    # summary follows first, never depend on it. (The paths sorted, each walked as the
    # folders come: files before sub-folders, which lets imports meet their modules
    # first more often than a plain sort of all the files does.)
    given = sorted((os.fspath(x) for x in paths), key=str)
    walked = {w.path: w for w in walk(given)}
    files = list(walked)
    out: list[Finding] = []
    sources = _read_all(files, codes, out)
    run = {str(f) for f in sources}
    cache: dict[Path, list[str]] = {}
    named = _module_map(sources)
    names = {f: (n, named.package[f]) for f, n in named.name.items()}
    _add_context(sources, names, cache)
    modules = _module_map(sources) if len(sources) > len(run) else named
    imports = {f: _imports(sources, f, names, cache) for f in sources}
    resolved = {f: _resolved(modules, f, ns) for f, ns in imports.items()}
    deps = {f: [g for g in hits.values() if g != f] for f, hits in resolved.items()}
    program = Program()
    ev = Evidence.of(sources.values())
    hydra = ev.lightning_accumulates or _hydra_accumulates(sources)
    program.evidence = replace(ev, lightning_accumulates=hydra)
    program.hf_old = _pins_old_transformers(given, sources)
    # WB301: labels masked out of a token loss in a dataset module counts for the loop
    # imported alongside it (`frameworks.Evidence.masks_labels`).
    marked = {f for f, text in sources.items() if masks_labels(text)}
    program.masked = _masked(sources, deps, modules, marked)
    # `writes_masked_labels` tests less of the text than `masks_labels`, so only a file
    # `masks_labels` marks can pass it (each reads the whole text of every file)
    written = {f for f in marked if writes_masked_labels(sources[f])}
    program.masked_values = _masked(sources, deps, modules, written)
    program.label_values = _label_values(sources, deps, modules, marked)
    minus_100 = {f for f in written if writes_default_ignored(sources[f])}
    program.masked_default = _masked(sources, deps, modules, minus_100)
    # WB302: whose `no_sync()` a file calls, by the wrappers built alongside it.
    program.fsdp_built = _alongside(sources, deps, builds_fsdp)
    program.ddp_built = _alongside(sources, deps, builds_ddp)
    program.masked_wide = _masked(sources, deps, modules, marked, wide=True)
    program.engine_makers, program.engine_attrs = deepspeed_run_engines(sources.values())
    program.roots = {name.split(".")[0] for name in modules.own.values()}
    program.roots |= {n.split(".")[0] for hits in resolved.values() for n in hits}
    helpers = _imported_helpers(sources, deps)
    by_file: dict[Path, ModuleFacts] = {}
    layers = _LayerUses()
    with_noqa: dict[str, str] = {}  # sources with a noqa comment, read once findings are known
    for f in import_order(list(sources), deps):
        source = sources.pop(f)
        module = modules.own.get(f, "")
        with _aliases(program, modules, _with_theirs(resolved, f), by_file):
            found, facts = _lint_text(
                source,
                str(f),
                codes,
                program,
                module,
                modules.package.get(f, False),
                bool(module) and (f in helpers or _follows(program, imports[f])),
                report=str(f) in run,
            )
        if facts is not None:
            layers.note(program, module, facts)
        if facts is not None and module and (facts.functions or facts.classes or facts.names):
            by_file[f] = facts
            if f in modules.name:  # a name no other file of the run shares
                program.add(module, facts)
        if "noqa" in source.lower():
            with_noqa[str(f)] = source
        out.extend(found)
    out.extend(f for f in _pending(program, modules, resolved, by_file) if f.code in codes)
    kept, hidden = _reported(
        out, walked, with_noqa, lambda hit: layers.settled(program, hit), tests
    )
    return Report(findings=kept, files=len(files), hidden=hidden)


# A script's guard at the module's own level: `if __name__ == "__main__":`.
_MAIN_GUARD_RE = re.compile(r"""^if\s+__name__\s*==\s*["']__main__["']""", re.MULTILINE)


def _module_map(sources: dict[Path, str]) -> ModuleMap:
    """The module names of `sources`, knowing which use relative imports and which run
    as scripts (a module-level `if __name__ == "__main__":` guard)."""
    scripts = {f for f, text in sources.items() if _MAIN_GUARD_RE.search(text)}
    return ModuleMap(list(sources), _relative(sources), scripts)


def _follows(program: Program, imported: list[str]) -> bool:
    """Does a file import a summary of the run worth following (`Program.followed`, as
    the files imported before it have left the program)?"""
    return any(program.followed(n) for n in imported if n.split(".")[0] in program.roots)


def _imported_helpers(sources: dict[Path, str], deps: dict[Path, list[Path]]) -> set[Path]:
    """The files of the run that a file holding some rule's words imports, directly or
    through one more file: a helper module with none of those words (`utils.py`'s
    `masked_mean`, `(values * mask).sum() / mask.sum()`) still needs its summaries, for
    the calls into it to be followed."""
    worded = [f for f, text in sources.items() if any(w in text for w in _ANY_WORD)]
    first = {g for f in worded for g in deps.get(f, ())}
    near = first | {h for g in first for h in deps.get(g, ())}
    # only a helper that returns a mean or a quotient is worth its summaries
    return {g for g in near if _RETURNS_MEAN_RE.search(sources.get(g, "")) is not None}


# `return (values * mask).sum() / mask.sum()`, `return values[mask].mean()`
_RETURNS_MEAN_RE = re.compile(
    r"^[ \t]+return\b[^\n]*(?:[\w)\]]\s*/\s*[\w(]|\.mean\()", re.MULTILINE
)


# The files where a project pins its dependencies, beside the folder it is linted from.
# (and a conda environment's pip section: `- transformers==4.31.0` in environment.yml)
_ENV_FILES = ("environment.yml", "environment.yaml")
_PIN_FILES = ("pyproject.toml", "setup.py", "setup.cfg", *_ENV_FILES)


def _pins_old_transformers(given: list[str], files: Iterable[Path]) -> set[str]:
    """The files whose project pins transformers below 4.46 (`frameworks.
    hf_pinned_before_446`): the nearest folder, from the file's own up to the folder given
    that holds it (for a file given, its own folder only), whose pin files (`_PIN_FILES`,
    `requirements*.txt`) name transformers decides. A sub-project's own requirements
    (`chat/requirements.txt`) govern its scripts, whatever the top of the tree pins; a
    folder whose pin files do not name transformers leaves it to the folder above."""
    roots = [Path(g) for g in given if os.path.isdir(g)]
    verdicts: dict[Path, bool | None] = {}
    out: set[str] = set()
    for f in files:
        top = max((r for r in roots if r in f.parents), key=lambda r: len(r.parts), default=None)
        folder = f.parent
        while True:
            if folder not in verdicts:
                verdicts[folder] = _folder_pin(folder)
            verdict = verdicts[folder]
            if verdict is not None or top is None or folder == top or folder == folder.parent:
                break
            folder = folder.parent
        if verdict:
            out.add(str(f))
    return out


def _folder_pin(folder: Path) -> bool | None:
    """Do the pin files of `folder` pin transformers below 4.46 (True), name it otherwise
    (False), or not name it at all (None)? A few files read, no walk."""
    try:
        names = [n for n in os.listdir(folder) if n in _PIN_FILES or _is_requirements(n)]
    except OSError:
        return None
    verdict: bool | None = None
    # A conda environment file is an export of one machine's packages: it decides only
    # where no install spec of the folder (requirements, pyproject.toml, setup.py) names
    # transformers (pyreft's environment.yml pins 4.39.3 beside `transformers>=4.48.2`).
    names.sort(key=lambda n: (n in _ENV_FILES, n))
    for n in names:
        if n in _ENV_FILES and verdict is not None:
            break
        try:
            text = (folder / n).read_text(errors="replace")
        except OSError:
            continue
        if hf_pinned_before_446(text):
            return True
        if names_transformers(text):
            verdict = False
    if verdict is None and "README.md" in os.listdir(folder):
        # no pin file names transformers: an install line of the README does
        # (`pip install transformers==4.29.2`), where every version it names is below 4.46
        try:
            readme = (folder / "README.md").read_text(errors="replace")
        except OSError:
            return None
        return True if hf_pinned_only_before_446(readme) else None
    return verdict


# The most YAML files read from one Hydra config folder (a folder of thousands is data).
_MAX_CONFIGS = 400


def _hydra_accumulates(sources: dict[Path, str]) -> bool:
    """Does a Hydra application of the run configure a Trainer that accumulates
    (`frameworks.yaml_accumulates`) in the YAML files of the config folder it names
    (`frameworks.hydra_config_dirs`)? Read only for files that import hydra."""
    for f, text in sources.items():
        for rel in hydra_config_dirs(text):
            folder = f.parent / rel
            if not folder.is_dir():
                continue
            configs = sorted(p for p in folder.rglob("*.y*ml") if p.suffix in (".yaml", ".yml"))
            for p in configs[:_MAX_CONFIGS]:
                try:
                    if yaml_accumulates(p.read_text(errors="replace")):
                        return True
                except OSError:
                    continue
    return False


def _is_requirements(name: str) -> bool:
    # (`requirement.txt` too: LESS's and LLM-Shearing's, which their setup.py reads)
    return name.startswith("requirement") and name.endswith((".txt", ".in"))


def _masked(
    sources: dict[Path, str],
    deps: dict[Path, list[Path]],
    modules: ModuleMap,
    shown: set[Path],
    *,
    wide: bool = False,
) -> set[str]:
    """The files for which labels are masked out of a token loss (`shown`: the files whose
    text shows it, `frameworks.masks_labels` or `writes_masked_labels`) in a file imported
    alongside them (`program.co_imported`) of their own code: the same top-level package,
    or for a script the same folder. (A vendored library's collator is not evidence about
    the scripts that import it: its -100 is for the tasks that use it.) A package beside
    a script (`data/collators.py` next to `train.py`) is the script's own code too."""

    def own(f: Path) -> str:
        name = modules.own.get(f, "")
        if "." in name or modules.package.get(f, False):
            return name.split(".")[0]
        return str(f.parent)

    # a script that loads a dataset from disk reads what a script of its folder saved
    # there (`ds.save_to_disk(...)`): the tokenizing script's labels are its labels
    deps = _with_saved_data(sources, deps, shown)
    groups: dict[str, set[Path]] = {}
    beside: dict[str, str] = {}  # a package's key -> the folder that holds it
    for f in sources:
        if f in shown:
            key = own(f)
            groups.setdefault(key, set()).add(f)
            name = modules.own.get(f, "")
            if key != str(f.parent) or modules.package.get(f, False):
                beside[key] = str(import_base(f, name, modules.package.get(f, False)))
    out: set[str] = set()
    for key, marked in groups.items():
        near = beside.get(key)
        # a script in a folder of the package without `__init__.py` (`llava/train/`,
        # imported as `llava.train.train`) is the package's own code too
        # (`wide` only: the HF Trainer pinned below 4.46, `Evidence.package_masks_labels`);
        # so is, for a script, a folder beneath its own without `__init__.py`
        # (`component/collator.py` beside `train.py`, imported as `component.collator`)
        inside = os.path.join(near, key, "") if near is not None and wide else None
        out.update(
            str(f)
            for f in co_imported(deps, marked)
            if own(f) == key
            or (near is not None and own(f) == near)
            or (inside is not None and str(f).startswith(inside))
            or (wide and key.startswith(os.path.join(own(f), "")))
            # and, for a script, a folder beneath its own imported alongside it: a
            # namespace package without `__init__.py` (`pkg/constants.py` writes the
            # -100, `pkg/train/trainer.py`, imported as `pkg.train.trainer`, trains)
            or (wide and near is None and own(f).startswith(os.path.join(key, "")))
        )
    return out


def _with_saved_data(
    sources: dict[Path, str], deps: dict[Path, list[Path]], marked: set[Path]
) -> dict[Path, list[Path]]:
    """`deps` with an edge from each file that loads a Hugging Face dataset from disk
    (`datasets.load_from_disk(path)`) to each file of its folder that masks labels and
    saves one (`ds.save_to_disk(path)`, a tokenizing script run before it): no import
    joins them, the files on disk do, so the saved labels are the loaded ones (WB301)."""
    savers: dict[Path, list[Path]] = {}
    for f in sorted(marked):
        if "save_to_disk(" in sources[f]:
            savers.setdefault(f.parent, []).append(f)
    if not savers:
        return deps
    out = dict(deps)
    for f, text in sources.items():
        near = [g for g in savers.get(f.parent, ()) if g != f]
        if near and "load_from_disk(" in text:
            out[f] = [*deps.get(f, ()), *near]
    return out


def _label_values(
    sources: dict[Path, str], deps: dict[Path, list[Path]], modules: ModuleMap, marked: set[Path]
) -> dict[str, frozenset[int]]:
    """Per file, the label values written at masked places (`scope.label_writes`) in a
    file of its own code imported alongside it (`_masked`): a model module's
    `CrossEntropyLoss(ignore_index=0)` ignores the 0s its dataset module writes
    (`labels[~label_mask] = 0`), as a -100 would show (WB301). Read in the files that
    mask labels (`marked`) or index them (`labels[`), the only ones that can write any."""
    by_value: dict[int, set[Path]] = {}
    for f, text in sources.items():
        if f in marked or "labels[" in text:
            for v in label_writes(text):
                by_value.setdefault(v, set()).add(f)
    out: dict[str, set[int]] = {}
    for v, written in sorted(by_value.items()):
        hits = _masked(sources, deps, modules, written)
        # and a script above the writer's folder (`data/alpaca.py`, a folder without
        # `__init__.py`, under `main_finetune.py`'s): its own code too
        folders = {f.parent for f in written}
        hits.update(
            str(g)
            for g in co_imported(deps, written)
            if any(g.parent == d or g.parent in d.parents for d in folders)
        )
        for p in hits:
            out.setdefault(p, set()).add(v)
    return {p: frozenset(vs) for p, vs in out.items()}


def _alongside(
    sources: dict[Path, str], deps: dict[Path, list[Path]], test: Callable[[str], bool]
) -> set[str]:
    """The files imported alongside one whose text passes `test` (`program.co_imported`),
    of any package: the helper module that gets the model a script wrapped (a helper's
    `no_sync()` is the wrapper's, wherever the helper lives)."""
    marked = {f for f, text in sources.items() if test(text)}
    return {str(f) for f in co_imported(deps, marked)}


def _read_all(files: list[Path], codes: frozenset[str], out: list[Finding]) -> dict[Path, str]:
    """The text of each file; one that cannot be read is a WB000 finding in `out`."""
    sources: dict[Path, str] = {}
    for f in files:
        try:
            sources[f] = read(f)
        except (OSError, UnicodeDecodeError, SyntaxError) as err:
            if "WB000" in codes:
                out.append(
                    Finding(
                        path=str(f),
                        line=1,
                        col=1,
                        code="WB000",
                        message=f"cannot read: {err}",
                        fix=RULES["WB000"].fix,
                    )
                )
    return sources


def _reported(
    found: list[Finding],
    walked: dict[Path, Walked],
    with_noqa: dict[str, str],
    settled: Callable[[Finding], bool],
    tests: bool,
) -> tuple[list[Finding], int]:
    """The findings a run reports, in order, and how many in test files it does not:
    one per place and rule, none in a file read only for its summaries, none a `# noqa`
    suppresses or a use in another file settles (`settled`, WB102)."""
    seen: set[tuple[str, int, int, str]] = set()
    kept: list[Finding] = []
    hidden = 0
    by_path = {str(f): w for f, w in walked.items()}
    noqa: dict[str, dict[int, frozenset[str] | None]] = {}
    for hit in sorted(found, key=_place):
        key = (hit.path, hit.line, hit.col, hit.code)
        w = by_path.get(hit.path)
        if w is None:
            continue  # in a file read only for its summaries
        if hit.path in with_noqa and hit.path not in noqa:
            noqa[hit.path] = _noqa_lines(with_noqa[hit.path])
        if key in seen or _suppressed(hit, noqa.get(hit.path, {})):
            continue
        if hit.code == "WB102" and settled(hit):
            continue
        seen.add(key)
        if not (w.shown or tests):
            hidden += 1
            continue
        kept.append(hit if w.tier == CODE else replace(hit, tier=w.tier))
    return kept, hidden
