"""The files of one lint run as a tree of modules: each file's dotted module name, and
an order in which every file comes after the files it imports, so that a module's
summaries (`summaries.ModuleFacts`) exist before the files that use them are linted.

Module names come from the folders alone: a file's package is the chain of parent
folders that hold an `__init__.py` (`src/pkg/sub/mod.py` -> `pkg.sub.mod`), a folder
without one inside such a chain counting as a namespace sub-package; a file
outside any package is a top-level module named after its stem, as when it is run as
a script next to its helpers. The import order is read with a regular expression over
the source text (no parse, nothing imported); an import it misses, or a cycle, only
means some call stays unknown for one file: no finding rather than a false one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ModuleMap",
    "co_imported",
    "import_base",
    "import_order",
    "imported_names",
    "locate",
    "module_name",
]

_IMPORT_RE = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<dots>\.*)(?P<mod>[\w.]*)[ \t]+import[ \t]+"
    r"(?P<names>\([^)]*\)|[^\n#;]*)|import[ \t]+(?P<plain>[\w., \t]+))",
    re.MULTILINE,
)


class ModuleMap:
    """The dotted module name of each file, and the file of each module name.

    Args:
        files: the files of the run.
        relative: those of them that use relative imports (`from . import x`): they sit
            in a package, through a folder without `__init__.py` if need be.
        scripts: those of them run as scripts (an `if __name__ == "__main__":` guard):
            their own folder is first on `sys.path`, whatever `__init__.py` lies there.
    """

    def __init__(
        self,
        files: Sequence[Path],
        relative: set[Path] | frozenset[Path] = frozenset(),
        scripts: set[Path] | frozenset[Path] = frozenset(),
    ) -> None:
        self.scripts = frozenset(scripts)
        self.name: dict[Path, str] = {}
        self.own: dict[Path, str] = {}  # every file's name from its folders, shared or not
        self.package: dict[Path, bool] = {}
        self._files = set(files)
        # (folder, module) -> (file, its path as module parts), for `_by_path`
        self._by_tail: dict[tuple[str, str], list[tuple[Path, tuple[str, ...]]]] = {}
        by_name: dict[str, list[Path]] = {}
        has_init: dict[Path, bool] = {}
        for f in files:
            parts = f.parent.parts if f.stem == "__init__" else (*f.parent.parts, f.stem)
            if len(parts) >= 2:
                self._by_tail.setdefault((parts[-2], parts[-1]), []).append((f, parts))
            name, package = module_name(f, has_init, namespace=f in relative)
            if not name or not all(p.isidentifier() for p in name.split(".")):
                continue  # `my-script.py`: not importable by name
            self.name[f] = name
            self.own[f] = name
            self.package[f] = package
            by_name.setdefault(name, []).append(f)
        # Two files with one name (scripts in different folders): neither is importable
        # by that name with certainty, so neither is resolved.
        self.file: dict[str, Path] = {n: fs[0] for n, fs in by_name.items() if len(fs) == 1}
        self._shared = {n: fs for n, fs in by_name.items() if len(fs) > 1}
        for fs in by_name.values():
            if len(fs) > 1:
                for f in fs:
                    self.name.pop(f, None)

    def imports_of(self, f: Path, source: str) -> list[Path]:
        """The files of the run that `source` (the text of `f`) imports, as far as a
        regular expression over its import lines can tell."""
        names = imported_names(self.name.get(f), self.package.get(f, False), source)
        return [hit for hit in self.files_of(names) if hit != f]

    def files_of(self, names: list[str]) -> list[Path]:
        """The files of the run that these module names are (unknown names dropped)."""
        return [hit for n in names if (hit := self.file.get(n)) is not None]

    def resolve(self, f: Path, name: str) -> Path | None:
        """The file of the run that module `name`, as imported by file `f`, is (None:
        not in the run).

        A file outside any package runs as a script, and Python puts the script's own
        folder first on `sys.path`: a module beside it (`utils.py`, or `models/loss.py`
        under a folder without `__init__.py`, a namespace package) wins over any other
        file of that name, such as a `utils.py` in a sub-folder. A script inside a
        package's folder (`python finetune.py` beside an `__init__.py`) has its folder
        first all the same: an absolute import that no other file of the run answers, and
        not a standard-library name, is its neighbour.
        """
        if "." not in self.own.get(f, "."):
            beside = self._neighbour(f, name)
            if beside is not None:
                return beside
        hit = self.file.get(name)
        if hit is None and name in self._shared:
            hit = _nearest(f, name, self._shared[name])
        if hit is None:
            hit = self._by_path(name, f)
        if hit is None and f in self.scripts and name.split(".")[0] not in _STDLIB:
            hit = self._neighbour(f, name, other=True)
        return hit

    def _neighbour(self, f: Path, name: str, *, other: bool = False) -> Path | None:
        """The file of the run that module `name` is in `f`'s own folder, if any (`other`:
        not `f` itself)."""
        rel = Path(*name.split("."))
        return next(
            (
                c
                for c in (f.parent / rel.with_suffix(".py"), f.parent / rel / "__init__.py")
                if c in self._files and not (other and c == f)
            ),
            None,
        )

    def _by_path(self, name: str, near: Path | None = None) -> Path | None:
        """The one file of the run whose path ends as `name` spells it (`a/b/c.py`, or
        `a/b/c/__init__.py`): a module under folders without `__init__.py`. Where several
        do (sub-projects of one tree, each with its own `internvl/model/`), the one of
        the importer's own project (`_nearest`)."""
        parts = tuple(name.split("."))
        if len(parts) < 2:
            return None
        n = len(parts)
        hits = [f for f, fp in self._by_tail.get((parts[-2], parts[-1]), ()) if fp[-n:] == parts]
        if len(hits) > 1 and near is not None:
            return _nearest(near, name, hits)
        return hits[0] if len(hits) == 1 else None


# A script's neighbour named like a standard-library module would shadow it, but a script
# that means the neighbour is rare and reading it so is costly (torch's `types.py`).
_STDLIB = sys.stdlib_module_names


def _nearest(near: Path, name: str, hits: Sequence[Path]) -> Path | None:
    """Of the files `hits` that module `name` may be, the one imported from a folder
    above the importer `near` (the project folder Python runs it from puts its own
    package first), the nearest such folder if several; None if none lies so."""
    depth = len(name.split("."))
    bases: list[tuple[int, Path]] = []
    for h in hits:
        base = h.parent if h.stem == "__init__" else h
        for _ in range(depth):
            base = base.parent
        if base in near.parents:
            bases.append((len(base.parts), h))
    if not bases:
        return None
    bases.sort(key=lambda b: -b[0])
    if len(bases) > 1 and bases[0][0] == bases[1][0]:
        return None
    return bases[0][1]


def module_name(
    f: Path, has_init: dict[Path, bool] | None = None, *, namespace: bool = False
) -> tuple[str, bool]:
    """(dotted module name, is a package's `__init__`) of a file, from its folders.

    `has_init`: which folders hold an `__init__.py`, filled as they are looked at
    (one dict per run: a run reads each folder once). `namespace`: the file imports
    relatively, so it sits in a package even where its folder has no `__init__.py`.
    """
    seen = {} if has_init is None else has_init

    def is_package(folder: Path) -> bool:
        hit = seen.get(folder)
        if hit is None:
            hit = seen[folder] = (folder / "__init__.py").is_file()
        return hit

    parts = [] if f.stem == "__init__" else [f.stem]
    folder = f.parent
    # `namespace`: a folder without `__init__.py` inside a package is a namespace
    # sub-package of it (`grad_cache/pytorch_lightning/pl_gradcache.py`, which imports
    # `..grad_cache`, is grad_cache.pytorch_lightning.pl_gradcache).
    entered = False  # met a folder with `__init__.py`: only such folders count above it
    while folder.name.isidentifier():
        if is_package(folder):
            entered = True
        elif entered or not (namespace and is_package(folder.parent)):
            break
        parts.insert(0, folder.name)
        if folder.parent == folder:
            break
        folder = folder.parent
    return ".".join(parts), f.stem == "__init__"


def import_base(near: Path, me: str, is_pkg: bool) -> Path:
    """The folder the imports of `near` (module `me`) are resolved from: the one holding
    its top-level package (for a file outside any package: its own folder)."""
    depth = len(me.split(".")) - (0 if is_pkg else 1)  # folders from `near` up to the base
    base = near.parent
    for _ in range(depth):
        base = base.parent
    return base


def locate(name: str, me: str, base: Path) -> Path | None:
    """The file of module `name` as imported by module `me` resolving from `base`, if
    it lies in `me`'s own package tree (or, for a module outside any package, beside it);
    else None. Nothing outside that tree is looked at (not site-packages, not the stdlib)."""
    if not me or ("." in me and name.split(".")[0] != me.split(".")[0]):
        return None  # another top-level package
    rel = Path(*name.split("."))
    for cand in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def imported_names(me: str | None, is_package: bool, source: str) -> list[str]:
    """The absolute module names `source` may import (a `from m import n` gives `m` and
    `m.n`), as a regular expression over its import lines reads them."""
    out: list[str] = []
    if me is None:
        return out
    pkg = me.split(".") if is_package else me.split(".")[:-1]
    add = out.append
    for m in _IMPORT_RE.finditer(source):
        plain = m.group("plain")
        if plain is not None:
            for item in plain.split(","):
                words = item.split()
                if words:
                    name = words[0]
                    add(name)
                    # `import a.b.c` also runs a and a.b
                    while "." in name:
                        name = name.rpartition(".")[0]
                        add(name)
            continue
        dots, mod = m.group("dots"), m.group("mod")
        if dots:
            level = len(dots)
            if level - 1 > len(pkg):
                continue
            base_parts = pkg[: len(pkg) - (level - 1)]
            base = ".".join([*base_parts, mod] if mod else base_parts)
        else:
            base = mod
        if base:
            add(base)
        for item in m.group("names").strip("()").split(","):
            words = item.split()
            if words and words[0].isidentifier():
                add(f"{base}.{words[0]}" if base else words[0])
    return out


def import_order(files: Sequence[Path], deps: dict[Path, list[Path]]) -> list[Path]:
    """`files` reordered so each comes after the files it imports (depth first, in the
    given order otherwise; an import cycle is cut where the walk meets it)."""
    done: set[Path] = set()
    out: list[Path] = []
    for start in files:
        if start in done:
            continue
        done.add(start)
        stack: list[tuple[Path, int]] = [(start, 0)]
        while stack:
            f, i = stack[-1]
            children = deps.get(f, ())
            if i < len(children):
                stack[-1] = (f, i + 1)
                child = children[i]
                if child not in done:
                    done.add(child)
                    stack.append((child, 0))
            else:
                stack.pop()
                out.append(f)
    return out


def co_imported(deps: dict[Path, list[Path]], marked: set[Path], depth: int = 3) -> frozenset[Path]:
    """The files imported alongside a file of `marked`: those within `depth` imports of a
    file that is itself within `depth` imports of a marked one (the training loop's
    module and the dataset module a script imports both). Two walks of the import graph,
    each from all of its starting files at once: linear in its size."""
    if not marked:
        return frozenset()
    importers: dict[Path, list[Path]] = {}
    for f, ds in deps.items():
        for d in ds:
            importers.setdefault(d, []).append(f)

    def reach(start: set[Path], edges: dict[Path, list[Path]]) -> set[Path]:
        seen = set(start)
        frontier = list(start)
        for _ in range(depth):
            nxt = [g for f in frontier for g in edges.get(f, ()) if g not in seen]
            seen.update(nxt)
            frontier = nxt
        return seen

    return frozenset(reach(reach(marked, importers), deps))
